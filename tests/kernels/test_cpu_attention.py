"""The host attention kernel (vattn.attention.host_attention) against a dense
float64 reference on copies of the same K/V.

Every case runs on the scalar path and on the fastest vector path this CPU
has, so both are checked on every machine that has them; the small models'
head shapes run on every path the CPU supports (the C++ harness,
test_cpu_attn_isas.py, runs every path on random cases too). The
manager cases map exactly each request's length (no lookahead, no background
mapper) and put request ends at page ends, so a kernel that read one row past
a request would fault instead of passing.

Tolerances (max abs error against float64, outputs of magnitude ~1):
float32 2e-5, float16 2e-3 (10-bit mantissa of the output), bfloat16 1.6e-2
(7-bit mantissa); log-sum-exp (always float32) 2e-4.

VATTN_LONG_TESTS=1 adds a longer randomized sweep.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

import vattn
from vattn.attention import (AttentionBatch, attention, host_attention, host_attention_info, sdpa_attention,
                             write_kv)
from vattn.core.manager import MappedCheck
from vattn.kernels import KERNELS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LSE_ATOL = 2e-4
HEAD_DIMS = [64, 80, 96, 128, 256]
VECTOR_ISA = host_attention_info()["isa"]
ISAS = ["scalar"] + ([VECTOR_ISA] if VECTOR_ISA != "scalar" else [])
LONG = os.environ.get("VATTN_LONG_TESTS") == "1"


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], batch: AttentionBatch,
              scale: float, window: int = 0, cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention; keys[i] / values[i] are request i's [seq_len, H_kv, D] rows."""
    q = q.double()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    for i, (c, n) in enumerate(zip(batch.cached_lens, batch.seq_lens)):
        s, e = batch.query_starts[i], batch.query_starts[i + 1]
        group = q.shape[1] // keys[i].shape[1]
        k = keys[i].double().repeat_interleave(group, dim=1)
        v = values[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        pos = c + torch.arange(e - s)[:, None]
        key = torch.arange(n)[None, :]
        visible = key <= pos
        if window:
            visible &= key > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[s:e] = torch.logsumexp(scores, -1).T
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, lse


def check(out: torch.Tensor, lse: torch.Tensor | None, ref: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    err = (out.double() - ref[0]).abs().max().item()
    assert err <= ATOL[out.dtype], f"{what}: max abs error {err:.3g} > {ATOL[out.dtype]}"
    if lse is not None:
        lerr = (lse.double() - ref[1]).abs().max().item()
        assert lerr <= LSE_ATOL, f"{what}: lse max abs error {lerr:.3g} > {LSE_ATOL}"


def rand(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# ---- dense tensors: every head dim, dtype, GQA ratio; strided caches ------------------


class DenseCase:
    """A [B, L, H_kv, D] cache (optionally a strided slice of a bigger buffer,
    like an all_layers view) holding each request's history, plus new q/k/v."""

    def __init__(self, batch: AttentionBatch, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype,
                 max_len: int, layers: int = 1, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        slots = max(batch.reqids) + 1
        # [B, L, layers, H, D] with layer 1 taken: token stride layers*H*D
        self.k_buf = torch.zeros(slots, max_len, layers, heads_kv, head_dim, dtype=dtype)
        self.v_buf = torch.zeros_like(self.k_buf)
        layer = layers - 1
        self.k_cache, self.v_cache = self.k_buf[:, :, layer], self.v_buf[:, :, layer]
        t = batch.num_tokens
        self.q = rand(t, heads_q, head_dim, dtype=dtype, gen=gen)
        self.k = rand(t, heads_kv, head_dim, dtype=dtype, gen=gen)
        self.v = rand(t, heads_kv, head_dim, dtype=dtype, gen=gen)
        self.keys, self.values = [], []
        for i, (r, c) in enumerate(zip(batch.reqids, batch.cached_lens)):
            k_hist = rand(c, heads_kv, head_dim, dtype=dtype, gen=gen)
            v_hist = rand(c, heads_kv, head_dim, dtype=dtype, gen=gen)
            self.k_cache[r, :c], self.v_cache[r, :c] = k_hist, v_hist
            s, e = batch.query_starts[i], batch.query_starts[i + 1]
            self.keys.append(torch.cat([k_hist, self.k[s:e]]))
            self.values.append(torch.cat([v_hist, self.v[s:e]]))
        self.batch = batch


def mixed_batch(rng: random.Random, max_len: int, requests: int) -> AttentionBatch:
    """Decodes and prefill chunks (with and without history) in shuffled reqid order."""
    cached, query = [], []
    for _ in range(requests):
        kind = rng.random()
        if kind < 0.5:  # decode
            cached.append(rng.randrange(0, max_len))
            query.append(1)
        elif kind < 0.75:  # first prefill chunk
            cached.append(0)
            query.append(rng.randrange(1, min(max_len, 96) + 1))
        else:  # later chunk
            q = rng.randrange(2, min(max_len, 48) + 1)
            cached.append(rng.randrange(0, max_len - q + 1))
            query.append(q)
    reqids = rng.sample(range(requests + 2), requests)
    return AttentionBatch(reqids, cached, query)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_mixed_batches(isa: str, head_dim: int, dtype: torch.dtype) -> None:
    rng = random.Random(head_dim * 7 + DTYPES.index(dtype))
    for heads_q, heads_kv in ((4, 4), (8, 2), (8, 1)):  # GQA ratios 1, 4, 8
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


def test_the_default_path_is_the_fastest_this_cpu_has() -> None:
    """AMX, then AVX-512 with AVX512_BF16 (VDPBF16PS), AVX-512, AVX2; SVE at
    256 bits, NEON; scalar: the first of these the CPU supports is the default."""
    info = host_attention_info()
    fastest_first = ["amx", "avx512_bf16", "avx512", "avx2", "sve256", "neon", "scalar"]
    assert info["best_isa"] == next(i for i in fastest_first if i in info["supported"]), info
    assert sorted(info["supported"]) == sorted(i for i in fastest_first if i in info["supported"])


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


def test_a_call_too_small_to_share_stays_on_one_thread() -> None:
    """Handing items to another thread and waiting for it costs more than a
    few microseconds of work saves: a small decode is one item (no head or
    key split), a long one is cut for every thread of the pool."""
    small = AttentionBatch([0], [127], [1])
    assert small.plan(KERNELS["host"]).native.num_items(group_size=4, heads_kv=2, head_dim=64) == (1, 0)
    if host_attention_info()["threads"] > 1:
        long = AttentionBatch([0], [4095], [1])
        items, groups = long.plan(KERNELS["host"]).native.num_items(group_size=4, heads_kv=2, head_dim=64)
        assert items >= host_attention_info()["threads"] and groups > 0, (items, groups)


def test_concurrent_calls_from_many_threads_agree() -> None:
    """Callers on several threads at once (each its own batch, split-KV
    decodes that use the per-thread split buffers, prefill chunks) get the
    same results as one call at a time."""
    cases = []
    for i in range(4):
        lens = [2000 + 300 * i, 700, 1]
        batch = AttentionBatch([0, 1, 2], [n - 1 for n in lens], [1, 1, 1]) if i % 2 else \
            AttentionBatch([0, 1], [1500 + 100 * i, 0], [1, 33])
        case = DenseCase(batch, 8, 2, 64, torch.bfloat16, max_len=3000, seed=i)
        alone = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
        cases.append((case, alone))
    errors: list[str] = []

    def hammer(i: int) -> None:
        case, alone = cases[i]
        for n in range(30):
            out = host_attention(case.q, case.k_cache, case.v_cache, case.batch)
            if not torch.equal(out, alone):
                errors.append(f"thread {i} call {n}")
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

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
                      page_size=64 << 10, background=False, deferred_reclaim=False, eager=False,
                      lookahead_tokens=0)
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


# ---- bad input ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> DenseCase:
    return DenseCase(AttentionBatch([1, 0], [3, 0], [1, 4]), 4, 2, 64, torch.float16, max_len=8)


def test_bad_dtypes_raise_type_error(small: DenseCase) -> None:
    c, b = small, small.batch
    with pytest.raises(TypeError, match="k must have the cache's dtype"):
        host_attention(c.q, c.k_cache, c.v_cache, b, k=c.k.float(), v=c.v.float())
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        host_attention(c.q.to(torch.int32), c.k_cache, c.v_cache, b)
    with pytest.raises(TypeError, match="k_cache and v_cache dtypes differ"):
        host_attention(c.q, c.k_cache, c.v_cache.float(), b)
    with pytest.raises(TypeError, match="out must have q's dtype"):
        host_attention(c.q, c.k_cache, c.v_cache, b, out=torch.empty(c.q.shape))


def test_bad_shapes_and_strides_raise_value_error(small: DenseCase) -> None:
    c, b = small, small.batch
    cases = [
        (dict(q=c.q[:4]), r"q must have num_tokens = 5 rows"),
        (dict(q=c.q[None]), r"q must be \[num_tokens, num_heads_q, head_dim\], got 4-D"),
        (dict(q=c.q[:, :3]), r"q heads \(3\) must be a positive multiple of the cache's kv heads \(2\)"),
        (dict(q=c.q.transpose(1, 2).contiguous().transpose(1, 2)), r"q must be contiguous in its last dimension"),
        (dict(k_cache=c.k_cache[..., :32]), r"k_cache and v_cache shapes differ"),
        (dict(k_cache=c.k_cache.transpose(2, 3), v_cache=c.v_cache.transpose(2, 3)),
         r"k_cache must be contiguous in its last dimension"),
        (dict(k_cache=c.k_cache[:1], v_cache=c.v_cache[:1]), r"reqids must be in \[0, 0\] for this cache"),
        (dict(k_cache=c.k_cache[:, :3], v_cache=c.v_cache[:, :3]),
         r"cached_lens \+ query_lens must be <= 3 \(the cache's max_context_len\), got 4"),
        (dict(k=c.k), r"k and v must be given together"),
        (dict(k=c.k[:, :1], v=c.v[:, :1]), r"k must be \[5, 2, 64\]"),
        (dict(out=torch.empty(5, 4, 32, dtype=torch.float16)), r"out must have q's shape"),
        (dict(sliding_window=-1), r"sliding_window must be >= 0"),
        (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be a finite value >= 0"),
        (dict(softmax_scale=float("nan")), r"softmax_scale must be finite"),
    ]
    for override, message in cases:
        args = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, batch=b)
        args.update(override)
        with pytest.raises(ValueError, match=message):
            host_attention(**args)


def test_bad_plans_raise(small: DenseCase) -> None:
    from vattn import _cpu_attn

    with pytest.raises(ValueError, match="distinct"):
        _cpu_attn.Plan([0, 0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="query_lens must be >= 1"):
        _cpu_attn.Plan([0], [1], [0])
    with pytest.raises(TypeError, match="reqids must hold ints"):
        _cpu_attn.Plan([0.5], [1], [1])
    plan = _cpu_attn.Plan([0], [1], [1])
    for bad in (dict(group_size=0, heads_kv=1), dict(group_size=1, heads_kv=0)):  # a division by zero once
        with pytest.raises(ValueError, match="group_size and heads_kv must be >= 1"):
            plan.num_items(**bad)
    with pytest.raises(ValueError, match="window must be >= 0"):
        plan.num_items(group_size=1, heads_kv=1, window=-1)
    with pytest.raises(ValueError, match="isa must be one of"):
        host_attention(small.q, small.k_cache, small.v_cache, small.batch, isa="sse9")
    args = dict(q=small.q, k_cache=small.k_cache, v_cache=small.v_cache)
    extra = dict(k=small.k_cache[0, :1], v=small.v_cache[0, :1], out=torch.empty_like(small.q))
    for name in [*args, *extra]:  # each argument is checked, and named
        moved = {**args, **extra, name: {**args, **extra}[name].to("meta")}
        with pytest.raises(ValueError, match=f"needs CPU tensors, got {name} on meta"):
            host_attention(batch=small.batch, **moved)


@pytest.fixture
def mapped_cache():
    """A manager mapping exactly one page (``t`` tokens) of reqid 0 and none
    of reqid 1, which is allocated; reqid 2 is free. Rows past a mapping fault
    when read, so a check that ran after the kernel read would crash the test."""
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                              max_context_len=2048, page_size=64 << 10, background=False, deferred_reclaim=False,
                              eager=False, lookahead_tokens=0)
    t = kv.page_size // kv.config.token_bytes_per_buffer
    assert (kv.alloc_reqid(), kv.alloc_reqid()) == (0, 1)
    assert kv.step([t, 0, 0, 0])
    yield kv, t
    kv.cleanup()


ADAPTERS = {"host_attention": host_attention, "attention": attention, "sdpa_attention": sdpa_attention}


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("layout_view", ["layer", "kv_tensor"])
def test_rows_past_the_mapping_or_unallocated_reqids_raise(mapped_cache, adapter: str, layout_view: str) -> None:
    kv, t = mapped_cache
    fn = ADAPTERS[adapter]
    k_cache, v_cache = kv.layer(1) if layout_view == "layer" else tuple(kv.kv_tensor(1))
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    new = torch.randn(1, 2, 64, dtype=torch.float16)
    fn(q, k_cache, v_cache, AttentionBatch([0], [t - 1], [1]), k=new, v=new)  # the last mapped row: fine
    cases = [
        (AttentionBatch([0], [t], [1]), rf"reqid 0 would read {t + 1} tokens but has {t} mapped"),
        (AttentionBatch([0], [0], [t + 1]), rf"reqid 0 would read {t + 1} tokens but has {t} mapped"),
        (AttentionBatch([1], [0], [1]), r"reqid 1 would read 1 tokens but has 0 mapped"),
        (AttentionBatch([0, 2], [3, 0], [1, 1]), r"reqid 2 is not allocated"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(torch.randn(batch.num_tokens, 4, 64, dtype=torch.float16), k_cache, v_cache, batch)
        with pytest.raises(ValueError, match=message):  # and before any new row is written
            fn(torch.randn(batch.num_tokens, 4, 64, dtype=torch.float16), k_cache, v_cache, batch,
               k=torch.randn(batch.num_tokens, 2, 64, dtype=torch.float16),
               v=torch.randn(batch.num_tokens, 2, 64, dtype=torch.float16))


def test_every_call_is_checked_and_views_keep_their_slots(mapped_cache) -> None:
    kv, t = mapped_cache
    k_cache, v_cache = kv.layer(0)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    batch = AttentionBatch([0], [t - 1], [1])
    host_attention(q, k_cache, v_cache, batch)
    kv.free_reqid(0)  # unmapped at once (no deferred reclaim): the same batch must not read it now
    with pytest.raises(ValueError, match="vattn.s host kernel: reqid 0 is not allocated"):
        host_attention(q, k_cache, v_cache, batch)
    # a slice of the cache: its row 0 is reqid 1 (allocated, nothing mapped) and row 1 token 0 is token 1
    with pytest.raises(ValueError, match="reqid 1 would read 1 tokens but has 0 mapped"):
        host_attention(q, k_cache[1:], v_cache[1:], AttentionBatch([0], [0], [1]))
    kv.alloc_reqid(reqid=0)
    assert kv.step([t, 0, 0, 0])
    with pytest.raises(ValueError, match=rf"reqid 0 would read {t + 1} tokens but has {t} mapped"):
        host_attention(q, k_cache[:, 1:], v_cache[:, 1:], AttentionBatch([0], [t - 1], [1]))
    with pytest.raises(ValueError, match="a view of the vattn cache must have its reqid and token strides"):
        host_attention(q, k_cache[::2], v_cache[::2], AttentionBatch([0], [0], [1]))


def test_the_core_is_asked_again_only_after_a_slice_shrinks(mapped_cache) -> None:
    """A batch's mapping check runs per layer; it asks the core once, then
    again only when a slice lost positions or a reqid was freed (growth keeps
    every check valid)."""
    kv, t = mapped_cache

    class CountingPages:
        def __init__(self, pages) -> None:
            self.pages, self.asked = pages, 0

        @property
        def shrinks(self) -> int:
            return self.pages.shrinks

        def check_mapped(self, *args) -> None:
            self.asked += 1
            self.pages.check_mapped(*args)

    pages = CountingPages(kv._pages)
    check = MappedCheck(pages, [0], [t], (0, 0), "probe")
    for _ in range(4):  # four layers
        check()
    assert pages.asked == 1
    assert kv.step([2 * t, 5, 0, 0])  # slices grow: still valid
    check()
    assert pages.asked == 1
    kv.free_reqid(1)  # a shrink elsewhere: asked again, and still true
    check()
    check()
    assert pages.asked == 2
    kv.free_reqid(0)
    with pytest.raises(ValueError, match="probe: reqid 0 is not allocated"):
        check()
    with pytest.raises(ValueError, match="probe: reqid 0 is not allocated"):  # a failed check is not cached
        check()


def test_a_cache_at_a_closed_caches_addresses_is_checked_as_itself() -> None:
    """After cleanup its addresses may go to a new manager: the check must ask
    the new one, never the closed one (kept alive here), though a view at the
    same place and strides was checked against the closed one before."""
    kwargs = dict(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=2,
                  max_context_len=64, page_size=4096, background=False, eager=False)
    q = torch.randn(1, 2, 64)
    closed = vattn.KVCacheManager(**kwargs)
    for reqid in range(2):
        closed.alloc_reqid(reqid=reqid)
    assert closed.step([5, 5])
    host_attention(q, *closed.layer(0), AttentionBatch([1], [4], [1]))  # its views' owner is remembered
    closed_span = closed._span
    closed.cleanup()
    with vattn.KVCacheManager(**kwargs) as kv:
        assert kv._span == closed_span  # the same addresses: the remembered owner must not be used
        r = kv.alloc_reqid()
        lens = [0, 0]
        lens[r] = 5
        assert kv.step(lens)
        k_cache, v_cache = kv.layer(0)
        out = host_attention(q, k_cache, v_cache, AttentionBatch([r], [4], [1]))
        assert out.shape == q.shape
        with pytest.raises(ValueError, match=f"reqid {1 - r} is not allocated"):
            host_attention(q, k_cache, v_cache, AttentionBatch([1 - r], [0], [1]))


def test_calls_are_counted_per_path() -> None:
    batch = AttentionBatch([0], [3], [1])
    case = DenseCase(batch, 4, 2, 64, torch.float32, max_len=8)
    for isa in ISAS:
        before = host_attention_info()["calls"][isa]
        host_attention(case.q, case.k_cache, case.v_cache, batch, isa=isa)
        assert host_attention_info()["calls"][isa] == before + 1


def test_isa_env_forces_a_lower_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "scalar")
    assert host_attention_info()["isa"] == "scalar"
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "nonsense")
    info = host_attention_info()
    assert info["isa"] == info["best_isa"] and "ignored" in info["note"]


POOL_SCRIPT = """
import os, sys, torch
from vattn.attention import AttentionBatch, host_attention, host_attention_info, sdpa_attention
torch.manual_seed(0)
batch = AttentionBatch([1, 0, 2], [300, 0, 57], [1, 40, 1])
k_cache, v_cache = torch.randn(3, 341, 2, 64), torch.randn(3, 341, 2, 64)
q = torch.randn(batch.num_tokens, 8, 64)
expected = sdpa_attention(q, k_cache, v_cache, batch)
def ok():
    return (host_attention(q, k_cache, v_cache, batch) - expected).abs().max().item() < 2e-5
assert ok()
print(host_attention_info()["pool"], flush=True)
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:
        os._exit(0 if ok() and host_attention_info()["pool"] == "own" else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the forked child's kernel failed"
    assert ok()
print("done")
"""


def run_pool_script(mode: str, **env: str) -> str:
    """The kernel in a fresh interpreter (the pool is chosen once per process),
    with this checkout's vattn first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), **env)
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env=environ, cwd=root)
    assert proc.returncode == 0 and proc.stdout.endswith("done\n"), proc.stdout + proc.stderr[-3000:]
    return proc.stdout.splitlines()[0]


def test_runs_on_torchs_openmp_threads_or_its_own_pool() -> None:
    """With torch loaded, jobs run on its OpenMP runtime's threads (one set of
    threads for the framework's ops and attention); VATTN_CPU_ATTN_POOL=own
    gives the kernel a pool of its own. Both compute the same."""
    assert host_attention_info()["pool"].startswith("openmp (")
    assert run_pool_script("plain", VATTN_CPU_ATTN_POOL="own") == "own"
    assert run_pool_script("plain", VATTN_CPU_ATTN_THREADS="3").startswith("openmp (")


def test_a_forked_child_runs_the_kernel_on_a_pool_of_its_own() -> None:
    """The parent's OpenMP team does not exist in a fork: the child must not
    wait on it (the test would time out) and must get the same output."""
    assert run_pool_script("fork").startswith("openmp (")
    assert run_pool_script("fork", VATTN_CPU_ATTN_POOL="own") == "own"


def test_info_names_the_active_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from vattn.cli.info import collect, render

    assert f"host attention kernel: {VECTOR_ISA} path" in render(collect())
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "scalar")
    assert "host attention kernel: scalar path" in render(collect())
