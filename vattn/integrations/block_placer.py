"""What any framework with its own block manager needs to run on vattn:
blocks as pages, requests as slices.

A framework that allocates KV blocks itself (vLLM, SGLang) keeps doing so;
vattn makes one block one page of every K/V buffer (:func:`choose_layout`)
and keeps each request's blocks mapped at their positions in the request's
own contiguous slice (:class:`BlockPlacer`), so attention kernels read
``k[reqid, :seq_len]`` and never a block table (or, with blocks a fraction
of a page, :class:`vattn.integrations.subpage_placer.SubPageBlockPlacer` keeps each request's blocks at their
rows of its own or shared pages). A request keeps its slice
for its whole life, whatever row of the framework's batch it sits in: when
the framework compacts or reorders its batch, nothing is mapped or
unmapped. Needs no framework import.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from vattn.common.config import LAYOUTS
from vattn.core import KVCacheManager

__all__ = ["LAYOUTS", "NULL_BLOCK_ID", "BlockPlacer", "choose_layout"]

NULL_BLOCK_ID = 0  # the framework's padding block (vLLM's null block): never handed to a request


def choose_layout(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int,
                  granularity: int, layout: str | None = None, setting: str = "layout") -> tuple[str, int]:
    """The vattn layout and page size (bytes per buffer) that make one block
    of ``block_size`` tokens exactly one page of every buffer.

    ``per_layer`` pages hold ``block_size`` tokens of one layer's K (or V),
    ``all_layers`` pages the same tokens of every layer; the page must be a
    multiple of the backend's ``granularity`` (bytes; host: the OS page size,
    CUDA with the stock driver: 2 MiB). ``layout`` None: per_layer if it
    fits, else all_layers. ``setting`` names where ``layout`` came from in
    messages (a framework's environment variable). Raises ValueError naming
    the block sizes that fit otherwise.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"{setting} must be one of {LAYOUTS}, got {layout!r}")
    token_bytes = {"per_layer": num_kv_heads * head_dim * dtype_bytes}
    token_bytes["all_layers"] = token_bytes["per_layer"] * num_layers
    candidates = [layout] if layout else list(LAYOUTS)
    for name in candidates:
        page = block_size * token_bytes[name]
        if page % granularity == 0:
            return name, page
    raise ValueError(
        f"vattn: one block must be one vattn page of every K/V buffer, but block_size={block_size} makes "
        + " or ".join(f"{block_size * token_bytes[n]}-byte pages ({n})" for n in candidates)
        + f", not a multiple of the backend's {granularity}-byte granularity; block sizes that fit: "
        + fitting_block_sizes(token_bytes, candidates, granularity)
    )


def fitting_block_sizes(token_bytes: dict[str, int], layouts: Sequence[str], granularity: int) -> str:
    """The smallest block size (tokens) whose pages fill the granularity, per layout, for messages."""
    return ", ".join(f"multiples of {smallest_block_size(token_bytes[n], granularity)} tokens ({n}: "
                     f"{token_bytes[n]} bytes per token)" for n in layouts)


def smallest_block_size(token_bytes: int, granularity: int) -> int:
    """The fewest tokens whose bytes (``token_bytes`` per token) are a whole
    number of ``granularity``-byte pages."""
    return granularity // math.gcd(granularity, token_bytes)


