"""The worker side of the vLLM integration without vLLM: fake block tables
through BlockMapper onto a real external-page cache, and the start-up checks.

Rows are vLLM's persistent-batch rows (reqids); block ids are page ids. Each
test writes K/V through one row and reads them back through another, so a
wrong mapping shows up as wrong rows, not only as wrong bookkeeping.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants
from vattn.integrations.vllm import NULL_BLOCK_ID, BlockMapper, check_kernel, choose_layout

PAGE = 4096
BLOCK = 16  # tokens per block: fp32, 2 KV heads x 32 = 256 bytes per token per buffer -> 4 KiB pages
ROWS, MAX_LEN, NUM_BLOCKS = 4, 128, 40


@pytest.fixture
def kv():
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                              max_batch_size=ROWS, max_context_len=MAX_LEN, page_size=PAGE,
                              physical_memory=NUM_BLOCKS * 4 * PAGE, page_allocator="external",
                              background=False, deferred_reclaim=False, eager=False) as kv:
        assert kv.page_tokens == BLOCK and kv.num_page_ids == NUM_BLOCKS
        yield kv


def table(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's CPU block table: int32 [max_num_reqs, max_blocks], zeros past each row's blocks."""
    out = np.zeros((ROWS, MAX_LEN // BLOCK), dtype=np.int32)
    for r, ids in enumerate(rows):
        out[r, :len(ids)] = ids
    return out, np.array([len(ids) for ids in rows] + [0] * (ROWS - len(rows)), dtype=np.int32)


def step(mapper: BlockMapper, rows: list[list[int]], seq_lens: list[int]) -> None:
    mapper.map_rows(*table(rows), np.array(seq_lens))


def write(kv, row: int, start: int, n: int, value: float) -> None:
    for layer in range(2):
        k, v = kv.layer(layer)
        k[row, start:start + n] = value + layer
        v[row, start:start + n] = -(value + layer)


def read(kv, row: int, start: int, n: int) -> list[float]:
    """One value per token (K of layer 0), after checking every layer, head and V agree."""
    out = []
    for layer in range(2):
        k, v = kv.layer(layer)
        rows_k, rows_v = k[row, start:start + n], v[row, start:start + n]
        assert torch.equal(rows_k, -rows_v)
        assert torch.equal(rows_k, rows_k[:, :1, :1].expand_as(rows_k))
        if layer == 0:
            out = rows_k[:, 0, 0].tolist()
        else:
            assert rows_k[:, 0, 0].tolist() == [x + 1 for x in out]
    return out


def test_rows_map_exactly_the_blocks_their_lengths_need(kv):
    mapper = BlockMapper(kv, BLOCK)
    assert all(kv.is_allocated(r) for r in range(ROWS))
    step(mapper, [[3, 7, 9], [5]], [33, 16])  # 33 tokens need 3 blocks; 16 need 1
    assert [kv.page_ids(r) for r in range(ROWS)] == [[3, 7, 9], [5], [], []]
    step(mapper, [[3, 7, 9, 11], [5, 6]], [40, 17])  # vLLM allocated ahead: only what is read is mapped
    assert [kv.page_ids(r) for r in range(ROWS)] == [[3, 7, 9], [5, 6], [], []]
    assert kv.stats()["bytes_mapped"] == 5 * kv.config.num_buffers * PAGE
    assert_invariants(kv)


def test_prefix_shared_blocks_are_one_page_in_several_slices(kv):
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[8, 2]], [20])
    write(kv, 0, 0, 20, 1.0)  # the system prompt's K/V, written by the first request
    step(mapper, [[8, 2], [8, 4], [8, 5]], [21, 17, 30])  # two more requests hit the cached first block
    assert read(kv, 1, 0, BLOCK) == read(kv, 2, 0, BLOCK) == [1.0] * BLOCK
    assert kv.stats()["pages_mapped"] == 4 * kv.config.num_buffers  # 8 once, plus 2, 4, 5
    assert kv.stats()["page_slots_mapped"] == 6 * kv.config.num_buffers
    assert_invariants(kv)


