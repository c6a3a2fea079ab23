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
installed, instead of a loop of SDPA calls over the batch's requests. Run
through :meth:`TorchFlashKernel.run_layer` (the cache's token rows made once,
:meth:`TorchFlashKernel.layer_views`; the key starts and each new token's row
made by the plan, once per forward) a layer is two ``index_copy_``, the op and
the copy of its result into ``out``.
"""

from __future__ import annotations

from typing import Any

import torch

from .batch import AttentionBatch, token_rows
from .flash_attn import FlashAttentionBuffers, cache_rows, flat_token_rows
from .protocol import AttentionCase, Kernel, KernelPlan, LayerViews, Support, check_layer

__all__ = ["TorchFlashKernel", "TorchFlashPlan", "cache_rows"]


class TorchFlashPlan(KernelPlan):
    """The batch as one varlen call of torch's FlashAttention-2."""

    __slots__ = ("cu_seqlens_q", "seqused_k", "reqids", "max_seqlen_q", "max_seqlen_k", "token_reqids",
                 "token_positions", "num_tokens", "flat_rows", "rows_per_slice", "_key_starts")

    def __init__(self, batch: AttentionBatch, case: AttentionCase | None = None) -> None:
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
        # with the cache's geometry in case: each new token's token row, and the key starts, once per forward
        self.rows_per_slice, self.flat_rows = flat_token_rows(self.token_reqids, self.token_positions, case)
        if self.rows_per_slice:  # the last start, read by no request (seqused_k): the end of the last slice read
            self.key_starts(self.rows_per_slice, (batch.max_reqid + 1) * self.rows_per_slice)

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
        # a fill kernel: an element assignment copies from the host, which CUDA graph capture refuses
        starts[n:].fill_(total_rows)
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
        """The batch's index tensors; with ``case`` giving the cache's
        strides, also the key starts and each new token's token row, for
        :meth:`run_layer`."""
        return TorchFlashPlan(batch, case)

    def plan_into(self, buffers: FlashAttentionBuffers, batch: AttentionBatch | None, *, num_rows: int,
                  num_tokens: int, padding_reqid: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, rows_per_slice: int = 0) -> TorchFlashPlan:
        """A plan whose tensors lie at the same addresses every forward (CUDA
        graphs): :meth:`vattn.kernels.FlashAttentionKernel.plan_into`'s
        arguments and buffers (the block-table column is the rows' reqids).
        A padded row's keys start in ``padding_reqid``'s slice. With
        ``rows_per_slice`` (S of the cache it runs on) the key starts
        (``reqid * S``) and each new token's token row are written into the
        buffers with the rest; without, the key starts are computed by each
        run's first layer from the buffers, so a captured run recomputes them
        at every replay: run a copy of the plan (``copy.copy``) in each
        forward. Writes the indices with one host-to-device copy."""
        buffers.fill_checked(batch, cu_seqlens_q, seqused_k, num_rows, num_tokens, padding_reqid, rows_per_slice)
        plan = TorchFlashPlan.__new__(TorchFlashPlan)
        plan.batch = batch
        plan.check = None if batch is None else batch.mapped
        plan.cu_seqlens_q, plan.seqused_k = cu_seqlens_q, seqused_k
        plan.reqids = buffers.block_table[:num_rows]
        plan.max_seqlen_q, plan.max_seqlen_k = max_seqlen_q, max_seqlen_k
        rows = buffers.token_rows[:num_tokens]
        plan.token_reqids, plan.token_positions = rows[:, 0], rows[:, 1]
        plan.num_tokens = num_tokens
        plan.rows_per_slice = rows_per_slice
        plan.flat_rows = rows[:, 2] if rows_per_slice else None
        plan._key_starts = (rows_per_slice, buffers.key_starts[:num_rows + 1]) if rows_per_slice else None
        return plan

    def layer_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> LayerViews:
        """The cache as the op reads it and the new K/V are written, its
        token rows (:func:`cache_rows`), made once per cache. Raises
        ``ValueError`` where the op cannot read this cache."""
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"{self.name} needs head_dim % {self.head_dim_multiple} == 0, got {k_cache.shape[-1]}")
        super().layer_views(k_cache, v_cache)  # shapes
        (k_rows, rows_per_slice), (v_rows, _) = cache_rows(k_cache), cache_rows(v_cache)
        if k_rows.shape[0] > self.max_rows:
            raise ValueError(f"{self.name} addresses at most {self.max_rows} token rows, this cache has "
                             f"{k_rows.shape[0]}")
        return LayerViews(k_cache, v_cache, k_rows, v_rows, k_rows, v_rows, rows_per_slice, self.op())

    def run_layer(self, plan: KernelPlan, views: LayerViews, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, out: torch.Tensor, softmax_scale: float | None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`Kernel.run_layer`: the new K/V written with one
        ``index_copy_`` each into the token rows, the op, its result copied
        into ``out``; a plan made without this cache's geometry runs
        :meth:`run`, checks included."""
        if plan.rows_per_slice != views.rows_per_slice:
            return self.run(plan, q, views.k_cache, views.v_cache, k, v, out=out, softmax_scale=softmax_scale,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if k is not None:
            views.k_rows.index_copy_(0, plan.flat_rows, k)
            views.v_rows.index_copy_(0, plan.flat_rows, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out.copy_(views.library(q, views.k_read, views.v_read, plan.cu_seqlens_q, plan._key_starts[1],
                                plan.max_seqlen_q, plan.max_seqlen_k, 0.0, True, False, scale=softmax_scale,
                                seqused_k=plan.seqused_k)[0])
        return out

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
