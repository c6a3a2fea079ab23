"""Blocks a fraction of a page: a framework's prefix cache hits at block
granularity while each request's slice still holds its own rows at their
positions (:class:`SubPageBlockPlacer`, a :class:`BlockPlacer` whose block
ids are not page ids). Needs no framework import.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import numpy as np
import torch

from vattn.core import KVCacheManager
from vattn.integrations.block_placer import NULL_BLOCK_ID, BlockPlacer

__all__ = ["SubPageBlockPlacer"]


class SubPageBlockPlacer(BlockPlacer):
    """A :class:`BlockPlacer` whose blocks are a fraction of a page:
    ``blocks_per_page`` blocks of ``block_size`` tokens make one page, so a
    framework's prefix cache hits at block granularity while pages keep the
    backend's granularity (a model with few KV bytes per token on CUDA's
    2 MiB pages).

    Block ids are not page ids. The placer hands out the pages itself (every
    id of the manager's pool but the null block's) and records where each block's rows live, ``location[block] = page *
    blocks_per_page + offset``. The rule that keeps kernels reading
    ``k[reqid, :seq_len]``: the page at a request's position ``k`` holds that
    request's blocks ``k * P .. k * P + P - 1`` (``P = blocks_per_page``) at
    offsets ``0 .. P - 1``, and nothing else is written there.

    - A block the request computes itself lives in its own page at that
      position (a block id the framework hands out again moves: its old
      rows are dead).
    - A position whose ``P`` blocks are all prefix-cache hits lying in one
      page at offsets ``0 .. P - 1`` maps that page: one physical page in
      several slices, as block-sized pages are shared.
    - A position the hit covers only in part (the hit ends inside the page,
      or its blocks lie in several pages) gets a page of its own, and the
      hit blocks' rows are copied into it: one indexed copy of every buffer
      (:meth:`KVCacheManager.token_rows`) before the forward, reading source
      pages through the placer's staging slice (``staging_reqid``, which no
      request gets). A hit on blocks that a request of the same forward
      computes (the framework caches a block when it schedules it) cannot be
      copied before the forward writes them: those rows are
      :attr:`late_copies`, which the forward copies layer by layer after the
      layer's new K/V are written and before it attends.

    A page goes back to the placer's pool when no slice maps it and none of
    its offsets is a block's location. The pool (one page id per block, the
    null block's included) never runs out: every page in use holds at least
    one block's rows once the free slices are unmapped. What the pages hold
    is kept near ``page_target`` pages (the blocks in whole pages, plus two
    per slice: a request's partly filled last page and the page its hit
    ends in, whose copied rows also stay where they were): past it, the rows
    of pages no slice maps are packed into the free offsets of others
    (:meth:`_pack`) before a page not made yet is taken. Pages that
    requests map are never packed, so it is a target, not a bound; the
    bound is the pool, ``blocks_per_page`` times the blocks' bytes.

    No sliding windows and no kernel read footprint (its constructor takes
    neither): each needs its positions' bookkeeping at page granularity,
    which this placer does not do.
    """

    def __init__(self, manager: KVCacheManager, block_size: int, blocks_per_page: int, num_blocks: int,
                 staging_reqid: int, null_block_id: int = NULL_BLOCK_ID, first_reqid: int = 0,
                 slices: int | None = None) -> None:
        super().__init__(manager, block_size, null_block_id, first_reqid, slices)
        if blocks_per_page < 1 or manager.page_tokens != block_size * blocks_per_page:
            raise ValueError(f"SubPageBlockPlacer: block_size x blocks_per_page must be the manager's "
                             f"{manager.page_tokens} tokens per page, got {block_size} x {blocks_per_page}")
        if num_blocks < 1:
            raise ValueError(f"SubPageBlockPlacer: num_blocks must be >= 1, got {num_blocks}")
        if not 0 <= staging_reqid < manager.config.max_batch_size or \
                first_reqid <= staging_reqid < first_reqid + self.slices:
            raise ValueError(f"SubPageBlockPlacer: staging_reqid must be a reqid in [0, "
                             f"{manager.config.max_batch_size - 1}] outside the placer's [{first_reqid}, "
                             f"{first_reqid + self.slices - 1}], got {staging_reqid}")
        self.blocks_per_page = blocks_per_page
        self.page_tokens = manager.page_tokens
        self.staging_reqid = staging_reqid
        manager.alloc_reqid(reqid=staging_reqid)
        self.location = np.full(num_blocks, -1, dtype=np.int64)  # page * blocks_per_page + offset; -1: unknown
        self._located_in = np.zeros(num_blocks, dtype=np.int64)  # the forward that located each block
        self._forward = 0
        self._page_at = np.full((self.slices, self._positions), -1, dtype=np.int64)  # page mapped per position
        self._located = np.zeros(self.slices, dtype=np.int64)  # blocks of the slice's request located
        self._hits = np.zeros(self.slices, dtype=np.int64)  # blocks its request got as prefix-cache hits
        self._staged = np.zeros(0, dtype=np.int64)  # pages the staging slice maps
        self._free_pages: collections.deque[int] = collections.deque()
        # pages made (handed out once: their memory exists), and how many the placer makes before it packs
        # rows to empty pages instead: the framework's blocks in whole pages, plus two per slice (a request's
        # partly filled last page, and the page its hit ends in, whose copied rows also live where they were)
        self.made = np.zeros(manager.num_page_ids, dtype=bool)
        self.page_target = -(-num_blocks // blocks_per_page) + 2 * self.slices
        self.rows_packed = 0  # token rows moved to empty pages (_pack)
        self._rows: object = None  # the manager's token_rows view, made on the first copy
        self.late_copies: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.rows_copied = 0  # token rows copied into partially hit pages (before or during forwards)
        self.pages_shared = 0  # positions that mapped a page of hit blocks instead of a copy
        self.late_copy_forwards = 0  # forwards that hit blocks they compute themselves (late_copies)

    def _take_slice(self, blocks: np.ndarray | None) -> tuple[int, int]:
        return super()._take_slice(None)  # a free slice's pages are not its blocks: nothing to reuse by id

    def _assign(self, rows: dict[Hashable, int], block_table: np.ndarray | None,
                num_blocks: np.ndarray | None) -> None:
        super()._assign(rows, block_table, num_blocks)
        for key in rows:
            s = self._slice_of[key]
            self._page_at[s] = -1
            self._located[s] = self._hits[s] = 0

    def reclaim_free(self) -> None:
        super().reclaim_free()
        with self._lock:
            self._page_at[list(self._free)] = -1

    # ---- the forward's mapping ---------------------------------------------------------------

    def map(self, reqids: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray,
            query_lens: np.ndarray | None = None) -> None:
        """:meth:`BlockPlacer.map` at block granularity; ``query_lens`` is
        required (a request's first forward finds its prefix-cache hits below
        ``seq_lens - query_lens``). Afterwards :attr:`late_copies` holds the
        rows the forward must copy after each layer's K/V writes (None: no
        such rows)."""
        self.late_copies = None
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        if len(seq_lens) == 0:
            return
        if query_lens is None:
            raise ValueError("SubPageBlockPlacer.map: query_lens is required (prefix-cache hits lie below "
                             "seq_lens - query_lens)")
        s = reqids - self.first_reqid
        need = -(-seq_lens // self.block_size)
        grow = np.flatnonzero(need > self._located[s])
        if not len(grow):
            return  # decodes within their last block
        self._forward += 1
        computed = seq_lens - np.asarray(query_lens, dtype=np.int64)
        full_hits: list[tuple[int, int]] = []  # (row, position) whose P blocks are all hits: decided below
        maps: list[tuple[int, int, int]] = []  # (row, position, page)
        table, have = block_table, np.asarray(num_blocks)
        for i in grow:
            si, nb = int(s[i]), int(need[i])
            positions = -(-nb // self.blocks_per_page)
            start = int(self._mapped[si])
            if have[i] < nb:  # a warm-up row: the null block where blocks are missing, from the table next time
                maps += [(i, k, self.null_block_id) for k in range(start, positions)]
                continue
            if start == 0 and self._located[si] == 0:
                self._hits[si] = computed[i] // self.block_size
            hits = int(self._hits[si])
            for k in range(start, positions):
                if hits >= (k + 1) * self.blocks_per_page:
                    full_hits.append((i, k))
                else:
                    maps.append((i, k, self._fresh_page(si, k)))
            self._locate_own(si, table[i], hits, nb)
        copies = []  # (row, first block, blocks) of hit blocks to copy into the row's own pages
        for i, k in full_hits:
            si, lo = int(s[i]), k * self.blocks_per_page
            locs = self.location[table[i, lo:lo + self.blocks_per_page]]
            page = int(locs[0]) // self.blocks_per_page
            if locs[0] >= 0 and (locs == page * self.blocks_per_page + np.arange(self.blocks_per_page)).all():
                self._page_at[si, k] = page
                maps.append((i, k, page))
                self.pages_shared += 1
            else:
                maps.append((i, k, self._fresh_page(si, k)))
                copies.append((i, lo, self.blocks_per_page))
        for i in grow:
            si = int(s[i])
            hits, start = int(self._hits[si]), int(self._mapped[si]) * self.blocks_per_page
            first = hits - hits % self.blocks_per_page
            if have[i] >= need[i] and hits > first >= start:  # the hit ends inside a page mapped now
                copies.append((i, first, hits - first))
        self._map_positions(reqids, s, maps, have, need)
        if copies:
            self._copy_hits(reqids, table, copies)
        self.forwards_mapping += 1

    def _locate_own(self, si: int, row: np.ndarray, hits: int, nb: int) -> None:
        """The request's blocks from ``hits`` (or those located before) to ``nb`` live in its own pages."""
        js = np.arange(max(int(self._located[si]), hits), nb)
        if len(js):
            blocks = np.asarray(row[js], dtype=np.int64)
            pages = self._page_at[si, js // self.blocks_per_page]
            self.location[blocks] = pages * self.blocks_per_page + js % self.blocks_per_page
            self._located_in[blocks] = self._forward
        self._located[si] = nb

    def _map_positions(self, reqids: np.ndarray, s: np.ndarray, maps: list[tuple[int, int, int]],
                       have: np.ndarray, need: np.ndarray) -> None:
        """One ``map_pages`` call for every (row, position, page) of the forward."""
        if not maps:
            return
        maps.sort()
        rows = np.array([m[0] for m in maps], dtype=np.int64)
        pages = np.array([m[2] for m in maps], dtype=np.int64)
        order, first = np.unique(rows, return_index=True)
        counts = np.diff(np.append(first, len(rows)))
        starts = self._mapped[s[order]]
        self.manager.map_pages(reqids[order], starts, pages, counts)
        self.positions_needed += int(counts.sum())
        for row, n in zip(order, counts):
            si = int(s[row])
            if have[row] >= need[row]:
                self._mapped[si] += n
                self._covered[si] = self._mapped[si]
            else:
                self._page_at[si, self._mapped[si]:self._mapped[si] + n] = self.null_block_id

    def _fresh_page(self, si: int, position: int) -> int:
        """A page of the pool that holds no block's rows and that no slice maps, for slice ``si``'s ``position``."""
        if not self._free_pages:
            self._refill()
        page = self._free_pages.popleft()
        self._page_at[si, position] = page
        return page

    def _used(self) -> np.ndarray:
        """``[num_page_ids]`` bool: the pages that hold a block's rows or that a slice maps."""
        used = np.zeros(self.manager.num_page_ids, dtype=bool)
        used[self.null_block_id] = True
        used[self.location[self.location >= 0] // self.blocks_per_page] = True
        used[self._page_at[self._page_at >= 0]] = True
        used[self._staged] = True
        return used

    def _refill(self) -> None:
        """Pages for the free list, cheapest first: pages made before that hold nothing now; pages not made
        yet while fewer than ``page_target`` are made; after unmapping the free slices, then after packing
        the rows of pages no slice maps (:meth:`_pack`), the same; only then a page past the target."""
        for step in ("reuse", "unmap", "pack", "grow"):
            if step == "unmap":
                self._unmap_free_slices()
            elif step == "pack":
                self._pack()
            idle = ~self._used()
            reusable = np.flatnonzero(idle & self.made)
            if len(reusable):
                self._free_pages.extend(reusable.tolist())
                return
            below = self.page_target - int(self.made.sum())
            new = np.flatnonzero(idle & ~self.made)[:max(below, 1 if step == "grow" else 0)]
            if len(new):
                self.made[new] = True
                self._free_pages.extend(new.tolist())
                return
        raise RuntimeError(f"vattn: every one of the pool's {self.manager.num_page_ids} page ids holds a block's "
                           f"rows or is mapped by a request; a pool of blocks_per_page={self.blocks_per_page} "
                           f"blocks per page needs the framework's block count plus the null block")

    def _unmap_free_slices(self) -> None:
        """The free slices' pages go (a finished request's blocks keep their rows where they are)."""
        free = np.array(sorted(self._free), dtype=np.int64)
        if len(free):
            self.manager.unmap_pages(free + self.first_reqid, np.zeros(len(free), dtype=np.int64))
            self._page_at[free] = -1
            self._mapped[free] = self._covered[free] = 0

    def _pack(self) -> None:
        """Moves block rows from the sparsest pages no slice maps into the free offsets of the fullest
        ones, so that pages empty (their blocks' full-page sharing is lost: later hits copy them); one
        indexed copy of every buffer through the staging slice, as many pages as it has positions."""
        per, ids = self.blocks_per_page, self.manager.num_page_ids
        blocks = np.flatnonzero(self.location >= 0)
        pages, offsets = self.location[blocks] // per, self.location[blocks] % per
        mapped = np.zeros(ids, dtype=bool)
        mapped[self._page_at[self._page_at >= 0]] = True
        loose = ~mapped[pages]
        block_at = np.full((ids, per), -1, dtype=np.int64)
        block_at[pages[loose], offsets[loose]] = blocks[loose]
        counts = (block_at >= 0).sum(axis=1)
        order = np.flatnonzero(counts)
        order = order[np.argsort(counts[order], kind="stable")]  # sparsest first
        moves, touched = [], {}
        lo, hi = 0, len(order) - 1
        while lo < hi:
            src, dst = int(order[lo]), int(order[hi])
            if counts[dst] == per:
                hi -= 1
                continue
            if len(touched.keys() | {src, dst}) > self._positions:
                break
            o_src, o_dst = int(np.argmax(block_at[src] >= 0)), int(np.argmax(block_at[dst] < 0))
            moves.append((int(block_at[src, o_src]), src, o_src, dst, o_dst))
            block_at[dst, o_dst], block_at[src, o_src] = block_at[src, o_src], -1
            counts[src] -= 1
            counts[dst] += 1
            for page in (src, dst):
                touched.setdefault(page, len(touched))
            if counts[src] == 0:
                lo += 1
        if not moves:
            return
        staged = np.array(list(touched), dtype=np.int64)
        self.manager.map_pages(np.array([self.staging_reqid], dtype=np.int64), np.zeros(1, dtype=np.int64), staged,
                               np.array([len(staged)], dtype=np.int64))
        self._staged = staged
        move = np.array(moves, dtype=np.int64)
        offsets_in_block = np.arange(self.block_size)

        def rows(page: np.ndarray, offset: np.ndarray) -> torch.Tensor:
            position = np.array([touched[int(p)] for p in page], dtype=np.int64)
            first = position * self.page_tokens + offset * self.block_size
            return torch.from_numpy((first[:, None] + offsets_in_block).ravel()).to(self.manager.device)

        if self._rows is None:
            self._rows = self.manager.token_rows()
        self._rows[:, self.staging_reqid, rows(move[:, 3], move[:, 4])] = \
            self._rows[:, self.staging_reqid, rows(move[:, 1], move[:, 2])]
        self.location[move[:, 0]] = move[:, 3] * per + move[:, 4]
        self.rows_packed += len(move) * self.block_size

    def _copy_hits(self, reqids: np.ndarray, table: np.ndarray, copies: list[tuple[int, int, int]]) -> None:
        """Copies hit blocks' rows into the requests' own pages: before the
        forward where the rows are written, else (blocks this forward
        computes) into :attr:`late_copies`."""
        block, per = self.block_size, self.blocks_per_page
        rows = np.repeat(np.array([c[0] for c in copies], dtype=np.int64), [c[2] for c in copies])
        js = np.concatenate([np.arange(lo, lo + n) for _, lo, n in copies])
        blocks = np.asarray(table[rows, js], dtype=np.int64)
        where = self.location[blocks]
        if (where < 0).any():
            raise RuntimeError(f"vattn: blocks {blocks[where < 0].tolist()} are prefix-cache hits whose rows "
                               f"the placer never saw computed")
        offsets = np.arange(block)
        dst_reqid = np.repeat(reqids[rows], block)
        dst_row = (js[:, None] * block + offsets).ravel()
        src_page, src_offset = where // per, where % per
        late = np.repeat(self._located_in[blocks] == self._forward, block)
        self.rows_copied += len(dst_row)
        if late.any():
            # blocks located this forward live in a live request's slice: read them there once written
            owner_slice, owner_position = self._slices_mapping(src_page)
            if (owner_slice[late[::block]] < 0).any():
                raise RuntimeError("vattn: a block this forward computes lies in a page no request maps")
            src_reqid = np.repeat(owner_slice + self.first_reqid, block)
            src_row = ((owner_position * self.page_tokens + src_offset * block)[:, None] + offsets).ravel()
            self.late_copies = (dst_reqid[late], dst_row[late], src_reqid[late], src_row[late])
            self.late_copy_forwards += 1
        early = ~late
        if early.any():
            self._staged_copy(dst_reqid[early], dst_row[early], np.repeat(src_page, block)[early],
                              (src_offset[:, None] * block + offsets).ravel()[early])

    def _slices_mapping(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each page, a (slice, position) of the placer that maps it; (-1, -1) where none does."""
        slices, positions = np.nonzero(self._page_at >= 0)
        found = {int(p): (int(a), int(b)) for a, b, p in zip(slices, positions, self._page_at[slices, positions])}
        pairs = np.array([found.get(int(p), (-1, -1)) for p in pages], dtype=np.int64).reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def _staged_copy(self, dst_reqid: np.ndarray, dst_row: np.ndarray, src_page: np.ndarray,
                     src_row_in_page: np.ndarray) -> None:
        """Maps the source pages into the staging slice and copies, every buffer in one indexed copy per
        ``positions`` source pages."""
        if self._rows is None:
            self._rows = self.manager.token_rows()
        rows, device = self._rows, self.manager.device
        distinct, position_of = np.unique(src_page, return_inverse=True)
        for lo in range(0, len(distinct), self._positions):
            pages = distinct[lo:lo + self._positions]
            take = (position_of >= lo) & (position_of < lo + len(pages))
            self.manager.map_pages(np.array([self.staging_reqid], dtype=np.int64), np.zeros(1, dtype=np.int64),
                                   pages, np.array([len(pages)], dtype=np.int64))
            self._staged = pages
            src = torch.from_numpy((position_of[take] - lo) * self.page_tokens + src_row_in_page[take]).to(device)
            dst_r = torch.from_numpy(dst_reqid[take]).to(device)
            dst = torch.from_numpy(dst_row[take]).to(device)
            rows[:, dst_r, dst] = rows[:, self.staging_reqid, src]