def test_a_request_moved_to_another_row_keeps_its_tokens(kv):
    """vLLM condenses its persistent batch: a request in row 2 moves to row 0."""
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[1], [2], [6, 10]], [5, 9, 20])
    write(kv, 2, 0, 20, 7.0)
    step(mapper, [[6, 10]], [21])  # rows 0 and 1 finished; the request now sits in row 0
    assert [kv.page_ids(r) for r in range(ROWS)] == [[6, 10], [], [], []]
    assert read(kv, 0, 0, 20) == [7.0] * 20
    assert_invariants(kv)


def test_a_freed_block_comes_back_from_the_prefix_cache_with_its_contents(kv):
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[12, 13]], [32])
    write(kv, 0, 0, 32, 3.0)
    step(mapper, [], [])  # the request finished: its blocks are free but cached, mapped nowhere
    assert kv.stats()["page_slots_mapped"] == 0
    step(mapper, [[20], [14]], [10, 10])  # other blocks pass through the same addresses
    write(kv, 0, 0, 10, -5.0)
    write(kv, 1, 0, 10, -6.0)
    step(mapper, [[20], [12, 13, 15]], [10, 40])  # a new request in row 1 hits both cached blocks
    assert read(kv, 1, 0, 32) == [3.0] * 32
    assert read(kv, 0, 0, 10) == [-5.0] * 10
    assert_invariants(kv)


def test_a_row_taken_by_a_shorter_request_loses_the_old_tail(kv):
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[30, 31, 32]], [48])
    step(mapper, [[30]], [3])  # same first block (a prefix hit), shorter request
    assert kv.page_ids(0) == [30]
    step(mapper, [[33, 34]], [20])  # another request entirely
    assert kv.page_ids(0) == [33, 34]
    assert_invariants(kv)


def test_dummy_rows_without_blocks_get_the_null_block(kv):
    """Warm-up forwards come with lengths but no blocks: they write into
    vLLM's null block only, never into a block a request may own."""
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[], []], [40, 1])
    assert [kv.page_ids(r) for r in range(2)] == [[NULL_BLOCK_ID] * 3, [NULL_BLOCK_ID]]
    write(kv, 0, 0, 40, 9.0)
    step(mapper, [[4]], [2])  # the first real step maps real blocks over them
    assert [kv.page_ids(r) for r in range(ROWS)] == [[4], [], [], []]
    assert_invariants(kv)


def test_mapper_errors(kv):
    mapper = BlockMapper(kv, BLOCK)
    with pytest.raises(ValueError, match=r"5 rows in a forward, but the cache has 4 \(max_num_seqs\)"):
        mapper.map_rows(np.zeros((5, 8), dtype=np.int32), np.zeros(5, dtype=np.int32), np.ones(5))
    rows, counts = table([[NUM_BLOCKS]])
    with pytest.raises(ValueError, match=r"page_ids\[0\] must be in \[0, 39\]"):
        mapper.map_rows(rows, counts, np.array([1]))
    assert kv.page_ids(0) == []  # nothing changed
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=32, max_batch_size=1, max_context_len=64,
                              background=False) as managed:
        with pytest.raises(ValueError, match="page_allocator='external'"):
            BlockMapper(managed, BLOCK)


# ---- start-up decisions ------------------------------------------------------------------


