"""The host attention kernel (vattn.attention.host_attention) against a dense
float64 reference on copies of the same K/V (kernels/host_attention_cases.py,
with the tolerances).

Every case runs on the scalar path and on the fastest vector path this CPU
has, so both are checked on every machine that has them; the small models'
head shapes run on every path the CPU supports (the C++ harness,
test_cpu_attn_isas.py, runs every path on random cases too). The
manager cases map exactly each request's length (no lookahead, no background
mapper) and put request ends at page ends, so a kernel that read one row past
a request would fault instead of passing. What surrounds the arithmetic (bad
input, the mapping checks, path selection, threads) is
test_cpu_attention_calls.py.

VATTN_LONG_TESTS=1 adds a longer randomized sweep.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

import vattn
from kernels.host_attention_cases import (ATOL, DTYPES, HEAD_DIMS, ISAS, LSE_ATOL, DenseCase, check, mixed_batch,
                                          rand, reference)
from vattn.attention import AttentionBatch, attention, host_attention, host_attention_info, write_kv
from vattn.kernels import KERNELS

LONG = os.environ.get("VATTN_LONG_TESTS") == "1"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_mixed_batches(isa: str, head_dim: int, dtype: torch.dtype) -> None:
    rng = random.Random(head_dim * 7 + DTYPES.index(dtype))
    for heads_q, heads_kv in ((4, 4), (4, 2), (8, 2), (8, 1)):  # GQA ratios 1, 2, 4, 8
        batch = mixed_batch(rng, max_len=300, requests=4)
        case = DenseCase(batch, heads_q, heads_kv, head_dim, dtype, max_len=300, layers=2,
                         seed=rng.randrange(1 << 30))
        out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                                  isa=isa)
        scale = 1 / math.sqrt(head_dim)
        check(out, lse, reference(case.q, case.keys, case.values, batch, scale),
              f"{isa} {dtype} D={head_dim} {heads_q}/{heads_kv} {batch}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_softcap_scale(isa: str, dtype: torch.dtype) -> None:
    batch = AttentionBatch([2, 0, 1, 3], [0, 300, 40, 400], [100, 1, 70, 1])
    case = DenseCase(batch, 8, 2, 64, dtype, max_len=401)
    for window, cap, scale in ((1, 0.0, None), (17, 0.0, 0.3), (0, 5.0, None), (100, 2.0, 0.5)):
        out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v,
                                  softmax_scale=scale, sliding_window=window, logits_soft_cap=cap, return_lse=True,
                                  isa=isa)
        check(out, lse, reference(case.q, case.keys, case.values, batch, scale or 1 / 8, window, cap),
              f"{isa} {dtype} window={window} cap={cap} scale={scale}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_short_chunks_whose_rows_see_different_keys(isa: str, dtype: torch.dtype) -> None:
    """Chunks of 1-3 queries whose queries straddle key-tile edges (tiles of 8-128 keys end at 63/64 and
    127/128), under sliding windows of 1-3 and a soft cap: rows of one block see different keys, and in a
    tile one row may see none while the rows beside it do. Chunks of at most 8 rows a kv head run the
    decode loop, whose softmax takes a tile's rows four at a time (3 queries of 3 or 4 query heads a kv
    head run the prefill path); 2 and 3 query heads a kv head put two queries' rows in one block of four."""
    batch = AttentionBatch([0, 1, 2, 3], [63, 127, 31, 64], [2, 3, 2, 1])
    for heads_q, heads_kv in ((4, 2), (12, 4), (8, 2)):  # 2, 3 and 4 query heads a kv head
        case = DenseCase(batch, heads_q, heads_kv, 64, dtype, max_len=140, seed=heads_q)
        for window, cap in ((1, 0.0), (2, 3.0), (3, 0.0), (0, 0.0)):
            out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v,
                                      sliding_window=window, logits_soft_cap=cap, return_lse=True, isa=isa)
            check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / 8, window, cap),
                  f"{isa} {dtype} {heads_q}/{heads_kv} window={window} cap={cap}")


