"""The worker side of the vLLM integration without vLLM: fake block tables
through BlockPlacer onto a real external-page cache, and the start-up checks.

Requests are named by keys (vLLM's request ids) and keep one slice each;
block ids are page ids. Tests write K/V through one request's slice and read
them back through another, so a wrong mapping shows up as wrong rows, not
only as wrong bookkeeping.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants
from vattn.integrations.vllm import NULL_BLOCK_ID, BlockPlacer, check_kernel, choose_layout
from vattn.integrations.vllm.configuration import fit_block_size

PAGE = 4096
BLOCK = 16  # tokens per block: fp32, 2 KV heads x 32 = 256 bytes per token per buffer -> 4 KiB pages
SLICES, MAX_LEN, NUM_BLOCKS = 6, 128, 40


def make_kv(slices: int = SLICES) -> vattn.KVCacheManager:
    return vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                max_batch_size=slices, max_context_len=MAX_LEN, page_size=PAGE,
                                physical_memory=NUM_BLOCKS * 4 * PAGE, page_allocator="external",
                                policy={"background": False, "deferred_reclaim": False, "eager": False})


@pytest.fixture
def kv():
    with make_kv() as kv:
        assert kv.page_tokens == BLOCK and kv.num_page_ids == NUM_BLOCKS
        yield kv


def table(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's CPU block table: int32 [max_num_reqs, max_blocks], zeros past each row's blocks."""
    out = np.zeros((max(len(rows), 1), MAX_LEN // BLOCK), dtype=np.int32)
    for r, ids in enumerate(rows):
        out[r, :len(ids)] = ids
    return out, np.array([len(ids) for ids in rows] or [0], dtype=np.int32)


def step(placer: BlockPlacer, requests: dict[str, list[int]], seq_lens: list[int],
         query_lens: list[int] | None = None) -> dict[str, int]:
    """One forward: the requests in batch order (rows 0..), their block-table
    rows and lengths. Returns each request's reqid."""
    keys = list(requests)
    rows, counts = table(list(requests.values()))
    reqids = placer.reqids_of(keys, rows, counts)  # as the worker does: new requests may reuse a free slice
    placer.map(reqids, rows, counts, np.array(seq_lens), None if query_lens is None else np.array(query_lens))
    return dict(zip(keys, reqids.tolist()))


def maps_and_unmaps(kv) -> tuple[int, int]:
    s = kv.stats()
    return s["sync_page_maps"] + s["background_page_maps"], s["page_unmaps"]


def write(kv, reqid: int, start: int, n: int, value: float) -> None:
    for layer in range(2):
        k, v = kv.layer(layer)
        k[reqid, start:start + n] = value + layer
        v[reqid, start:start + n] = -(value + layer)


def read(kv, reqid: int, start: int, n: int) -> list[float]:
    """One value per token (K of layer 0), after checking every layer, head and V agree."""
    out = []
    for layer in range(2):
        k, v = kv.layer(layer)
        rows_k, rows_v = k[reqid, start:start + n], v[reqid, start:start + n]
        assert torch.equal(rows_k, -rows_v)
        assert torch.equal(rows_k, rows_k[:, :1, :1].expand_as(rows_k))
        if layer == 0:
            out = rows_k[:, 0, 0].tolist()
        else:
            assert rows_k[:, 0, 0].tolist() == [x + 1 for x in out]
    return out


def test_requests_map_exactly_the_blocks_their_lengths_need(kv):
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [3, 7, 9], "b": [5]}, [33, 16])  # 33 tokens need 3 blocks; 16 need 1
    assert kv.page_ids(r["a"]) == [3, 7, 9] and kv.page_ids(r["b"]) == [5]
    assert step(placer, {"a": [3, 7, 9, 11], "b": [5, 6]}, [40, 17]) == r  # vLLM allocated ahead
    assert kv.page_ids(r["a"]) == [3, 7, 9] and kv.page_ids(r["b"]) == [5, 6]  # only what is read is mapped
    assert kv.stats()["bytes_mapped"] == 5 * kv.config.num_buffers * PAGE
    assert placer.positions_needed == 5 and placer.live_requests == 2
    assert_invariants(kv)


