"""Holes at the front of a slice: ``unmap_pages_below`` (the core's punch).

A sliding window's request only needs the pages of its window: the pages
behind it are unmapped, the positions stay in the slice as holes, and the
positions after them keep their addresses, so the slice is still one
contiguous range. Only managers whose page ids the caller owns make holes.
"""

from __future__ import annotations

import errno

import pytest
import torch

import vattn
from conftest import assert_invariants
from host_faults import FAULTY_HOST, faulty_host_backend

PAGE = 4096
TOKENS = 16  # per page: fp32, 2 KV heads x 32 = 256 bytes a token in each buffer


def make(backend: str | None = None, page_allocator: str = "external") -> vattn.KVCacheManager:
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=3,
                              max_context_len=8 * TOKENS, page_size=PAGE, physical_memory=24 * 4 * PAGE,
                              page_allocator=page_allocator,
                              policy={"background": False, "deferred_reclaim": False, "eager": False},
                              backend=backend)
    if page_allocator == "external":
        for reqid in range(3):
            kv.alloc_reqid(reqid=reqid)
    return kv


def stamp(kv: vattn.KVCacheManager, reqid: int, first_token: int, count: int) -> None:
    for layer in range(2):
        for t in kv.layer(layer):
            t[reqid, first_token:first_token + count] = torch.arange(first_token, first_token + count).view(-1, 1, 1)


def reads(kv: vattn.KVCacheManager, reqid: int, first_token: int, count: int) -> bool:
    want = torch.arange(first_token, first_token + count, dtype=torch.float32).view(-1, 1, 1)
    return all(torch.equal(t[reqid, first_token:first_token + count], want.expand(count, 2, 32))
               for layer in range(2) for t in kv.layer(layer))


def test_the_front_unmaps_and_the_window_keeps_its_pages_and_addresses():
    with make() as kv:
        kv.map_pages([0], [0], [1, 2, 3, 4, 5], [5])
        stamp(kv, 0, 0, 5 * TOKENS)
        k_before = kv.layer(0)[0][0, 2 * TOKENS].data_ptr()
        assert kv.mapped_bytes(0) == 5 * 4 * PAGE
        kv.unmap_pages_below([0], [2])
        assert kv.page_ids(0) == [-1, -1, 3, 4, 5]
        assert kv.stats()["page_mappings"] == 3 * 4 and kv.stats()["pages_mapped"] == 3 * 4
        # the pages behind it, not the holes (they had counted: 5 pages' bytes); its extent stays
        assert kv.mapped_bytes(0) == 3 * 4 * PAGE == kv.stats()["bytes_in_requests"]
        assert kv.mapped_tokens(0) == 5 * TOKENS
        assert kv.layer(0)[0][0, 2 * TOKENS].data_ptr() == k_before and reads(kv, 0, 2 * TOKENS, 3 * TOKENS)
        assert_invariants(kv)
        kv.map_pages([0], [2], [3, 4, 5, 6], [4])  # the window moves on: only the new page is mapped
        assert kv.page_ids(0) == [-1, -1, 3, 4, 5, 6] and kv.stats()["sync_page_maps"] == 6 * 4
        kv.unmap_pages_below([0], [3])  # and one more page falls behind it
        assert kv.page_ids(0) == [-1, -1, -1, 4, 5, 6] and kv.stats()["page_unmaps"] == 3 * 4
        assert reads(kv, 0, 3 * TOKENS, 2 * TOKENS)
        assert_invariants(kv)


def test_a_short_slice_grows_to_the_window_with_holes_so_mapping_can_start_there():
    """A request that starts with a prefix-cache hit of a windowed group gets
    its window's blocks only: its slice starts with holes."""
    with make() as kv:
        kv.unmap_pages_below([1], [4])
        assert kv.page_ids(1) == [-1] * 4 and kv.stats()["page_mappings"] == 0
        kv.map_pages([1], [4], [9, 10], [2])
        stamp(kv, 1, 4 * TOKENS, 2 * TOKENS)
        assert kv.page_ids(1) == [-1] * 4 + [9, 10] and reads(kv, 1, 4 * TOKENS, 2 * TOKENS)
        assert_invariants(kv)


def test_a_new_occupant_maps_over_holes_and_truncating_skips_them():
    with make() as kv:
        kv.map_pages([0], [0], [1, 2, 3, 4], [4])
        kv.unmap_pages_below([0], [2])
        kv.map_pages([0], [0], [7, 8], [2])  # another request in the row: from position 0, the tail goes
        assert kv.page_ids(0) == [7, 8] and kv.stats()["page_mappings"] == 2 * 4
        kv.unmap_pages_below([0], [1])
        kv.unmap_pages([0], [0])  # a slice of holes and pages: only the pages are unmapped
        assert kv.page_ids(0) == [] and kv.stats()["page_mappings"] == 0
        assert_invariants(kv)