class BlockPlacer:
    """Keeps each request's blocks mapped at their positions in the request's slice.

    The placer owns reqids ``first_reqid .. first_reqid + slices - 1`` of the
    manager (several block tables, e.g. vLLM's KV cache groups, each get a
    range of one manager's reqids). A request, named by any hashable key
    (vLLM's request id), gets one of them when it is first seen
    (:meth:`reqids_of`) and keeps it until :meth:`release`; the kernels are
    handed each batch row's reqid. :meth:`map` runs once per forward and
    only grows slices: request ``i`` gets ``ceil(seq_lens[i] / block_size)``
    blocks of its block-table row at positions ``0..``, of which it maps the
    ones not mapped yet. So a decode step that crosses no block boundary maps
    nothing, and a request that moves to another row of the framework's
    batch maps nothing either. Block ids are page ids: a block shared by
    prefix caching is one physical page mapped into several slices.

    A released request's slice keeps its pages mapped (deferred
    reclamation, left lazy: nothing is unmapped until the slice is reused).
    A new request whose first blocks a free slice still maps at the same
    positions (a prefix-cache hit on a system prompt, a request resumed
    after a preemption) gets that slice: those positions are neither
    unmapped nor mapped again (``positions_reused``), and on the host they
    need no new page-table entries either. Other new requests get the
    oldest-freed slice. Either way only slices whose last readers the
    device has finished are taken while there are such (so reuse never
    waits for the device), and the positions past the reused prefix are
    unmapped then. A framework that replaces the blocks of a living request
    (vLLM after a preemption) releases it and gets a slice anew.

    Sliding windows (``window``, tokens a query sees, itself included): the
    blocks whose tokens no query of this forward or a later one can see lie
    behind the window; the framework frees them (vLLM hands them to other
    requests without telling the worker's block table, or puts its null
    block there when a prefix-cache hit starts past them). Their positions
    become holes (:meth:`KVCacheManager.unmap_pages_below`): the window's
    pages stay at their addresses, the slice stays contiguous. Invariant
    after ``map``: request ``i`` maps ``block_table[i, first:need]`` at those
    positions (``first``: the first block the window reaches, or the first
    that is not the null block), holes before.

    Blocks a row does not have (``num_blocks[i] < need``: a framework's
    warm-up rows) are mapped to the null block, which is never handed to a
    request, so dummy writes cannot touch a real block; they are mapped
    again from the table at the next forward.

    A kernel that reads rows besides a request's own (its
    :class:`vattn.kernels.ReadFootprint`: ``rows_past_end`` after the last
    row, ``rows_below_start`` before a window's first visible row) gets
    them mapped too: positions past a request's blocks, up to its footprint
    (within the slice), map ``scratch_page_id``, one page id shared by
    every slice that nothing writes; a real block replaces it when the
    request reaches that position (:meth:`KVCacheManager.map_pages` takes
    the new references before it drops the old). Below a window, the
    positions a tile may start in stay mapped: the blocks the framework
    freed there stay until the window has passed them by the footprint,
    and where it put its null block instead (a new request's prefix-cache
    hit past them) they map the scratch page.
    """

    def __init__(self, manager: KVCacheManager, block_size: int, null_block_id: int = NULL_BLOCK_ID,
                 first_reqid: int = 0, slices: int | None = None, window: int | None = None,
                 rows_past_end: int = 0, rows_below_start: int = 0, scratch_page_id: int | None = None) -> None:
        if manager.page_allocator != "external":
            raise ValueError("BlockPlacer needs a manager with page_allocator='external'")
        if rows_past_end < 0 or rows_below_start < 0:
            raise ValueError(f"BlockPlacer: rows_past_end and rows_below_start must be >= 0, got {rows_past_end}, "
                             f"{rows_below_start}")
        if (rows_past_end or rows_below_start) and (
                scratch_page_id is None or not 0 <= scratch_page_id < manager.num_page_ids
                or scratch_page_id == null_block_id):
            raise ValueError(f"BlockPlacer: a read footprint needs a scratch_page_id in [0, "
                             f"{manager.num_page_ids - 1}] other than the null block {null_block_id}, got "
                             f"{scratch_page_id}")
        reqids = manager.config.max_batch_size
        slices = reqids - first_reqid if slices is None else slices
        if first_reqid < 0 or slices < 1 or first_reqid + slices > reqids:
            raise ValueError(f"BlockPlacer: reqids first_reqid .. first_reqid + slices - 1 must lie in "
                             f"[0, {reqids - 1}], got first_reqid={first_reqid}, slices={slices}")
        self.manager = manager
        self.block_size = block_size  # tokens per block = per page
        self.null_block_id = null_block_id
        self.window = window or None  # tokens a query sees (sliding window), None: every token
        self.first_reqid = first_reqid
        self.slices = slices
        self.rows_past_end, self.rows_below_start = rows_past_end, rows_below_start  # the kernel's read footprint
        self.scratch_page_id = scratch_page_id  # mapped where the footprint reaches past a request's blocks
        self._positions = manager.slice_bytes // manager.page_size  # page positions of a slice
        self._slice_of: dict[Hashable, int] = {}  # request key -> slice index (reqid - first_reqid)
        self._free = collections.deque(range(slices))  # oldest freed first
        self._mapped = np.zeros(slices, dtype=np.int64)  # positions known mapped from the table (holes included)
        self._covered = np.zeros(slices, dtype=np.int64)  # positions mapped, the scratch page's past _mapped included
        self._holes = np.zeros(slices, dtype=np.int64)  # positions below which the slice is holes
        self._first_page = np.full(slices, -1, dtype=np.int64)  # block id at position 0, -1: none or a hole
        self._free_by_first: dict[int, list[int]] = {}  # block id at position 0 -> free slices mapping it there
        self._last_keys: list[Hashable] | None = None
        # the forward's thread assigns slices; a budget's keeper may release those of requests that
        # are not running (vattn.integrations.vllm.worker_budget) from its own
        self._lock = threading.Lock()
        self._last_reqids = np.zeros(0, dtype=np.int64)
        # lower bound of the mapping: (request, position) pairs a forward needed mapped and found unmapped
        self.positions_needed = 0
        self.positions_reused = 0  # positions a new request found mapped with its blocks in a free slice
        self.forwards_mapping = 0  # forwards that mapped anything

    # ---- requests and their slices -----------------------------------------------------------

    @property
    def holes(self) -> int:
        """Positions of the live requests' slices that are holes behind a window."""
        live = np.fromiter(self._slice_of.values(), dtype=np.int64, count=len(self._slice_of))
        return int(self._holes[live].sum()) if len(live) else 0

    @property
    def live_requests(self) -> int:
        return len(self._slice_of)

    def reqids_of(self, keys: Sequence[Hashable], block_table: np.ndarray | None = None,
                  num_blocks: np.ndarray | None = None) -> np.ndarray:
        """The reqid of each request of a forward (``int64``, one per key, in
        order); a key seen for the first time gets a slice. With the
        forward's ``block_table`` and ``num_blocks`` (as :meth:`map` takes
        them, row ``i`` for ``keys[i]``), a new request gets a free slice
        that still maps its first blocks, if one does. The same list of keys
        as the last call costs one list comparison."""
        if keys == self._last_keys:
            return self._last_reqids
        with self._lock:
            slice_of = self._slice_of
            new = {key: row for row, key in enumerate(keys) if key not in slice_of}
            if len(new) > len(self._free):
                raise ValueError(f"vattn: {len(slice_of) + len(new)} requests hold slices, but the cache has "
                                 f"{self.slices} per KV cache group")
            if new:
                self._assign(new, block_table, num_blocks)
            reqids = np.fromiter((slice_of[key] for key in keys), dtype=np.int64, count=len(keys))
            reqids += self.first_reqid
            self._last_keys, self._last_reqids = list(keys), reqids
            return reqids

    def _take_slice(self, blocks: np.ndarray | None) -> tuple[int, int]:
        """A free slice for a request whose first blocks are ``blocks`` (None:
        not known), and how many positions it maps with them already: the
        free slice mapping the longest run of them, else the oldest-freed;
        slices the device may still read are passed over while others are
        free."""
        manager, first = self.manager, self.first_reqid
        best, reused = None, 0
        if blocks is not None and len(blocks) and blocks[0] != self.null_block_id:
            for s in self._free_by_first.get(int(blocks[0]), ()):
                held = manager.page_ids(first + s)[:len(blocks)]
                same = int(np.argmin(np.append(np.asarray(held) == blocks[:len(held)], False)))
                if same > reused and manager.reads_done(first + s):
                    best, reused = s, same
        if best is None:
            best = next((s for s in self._free if manager.reads_done(first + s)), self._free[0])
        self._free.remove(best)
        page = int(self._first_page[best])
        if page >= 0:
            self._free_by_first[page].remove(best)
            if not self._free_by_first[page]:
                del self._free_by_first[page]
        return best, reused

    def _assign(self, rows: dict[Hashable, int], block_table: np.ndarray | None,
                num_blocks: np.ndarray | None) -> None:
        taken: list[tuple[Hashable, int, int]] = []
        try:
            for key, row in rows.items():
                blocks = None
                if block_table is not None and num_blocks is not None:
                    blocks = np.asarray(block_table[row, :int(num_blocks[row])], dtype=np.int64)
                s, reused = self._take_slice(blocks)
                taken.append((key, s, reused))
                reqid = self.first_reqid + s
                # past the reused blocks, its last request's pages go, before it is allocated again: unmapping a
                # free slice waits only for its own last readers (done, as _take_slice chose it)
                self.manager.unmap_pages(np.array([reqid], dtype=np.int64), np.array([reused], dtype=np.int64))
                self.manager.alloc_reqid(reqid=reqid)
        except BaseException:
            for _, s, _ in taken:
                if self.manager.is_allocated(self.first_reqid + s):
                    self.manager.free_reqid(self.first_reqid + s)
                self._free.appendleft(s)
                self._first_page[s] = -1  # whatever it still maps, it is not offered for reuse
            raise
        for key, s, reused in taken:
            self._slice_of[key] = s
            self._mapped[s] = self._covered[s] = reused
            self._holes[s] = 0
            if not reused:
                self._first_page[s] = -1
            self.positions_reused += reused

    def release(self, keys: Iterable[Hashable]) -> None:
        """The requests ended, or the framework replaced their blocks: their
        slices go back to the pool with their pages still mapped (unmapped
        when the slice is reused, past the blocks its new request shares, or
        by :meth:`reclaim_free`). Unknown keys are ignored (a request the
        forwards never saw)."""
        with self._lock:
            released = []
            for key in keys:
                s = self._slice_of.pop(key, None)
                if s is not None:
                    released.append(s)
            if not released:
                return
            for s in released:
                self.manager.free_reqid(self.first_reqid + s)
                page = int(self._first_page[s])
                if page >= 0:
                    self._free_by_first.setdefault(page, []).append(s)
            self._free.extend(released)
            self._last_keys = None

    def reclaim_free(self) -> None:
        """Unmaps the free slices' pages (of every placer on the manager), after
        the device is done with them, so that the blocks they held can give
        their memory back (a budget's :meth:`KVCacheManager.release_pages`).
        Forwards never call it: a free slice is unmapped when it is reused."""
        self.manager.reclaim_freed(wait=True)

    @property
    def all_reqids(self) -> np.ndarray:
        """Every reqid of the placer's range, live or free."""
        return np.arange(self.first_reqid, self.first_reqid + self.slices, dtype=np.int64)

    def release_holding(self, page_ids: set[int]) -> int:
        """Releases the requests whose slices map any of ``page_ids`` (blocks the framework freed
        that a slice still maps: a preempted request's, or behind a sliding window not yet
        unmapped); each gets a fresh slice, mapped again from its block table, when next seen.
        Returns how many requests."""
        with self._lock:
            holding = [key for key, s in self._slice_of.items()
                       if not page_ids.isdisjoint(self.manager.page_ids(self.first_reqid + s))]
        self.release(holding)
        return len(holding)

    def release_all_but(self, keys: Iterable[Hashable]) -> None:
        """Releases every request but ``keys`` (warm-up rows after warm-up)."""
        keep = set(keys)
        with self._lock:
            gone = [key for key in self._slice_of if key not in keep]
        self.release(gone)

    # ---- the forward's mapping ---------------------------------------------------------------

    def map(self, reqids: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray,
            query_lens: np.ndarray | None = None) -> None:
        """Maps what this forward's requests need and is not mapped yet.

        Args:
            reqids: ``[n]`` the requests' reqids (:meth:`reqids_of`).
            block_table: ``[>= n, max_blocks]`` int block ids, row ``i`` for
                request ``i`` (the framework's CPU block table; entries past
                ``num_blocks[i]`` are ignored).
            num_blocks: ``[>= n]`` blocks the framework allocated to each row.
            seq_lens: ``[n]`` tokens each request attends over after this
                forward (cached + new).
            query_lens: ``[n]`` new tokens of each request in this forward;
                with a window, the first of them is the earliest query, which
                sets where the window starts. None: windows are not applied.
        """
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        if len(seq_lens) == 0:
            return
        s = reqids - self.first_reqid
        windows = self.window and query_lens is not None
        block, past = self.block_size, self.rows_past_end
        if not windows and (seq_lens <= self._mapped[s] * block).all() and (
                not past or (np.minimum(seq_lens + past, self._positions * block) <= self._covered[s] * block).all()):
            return  # most forwards (decodes within their last block): a few array operations
        need = -(-seq_lens // block)
        # positions the kernel reads: its rows past the end too, within the slice
        cover = np.minimum(-(-(seq_lens + past) // block), self._positions) if past else need
        mapped = self._mapped[s]
        if windows:
            self._advance_windows(reqids, s, need, seq_lens, query_lens, mapped)
            mapped = self._mapped[s]
        grow = (need > mapped) | (cover > self._covered[s])
        if not grow.any():
            return
        rows = np.flatnonzero(grow)
        g_need, g_cover, g_start, g_s = need[rows], cover[rows], mapped[rows], s[rows]
        width = int(g_cover.max())
        cols = np.arange(width)
        have = np.asarray(num_blocks)[rows]
        table = block_table[rows, :min(width, block_table.shape[1])]
        if table.shape[1] < width:
            table = np.pad(table, ((0, 0), (0, width - table.shape[1])))
        ids = np.where(cols < have[:, None], table, self.null_block_id)
        if past:
            ids = np.where(cols >= g_need[:, None], self.scratch_page_id, ids)
        fresh = g_start == 0  # a request's first mapping: blocks before its first real one are holes
        if fresh.any():
            real = (cols < g_need[:, None]) & (ids != self.null_block_id)
            first = np.where(real.any(axis=1), real.argmax(axis=1), 0)
            # what a later request with the same first blocks may find mapped here (not a hole, not the null block)
            self._first_page[g_s[fresh]] = np.where(real[fresh, 0], ids[fresh, 0], -1)
            behind = fresh & (first > 0)
            if behind.any():
                # a tile the kernel reads may start this many rows below the first real block: the scratch page
                start = np.where(behind, np.maximum(first * block - self.rows_below_start, 0) // block, g_start)
                ids = np.where((cols >= start[:, None]) & (cols < first[:, None]), self.scratch_page_id, ids)
                self.manager.unmap_pages_below(reqids[rows][behind], start[behind])
                self._holes[g_s[behind]] = start[behind]
                g_start = np.where(behind, first, g_start)
                map_start = np.where(behind, start, g_start)
            else:
                map_start = g_start
        else:
            map_start = g_start
        take = (cols >= map_start[:, None]) & (cols < g_cover[:, None])
        self.manager.map_pages(reqids[rows], map_start, ids[take].astype(np.int64, copy=False), g_cover - map_start)
        self.positions_needed += int(np.maximum(g_need - g_start, 0).sum())
        self.forwards_mapping += 1
        # positions that got the null block for want of a block are mapped from the table next time
        self._mapped[g_s] = np.maximum(g_start, np.minimum(g_need, have))
        self._covered[g_s] = g_cover

    def _advance_windows(self, reqids: np.ndarray, s: np.ndarray, need: np.ndarray, seq_lens: np.ndarray,
                         query_lens: np.ndarray, mapped: np.ndarray) -> None:
        """Positions no query of this forward or a later one can see become holes."""
        lo = np.maximum(seq_lens - np.asarray(query_lens, dtype=np.int64) - self.window + 1 - self.rows_below_start, 0)
        # the earliest query's first visible block, or the first block a tile of its keys may start in
        first = np.minimum(lo // self.block_size, need - 1)
        passed = first > self._holes[s]
        if not passed.any():
            return
        self.manager.unmap_pages_below(reqids[passed], first[passed])
        self._holes[s[passed]] = first[passed]
        self._mapped[s[passed]] = np.maximum(mapped[passed], first[passed])
        self._covered[s[passed]] = np.maximum(self._covered[s[passed]], first[passed])

