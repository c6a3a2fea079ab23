"""torch ``scaled_dot_product_attention`` on the cache, CPU or GPU: one call
per request on ``k_cache[r, :seq_len]`` (a view), so no request is padded to
the longest one. The reference the other kernels are tested against, and the
fallback where no batched kernel serves a case."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .batch import AttentionBatch, write_rows
from .protocol import AttentionCase, Kernel, KernelPlan, check_layer


class SdpaKernel(Kernel):
    """torch SDPA per request (see the module docstring)."""

    name = "torch SDPA"
    key = "sdpa"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> KernelPlan:
        return KernelPlan(batch)

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap)
        batch = plan.batch
        if k is not None or v is not None:
            write_rows(k_cache, v_cache, batch, k, v)
        if out is None:
            out = torch.empty_like(q)
        starts = batch.query_starts
        for i, (reqid, seq_len) in enumerate(zip(batch.reqids, batch.seq_lens)):
            # k_cache[reqid, :seq_len] is a view of the mapped rows: nothing is copied
            out[starts[i]:starts[i + 1]] = sdpa_dense(q[starts[i]:starts[i + 1]], k_cache[reqid, :seq_len],
                                                      v_cache[reqid, :seq_len], softmax_scale)
        return out


def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """SDPA of one request: ``q`` ``[q_len, H_q, D]`` over ``k``/``v``
    ``[seq_len, H_kv, D]`` (any strides), causal with the queries at the last
    ``q_len`` positions. Returns ``[q_len, H_q, D]``."""
    tensors, options, upcast = sdpa_call(q, k, v, softmax_scale)
    out = F.scaled_dot_product_attention(*tensors, **options)
    return out[0].transpose(0, 1).to(q.dtype) if upcast else out[0].transpose(0, 1)


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None
              ) -> tuple[list[torch.Tensor], dict[str, Any], bool]:
    """The arguments :func:`sdpa_dense` gives torch's SDPA for one request:
    (q, k, v as ``[1, H, tokens, D]``, the keyword options, whether the rows
    were upcast to fp32). benchmarks/attention_ab.py asks torch with the same
    arguments which kernel SDPA picks (``torch._fused_sdp_choice``)."""
    q_len, seq_len = q.shape[0], k.shape[0]
    mask = None
    if 1 < q_len < seq_len:  # causal, aligned to the end of the request
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
    # 4-D [1, H, tokens, D]: torch's CPU flash kernel takes only batched
    # inputs (3-D ones fall back to the math path, ~20x slower for decode).
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    upcast = _cpu_half_is_slow(q)
    if upcast:  # copies only this request's rows
        heads_first = [t.float() for t in heads_first]
    options = dict(attn_mask=mask, is_causal=1 < q_len == seq_len, scale=softmax_scale,
                   enable_gqa=q.shape[1] != k.shape[1])
    return heads_first, options, upcast


def _cpu_half_is_slow(q: torch.Tensor) -> bool:
    """torch's CPU SDPA in fp16 / bf16 ran 2-6x slower for decode than
    converting the request's rows to fp32 first (torch 2.13 on an AVX-512 CPU,
    AVX512-BF16 present); fp32 is what the half kernel accumulates in anyway."""
    return q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16)
