"""Which open :class:`vattn.KVCacheManager` holds a tensor's memory.

Every open manager registers the address span of its reservation here (the
K/V buffers, all reqids); :func:`manager_of` maps a tensor back to its manager,
so a kernel handed a cache view can ask that manager which rows are mapped
before it reads them.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .manager import KVCacheManager

# (first address, end, manager) of every open manager: a tuple replaced whole
# under _spans_lock, so readers need no lock. A manager leaves it at cleanup
# (its addresses may then be reused by another cache) or when collected.
_spans: tuple[tuple[int, int, weakref.ref[KVCacheManager]], ...] = ()
_spans_lock = threading.Lock()


def remember_span(manager: KVCacheManager) -> None:
    """Registers ``manager._span`` (first address, end) for :func:`manager_of`."""
    global _spans
    with _spans_lock:
        _spans = (*_spans, (*manager._span, weakref.ref(manager, forget_span)))


def forget_span(gone: KVCacheManager | weakref.ref[KVCacheManager]) -> None:
    """Drops a manager's span (at cleanup, or when the manager is collected)."""
    global _spans
    with _spans_lock:
        _spans = tuple(s for s in _spans if s[2] is not gone and s[2]() is not gone and s[2]() is not None)


def manager_of(tensor: torch.Tensor) -> KVCacheManager | None:
    """The open manager whose cache memory holds ``tensor``'s first element,
    or None for any other tensor (a closed manager's views included: they
    read the memory they kept, like plain tensors)."""
    address = tensor.data_ptr()
    for low, high, ref in _spans:
        if low <= address < high:
            manager = ref()
            if manager is not None and manager.device.type == tensor.device.type:
                return manager
    return None
