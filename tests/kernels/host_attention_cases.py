"""The host attention kernel's test cases and what they are compared with:
a float64 reference on copies of the same K/V, its tolerances, dense caches
holding each request's history (DenseCase), random mixed batches, and the
paths every case runs on (ISAS: scalar and the fastest vector path this CPU
has). Used by test_cpu_attention.py and test_cpu_attention_calls.py.

Tolerances (max abs error against float64, outputs of magnitude ~1):
float32 2e-5, float16 2e-3 (10-bit mantissa of the output), bfloat16 1.6e-2
(7-bit mantissa); log-sum-exp (always float32) 2e-4.
"""

from __future__ import annotations

import random

import torch

from vattn.attention import AttentionBatch, host_attention_info

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LSE_ATOL = 2e-4
HEAD_DIMS = [64, 80, 96, 128, 256]
VECTOR_ISA = host_attention_info()["isa"]
ISAS = ["scalar"] + ([VECTOR_ISA] if VECTOR_ISA != "scalar" else [])


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
