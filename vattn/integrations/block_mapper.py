"""What any framework with its own block manager needs to run on vattn:
blocks as pages, rows as slices.

A framework that allocates KV blocks itself (vLLM, SGLang) keeps doing so;
vattn makes one block one page of every K/V buffer (:func:`choose_layout`)
and keeps each batch row's blocks mapped at their positions in the row's
contiguous slice (:class:`BlockMapper`), so attention kernels read
``k[row, :seq_len]`` and never a block table. Needs no framework import.
"""

from __future__ import annotations

import math

import numpy as np

from vattn.core import KVCacheManager

__all__ = ["LAYOUTS", "NULL_BLOCK_ID", "BlockMapper", "choose_layout"]

LAYOUTS = ("per_layer", "all_layers")
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
    fits = ", ".join(f"multiples of {granularity // math.gcd(granularity, token_bytes[n])} tokens ({n}: "
                     f"{token_bytes[n]} bytes per token)" for n in candidates)
    raise ValueError(
        f"vattn: one block must be one vattn page of every K/V buffer, but block_size={block_size} makes "
        + " or ".join(f"{block_size * token_bytes[n]}-byte pages ({n})" for n in candidates)
        + f", not a multiple of the backend's {granularity}-byte granularity; block sizes that fit: {fits}"
    )


class BlockMapper:
    """Keeps each row's blocks mapped at their positions in the row's slice.

    Reqids ``first_reqid .. first_reqid + rows - 1`` are allocated for good:
    row ``r`` of the framework's persistent batch is reqid ``first_reqid +
    r`` (several block tables, e.g. vLLM's KV cache groups, each get a range
    of one manager's reqids). :meth:`map_rows` runs once per forward: row
    ``r`` gets ``ceil(seq_lens[r] / block_size)`` blocks of its block-table
    row at positions ``0..``; every position past that, in every row, is
    unmapped (rows of finished or moved requests, a previous occupant's
    tail). Block ids are page ids, so a block shared by prefix caching is one
    physical page mapped into several slices, and a row that changes hands
    just gets the new ids.

    Sliding windows (``window``, tokens a query sees, itself included): the
    blocks whose tokens no query of this forward or a later one can see lie
    behind the window; the framework frees them (vLLM hands them to other
    requests without telling the worker's block table, or puts its null
    block there when a prefix-cache hit starts past them). Their positions
    become holes (:meth:`KVCacheManager.unmap_pages_below`): the window's
    pages stay at their addresses, the slice stays contiguous, and nothing
    behind the window is mapped. Invariant after ``map_rows``: row ``r < n``
    maps exactly ``block_table[r, first[r]:need[r]]`` at those positions
    (``first[r]``: the first block the window reaches, or the first that is
    not the null block), holes before, and rows ``>= n`` map nothing.
    """

    def __init__(self, manager: KVCacheManager, block_size: int, null_block_id: int = NULL_BLOCK_ID,
                 first_reqid: int = 0, rows: int | None = None, window: int | None = None) -> None:
        if manager.page_allocator != "external":
            raise ValueError("BlockMapper needs a manager with page_allocator='external'")
        num_reqids = manager.config.max_batch_size
        rows = num_reqids - first_reqid if rows is None else rows
        if first_reqid < 0 or rows < 1 or first_reqid + rows > num_reqids:
            raise ValueError(f"BlockMapper: reqids first_reqid .. first_reqid + rows - 1 must lie in "
                             f"[0, {num_reqids - 1}], got first_reqid={first_reqid}, rows={rows}")
        self.manager = manager
        self.block_size = block_size  # tokens per block = per page
        self.null_block_id = null_block_id
        self.window = window or None  # tokens a query sees (sliding window), None: every token
        self.rows = rows
        self.holes = 0  # positions left unmapped behind windows by the last map_rows, all rows
        self._all_rows = np.arange(first_reqid, first_reqid + rows, dtype=np.int64)  # reqid of each row
        for reqid in self._all_rows:
            manager.alloc_reqid(reqid=int(reqid))

    @property
    def reqids(self) -> np.ndarray:
        """The reqid of each row (``int64``, one per row)."""
        return self._all_rows

    def map_rows(self, block_table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray,
                 query_lens: np.ndarray | None = None) -> None:
        """Maps rows ``0 .. n - 1`` for this forward (``n = len(seq_lens)``).

        Args:
            block_table: ``[>= n, max_blocks]`` int block ids per row (the
                framework's CPU block table; entries past ``num_blocks[r]``
                are ignored).
            num_blocks: ``[>= n]`` blocks the framework allocated to each row.
            seq_lens: ``[n]`` tokens each row attends over after this forward
                (cached + new).
            query_lens: ``[n]`` new tokens of each row in this forward; with a
                window, the first of them is the earliest query, which sets
                where the window starts. None: windows are not applied.

        A row needing more blocks than it was allocated is a dummy (warm-up)
        row with no blocks: its positions get the null block, which is never
        handed to a request, so dummy writes cannot touch a real block.
        """
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        n = len(seq_lens)
        if n > self.rows:
            raise ValueError(f"vattn: {n} rows in a forward, but the cache has {self.rows} (max_num_seqs)")
        need = -(-seq_lens // self.block_size)
        keep = np.zeros(self.rows, dtype=np.int64)
        keep[:n] = need
        self.manager.unmap_pages(self._all_rows, keep)
        self.holes = 0
        if n == 0:
            return
        width = int(need.max())
        cols = np.arange(width)
        ids = np.where(cols < np.asarray(num_blocks[:n])[:, None], block_table[:n, :width], self.null_block_id)
        used = cols < need[:, None]
        real = used & (ids != self.null_block_id)
        first = np.where(real.any(axis=1), real.argmax(axis=1), 0)  # positions before it: behind a window
        if self.window and query_lens is not None:  # the earliest query sees tokens from lo on
            lo = np.maximum(seq_lens - np.asarray(query_lens, dtype=np.int64) - self.window + 1, 0)
            first = np.maximum(first, np.minimum(lo // self.block_size, need - 1))
        behind = first > 0
        self.holes = int(first.sum())
        if behind.any():
            self.manager.unmap_pages_below(self._all_rows[:n][behind], first[behind])
        self.manager.map_pages(self._all_rows[:n], first, ids[used & (cols >= first[:, None])].astype(np.int64),
                               need - first)
