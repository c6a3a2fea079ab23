"""The vattn cache seen as a paged cache whose page table is plain ranges.

A paged kernel (FlashInfer) takes a pool of equal pages, each request's page
indices and the length of its last page. The vattn cache ``[B_max, L, H, D]``
is such a pool already: cut every slice into pages of ``page_tokens`` rows and
page ``j`` of reqid ``r`` is pool page ``r * P + j``, where ``P`` is the
pages per slice (a slice is ``slice_stride`` elements, rows ``row_stride``
apart). So the indices of a batch are ranges, computed once per batch from
the reqids and lengths (:func:`page_ranges`); no table is kept, and the pool
(:func:`paged_view`) is a strided view of the cache, not a copy.

Rows of a page past a request's length are never read (the last page's
length says where the request ends), so pages may straddle mapped and
unmapped memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

DEFAULT_PAGE_TOKENS = 256
"""The page, in tokens, when the vattn page is not known: the largest power
of two up to this that divides the slice."""


class PageGeometry(NamedTuple):
    """How the cache is cut into pages."""

    page_tokens: int  # rows per page
    pages_per_slice: int  # P: reqid r's pages are r * P .. r * P + P - 1
    page_stride: int  # elements from one page to the next (page_tokens * row_stride)


def page_geometry(slice_stride: int, row_stride: int, page_tokens: int | None = None) -> PageGeometry:
    """The pages of a cache whose slices are ``slice_stride`` elements and rows
    ``row_stride`` elements apart (``k_cache.stride(0)``, ``stride(1)``).

    ``page_tokens``: the vattn page in tokens (None: unknown, the largest
    power of two up to :data:`DEFAULT_PAGE_TOKENS` that divides the slice).
    Raises ``ValueError`` when a slice is not a whole number of rows, or not
    a whole number of such pages.
    """
    if slice_stride < 1 or row_stride < 1:
        raise ValueError(f"slice_stride and row_stride must be >= 1, got {slice_stride} and {row_stride}")
    if slice_stride % row_stride:
        raise ValueError(f"a slice ({slice_stride} elements) is not a whole number of token rows "
                         f"({row_stride} elements each): the cache cannot be cut into pages of whole tokens")
    slice_rows = slice_stride // row_stride
    if page_tokens is None:
        page_tokens = math.gcd(slice_rows, DEFAULT_PAGE_TOKENS)
    if page_tokens < 1 or slice_rows % page_tokens:
        raise ValueError(f"page_tokens must divide the slice's {slice_rows} rows, got {page_tokens}")
    return PageGeometry(page_tokens, slice_rows // page_tokens, page_tokens * row_stride)


def paged_view(cache: torch.Tensor, geometry: PageGeometry) -> torch.Tensor:
    """``cache`` ``[B_max, L, H, D]`` as the pool ``[B_max * P, page_tokens,
    H, D]`` (a view: same memory, same row and head strides)."""
    num_reqids, _, heads, head_dim = cache.shape
    _, row, head, elem = cache.stride()
    return cache.as_strided((num_reqids * geometry.pages_per_slice, geometry.page_tokens, heads, head_dim),
                            (geometry.page_stride, row, head, elem), cache.storage_offset())


class PageRanges(NamedTuple):
    """A batch's pages in the pool, as a paged kernel takes them (int32, on
    the host)."""

    indptr: torch.Tensor  # [n + 1]: request i's pages are indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # [indptr[n]]: pool pages, request by request
    last_page_len: torch.Tensor  # [n]: rows of each request's last page, 1 .. page_tokens


def page_ranges(reqids: Sequence[int], seq_lens: Sequence[int], geometry: PageGeometry) -> PageRanges:
    """The pages requests ``reqids`` read for ``seq_lens`` tokens each
    (every length >= 1): ceil(len / page_tokens) pages from ``reqid * P`` on.
    Built with a few tensor ops on the host, whatever the number of pages."""
    t, p = geometry.page_tokens, geometry.pages_per_slice
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    counts = (lens + t - 1) // t
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    total = int(indptr[-1])
    # page k of the batch belongs to request i = the one whose range holds k; its index is
    # reqid_i * P + (k - indptr[i])
    first = torch.tensor(reqids, dtype=torch.int64) * p - indptr[:-1]
    indices = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(first, counts, output_size=total)
    last = lens - (counts - 1) * t
    return PageRanges(indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32))
