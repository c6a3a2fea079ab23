"""torch's own FlashAttention-2 on the whole cache: one varlen call per layer
for the whole batch, with no package beyond torch.

torch ships FlashAttention-2 as ``torch.ops.aten._flash_attention_forward``
(what ``scaled_dot_product_attention`` runs on CUDA). Its varlen form reads
request ``b``'s keys at rows ``cu_seqlens_k[b] .. cu_seqlens_k[b] +
seqused_k[b] - 1`` of a token-packed ``[rows, H_kv, D]`` tensor. The vattn
cache is such a tensor already: every slice is the same number of token rows
``S`` (a slice is whole pages), so the cache's rows are one strided view
(:func:`cache_rows`) and request ``b`` starts at row ``reqid_b * S``. With
``seqused_k`` given the kernel takes only that start from ``cu_seqlens_k``
(never a difference of two entries), so the batch's rows need not be in
reqid order. Queries of any lengths share the call (``cu_seqlens_q``).

This is the kernel vattn runs on CUDA where the flash-attn package is not
installed, instead of a loop of SDPA calls over the batch's requests.
"""

from __future__ import annotations

from typing import Any

import torch

from .batch import AttentionBatch, token_rows
from .flash_attn import FlashAttentionBuffers
from .protocol import AttentionCase, Kernel, KernelPlan, Support, check_layer