def test_shared_pages_stay_where_another_slice_maps_them():
    with make() as kv:
        kv.map_pages([0, 1], [0, 0], [1, 2, 3, 1, 2, 4], [3, 3])  # pages 1 and 2 shared (a prefix-cache hit)
        stamp(kv, 0, 0, 2 * TOKENS)
        kv.unmap_pages_below([0], [2])
        assert kv.page_ids(0) == [-1, -1, 3] and kv.page_ids(1) == [1, 2, 4]
        assert reads(kv, 1, 0, 2 * TOKENS) and kv.stats()["pages_mapped"] == 4 * 4
        assert_invariants(kv)


def test_closing_with_holes_unmaps_only_the_pages():
    kv = make()
    kv.map_pages([2], [0], [5, 6, 7], [3])
    kv.unmap_pages_below([2], [2])
    assert len(kv._pages.table()) == 1 * 4  # the table lists mappings, not holes
    kv.cleanup()


def test_a_failed_unmap_keeps_the_page_as_an_orphan_retried_later():
    with faulty_host_backend() as faults, make(backend=FAULTY_HOST) as kv:
        kv.map_pages([0], [0], [1, 2, 3], [3])
        faults.fail("unmap", 0, 1, errno.EINVAL)
        with pytest.raises(vattn.DriverError):
            kv.unmap_pages_below([0], [2])
        assert kv.page_ids(0) == [-1, -1, 3] and kv.stats()["pages_orphaned"] > 0
        assert_invariants(kv)
        kv.unmap_pages_below([0], [2])  # the next call on the slice settles the orphans
        assert kv.stats()["pages_orphaned"] == 0 and kv.stats()["page_mappings"] == 1 * 4
        assert_invariants(kv)


def test_errors_name_the_argument_and_change_nothing():
    with make() as kv:
        kv.map_pages([0], [0], [1, 2], [2])
        with pytest.raises(ValueError, match=r"unmap_pages_below: first must be in \[0, 8\] \(page positions per "
                                             r"reqid\), got 9"):
            kv.unmap_pages_below([0], [9])
        with pytest.raises(ValueError, match="reqids and first must have equal lengths"):
            kv.unmap_pages_below([0, 1], [1])
        assert kv.page_ids(0) == [1, 2]
    with make(page_allocator="vattn") as managed:
        with pytest.raises(ValueError, match=r"only a manager whose page ids the caller owns "
                                             r"\(page_allocator='external'\) leaves holes"):
            managed.unmap_pages_below([0], [1])


def test_attention_reads_a_slice_with_holes_only_through_a_window_above_them():
    """The mapping check knows the holes: attention whose rows reach below them raises ValueError (the
    kernels read the unmapped rows and the process died of SIGSEGV), a sliding window that starts above
    them reads the slice and equals attention on a dense copy of what it sees, and writing the new rows
    needs nothing below them."""
    from vattn.attention import AttentionBatch, host_attention, sdpa_attention, write_kv

    kv = make()
    kv.map_pages([0], [0], [[4, 5, 6]])  # 3 pages: rows 0-47
    k, v = kv.layer(0)
    torch.manual_seed(0)
    k[0, :3 * TOKENS], v[0, :3 * TOKENS] = torch.randn(3 * TOKENS, 2, 32), torch.randn(3 * TOKENS, 2, 32)
    kv.unmap_pages_below([0], [2])  # rows 0-31 are holes
    batch = AttentionBatch(reqids=[0], cached_lens=[3 * TOKENS - 1], query_lens=[1], cache=kv)
    q = torch.randn(1, 4, 32)
    out = host_attention(q, k, v, batch, sliding_window=TOKENS)  # the query at row 47 sees rows 32-47
    seen_k, seen_v = (t[0, 2 * TOKENS:3 * TOKENS].repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), seen_k, seen_v)
    torch.testing.assert_close(out, dense.transpose(0, 1), rtol=1e-5, atol=1e-5)
    for window in (None, TOKENS + 1, 5 * TOKENS):
        with pytest.raises(ValueError, match=r"host kernel: reqid 0 would read rows from \d+ on, but its rows "
                                             r"below 32 are unmapped"):
            host_attention(q, k, v, batch, sliding_window=window)
    with pytest.raises(ValueError, match="rows below 32 are unmapped"):
        sdpa_attention(q, k, v, batch)
    with pytest.raises(ValueError, match="rows below 32 are unmapped"):
        kv.check_mapped(k, [0], [3 * TOKENS])
    kv.check_mapped(k, [0], [3 * TOKENS], first_rows=[2 * TOKENS])
    with pytest.raises(ValueError, match="would read -1 tokens: seq_lens must be at least 0"):  # not "step() it to
        kv.check_mapped(k, [0], [-1])  # at least -1 tokens"
    write_kv(k, v, batch, torch.ones(1, 2, 32), torch.ones(1, 2, 32))  # row 47 only
    assert torch.all(k[0, 3 * TOKENS - 1] == 1.0)
    assert_invariants(kv)
    kv.cleanup()