@pytest.mark.parametrize("isa", ISAS)
def test_long_decodes_split_and_merge(isa: str) -> None:
    """Long contexts are cut into key splits (several per request on a
    multi-core pool) whose partials merge; lengths sit at and around split
    and tile boundaries, up to 4096."""
    lens = [4096, 1, 255, 256, 257, 511, 1024, 2049, 3000]
    batch = AttentionBatch(list(range(len(lens))), [n - 1 for n in lens], [1] * len(lens))
    for heads_q, heads_kv, dtype in ((8, 1, torch.bfloat16), (4, 4, torch.float32), (8, 2, torch.float16)):
        case = DenseCase(batch, heads_q, heads_kv, 128, dtype, max_len=4096, seed=heads_kv)
        out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                                  isa=isa)
        check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / math.sqrt(128)),
              f"{isa} {dtype} {heads_q}/{heads_kv}")
    if host_attention_info()["threads"] > 1:
        _, groups = batch.plan(KERNELS["host"]).native.num_items(group_size=8, heads_kv=1)
        assert groups > 0, "a 4096-token MQA decode should be split across threads"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_decodes_over_wide_rows(isa: str, dtype: torch.dtype) -> None:
    """Decode items of >= 512 keys over 8 kv heads (2-4 KiB of K per token)
    stream in smaller tiles with the next tile fetched inside the loops;
    lengths off every tile and split boundary."""
    lens = [2049, 512, 513, 777, 1031]
    batch = AttentionBatch([4, 0, 2, 1, 3], [n - 1 for n in lens], [1] * len(lens))
    case = DenseCase(batch, 16, 8, 128, dtype, max_len=2049, seed=7)
    out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                              isa=isa)
    check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / math.sqrt(128)), f"{isa} {dtype}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [80, 128])
def test_decodes_of_two_query_heads_a_kv_head_from_memory(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    """Decode items of 2 query heads a kv head (rows of 2: P V in 4-vector
    passes on 8-float vectors) whose call's K/V outgrow L2 (6-12 MiB here, so
    the short tiles of narrow rows from memory: 16 KiB of K each); lengths
    around those tiles and the split boundaries, head dims whole and not
    whole in 4-vector passes."""
    lens = [1, 15, 16, 17, 255, 1000, 2049, 3000]
    batch = AttentionBatch([7, 0, 2, 1, 3, 6, 4, 5], [n - 1 for n in lens], [1] * len(lens))
    case = DenseCase(batch, 4, 2, head_dim, dtype, max_len=3000, seed=head_dim)
    out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                              isa=isa)
    check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / math.sqrt(head_dim)),
          f"{isa} {dtype} head_dim={head_dim}")


SUPPORTED = host_attention_info()["supported"]  # every path this CPU runs (scalar, avx2, avx512, avx512_bf16, ...)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (14, 2), (32, 4)], ids=["8q2kv", "14q2kv", "32q4kv"])
def test_small_model_head_shapes(dtype: torch.dtype, heads_q: int, heads_kv: int) -> None:
    """The head shapes of the small models served on CPUs (2-4 kv heads of
    64; Qwen2-0.5B's 7 query heads a kv head leave prefill blocks of rows
    that are no whole number of vectors) on every path this CPU supports: a
    fresh prefill of several key tiles, a chunk after history, and decodes
    around tile and split boundaries, plain and with a sliding window and
    soft-cap (prefill blocks mask the window and the diagonal down the columns)."""
    batch = AttentionBatch([3, 0, 5, 1, 2, 4], [0, 300, 0, 127, 128, 599], [200, 40, 1, 1, 1, 1])
    case = DenseCase(batch, heads_q, heads_kv, 64, dtype, max_len=600, seed=heads_q)
    for window, cap in ((0, 0.0), (150, 20.0)):
        expected = reference(case.q, case.keys, case.values, batch, 1 / 8, window, cap)
        for isa in SUPPORTED:
            out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v,
                                      return_lse=True, sliding_window=window, logits_soft_cap=cap, isa=isa)
            check(out, lse, expected, f"{isa} {dtype} {heads_q}/{heads_kv} window={window} cap={cap}")


def packed_bytes() -> int:
    return host_attention_info()["packed_value_bytes"]