def test_a_decode_step_that_crosses_no_block_maps_nothing(kv, monkeypatch):
    placer = BlockPlacer(kv, BLOCK)
    step(placer, {"a": [3, 7], "b": [5]}, [20, 3])
    calls = []
    monkeypatch.setattr(kv, "map_pages", lambda *a, **k: calls.append(a))
    for n in range(1, 12):  # a: 21..31 tokens, b: 4..14: both within their last block
        step(placer, {"a": [3, 7], "b": [5]}, [20 + n, 3 + n], [1, 1])
    assert calls == []


def test_a_request_moved_to_another_row_maps_and_unmaps_nothing(kv):
    """vLLM condenses its persistent batch: a request in row 2 moves to row
    0, and two rows swap; the kernel is handed the same reqids, and the only
    mapping work is the new request's block."""
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [1], "b": [2], "c": [6, 10]}, [5, 9, 20])
    write(kv, r["c"], 0, 20, 7.0)
    placer.release(["a", "b"])  # finished
    assert step(placer, {"c": [6, 10]}, [21]) == {"c": r["c"]}
    assert kv.page_ids(r["a"]) == [1] and kv.page_ids(r["b"]) == [2]  # free, mapped until reused
    assert read(kv, r["c"], 0, 20) == [7.0] * 20
    maps, unmaps = maps_and_unmaps(kv)
    r2 = step(placer, {"d": [11], "c": [6, 10]}, [3, 22])  # c in row 1 now, d new in row 0
    assert r2["c"] == r["c"] and maps_and_unmaps(kv) == (maps + kv.config.num_buffers, unmaps)
    assert step(placer, {"c": [6, 10], "d": [11]}, [23, 4]) == r2  # rows swapped
    assert maps_and_unmaps(kv) == (maps + kv.config.num_buffers, unmaps)
    assert read(kv, r["c"], 0, 20) == [7.0] * 20
    assert_invariants(kv)


def test_prefix_shared_blocks_are_one_page_in_several_slices(kv):
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [8, 2]}, [20])
    write(kv, r["a"], 0, 20, 1.0)  # the system prompt's K/V, written by the first request
    r = step(placer, {"a": [8, 2], "b": [8, 4], "c": [8, 5]}, [21, 17, 30])  # b and c hit the cached first block
    assert read(kv, r["b"], 0, BLOCK) == read(kv, r["c"], 0, BLOCK) == [1.0] * BLOCK
    assert kv.stats()["pages_mapped"] == 4 * kv.config.num_buffers  # 8 once, plus 2, 4, 5
    assert kv.stats()["page_mappings"] == 6 * kv.config.num_buffers
    assert_invariants(kv)


def test_a_released_slice_keeps_its_pages_until_it_is_reused_and_is_emptied_then(kv):
    """Deferred reclamation, lazily: a finished request's pages stay mapped
    (the device may still read them, a later request may share them) until
    its slice is reused; a new request that shares none of its blocks gets
    the oldest-freed slice, emptied first, and never maps over old pages."""
    placer = BlockPlacer(kv, BLOCK, slices=2)
    r = step(placer, {"a": [12, 13]}, [32])
    page_id_bytes = kv.page_size * kv.config.num_buffers
    assert kv.bytes_in_requests == kv.bytes_mapped == 2 * page_id_bytes
    placer.release(["a"])
    assert kv.page_ids(r["a"]) == [12, 13] and not kv.is_allocated(r["a"])
    assert kv.bytes_mapped == 2 * page_id_bytes and kv.bytes_in_requests == 0  # mapped, but no request's
    assert kv.reads_done(r["a"])  # freed, and the host has no queued readers
    r2 = step(placer, {"b": [20]}, [10])  # the never-used slice: it was freed first (at start-up)
    assert r2["b"] != r["a"] and kv.page_ids(r["a"]) == [12, 13]
    assert not kv.reads_done(r2["b"])  # allocated: still read
    before = maps_and_unmaps(kv)
    r3 = step(placer, {"b": [20], "c": [14, 15, 16]}, [10, 40])  # now the freed one
    assert r3["c"] == r["a"] and kv.page_ids(r["a"]) == [14, 15, 16]
    buffers = kv.config.num_buffers
    assert maps_and_unmaps(kv) == (before[0] + 3 * buffers, before[1] + 2 * buffers)
    assert placer.positions_reused == 0
    with pytest.raises(ValueError, match="3 requests hold slices, but the cache has 2 per KV cache group"):
        placer.reqids_of(["b", "c", "d"])
    assert placer.live_requests == 2
    placer.release(["c"])
    placer.reqids_of(["b", "d"])  # reused without a block table: emptied first
    assert kv.page_ids(r["a"]) == []
    assert_invariants(kv)


