"""vattn: a virtual-memory KV cache for LLM serving (vAttention style).

Each layer's K and V cache is one contiguous virtual tensor; physical pages are
mapped behind it on demand. Attention kernels see dense tensors, no block table.

Module-level functions act on one default manager created by :func:`init`;
:class:`KVCacheManager` gives as many independent caches as needed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec

from vattn.common.errors import BackendUnavailable, BudgetError, ClosedError, DriverError, ForkedError, OutOfPages
from vattn.common.errors import BudgetLockTimeout, OutOfReqids, VAttnError
from vattn.common.deprecation import warn_renamed
from vattn.common.install_check import check_extension, check_torch
from vattn.common.version import VERSION as __version__

check_torch()  # "install torch first" at import instead of a bare "No module named 'torch'" at first use
check_extension()  # "not built, build it so" instead of a "circular import" of _C

from vattn.budget import Budget  # noqa: E402 (after the checks: it loads _C; not torch)

if TYPE_CHECKING:
    import torch

    from vattn.core import KVCacheManager, Policy, PrefixHandle, SeqLens

# The names whose modules import torch (seconds of a cold start) are bound on first
# use (PEP 562 ``__getattr__`` below): ``python -m vattn budget`` and ``top``
# import this package first, and an operator's tool must start in a fraction
# of a second on a loaded machine (docs/elastic.md, "Command line").
_RENAMED = {"OutOfSlots": "OutOfReqids"}
_NAMES_BOUND_ON_FIRST_USE = ("KVCacheManager", "Policy", "PrefixHandle", "SeqLens", "init")

__all__ = [
    "KVCacheManager",
    "Policy",
    "VAttnError",
    "DriverError",
    "BackendUnavailable",
    "OutOfReqids",
    "OutOfPages",
    "ClosedError",
    "ForkedError",
    "PrefixHandle",
    "Budget",
    "BudgetError",
    "BudgetLockTimeout",
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

P = ParamSpec("P")

_default: KVCacheManager | None = None
_default_lock = threading.Lock()  # init / cleanup from several threads: one winner each


def _takes_parameters_of(target: Callable[P, Any]) -> Callable[[Callable[..., KVCacheManager]],
                                                              Callable[P, KVCacheManager]]:
    """Gives the decorated forwarder ``target``'s parameter list, so the list
    is written once: at run time as its ``__signature__`` (``help()``,
    ``inspect``) and, through the ParamSpec, for type checkers and IDEs."""

    def wrap(forwarder: Callable[..., KVCacheManager]) -> Callable[P, KVCacheManager]:
        forwarder.__signature__ = inspect.signature(target).replace(  # type: ignore[attr-defined]
            return_annotation="KVCacheManager")
        return forwarder

    return wrap


def init(*args: Any, **kwargs: Any) -> KVCacheManager:
    """Creates the default manager: ``KVCacheManager(*args, **kwargs)``, the
    same parameters (see :class:`KVCacheManager` for them).

    Raises :class:`VAttnError` if one exists and was not cleaned up.
    """
    global _default
    with _default_lock:
        if _default is not None and not _default.closed:
            raise VAttnError("vattn.init was already called; call vattn.cleanup() first")
        from vattn.core import KVCacheManager

        _default = KVCacheManager(*args, **kwargs)
        return _default


# init takes KVCacheManager's parameter list, known once vattn.core (torch) is
# imported: _bind_names_that_import_torch publishes it with that list.
_init_forwarder = init
del init


def get_manager() -> KVCacheManager:
    """The default manager; raises :class:`ClosedError` before init / after cleanup, and
    :class:`ForkedError` in a forked child whose parent made it (``init`` in the child makes its own)."""
    manager = _default
    if manager is not None:
        manager._check_process()  # the parent's: ForkedError, not "call init first"
    if manager is None or manager.closed:
        raise ClosedError("no vattn cache: call vattn.init(...) first")
    return manager


def layer(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, L, H, D]`` of layer ``index`` of the default manager."""
    return get_manager().layer(index)


def alloc_reqid(prompt_len: int | None = None, reqid: int | None = None) -> int:
    """A free reqid in ``[0, B)`` (``reqid``: that one); raises :class:`OutOfReqids` when none is free."""
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
    """Releases the default manager's memory; its tensors must not be used after. In a forked child
    whose parent made the default manager: :class:`ForkedError`, nothing changed."""
    global _default
    with _default_lock:
        manager = _default
        if manager is not None:
            manager._check_process()
        _default = None
    if manager is None or manager.closed:
        raise ClosedError("no vattn cache to clean up: call vattn.init(...) first")
    manager.cleanup()


def _bind_names_that_import_torch() -> dict[str, Any]:
    """Imports the modules behind :data:`_NAMES_BOUND_ON_FIRST_USE` and binds
    those names in this module; returns them. Idempotent and thread-safe (a
    race binds the same objects twice)."""
    from vattn.core import KVCacheManager, Policy, PrefixHandle, SeqLens

    names = {"KVCacheManager": KVCacheManager, "Policy": Policy, "PrefixHandle": PrefixHandle, "SeqLens": SeqLens,
             "init": _takes_parameters_of(KVCacheManager)(_init_forwarder)}
    globals().update(names)
    return names


def __getattr__(name: str) -> Any:
    """PEP 562: ``vattn.KVCacheManager`` and the other names that import torch
    on first use; a submodule (``vattn.core``) by importing it."""
    if name in _NAMES_BOUND_ON_FIRST_USE:
        return _bind_names_that_import_torch()[name]
    if name in _RENAMED:  # a name the glossary retired (docs/design.md): still there, with a warning
        warn_renamed(f"vattn.{name}", f"vattn.{_RENAMED[name]}")
        return globals()[_RENAMED[name]]
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