@pytest.mark.parametrize("dtype, layers, packs", [(torch.float32, 2, True), (torch.float32, 1, False),
                                                  (torch.bfloat16, 2, False), (torch.float16, 2, False)],
                         ids=["fp32-1KiB-tokens", "fp32-512B-tokens", "bf16", "fp16"])
def test_prompt_blocks_read_values_packed_once(dtype: torch.dtype, layers: int, packs: bool) -> None:
    """A prompt of several query blocks packs each kv head's values once per call where its blocks would
    copy every V tile (fp32 tokens a multiple of 1 KiB apart, here 2 kv heads of 64 in a 2-layer
    all_layers view), from the window's first key on; the rest, and 16-bit caches, read the cache as
    before. Exactly those bytes are packed, and every output matches the reference, on every path this
    CPU supports."""
    # 8 q / 2 kv heads of 64: 16 queries a block. Request 1: 70 new tokens over 30 (5 blocks, packed);
    # request 0 a decode and request 2 one block of 10 (neither packed).
    batch = AttentionBatch([1, 0, 2], [30, 200, 5], [70, 1, 10])
    case = DenseCase(batch, 8, 2, 64, dtype, max_len=201, layers=layers, seed=layers)
    for isa in SUPPORTED:
        for window in (0, 20):
            before = packed_bytes()
            out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v,
                                      sliding_window=window, return_lse=True, isa=isa)
            check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / 8, window),
                  f"{isa} {dtype} layers={layers} window={window}")
            first = max(0, 30 - window + 1) if window else 0  # the first key any of its queries sees
            assert packed_bytes() - before == ((100 - first) * 2 * 64 * 4 if packs else 0), isa


def test_packed_values_stop_at_64_mib() -> None:
    """A call packs at most 64 MiB of values: of two prompts of 36 MiB each, the second keeps reading its
    V tiles from the cache, and both are right."""
    tokens = 36 * 1024  # 2 kv heads of 128 in fp32: 1 KiB a token
    batch = AttentionBatch([0, 1], [tokens - 70, tokens - 70], [70, 70])
    case = DenseCase(batch, 2, 2, 128, torch.float32, max_len=tokens)
    before = packed_bytes()
    out = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
    assert packed_bytes() - before == tokens * 1024
    check(out, None, reference(case.q, case.keys, case.values, batch, 128 ** -0.5), "two 36 MiB prompts")


def test_single_long_request_split_over_keys() -> None:
    """One request, one kv head: all parallelism comes from key splits, also
    for a prefill chunk after a long history."""
    batch = AttentionBatch([0], [3000], [40])
    case = DenseCase(batch, 4, 1, 64, torch.float32, max_len=3040)
    out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True)
    check(out, lse, reference(case.q, case.keys, case.values, batch, 1 / 8), "prefill after 3000")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_reaches_exactly_the_rows_that_read_it(isa: str, where: str) -> None:
    """A NaN in a query, or in K or V of a key a query sees, makes that
    query's output NaN (and its LSE, unless the NaN is in V), as in torch's
    SDPA, on every path: the vector exp must not clamp a NaN score into a
    probability, and the split merge must not drop a split whose max is NaN.
    Rows that never read it stay exact. Request 0 is a long decode (key
    splits), request 1 a prefill chunk after history, request 2 untouched."""
    batch = AttentionBatch([0, 1, 2], [3000, 300, 500], [1, 24, 1])
    for dtype in (torch.float32, torch.bfloat16):
        case = DenseCase(batch, 8, 2, 64, dtype, max_len=3100, seed=5)
        clean = reference(case.q, case.keys, case.values, batch, 1 / 8)
        poisoned_rows = []  # (token range, query heads) that must come out NaN
        for i, (reqid, key) in enumerate(((0, 1700), (1, 10))):
            s, e = batch.query_starts[i], batch.query_starts[i + 1]
            if where == "q":
                case.q[s:e, 5] = float("nan")
                poisoned_rows.append((slice(s, e), slice(5, 6)))
            else:  # kv head 1 of a history key every query of the request sees
                (case.k_cache if where == "k" else case.v_cache)[reqid, key, 1, 7] = float("nan")
                poisoned_rows.append((slice(s, e), slice(4, 8)))
        out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                                  isa=isa)
        expect_nan = torch.zeros(out.shape, dtype=torch.bool)  # a NaN in V reaches only its own column
        for tokens, heads in poisoned_rows:
            expect_nan[tokens, heads, 7 if where == "v" else slice(None)] = True
        got = out.isnan()
        assert torch.equal(got, expect_nan), \
            f"{isa} {dtype} NaN in {where}: NaN at {got.nonzero().tolist()[:8]}, expected {expect_nan.sum()} entries"
        rows_nan = expect_nan.all(-1)
        assert torch.equal(lse.isnan(), rows_nan), f"{isa} {dtype} NaN in {where}: lse"
        fine = ~expect_nan
        err = (out[fine].double() - clean[0][fine]).abs().max().item()
        assert err <= ATOL[dtype], f"{isa} {dtype} NaN in {where}: untouched rows off by {err:.3g}"
        lerr = (lse[~rows_nan].double() - clean[1][~rows_nan]).abs().max().item()
        assert lerr <= LSE_ATOL, f"{isa} {dtype} NaN in {where}: untouched lse off by {lerr:.3g}"