def test_a_new_request_that_starts_with_a_free_slices_blocks_reuses_them_in_place(kv):
    """A prefix-cache hit (a shared system prompt, a resumed request): the
    free slice that maps the longest run of the new request's first blocks
    is taken, those positions are neither unmapped nor mapped again, the
    old request's pages after them are unmapped, and the shared tokens read
    back through the new request's slice."""
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [12, 13, 14], "b": [12, 17]}, [48, 20])
    write(kv, r["a"], 0, 48, 2.0)
    placer.release(["a", "b"])
    step(placer, {"x": [30]}, [4])  # an unrelated request takes the oldest free slice, not these
    before = maps_and_unmaps(kv)
    r2 = step(placer, {"c": [12, 13, 18, 19]}, [60])  # shares a's first two blocks: a's slice, not b's
    buffers = kv.config.num_buffers
    assert r2["c"] == r["a"] and kv.page_ids(r2["c"]) == [12, 13, 18, 19]
    assert kv.stats()["bytes_in_requests"] == 5 * kv.page_size * kv.config.num_buffers  # 12, 13, 18, 19 and x's 30
    assert maps_and_unmaps(kv) == (before[0] + 2 * buffers, before[1] + 1 * buffers)  # 14 out, 18 and 19 in
    assert placer.positions_reused == 2 and kv.page_ids(r["b"]) == [12, 17]
    assert read(kv, r2["c"], 0, 32) == [2.0] * 32
    r3 = step(placer, {"c": [12, 13, 18, 19], "d": [12, 17]}, [60, 20])  # b's whole slice, nothing mapped
    assert r3["d"] == r["b"] and maps_and_unmaps(kv)[0] == before[0] + 2 * buffers
    assert placer.positions_reused == 4
    r4 = step(placer, {"c": [12, 13, 18, 19], "d": [12, 17], "e": [36, 37]}, [60, 20, 20])
    assert kv.page_ids(r4["e"]) == [36, 37]  # no free slice maps block 36: the oldest-freed one
    assert placer.positions_reused == 4
    assert_invariants(kv)


def test_a_freed_block_comes_back_from_the_prefix_cache_with_its_contents(kv):
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [12, 13]}, [32])
    write(kv, r["a"], 0, 32, 3.0)
    placer.release(["a"])  # finished: its blocks are free but cached
    r = step(placer, {"b": [20], "c": [14]}, [10, 10])  # other blocks, other slices
    write(kv, r["b"], 0, 10, -5.0)
    write(kv, r["c"], 0, 10, -6.0)
    r = step(placer, {"b": [20], "d": [12, 13, 15]}, [10, 40])  # a new request hits both cached blocks
    assert read(kv, r["d"], 0, 32) == [3.0] * 32
    assert read(kv, r["b"], 0, 10) == [-5.0] * 10
    assert_invariants(kv)


def test_a_request_resumed_after_a_preemption_with_new_blocks_gets_another_slice(kv):
    """vLLM frees a preempted request's blocks and gives it new ones when it
    resumes: the worker releases it, and its next forward maps the new blocks
    into another slice; the old one keeps its pages until it is reused, so
    nothing is unmapped on the way."""
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"a": [30, 31, 32]}, [48])
    placer.release(["a"])
    before = maps_and_unmaps(kv)
    r2 = step(placer, {"a": [33, 34]}, [20])
    assert r2["a"] != r["a"] and kv.page_ids(r2["a"]) == [33, 34] and kv.page_ids(r["a"]) == [30, 31, 32]
    assert maps_and_unmaps(kv) == (before[0] + 2 * kv.config.num_buffers, before[1])
    placer.release(["a"])  # preempted again, resumed on its first blocks (prefix-cache hits): its first slice
    r3 = step(placer, {"a": [30, 31, 35]}, [40])
    assert r3["a"] == r["a"] and kv.page_ids(r3["a"]) == [30, 31, 35] and placer.positions_reused == 2
    assert_invariants(kv)


