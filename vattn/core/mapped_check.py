"""That a batch's rows are mapped before a kernel reads them.

:class:`MappedCheck` asks one cache's core about one batch's rows;
:class:`ViewsCheck` is what a forward's plan carries: built once per forward
for the cache the batch reads (:meth:`vattn.KVCacheManager.mapped_check`),
it checks per layer that the views handed are that cache's and its rows
mapped. Views it was not built for (plain tensors handed to the function
API, another cache's views) are found by address (:mod:`.tensor_owners`),
here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vattn.common.argument_checks import int_array

from .tensor_owners import CacheSpan, view_owner

IntArray = Sequence[int] | torch.Tensor | np.ndarray


class MappedCheck:
    """That a batch's rows are mapped in one cache: called per layer, it asks
    the core again only when the core's count of shrinks (positions cut from
    a slice, reqids freed) moved since the last check passed."""

    __slots__ = ("pages", "reqids", "tokens", "firsts", "what", "verified")

    def __init__(self, pages: Any, reqids: IntArray, seq_lens: IntArray, origin: tuple[int, int], what: str,
                 first_rows: np.ndarray | None = None) -> None:
        self.pages, self.what, self.verified = pages, what, -1
        self.reqids, self.tokens = self.rows(reqids, seq_lens, origin)
        self.firsts = self.first_rows(first_rows, origin)

    @staticmethod
    def rows(reqids: IntArray, seq_lens: IntArray, origin: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The core's reqids and token counts of ``view[reqids[i], :seq_lens[i]]`` for a view whose
        row 0 is ``origin``: a slice of a layer view starts at another reqid / token."""
        rows = np.asarray(int_array("reqids", reqids), dtype=np.int64) + origin[0]
        tokens = np.asarray(int_array("seq_lens", seq_lens), dtype=np.int64) + origin[1]
        return rows, tokens

    @staticmethod
    def first_rows(first_rows: IntArray | None, origin: tuple[int, int]) -> np.ndarray | None:
        """The core's rows of the first row each request reads (None: from the slice's row 0)."""
        if first_rows is None:
            return None
        return np.asarray(int_array("first_rows", first_rows), dtype=np.int64) + origin[1]

    def __call__(self, what: str | None = None) -> None:
        """Raises ``ValueError`` starting with ``what`` (default: the name
        given at construction) unless every row is mapped."""
        shrinks = self.pages.shrinks  # read first: a shrink during the check makes the next call ask again
        if shrinks != self.verified:
            self.pages.check_mapped(self.reqids, self.tokens, what or self.what, self.firsts)
            self.verified = shrinks


