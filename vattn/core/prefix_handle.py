"""PrefixHandle: references that keep a request's whole-page prefix alive
(a prefix-cache entry), from :meth:`vattn.KVCacheManager.retain_prefix`."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import KVCacheManager


class PrefixHandle:
    """References to the whole pages of a request's prefix (see
    :meth:`KVCacheManager.retain_prefix`). ``num_tokens``: tokens covered;
    ``page_ids``: the ids, position 0 first. Dropped without :meth:`release`,
    it releases its pages when collected; in a forked child every use raises
    :class:`vattn.ForkedError` (the pages are the parent's)."""

    __slots__ = ("_manager", "_id", "num_tokens", "_finalizer", "__weakref__")

    def __init__(self, manager: KVCacheManager, handle_id: int, num_tokens: int) -> None:
        self._manager = manager
        self._id = handle_id
        self.num_tokens: int = num_tokens
        # Runs once, from release() or when collected; not at exit (cleanup releases every handle then).
        self._finalizer = weakref.finalize(self, PrefixHandle._release_pages, manager._pages, handle_id, os.getpid())
        self._finalizer.atexit = False

    @staticmethod
    def _release_pages(pages: Any, handle_id: int, pid: int) -> None:
        """Nothing in a forked child or after cleanup; never raises (the garbage collector may call it)."""
        try:
            if os.getpid() == pid and not pages.closed:
                pages.release_prefix(handle_id)
        except Exception:  # noqa: BLE001 - cleanup releases what is left
            pass

    @property
    def released(self) -> bool:
        self._manager._check_process()
        return not self._finalizer.alive or self._manager.closed

    @property
    def page_ids(self) -> list[int]:
        if self.released:
            raise ValueError("handle was released")
        return self._manager._pages.prefix_ids(self._id)

    def release(self) -> None:
        """Drops the references (idempotent): pages no request maps return to the pool."""
        self._manager._check_process()
        self._finalizer()

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if os.getpid() != self._manager._pid:
            return f"PrefixHandle(num_tokens={self.num_tokens}, from another process)"
        state = "released" if self.released else f"{len(self.page_ids)} pages"
        return f"PrefixHandle(num_tokens={self.num_tokens}, {state})"