def test_layout_makes_one_block_one_page():
    # 2 KV heads x 32 x fp32 = 256 bytes per token and layer; 2 layers
    assert choose_layout(2, 2, 32, 4, 32, 4096) == ("per_layer", 8192)
    assert choose_layout(2, 2, 32, 4, 64, 4096) == ("per_layer", 16384)
    assert choose_layout(2, 2, 32, 4, 8, 4096) == ("all_layers", 4096)  # per_layer would be 2 KiB
    assert choose_layout(2, 2, 32, 4, 32, 4096, "all_layers") == ("all_layers", 16384)
    # an 8B-class model on CUDA's 2 MiB granularity: 32 layers x 8 heads x 128 x bf16
    assert choose_layout(32, 8, 128, 2, 32, 2 << 20) == ("all_layers", 2 << 20)
    with pytest.raises(ValueError, match=r"block_size=4 makes 1024-byte pages \(per_layer\) or 2048-byte pages "
                                         r"\(all_layers\).*multiples of 16 tokens \(per_layer.*multiples of 8 tokens"):
        choose_layout(2, 2, 32, 4, 4, 4096)
    with pytest.raises(ValueError, match=r"block_size=16 makes 1048576-byte pages \(all_layers\), not a multiple "
                                         r"of the backend's 2097152-byte granularity; block sizes that fit: "
                                         r"multiples of 32 tokens"):
        choose_layout(32, 8, 128, 2, 16, 2 << 20, "all_layers")
    with pytest.raises(ValueError, match="VATTN_VLLM_LAYOUT must be one of"):
        choose_layout(2, 2, 32, 4, 32, 4096, "paged")


def test_kernel_limits_are_checked_at_start_up(monkeypatch):
    assert check_kernel(128, "cuda") == "FlashAttention-2"
    with pytest.raises(ValueError, match=r"head_dim=36 is not supported by FlashAttention-2 \(head_dim must be "
                                         r"a multiple of 8 in \[8, 256\]\)"):
        check_kernel(36, "cuda")
    with pytest.raises(ValueError, match="head_dim=512 is not supported by FlashAttention-2"):
        check_kernel(512, "cuda")
    with pytest.raises(ValueError, match=r"FlashAttention-2 has no sliding windows \(sliding_window=4096"):
        check_kernel(128, "cuda", sliding_window=4096)
    # vattn's host kernel: windows and soft-caps, head_dim <= 1024
    assert check_kernel(80, "cpu", sliding_window=512, logits_soft_cap=30.0) == "vattn's host kernel"
    with pytest.raises(ValueError, match=r"head_dim=2048 is not supported by vattn's host kernel"):
        check_kernel(2048, "cpu")


# ---- sliding windows and KV cache groups ---------------------------------------------------


def test_blocks_a_window_left_behind_become_holes_and_the_window_keeps_its_addresses(kv):
    """vLLM frees the blocks a sliding window (here 32 tokens) left behind and
    puts its null block in their places: those positions are unmapped, the
    window's pages stay where they are."""
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[3, 4, 5]], [40])
    write(kv, 0, 16, 24, 2.0)
    address = kv.layer(0)[0][0, 32].data_ptr()
    step(mapper, [[NULL_BLOCK_ID, 4, 5]], [41])  # the first block fell out of the window
    assert kv.page_ids(0) == [-1, 4, 5] and mapper.holes == 1
    assert read(kv, 0, 16, 24) == [2.0] * 24 and kv.layer(0)[0][0, 32].data_ptr() == address
    step(mapper, [[NULL_BLOCK_ID, NULL_BLOCK_ID, 5, 6]], [50])  # and the second; a new block at the end
    assert kv.page_ids(0) == [-1, -1, 5, 6] and kv.stats()["page_slots_mapped"] == 2 * kv.config.num_buffers
    step(mapper, [[7]], [3])  # another request takes the row: the holes and the old pages go
    assert kv.page_ids(0) == [7] and mapper.holes == 0
    assert_invariants(kv)