class ViewsBinding:
    """Where one cache's layer views lie, as a :class:`ViewsCheck` compares
    them: the cache's span, the (reqid, token) of the views' row 0 and their
    strides. Fixed for the cache's life, so made once per origin
    (:meth:`vattn.KVCacheManager.mapped_check`) and shared by every
    forward's check."""

    __slots__ = ("pages", "origin", "low", "end", "buffer_bytes", "first", "token_bytes", "strides")

    def __init__(self, span: CacheSpan, origin: tuple[int, int], element_size: int) -> None:
        self.pages, self.origin = span.pages, origin
        self.low, self.end = span.low, span.high
        self.buffer_bytes, self.token_bytes = span.buffer_bytes, span.token_bytes
        self.first = origin[0] * span.slice_bytes + origin[1] * span.token_bytes  # row 0's offset in a buffer
        self.strides = (span.slice_bytes // element_size, span.token_bytes // element_size)  # elements

    def holds(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is a view of the cache at this origin, with its strides (a layer of
        all_layers starts inside the token row, hence the range)."""
        offset = view.data_ptr() - self.low
        return (0 <= offset < self.end - self.low and 0 <= offset % self.buffer_bytes - self.first < self.token_bytes
                and view.stride()[:2] == self.strides)


class ViewsCheck:
    """A forward's mapping check, carried by its plan: per layer,
    ``check(k_cache, v_cache, what)`` raises ``ValueError`` (starting with
    ``what``) unless every request's rows ``[0, seq_len)`` may be read;
    ``check(k_cache, v_cache, what, sliding_window)`` those a window of that
    many tokens reads, from ``cached_len - sliding_window + 1`` on (built
    with ``cached_lens``; without them, from row 0). Rows below a slice's
    holes (:meth:`vattn.KVCacheManager.unmap_pages_below`) are unmapped: only a
    window that starts above them passes.

    Built for a cache (its :class:`ViewsBinding`), a layer's views cost an
    address and stride comparison and one read of the core's shrink counter.
    Views elsewhere are found by address: another cache's are checked
    against that cache, plain tensors are not checked (their shape bounds
    what the kernels read). Built without a cache (``binding`` None), the
    first views handed decide which cache it is.
    """

    __slots__ = ("reqids", "seq_lens", "what", "mapped", "binding", "others", "cached_lens", "first_rows",
                 "windows")

    def __init__(self, reqids: IntArray, seq_lens: IntArray, what: str, binding: ViewsBinding | None = None,
                 cached_lens: IntArray | None = None, first_rows: np.ndarray | None = None) -> None:
        self.reqids, self.seq_lens, self.what = reqids, seq_lens, what
        self.cached_lens = cached_lens  # read by a window's check only (none per forward without one)
        self.first_rows = first_rows  # the first row read per request (None: row 0)
        self.windows: dict[int, ViewsCheck] = {}  # the same rows seen through a sliding window, per window
        self.others: dict[tuple[int, tuple[int, int]], MappedCheck] = {}  # found by address: (id of pages, origin)
        self.mapped: MappedCheck | None = None
        self.binding: ViewsBinding | None = None  # no cache yet: every view is looked up by address
        if binding is not None:
            self._bind(binding)

    def _bind(self, binding: ViewsBinding) -> None:
        self.binding = binding
        self.mapped = MappedCheck(binding.pages, self.reqids, self.seq_lens, binding.origin, self.what,
                                  self.first_rows)
        # the bound cache at its origin, found by address (the V of the K that bound it): the same check
        self.others[(id(binding.pages), binding.origin)] = self.mapped

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str,
                 sliding_window: int | None = None) -> None:
        if sliding_window and self.cached_lens is not None:
            self._window(sliding_window)(k_cache, v_cache, what)
            return
        mapped, binding = self.mapped, self.binding
        if mapped is not None and binding is not None and binding.holds(k_cache) and binding.holds(v_cache):
            mapped(what)
            return
        for check in {id(c): c for c in map(self._by_address, (k_cache, v_cache), (what, what)) if c}.values():
            check(what)

    def _window(self, sliding_window: int) -> ViewsCheck:
        """The check of the rows a window of ``sliding_window`` tokens reads, made once per window."""
        check = self.windows.get(sliding_window)
        if check is None:  # two threads may both make it: either is right
            cached = np.asarray(int_array("cached_lens", self.cached_lens), dtype=np.int64)
            first_rows = np.maximum(cached - (sliding_window - 1), 0)
            check = ViewsCheck(self.reqids, self.seq_lens, self.what, self.binding, first_rows=first_rows)
            self.windows[sliding_window] = check
        return check

    def _by_address(self, view: torch.Tensor, what: str) -> MappedCheck | None:
        """The check of a view the bound cache does not hold: None for a plain tensor (or a bad rank,
        which the shape checks name)."""
        owner = view_owner(view, what) if view.dim() == 4 else None
        if owner is None:
            return None
        span, origin = owner
        if self.mapped is None:  # built without a cache: the first cache's views are the forward's
            self._bind(ViewsBinding(span, origin, view.element_size()))
            return self.mapped
        key = (id(span.pages), origin)  # the check keeps the pages, so the id stays theirs
        check = self.others.get(key)
        if check is None:
            check = self.others[key] = MappedCheck(span.pages, self.reqids, self.seq_lens, origin, self.what,
                                                   self.first_rows)
        return check
