"""FlashAttention on the whole cache: one varlen call per layer for the whole batch.

FlashAttention's ``flash_attn_varlen_func`` takes a batch of requests of any
query lengths (``cu_seqlens_q``) over a paged K/V cache (``block_table``).
Over the vattn cache it needs no block table of vattn's own: each request's
slice is one page of the paged cache (the cache's ``[B_max, L, H, D]`` view
with its slot stride as the page stride), so the block table is the batch's
reqids as a column, and a request's keys are its first ``seq_len`` rows.
Prefill chunks and decodes of any lengths share the one call. The step's new
K/V are written first with one indexed store per tensor. Every index tensor
is built by the plan, once per forward, in one copy to the device.

Two builds serve this call: the flash-attn package (FlashAttention-2, whose
paged pages must be multiples of 256 tokens, so a slice must be too), and
vLLM's bundled build (pages of 16-token multiples, and FlashAttention-3 on
Hopper; :mod:`vattn.integrations.vllm.flash_attn`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .batch import AttentionBatch, check_inputs, token_rows, write_rows
from .protocol import AttentionCase, Kernel, KernelPlan, Support, load_module


class FlashAttentionPlan(KernelPlan):
    """The batch as one varlen call: its index tensors on the batch's device."""

    __slots__ = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "max_seqlen_q", "max_seqlen_k")

    def __init__(self, batch: AttentionBatch) -> None:
        super().__init__(batch)
        starts, key_starts, seq_lens, reqids = batch.tensors(("query_starts", "key_starts", "seq_lens", "reqids"))
        self.cu_seqlens_q = starts  # [n + 1] int32: request i's queries are rows starts[i]:starts[i + 1]
        self.cu_seqlens_k = key_starts  # [n + 1] int32: the same for its keys (builds that take lengths so)
        self.seqused_k = seq_lens  # [n] int32: keys of request i (rows 0 .. seq_len - 1 of its slice)
        self.block_table = reqids[:, None]  # [n, 1] int32: request i's one page is its slice
        self.max_seqlen_q = max(batch.query_lens)
        self.max_seqlen_k = max(batch.seq_lens)


class FlashAttentionKernel(Kernel):
    """FlashAttention (see the module docstring); by default the flash-attn
    package's FlashAttention-2. Without the head_dim multiple FlashAttention
    pads, i.e. copies, the whole cache."""

    name = "FlashAttention-2"
    key = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_dim_max = 256
    head_dim_multiple = 8
    batched = True
    page_tokens_multiple: ClassVar[int] = 256  # the build's paged pages: multiples of this many tokens

    def __init__(self, module_name: str = "flash_attn",
                 install_hint: str = "FlashAttention-2 (pip install flash-attn)") -> None:
        """``module_name``: the module whose ``flash_attn_varlen_func`` runs;
        ``install_hint`` names it when it does not load."""
        self.module_name = module_name
        self.install_hint = install_hint

    def module(self) -> Any:
        """The module that provides ``flash_attn_varlen_func``."""
        return load_module(self.module_name, self.install_hint)

    def available(self) -> Support:
        try:
            self.module()
        except Exception as e:  # noqa: BLE001 - BackendUnavailable, or a broken build's own error
            return Support(False, str(e))
        return Support(True)

    def supports(self, case: AttentionCase) -> Support:
        support = super().supports(case)
        if support and case.slot_stride is not None and case.row_stride:
            try:
                self.slice_tokens(case.slot_stride, case.row_stride)
            except ValueError as e:
                return Support(False, str(e))
        return support

    def slice_tokens(self, slot_stride: int, row_stride: int) -> int:
        """Tokens from one slice's first row to the next slice's (elements
        ``slot_stride`` apart, rows ``row_stride``): the page of the paged
        view. ValueError unless a whole number of rows and of the build's
        page multiple."""
        if slot_stride % row_stride or (slot_stride // row_stride) % self.page_tokens_multiple:
            raise ValueError(f"{self.name} reads each slice as one page, which must be a multiple of "
                             f"{self.page_tokens_multiple} tokens; this cache's slices are "
                             f"{slot_stride / row_stride:g} tokens apart (choose a max_context_len, or vLLM "
                             f"block size, that makes them so)")
        return slot_stride // row_stride

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> FlashAttentionPlan:
        plan = FlashAttentionPlan(batch)
        token_rows(batch)  # the new rows' indices too: no layer builds any
        return plan

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        module = self.module()
        self.require_device(self.name, q=q, k_cache=k_cache)
        self.check_options(sliding_window, logits_soft_cap)
        if not isinstance(plan, FlashAttentionPlan):
            raise TypeError(f"plan must be FlashAttentionKernel.plan's, got {type(plan).__name__}")
        check_inputs(q, k_cache, v_cache, plan.batch, k, v, self.name)
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"{self.name} needs head_dim % {self.head_dim_multiple} == 0, got {k_cache.shape[-1]}")
        tokens = self.slice_tokens(k_cache.stride(0), k_cache.stride(1))
        if k is not None:
            write_rows(k_cache, v_cache, plan.batch, k, v)
        pages = [c.as_strided((c.shape[0], tokens, *c.shape[2:]), c.stride()) for c in (k_cache, v_cache)]
        result = self.varlen(module, plan, q, pages[0], pages[1], softmax_scale, out)
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def varlen(self, module: Any, plan: FlashAttentionPlan, q: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, softmax_scale: float | None, out: torch.Tensor | None) -> torch.Tensor:
        """The build's one call: the flash-attn package's signature (lengths of keys as ``cu_seqlens_k``)."""
        return module.flash_attn_varlen_func(
            q, k_pages, v_pages, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
            softmax_scale=softmax_scale, causal=True, block_table=plan.block_table)