@pytest.mark.parametrize("isa", ISAS)
def test_nan_in_a_split_that_sees_one_key(isa: str) -> None:
    """A prefill chunk after a long history, NaN in its first new key: where a
    key split starts at that key, the chunk's first query sees only the NaN
    key in that split, whose max is then no number. The row must still come
    out NaN (a split reporting max -inf would be skipped by the merge). The
    history lengths sweep split boundaries for any pool size (a one-thread
    pool splits nothing, and the merge is not reached)."""
    split = False
    for cached in range(256, 4097, 64):
        batch = AttentionBatch([0], [cached], [8])
        split = split or batch.plan(KERNELS["host"]).native.num_items(group_size=4, heads_kv=1, head_dim=64)[1] > 0
        case = DenseCase(batch, 4, 1, 64, torch.float32, max_len=cached + 8, seed=1)
        case.k[0, 0, 7] = float("nan")  # every query of the chunk sees its first new key
        out = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, isa=isa)
        finite_rows = (~out.isnan()).any(-1).nonzero().tolist()
        assert not finite_rows, f"{isa}: after {cached} cached tokens, rows {finite_rows} are finite"
    assert split or host_attention_info()["threads"] == 1, "no history length was split: the merge went untested"


def test_other_head_dims_use_a_generic_path() -> None:
    batch = AttentionBatch([1, 0], [5, 0], [1, 9])
    for head_dim in (8, 40, 72, 100):
        case = DenseCase(batch, 4, 2, head_dim, torch.float32, max_len=16)
        out = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
        check(out, None, reference(case.q, case.keys, case.values, batch, head_dim**-0.5), f"D={head_dim}")


def test_query_dtype_may_differ_from_the_cache() -> None:
    batch = AttentionBatch([0, 1], [10, 0], [1, 12])
    case = DenseCase(batch, 4, 2, 64, torch.bfloat16, max_len=16)
    q = case.q.float()
    out = host_attention(q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
    assert out.dtype == torch.float32
    check(out, None, reference(q, case.keys, case.values, batch, 1 / 8), "f32 q over bf16 cache")


@pytest.mark.skipif(not LONG, reason="long test: set VATTN_LONG_TESTS=1 (a longer randomized sweep)")
@pytest.mark.parametrize("seed", range(40))
def test_long_randomized_sweep(seed: int) -> None:
    rng = random.Random(1000 + seed)
    dtype = rng.choice(DTYPES)
    head_dim = rng.choice(HEAD_DIMS)
    heads_kv = rng.choice([1, 2, 4])
    heads_q = heads_kv * rng.choice([1, 4, 8])
    batch = mixed_batch(rng, max_len=4096, requests=rng.randrange(1, 9))
    case = DenseCase(batch, heads_q, heads_kv, head_dim, dtype, max_len=4096, layers=rng.choice([1, 3]), seed=seed)
    window = rng.choice([0, 0, 1, 33, 500])
    cap = rng.choice([0.0, 0.0, 20.0])
    for isa in ISAS:
        out, lse = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v, return_lse=True,
                                  sliding_window=window, logits_soft_cap=cap, isa=isa)
        check(out, lse, reference(case.q, case.keys, case.values, batch, head_dim**-0.5, window, cap),
              f"{isa} seed={seed}")


