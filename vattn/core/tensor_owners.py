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


# A 4-d cache view's (data pointer, reqid stride, token stride, element size, on the CPU) -> (the _spans it was
# found under, its manager, its origin). Kernels are handed every layer's views anew each call (vLLM indexes
# kv_cache[0] per layer), so without it each call would search the spans and check the strides again. An
# entry is used only while _spans is the tuple it was found under: a closed manager's addresses never
# resolve to it.
_view_owners: dict[tuple, tuple[tuple, weakref.ref[KVCacheManager], tuple[int, int]]] = {}
_VIEW_OWNERS_MAX = 4096  # views of distinct places remembered; past it, forgotten all at once


def view_owner(view: torch.Tensor, what: str) -> tuple[KVCacheManager, tuple[int, int]] | None:
    """``(manager, origin)`` of a 4-d view of an open manager's cache
    (:func:`manager_of`, :meth:`KVCacheManager.view_origin`: origin is the
    (reqid, token) of the view's row 0), or None for any other tensor.
    Raises ``ValueError`` starting with ``what`` when the view's reqid and
    token strides are not the cache's. Remembered per place and strides, so
    a layer's views made anew every step cost one lookup."""
    key = (view.data_ptr(), view.stride(0), view.stride(1), view.element_size(), view.is_cpu)
    spans = _spans
    known = _view_owners.get(key)
    if known is not None and known[0] is spans:
        manager = known[1]()
        if manager is not None:
            return manager, known[2]
    manager = manager_of(view)
    if manager is None:
        return None
    origin = manager.view_origin(view, what)  # raises for foreign strides: never remembered
    if len(_view_owners) >= _VIEW_OWNERS_MAX:
        _view_owners.clear()
    _view_owners[key] = (spans, weakref.ref(manager), origin)
    return manager, origin


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