def test_warm_up_rows_without_blocks_get_the_null_block_and_real_blocks_replace_it(kv):
    """Warm-up forwards come with lengths but no blocks: they write into
    vLLM's null block only, never into a block a request may own; what a
    request got that way is mapped again from its blocks."""
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"w0": [], "w1": []}, [40, 1])
    assert kv.page_ids(r["w0"]) == [NULL_BLOCK_ID] * 3 and kv.page_ids(r["w1"]) == [NULL_BLOCK_ID]
    write(kv, r["w0"], 0, 40, 9.0)
    placer.release_all_but([])
    r = step(placer, {"a": [4]}, [2])
    assert kv.page_ids(r["a"]) == [4]
    r = step(placer, {"b": []}, [20])  # a row with too few blocks, then its blocks
    assert kv.page_ids(r["b"]) == [NULL_BLOCK_ID] * 2
    step(placer, {"b": [5, 6]}, [21])
    assert kv.page_ids(r["b"]) == [5, 6]
    assert_invariants(kv)


def test_mapper_errors(kv):
    placer = BlockPlacer(kv, BLOCK)
    rows, counts = table([[NUM_BLOCKS]])
    reqids = placer.reqids_of(["a"])
    with pytest.raises(ValueError, match=r"page_ids\[0\] must be in \[0, 39\]"):
        placer.map(reqids, rows, counts, np.array([1]))
    assert kv.page_ids(int(reqids[0])) == []  # nothing changed
    step(placer, {"a": [4]}, [1])  # and the request maps once its table is right
    assert kv.page_ids(int(reqids[0])) == [4]
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=32, max_batch_size=1, max_context_len=64,
                              policy={"background": False}) as managed:
        with pytest.raises(ValueError, match="page_allocator='external'"):
            BlockPlacer(managed, BLOCK)
    with pytest.raises(ValueError, match=r"reqids first_reqid .. first_reqid \+ slices - 1 must lie in "
                                         r"\[0, 5\], got first_reqid=3, slices=4"):
        BlockPlacer(kv, BLOCK, first_reqid=3, slices=4)