def cache_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``[B, L, H, D]`` cache view (a layer of either layout) as the token
    rows of every slice, ``[B * S, H, D]``, and ``S``: request ``r``'s rows
    start at row ``r * S``. ``S`` (slice stride over token stride) is at least
    ``L`` and in general not ``L``, so ``view(-1, H, D)`` would not do.
    Raises ``ValueError`` where a slice is not a whole number of token rows
    (an all_layers page that ends inside a token's row of all layers): no
    varlen kernel reads such a cache."""
    slice_elements, row = cache.stride(0), cache.stride(1)
    if slice_elements % row:
        raise ValueError(f"a slice of {slice_elements} elements is not a whole number of {row}-element token rows, so the "
                         "cache has no [rows, H, D] view for varlen kernels")
    rows_per_slice = slice_elements // row
    flat = cache.as_strided((cache.shape[0] * rows_per_slice, *cache.shape[2:]), (row, *cache.stride()[2:]))
    return flat, rows_per_slice


class TorchFlashPlan(KernelPlan):
    """The batch as one varlen call of torch's FlashAttention-2."""

    __slots__ = ("cu_seqlens_q", "seqused_k", "reqids", "max_seqlen_q", "max_seqlen_k", "token_reqids",
                 "token_positions", "num_tokens", "_key_starts")

    def __init__(self, batch: AttentionBatch) -> None:
        super().__init__(batch)
        starts, seq_lens, reqids = batch.tensors(("query_starts", "seq_lens", "reqids"))
        self.cu_seqlens_q = starts  # [n + 1] int32
        self.seqused_k = seq_lens  # [n] int32: request i reads rows 0 .. seq_len - 1 of its slice
        self.reqids = reqids  # [n] int32
        self.max_seqlen_q = max(batch.query_lens)
        self.max_seqlen_k = max(batch.seq_lens)
        self.token_reqids, self.token_positions = token_rows(batch)  # [T] int64: where new K/V go
        self.num_tokens = batch.num_tokens  # T: rows of q, k, v and out
        self._key_starts: tuple[int, torch.Tensor] | None = None

    def key_starts(self, rows_per_slice: int, total_rows: int) -> torch.Tensor:
        """``[n + 1]`` int32: request i's first key row, ``reqid * S``; the
        last entry (which the kernel does not read with ``seqused_k``) is the
        row count. Made by the forward's first layer, reused by the others
        (every layer of a manager has the same geometry)."""
        made = self._key_starts
        if made is not None and made[0] == rows_per_slice:
            return made[1]
        n = self.reqids.shape[0]
        starts = torch.empty(n + 1, dtype=torch.int32, device=self.reqids.device)
        torch.mul(self.reqids, rows_per_slice, out=starts[:n])
        starts[n] = total_rows
        self._key_starts = (rows_per_slice, starts)
        return starts


class TorchFlashKernel(Kernel):
    """torch's built-in FlashAttention-2 (see the module docstring)."""

    name = "FlashAttention-2 (torch)"
    key = "torch_flash"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_dim_max = 256
    head_dim_multiple = 8  # otherwise the op pads, i.e. copies, the whole cache
    batched = True
    graphs = True
    # torch's rows are addressed in int32 (cu_seqlens_k)
    max_rows: int = 2**31 - 1

    def op(self) -> Any:
        """The op, ``torch.ops.aten._flash_attention_forward``."""
        return torch.ops.aten._flash_attention_forward

    def available(self) -> Support:
        try:
            arguments = {a.name for a in self.op().default._schema.arguments}
        except (AttributeError, RuntimeError) as e:
            return Support(False, f"{self.name} is not in this torch ({torch.__version__}): {e}")
        if "seqused_k" not in arguments:
            return Support(False, f"{self.name}: this torch's ({torch.__version__}) _flash_attention_forward "
                                  "has no seqused_k")
        return Support(True)

    def supports(self, case: AttentionCase) -> Support:
        support = super().supports(case)
        if support and case.slice_stride is not None and case.row_stride and case.slice_stride % case.row_stride:
            return Support(False, f"{self.name} reads the cache as token rows, and this cache's slices are "
                                  f"{case.slice_stride / case.row_stride:g} rows apart (not a whole number)")
        return support

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> TorchFlashPlan:
        return TorchFlashPlan(batch)

    def plan_into(self, buffers: FlashAttentionBuffers, batch: AttentionBatch | None, *, num_rows: int,
                  num_tokens: int, padding_reqid: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int) -> TorchFlashPlan:
        """A plan whose tensors lie at the same addresses every forward (CUDA
        graphs): :meth:`vattn.kernels.FlashAttentionKernel.plan_into`'s
        arguments and buffers (the block-table column is the rows' reqids).
        A padded row's keys start in ``padding_reqid``'s slice. The key starts
        (``reqid * S``) are computed by each run's first layer from the
        buffers, so a captured run recomputes them at every replay: run a copy
        of the plan (``copy.copy``) in each forward. Writes the indices with
        one host-to-device copy."""
        for name, t, n in (("cu_seqlens_q", cu_seqlens_q, num_rows + 1), ("seqused_k", seqused_k, num_rows)):
            if t.dtype != torch.int32 or tuple(t.shape) != (n,):
                raise ValueError(f"{name} must be [{n}] int32, got {tuple(t.shape)} {t.dtype}")
        buffers.fill(batch, num_rows, num_tokens, padding_reqid)
        plan = TorchFlashPlan.__new__(TorchFlashPlan)
        plan.batch = batch
        plan.check = None if batch is None else batch.mapped
        plan.cu_seqlens_q, plan.seqused_k = cu_seqlens_q, seqused_k
        plan.reqids = buffers.block_table[:num_rows]
        plan.max_seqlen_q, plan.max_seqlen_k = max_seqlen_q, max_seqlen_k
        rows = buffers.token_rows[:num_tokens]
        plan.token_reqids, plan.token_positions = rows[:, 0], rows[:, 1]
        plan.num_tokens = num_tokens
        plan._key_starts = None
        return plan

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        if not isinstance(plan, TorchFlashPlan):
            raise TypeError(f"plan must be TorchFlashKernel.plan's, got {type(plan).__name__}")
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, num_tokens=plan.num_tokens)
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"{self.name} needs head_dim % {self.head_dim_multiple} == 0, got {k_cache.shape[-1]}")
        (k_rows, rows_per_slice), (v_rows, _) = cache_rows(k_cache), cache_rows(v_cache)
        if k_rows.shape[0] > self.max_rows:
            raise ValueError(f"{self.name} addresses at most {self.max_rows} token rows, this cache has "
                             f"{k_rows.shape[0]}")
        if k is not None:
            rows = (plan.token_reqids, plan.token_positions)
            k_cache.index_put_(rows, k)
            v_cache.index_put_(rows, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        result = self.op()(q, k_rows, v_rows, plan.cu_seqlens_q, plan.key_starts(rows_per_slice, k_rows.shape[0]),
                           plan.max_seqlen_q, plan.max_seqlen_k, 0.0, True, False, scale=softmax_scale,
                           seqused_k=plan.seqused_k)[0]
        if out is not None:
            out.copy_(result)
            return out
        return result