# ---- the real cache, both layouts --------------------------------------------------------


class CacheCase:
    """A vattn manager mapping exactly each request's length, history written
    through write_kv, the step's new rows written by the kernel."""

    def __init__(self, layout: str, dtype: torch.dtype, heads_q: int, heads_kv: int, head_dim: int) -> None:
        gen = torch.Generator().manual_seed(7)
        kwargs = dict(num_layers=3, num_kv_heads=heads_kv, head_dim=head_dim, dtype=dtype, layout=layout,
                      page_size=64 << 10,
                      policy={"background": False, "deferred_reclaim": False, "eager": False, "lookahead_tokens": 0})
        probe = vattn.KVCacheManager(max_batch_size=1, max_context_len=8, **kwargs)
        t = probe.page_size // probe.config.token_bytes_per_buffer  # tokens per page
        probe.cleanup()
        # page ends inside and at the end of requests; a long decode that is split
        cached = [0, t - 1, t, 3 * t - 5, 0, 1200]
        query = [t, 1, 1, 10, 3, 1]
        self.kv = vattn.KVCacheManager(max_batch_size=8, max_context_len=max(1300, 4 * t), **kwargs)
        reqids = [self.kv.alloc_reqid() for _ in cached]
        self.batch = AttentionBatch(reqids[1:] + reqids[:1], cached[1:] + cached[:1], query[1:] + query[:1])
        lens = [0] * 8
        for r, n in zip(self.batch.reqids, self.batch.seq_lens):
            lens[r] = n
        assert self.kv.step(lens)
        b = self.batch
        self.layers = []
        for layer in range(3):
            k_cache, v_cache = self.kv.layer(layer)
            keys, values = [], []
            q = rand(b.num_tokens, heads_q, head_dim, dtype=dtype, gen=gen)
            k_new = rand(b.num_tokens, heads_kv, head_dim, dtype=dtype, gen=gen)
            v_new = rand(b.num_tokens, heads_kv, head_dim, dtype=dtype, gen=gen)
            for i, (r, c) in enumerate(zip(b.reqids, b.cached_lens)):
                k_hist = rand(c, heads_kv, head_dim, dtype=dtype, gen=gen)
                v_hist = rand(c, heads_kv, head_dim, dtype=dtype, gen=gen)
                if c:
                    write_kv(k_cache, v_cache, AttentionBatch([r], [0], [c]), k_hist, v_hist)
                s, e = b.query_starts[i], b.query_starts[i + 1]
                keys.append(torch.cat([k_hist, k_new[s:e]]))
                values.append(torch.cat([v_hist, v_new[s:e]]))
            self.layers.append((q, k_new, v_new, keys, values))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 96)], ids=str)
def test_on_the_cache(isa: str, layout: str, dtype: torch.dtype, head_dim: int) -> None:
    case = CacheCase(layout, dtype, heads_q=8, heads_kv=2, head_dim=head_dim)
    b = case.batch
    try:
        for layer, (q, k_new, v_new, keys, values) in enumerate(case.layers):
            k_cache, v_cache = case.kv.layer(layer)
            out, lse = host_attention(q, k_cache, v_cache, b, k=k_new, v=v_new, return_lse=True, isa=isa)
            check(out, lse, reference(q, keys, values, b, head_dim**-0.5), f"{isa} {layout} layer {layer}")
            for i, (r, c, n) in enumerate(zip(b.reqids, b.cached_lens, b.seq_lens)):  # the new rows landed
                s, e = b.query_starts[i], b.query_starts[i + 1]
                assert torch.equal(k_cache[r, c:n], k_new[s:e]) and torch.equal(v_cache[r, c:n], v_new[s:e])
        # the dispatcher takes the same path for CPU tensors
        q, _, _, keys, values = case.layers[0]
        check(attention(q, *case.kv.layer(0), b), None, reference(q, keys, values, b, head_dim**-0.5), "attention()")
    finally:
        case.kv.cleanup()