def test_a_vllm_like_trace_maps_each_block_once_into_each_request_that_holds_it():
    """Random arrivals, growth, finishes, preemptions and batch reorders
    against a reference model of what every live request must have mapped;
    every position mapped is one the trace needed (the lower bound), and
    new requests that start with a finished request's blocks (prefix-cache
    hits) find them mapped in its slice."""
    rng = random.Random(7)
    with make_kv(slices=12) as kv:
        placer = BlockPlacer(kv, BLOCK)
        free_blocks = list(range(1, NUM_BLOCKS))
        live: dict[str, tuple[list[int], int]] = {}  # key -> (blocks, tokens)
        finished: list[list[int]] = []  # finished requests' full blocks: what vLLM's prefix cache may hand out
        next_key = 0
        for _ in range(300):
            if len(live) < 6 and rng.random() < 0.4:  # a new request with a prompt
                tokens = rng.randint(1, 40)
                hit = rng.choice(finished) if finished and rng.random() < 0.5 else []
                hit = hit[:next((i for i, b in enumerate(hit) if b not in free_blocks), len(hit))]
                hit = hit[:(tokens - 1) // BLOCK]  # a prefix-cache hit leaves at least one token to compute
                need = -(-tokens // BLOCK) - len(hit)
                if len(free_blocks) - len(hit) >= need:
                    for b in hit:
                        free_blocks.remove(b)
                    live[f"r{next_key}"] = (hit + [free_blocks.pop() for _ in range(need)], tokens)
                    next_key += 1
            for key in list(live):
                blocks, tokens = live[key]
                event = rng.random()
                if event < 0.05 or tokens >= MAX_LEN - 1:  # finished
                    free_blocks += blocks
                    finished.append(blocks[:tokens // BLOCK])
                    del live[key]
                    placer.release([key])
                elif event < 0.08:  # preempted and resumed at once with new blocks
                    free_blocks += blocks
                    placer.release([key])
                    need = -(-tokens // BLOCK)
                    rng.shuffle(free_blocks)
                    live[key] = ([free_blocks.pop() for _ in range(need)], tokens)
                else:  # one more token
                    if tokens % BLOCK == 0:
                        if not free_blocks:
                            continue
                        blocks = blocks + [free_blocks.pop()]
                    live[key] = (blocks, tokens + 1)
            if not live:
                continue
            order = list(live)
            rng.shuffle(order)  # vLLM's rows: any order, changing every forward
            step(placer, {k: live[k][0] for k in order}, [live[k][1] for k in order])
            reqids = placer.reqids_of(order)
            for key, reqid in zip(order, reqids.tolist()):
                blocks, tokens = live[key]
                assert kv.page_ids(reqid) == blocks[:-(-tokens // BLOCK)], key
        assert_invariants(kv)
        maps, _ = maps_and_unmaps(kv)
        assert maps == placer.positions_needed * kv.config.num_buffers  # reused positions are not mapped again
        assert placer.positions_needed > 100 and placer.positions_reused > 10


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
    """vLLM frees the blocks a sliding window (here 32 tokens) left behind:
    those positions are unmapped, the window's pages stay where they are."""
    placer = BlockPlacer(kv, BLOCK, window=32)
    r = step(placer, {"a": [3, 4, 5]}, [40], [40])
    write(kv, r["a"], 16, 24, 2.0)
    address = kv.layer(0)[0][r["a"], 32].data_ptr()
    step(placer, {"a": [3, 4, 5]}, [41], [1])  # query 40 sees 9..40: block 0 still in the window
    assert kv.page_ids(r["a"]) == [3, 4, 5] and placer.holes == 0
    step(placer, {"a": [3, 4, 5]}, [48], [1])  # query 47 sees 16..47: block 0 fell out of the window
    assert kv.page_ids(r["a"]) == [-1, 4, 5] and placer.holes == 1
    assert read(kv, r["a"], 16, 24) == [2.0] * 24 and kv.layer(0)[0][r["a"], 32].data_ptr() == address
    step(placer, {"a": [3, 4, 5, 6, 7]}, [65], [1])  # query 64 sees 33..64: and block 1; new blocks at the end
    assert kv.page_ids(r["a"]) == [-1, -1, 5, 6, 7] and kv.stats()["page_mappings"] == 3 * kv.config.num_buffers
    placer.release(["a"])
    r2 = step(placer, {"b": [7]}, [3], [3])  # a new request: no holes of its own
    assert kv.page_ids(r2["b"]) == [7] and placer.holes == 0
    assert_invariants(kv)


def test_a_window_unmaps_the_blocks_no_query_can_see_though_the_table_still_names_them(kv):
    """vLLM frees a block once the window has passed it but leaves its id in
    the worker's block table (and may hand it to another request): the
    placer works the window out from the forward's earliest query."""
    placer = BlockPlacer(kv, BLOCK, window=32)
    r = step(placer, {"a": [3, 4, 5, 6]}, [50], [50])  # a prefill: every query from 0
    assert kv.page_ids(r["a"]) == [3, 4, 5, 6] and placer.holes == 0
    write(kv, r["a"], 32, 18, 4.0)
    step(placer, {"a": [3, 4, 5, 6]}, [51], [1])  # query 50 sees 19..50
    assert kv.page_ids(r["a"]) == [-1, 4, 5, 6] and placer.holes == 1
    # query 64 sees 33..64, past block 4 too; block 3 went to request b
    r = step(placer, {"a": [3, 4, 5, 6, 7], "b": [3]}, [65, 5], [1, 5])
    assert kv.page_ids(r["a"]) == [-1, -1, 5, 6, 7] and kv.page_ids(r["b"]) == [3] and placer.holes == 2
    assert read(kv, r["a"], 32, 18) == [4.0] * 18
    assert_invariants(kv)


def test_a_prefix_hit_in_a_windowed_group_maps_only_the_window(kv):
    """A request whose window starts in its third block, found in the prefix
    cache: vLLM hands it null blocks before the window."""
    placer = BlockPlacer(kv, BLOCK)
    r = step(placer, {"w": [], "a": [NULL_BLOCK_ID, NULL_BLOCK_ID, 8, 9]}, [1, 60])  # w: a warm-up row
    assert kv.page_ids(r["a"]) == [-1, -1, 8, 9] and kv.page_ids(r["w"]) == [NULL_BLOCK_ID] and placer.holes == 2
    assert kv.stats()["pages_mapped"] == 3 * kv.config.num_buffers
    assert_invariants(kv)


def test_groups_map_their_own_block_tables_into_their_own_slices_from_one_pool():
    """Two KV cache groups (a sliding-window one and a global one) of 3
    slices each on one manager: reqids 0-2 and 3-5. A block id is one
    physical page whichever group holds it, as vLLM's one block pool hands it
    out."""
    with make_kv() as kv:
        local, full = BlockPlacer(kv, BLOCK, first_reqid=0, slices=3), BlockPlacer(kv, BLOCK, first_reqid=3, slices=3)
        rl = step(local, {"a": [NULL_BLOCK_ID, 11, 12]}, [40])
        rf = step(full, {"a": [1, 2, 3]}, [40])
        assert (rl["a"], rf["a"]) == (0, 3)
        assert kv.page_ids(0) == [-1, 11, 12] and kv.page_ids(3) == [1, 2, 3]
        write(kv, 3, 0, 40, 5.0)
        local.release(["a"])  # the request finished: block 11 freed
        full.release(["a"])
        rf = step(full, {"b": [11]}, [10])  # and handed to the global group
        assert rf["b"] == 4 and kv.page_ids(4) == [11]
        assert kv.stats()["pages_created"] == 5 * kv.config.num_buffers  # 1, 2, 3, 11, 12 and nothing else
        assert_invariants(kv)


def test_the_worker_caches_per_forward_series_are_bounded():
    """vattn_stats keeps per-forward series; a server runs for days, so they keep the latest forwards only."""
    from vattn.integrations.vllm import worker_cache as vllm_cache

    cache = vllm_cache.WorkerCache(manager=None, groups=[], kernel=None, case=None)
    for series in (cache.time_s, cache.bytes_in_requests, cache.tokens, cache.behind_windows):
        for i in range(vllm_cache.SERIES_FORWARDS + 3):
            series.append(i)
        assert len(series) == vllm_cache.SERIES_FORWARDS and series[0] == 3


def test_a_block_size_vllm_chose_is_raised_to_fill_a_page_and_one_the_user_chose_is_refused():
    """At configuration time, in the process that configures vLLM: 16-token
    blocks of an 8B-class model (32 layers, 8 KV heads of 128, bf16) make
    1 MiB all_layers pages, below CUDA's 2 MiB: vLLM's default becomes 32
    tokens (all_layers); the user's own 16 is refused, naming the flag."""
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    assert fit_block_size(cache, 32, 8, 128, 2, 2 << 20, None) == 32 and cache.block_size == 32
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    assert fit_block_size(cache, 32, 8, 128, 2, 2 << 20, "per_layer") == 1024  # 2 KiB per token and layer
    cache = types.SimpleNamespace(block_size=128, user_specified_block_size=False)  # fits: unchanged
    assert fit_block_size(cache, 4, 2, 64, 4, 4096, None) == 128 and cache.block_size == 128
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=True)
    with pytest.raises(ValueError, match=r"block_size=16 makes 32768-byte pages \(per_layer\) or 1048576-byte "
                                         r"pages \(all_layers\).*multiples of 32 tokens \(all_layers.*--block-size"):
        fit_block_size(cache, 32, 8, 128, 2, 2 << 20, None)
    assert cache.block_size == 16




SCRATCH = NUM_BLOCKS - 1  # the tests' scratch page id: one vLLM never hands out here


def test_a_read_footprint_maps_the_scratch_page_past_each_requests_blocks_until_real_blocks_replace_it(kv):
    """A kernel that reads up to 20 rows past a request's last (a key tile
    less one row): the positions past the request's blocks that those rows
    reach map the shared scratch page, up to the slice's end; a block
    vLLM hands the request later replaces it there, and a decode whose
    footprint stays within what is mapped maps nothing."""
    placer = BlockPlacer(kv, BLOCK, rows_past_end=20, scratch_page_id=SCRATCH)
    r = step(placer, {"a": [3, 7], "b": [5]}, [20, 16])  # a: rows up to 39 read; b: up to 35
    assert kv.page_ids(r["a"]) == [3, 7, SCRATCH] and kv.page_ids(r["b"]) == [5, SCRATCH, SCRATCH]
    maps = maps_and_unmaps(kv)
    step(placer, {"a": [3, 7], "b": [5]}, [21, 16])  # a reads up to row 40: what is mapped already
    assert maps_and_unmaps(kv) == maps
    step(placer, {"a": [3, 7, 9], "b": [5, 6]}, [33, 17])  # second and third blocks replace the scratch page
    assert kv.page_ids(r["a"]) == [3, 7, 9, SCRATCH] and kv.page_ids(r["b"]) == [5, 6, SCRATCH]
    step(placer, {"a": [3, 7, 9, 11, 12, 13, 14, 15]}, [120])  # near the slice's end: no position past it
    assert kv.page_ids(r["a"]) == [3, 7, 9, 11, 12, 13, 14, 15]
    assert placer.positions_needed == 2 + 1 + 1 + 1 + 5  # real blocks only: the scratch page is not a need
    assert_invariants(kv)


def test_a_read_footprint_below_a_window_keeps_the_positions_a_tile_may_start_in_mapped(kv):
    """A window of 32 tokens and a kernel that reads up to 20 rows below a
    query's first visible row: a block the window left behind stays mapped
    until the window is 20 rows past it; a prefix hit whose null blocks
    lie where a tile may start maps the scratch page there."""
    placer = BlockPlacer(kv, BLOCK, window=32, rows_below_start=20, rows_past_end=20, scratch_page_id=SCRATCH)
    r = step(placer, {"a": [3, 4, 5]}, [48], [48])
    step(placer, {"a": [3, 4, 5]}, [49], [1])  # query 48 sees 17..48: a tile may start at row 0
    assert kv.page_ids(r["a"])[:3] == [3, 4, 5] and placer.holes == 0
    step(placer, {"a": [3, 4, 5, 6]}, [57], [1])  # query 56 sees 25..56, tiles from row 5: block 0 stays
    assert kv.page_ids(r["a"])[:4] == [3, 4, 5, 6] and placer.holes == 0
    step(placer, {"a": [3, 4, 5, 6]}, [60], [1])  # query 59 sees 28..59, tiles from row 8: still block 0
    step(placer, {"a": [3, 4, 5, 6, 7]}, [69], [1])  # query 68 sees 37..68, tiles from row 17: block 0 goes
    assert kv.page_ids(r["a"])[:5] == [-1, 4, 5, 6, 7] and placer.holes == 1
    hit = step(placer, {"b": [NULL_BLOCK_ID, NULL_BLOCK_ID, 8, 9]}, [60], [28])  # first real block at row 32
    assert kv.page_ids(hit["b"]) == [SCRATCH, SCRATCH, 8, 9, SCRATCH] and placer.holes == 1  # tiles from row 12
    assert_invariants(kv)


def test_a_read_footprint_needs_a_scratch_page():
    with make_kv() as kv:
        for bad in (None, NULL_BLOCK_ID, NUM_BLOCKS):
            with pytest.raises(ValueError, match=r"a read footprint needs a scratch_page_id in \[0, 39\] other than "
                                                 r"the null block 0, got " + str(bad)):
                BlockPlacer(kv, BLOCK, rows_past_end=1, scratch_page_id=bad)
        with pytest.raises(ValueError, match=r"rows_past_end and rows_below_start must be >= 0, got 0, -1"):
            BlockPlacer(kv, BLOCK, rows_below_start=-1)