def test_a_window_unmaps_the_blocks_no_query_can_see_though_the_table_still_names_them(kv):
    """vLLM frees a block once the window has passed it but leaves its id in
    the worker's block table (and may hand it to another request): the
    mapper works the window out from the forward's earliest query."""
    mapper = BlockMapper(kv, BLOCK, window=32)
    mapper.map_rows(*table([[3, 4, 5, 6]]), np.array([50]), np.array([50]))  # a prefill: every query from 0
    assert kv.page_ids(0) == [3, 4, 5, 6] and mapper.holes == 0
    write(kv, 0, 32, 18, 4.0)
    mapper.map_rows(*table([[3, 4, 5, 6]]), np.array([51]), np.array([1]))  # query 50 sees 19..50
    assert kv.page_ids(0) == [-1, 4, 5, 6] and mapper.holes == 1
    # query 64 sees 33..64, past block 4 too; block 3 went to the request in row 1
    mapper.map_rows(*table([[3, 4, 5, 6, 7], [3]]), np.array([65, 5]), np.array([1, 5]))
    assert kv.page_ids(0) == [-1, -1, 5, 6, 7] and kv.page_ids(1) == [3] and mapper.holes == 2
    assert read(kv, 0, 32, 18) == [4.0] * 18
    assert_invariants(kv)


def test_a_prefix_hit_in_a_windowed_group_maps_only_the_window(kv):
    """A request whose window starts in its third block, found in the prefix
    cache: vLLM hands it null blocks before the window."""
    mapper = BlockMapper(kv, BLOCK)
    step(mapper, [[], [NULL_BLOCK_ID, NULL_BLOCK_ID, 8, 9]], [1, 60])  # row 0: a dummy row, null only
    assert kv.page_ids(1) == [-1, -1, 8, 9] and kv.page_ids(0) == [NULL_BLOCK_ID] and mapper.holes == 2
    assert kv.stats()["pages_mapped"] == 3 * kv.config.num_buffers
    assert_invariants(kv)


def test_groups_map_their_own_block_tables_into_their_own_slices_from_one_pool():
    """Two KV cache groups (a sliding-window one and a global one) of 2 rows
    each on one manager: reqids 0-1 and 2-3. A block id is one physical page
    whichever group holds it, as vLLM's one block pool hands it out."""
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                              max_context_len=MAX_LEN, page_size=PAGE, physical_memory=NUM_BLOCKS * 4 * PAGE,
                              page_allocator="external", background=False, deferred_reclaim=False,
                              eager=False) as kv:
        local, full = BlockMapper(kv, BLOCK, first_reqid=0, rows=2), BlockMapper(kv, BLOCK, first_reqid=2, rows=2)
        local.map_rows(*table([[NULL_BLOCK_ID, 11, 12]]), np.array([40]))
        full.map_rows(*table([[1, 2, 3]]), np.array([40]))
        assert [kv.page_ids(r) for r in range(4)] == [[-1, 11, 12], [], [1, 2, 3], []]
        write(kv, 2, 0, 40, 5.0)
        local.map_rows(*table([]), np.array([], dtype=np.int64))  # the request finished: block 11 freed
        full.map_rows(*table([[11]]), np.array([10]))  # and handed to the global group
        assert kv.page_ids(0) == [] and kv.page_ids(2) == [11]
        assert kv.stats()["pages_created"] == 5 * kv.config.num_buffers  # 1, 2, 3, 11, 12 and nothing else
        assert_invariants(kv)
        with pytest.raises(ValueError, match=r"reqids first_reqid .. first_reqid \+ rows - 1 must lie in \[0, 3\], "
                                             r"got first_reqid=3, rows=2"):
            BlockMapper(kv, BLOCK, first_reqid=3, rows=2)


def test_the_worker_caches_per_forward_series_are_bounded():
    """vattn_stats keeps per-forward series; a server runs for days, so they keep the latest forwards only."""
    from vattn.integrations.vllm import worker_cache as vllm_cache

    cache = vllm_cache.WorkerCache(manager=None, groups=[], runner=None, kernel=None, case=None)
    for series in (cache.time_s, cache.bytes_mapped, cache.tokens, cache.behind_windows):
        for i in range(vllm_cache.SERIES_FORWARDS + 3):
            series.append(i)
        assert len(series) == vllm_cache.SERIES_FORWARDS and series[0] == 3
