"""Pages mapped in more than one place: forks, prefix handles, and the page-table primitives a
framework's block manager maps its own page ids with. A mixin of :class:`vattn.KVCacheManager`
(docs/design.md section 3)."""

from __future__ import annotations

from collections.abc import Sequence

from vattn.common.argument_checks import as_int as _as_int, int_array as _int_array, page_id_rows as _page_id_rows

from .mapped_check import IntArray
from .prefix_handle import PrefixHandle

_HOLE = 2**32 - 1  # a hole in page_ids (the core's PageTable::kHole)


class SharedPages:
    """The manager's page-sharing and page-table methods; they need its ``_pages`` (the core's
    PageManager) and ``_reqid`` (a checked reqid)."""

    def fork(self, src_reqid: int, num_tokens: int) -> int:
        """A new reqid whose first ``num_tokens`` tokens are ``src_reqid``'s.

        Whole pages below ``num_tokens`` that end on a token boundary are
        shared (the same physical page mapped in both slices); the tail from
        the last such boundary on is copied into fresh pages (one copy per
        buffer). When tokens straddle pages (``page_tokens`` is None) the
        shared part is the longest run of whole tokens that ends where a page
        ends, possibly none: then every page is copied. Call it after the
        device work that wrote the source's tokens was queued (CUDA: on the
        current stream, which the copy waits for).

        Immutability: GPUs have no copy-on-write faults for mapped pages, so
        the tokens in shared pages (``page_tokens`` x whole pages) are
        read-only for both requests afterwards. A write there through either
        request changes what every request sharing the page reads; vattn does
        not detect it. Tokens from the shared boundary on belong to each
        request alone.

        Raises :class:`vattn.OutOfReqids` / :class:`vattn.OutOfPages` (nothing
        changed) when no reqid or page is left; ``ValueError`` when
        ``src_reqid`` is free or ``num_tokens`` is outside
        ``[0, mapped_tokens(src_reqid)]``.
        """
        src = self._reqid(src_reqid, "src_reqid")
        return self._pages.fork(src, self._prefix_tokens("fork", src, num_tokens))

    def retain_prefix(self, reqid: int, num_tokens: int) -> PrefixHandle:
        """Keeps the whole pages holding ``reqid``'s first ``num_tokens``
        tokens alive after the request ends: a prefix-cache entry.

        The prefix is rounded down to whole pages (ending on a token
        boundary); ``handle.num_tokens`` says how many tokens it covers (e.g.
        144 for 150 tokens with 16-token pages). The pages are read-only while
        the handle holds them. Release with ``handle.release()`` or a
        ``with`` block; :meth:`cleanup` releases every handle.
        """
        r = self._reqid(reqid)
        handle, tokens = self._pages.retain_prefix(r, self._prefix_tokens("retain_prefix", r, num_tokens))
        return PrefixHandle(self, handle, tokens)

    def _prefix_tokens(self, what: str, reqid: int, num_tokens: int) -> int:
        """``num_tokens`` as the core takes it: an int (TypeError), and one the core's int64 cannot hold
        gets the range the core names for the others."""
        try:
            return _as_int("num_tokens", num_tokens, 2**62)
        except ValueError:
            raise ValueError(f"{what}: num_tokens must be in [0, {self.mapped_tokens(reqid)}] (tokens mapped for "
                             f"reqid {reqid}), got {num_tokens}") from None

    def attach_prefix(self, handle: PrefixHandle, reqid: int) -> int:
        """Maps a prefix handle's pages at positions 0.. of ``reqid``, a
        freshly allocated reqid holding no tokens yet. Returns the tokens now
        present (``handle.num_tokens``); the request prefills from there."""
        if not isinstance(handle, PrefixHandle):
            raise TypeError(f"handle must be a PrefixHandle, got {type(handle).__name__}")
        if handle._manager is not self:
            raise ValueError("handle belongs to another KV cache manager")
        if not handle._finalizer.alive:
            raise ValueError("handle was released")
        return self._pages.attach_prefix(handle._id, self._reqid(reqid))

    def map_pages(self, reqids: IntArray, starts: IntArray, page_ids: IntArray | Sequence[IntArray],
                  counts: IntArray | None = None) -> None:
        """The page-table primitive: maps page ids at page positions, for
        several requests in one call (C++, GIL released, no per-page Python).

        Request ``reqids[i]`` gets ``counts[i]`` page ids, taken in order from
        the flat ``page_ids``, at page positions ``starts[i], starts[i] + 1,
        ...`` of its slice. ``starts[i]`` may not pass the positions already
        mapped (the mapping of a slice is a prefix). Positions that already
        hold the same id are left alone; from the first position that differs,
        the reqid's old pages are unmapped and the new ids mapped. Without
        ``counts``, ``page_ids`` is one sequence of ids per request.

        With ``page_allocator="vattn"`` the ids must already be in use (mapped
        in some reqid or held by a prefix handle): this shares pages. With
        ``"external"`` any id in ``[0, num_page_ids)`` is accepted; pages are
        created on first use (:class:`vattn.OutOfPages`, nothing changed, when
        they cannot be: the budget refuses, the device is out of memory).

        The caller is taken to write the pages it maps (a framework's new
        blocks, filled by the forward that follows): on the host their
        page-table entries are made here, in one pass, so that those writes
        take no page fault per OS page. Pages that :meth:`step` maps, which
        a decode fills a token at a time, are left to fault in as written.
        """
        if counts is None:
            counts, page_ids = _page_id_rows(page_ids)
        self._pages.map_pages(_int_array("reqids", reqids), _int_array("starts", starts),
                            _int_array("counts", counts), _int_array("page_ids", page_ids))

    def unmap_pages(self, reqids: IntArray, keep: IntArray) -> None:
        """Unmaps page positions ``keep[i]`` and beyond of ``reqids[i]`` (free
        or allocated), in one call. Pages still used elsewhere stay there."""
        self._pages.unmap_pages(_int_array("reqids", reqids), _int_array("keep", keep))

    def unmap_pages_below(self, reqids: IntArray, first: IntArray) -> None:
        """Unmaps page positions below ``first[i]`` of ``reqids[i]``, in one
        call: they become holes, and positions from ``first[i]`` on keep their
        pages at their addresses, so the slice stays one contiguous range
        whose front maps nothing (the tokens behind a sliding window). A
        slice mapped over fewer positions grows to ``first[i]`` with holes, so
        :meth:`map_pages` may start there. Reading a hole faults: only
        kernels that skip the rows behind the window may read such a slice.
        ``page_allocator="external"`` only."""
        self._pages.unmap_pages_below(_int_array("reqids", reqids), _int_array("first", first))

    def page_ids(self, reqid: int) -> list[int]:
        """The page id mapped at each page position of reqid, in order; -1
        at a hole (:meth:`unmap_pages_below`)."""
        return [-1 if i == _HOLE else i for i in self._pages.reqid_page_ids(self._reqid(reqid))]
