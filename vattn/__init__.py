"""vattn: a virtual-memory KV cache for LLM serving (vAttention style).

Each layer's K and V cache is one contiguous virtual tensor; physical pages are
mapped behind it on demand. Attention kernels see dense tensors, no block table.

Module-level functions act on one default manager created by :func:`init`;
:class:`KVCacheManager` gives as many independent caches as needed.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .budget import Budget
from .errors import BackendUnavailable, ClosedError, DriverError, ForkedError, OutOfPages, OutOfSlots, VAttnError
from .errors import BudgetError
from .manager import KVCacheManager, PrefixHandle, SeqLens

__version__ = "0.1.0"

__all__ = [
    "KVCacheManager",
    "VAttnError",
    "DriverError",
    "BackendUnavailable",
    "OutOfSlots",
    "OutOfPages",
    "ClosedError",
    "ForkedError",
    "PrefixHandle",
    "Budget",
    "BudgetError",
    "init",
    "layer",
    "alloc_reqid",
    "free_reqid",
    "fork",
    "step",
    "stats",
    "cleanup",
    "get_manager",
]

_default: KVCacheManager | None = None
_default_lock = threading.Lock()  # init / cleanup from several threads: one winner each


def init(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    max_batch_size: int = 1,
    max_context_len: int = 4096,
    page_size: int | None = None,
    device: str | torch.device = "cpu",
    layout: str = "per_layer",
    physical_memory: int | None = None,
    background: bool = True,
    deferred_reclaim: bool = True,
    eager: bool = True,
    lookahead_tokens: int = 1,
    eager_tokens: int | None = None,
    reclaim_threshold: float = 0.1,
    page_allocator: str = "vattn",
    backend: str | None = None,
) -> KVCacheManager:
    """Creates the default manager (see :class:`KVCacheManager` for arguments).

    Raises :class:`VAttnError` if one exists and was not cleaned up.
    """
    global _default
    with _default_lock:
        if _default is not None and not _default.closed:
            raise VAttnError("vattn.init was already called; call vattn.cleanup() first")
        _default = KVCacheManager(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
            device=device,
            layout=layout,
            physical_memory=physical_memory,
            background=background,
            deferred_reclaim=deferred_reclaim,
            eager=eager,
            lookahead_tokens=lookahead_tokens,
            eager_tokens=eager_tokens,
            reclaim_threshold=reclaim_threshold,
            page_allocator=page_allocator,
            backend=backend,
        )
        return _default


def get_manager() -> KVCacheManager:
    """The default manager; raises :class:`ClosedError` before init / after cleanup."""
    if _default is None or _default.closed:
        raise ClosedError("no vattn cache: call vattn.init(...) first")
    return _default


def layer(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, L, H, D]`` of layer ``index`` of the default manager."""
    return get_manager().layer(index)


def alloc_reqid(prompt_len: int | None = None, reqid: int | None = None) -> int:
    """A free reqid in ``[0, B)`` (``reqid``: that one); raises :class:`OutOfSlots` when none is free."""
    return get_manager().alloc_reqid(prompt_len, reqid)


def free_reqid(reqid: int) -> None:
    """Ends request ``reqid``; its pages stay mapped for reuse (deferred reclaim)."""
    get_manager().free_reqid(reqid)


def fork(src_reqid: int, num_tokens: int) -> int:
    """A new reqid sharing ``src_reqid``'s first ``num_tokens`` tokens (see :meth:`KVCacheManager.fork`)."""
    return get_manager().fork(src_reqid, num_tokens)


def step(seq_lens: SeqLens) -> bool:
    """Maps pages for ``seq_lens`` (tokens, length B, 0 = inactive); False when out of pages."""
    return get_manager().step(seq_lens)


def stats() -> dict[str, Any]:
    """Counters and memory figures of the default manager."""
    return get_manager().stats()


def cleanup() -> None:
    """Releases the default manager's memory; its tensors must not be used after."""
    global _default
    with _default_lock:
        manager, _default = _default, None
    if manager is None or manager.closed:
        raise ClosedError("no vattn cache to clean up: call vattn.init(...) first")
    manager.cleanup()
