"""vLLM's bundled FlashAttention as a vattn kernel.

vLLM does not ship the flash-attn package: it bundles its own build as
``vllm.vllm_flash_attn``, whose ``flash_attn_varlen_func`` takes a paged K/V
cache through ``block_table`` and the keys' lengths as ``seqused_k``, and
runs FlashAttention-2, -3 (Hopper) or -4 (Blackwell) by ``fa_version``. Over
the vattn cache it is :class:`vattn.kernels.FlashAttentionKernel`'s one call
per layer (each slice one page, pages of 16-token multiples), at the version
stock vLLM would run on the same GPU, so that a comparison with stock vLLM
compares the same kernel.

The build is imported when the kernel is first checked
(:meth:`VllmFlashAttentionKernel.available`); on a vLLM without the CUDA
extensions (the CPU build) that fails, so the vLLM integration finds out at
start-up, not at the first forward.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vattn.kernels.flash_attn import FlashAttentionKernel, FlashAttentionPlan
from vattn.kernels.protocol import NO_FOOTPRINT, AttentionCase, ReadFootprint

BUNDLED = "vllm.vllm_flash_attn"

FA3_KEY_TILES = ((64, 192), (96, 144), (128, 176), (192, 128), (256, 96))
"""FlashAttention-3's key tile (``kBlockN``, rows) for 16-bit K/V, per head
dim up to the first entry's: the largest that ``tile_size_fwd_sm90`` in
``hopper/tile_size.h`` of vLLM's fork of FlashAttention (vllm-project/
flash-attention) returns for any of its variants (causal, local, one MMA
warpgroup; the split heuristic's 96 for head dim 256). Its TMA path (a
paged cache whose page is a multiple of ``kBlockN``, and more query rows
than its row tile ``kBlockM``) loads whole tiles of keys, aligned to the
page's row 0, with no length mask: up to ``kBlockN - 1`` rows past a
request's last key, and as many below a sliding window's first visible key.
Each slice is one page to it, so those rows lie in the request's slice."""


class VllmFlashAttentionKernel(FlashAttentionKernel):
    """FlashAttention from vLLM's build; ``fa_version`` None: the build's default."""

    page_tokens_multiple: ClassVar[int] = 16  # vLLM's build pages K/V in multiples of 16 tokens

    def __init__(self, fa_version: int | None = None) -> None:
        super().__init__(BUNDLED, "vLLM's bundled FlashAttention (vllm.vllm_flash_attn, in vLLM's CUDA builds)")
        self.fa_version = fa_version
        self.name = (f"FlashAttention-{fa_version} (vLLM's build)" if fa_version
                     else "FlashAttention (vLLM's build)")

    def for_this_gpu(self, head_size: int | None = None) -> VllmFlashAttentionKernel:
        """The kernel at the FlashAttention version vLLM picks for this GPU and
        head size (``vllm.v1.attention.backends.fa_utils.get_flash_attn_version``:
        FA3 on Hopper, FA2 on Ampere and Ada, the configured one if set)."""
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        return VllmFlashAttentionKernel(get_flash_attn_version(head_size=head_size))

    def read_footprint(self, case: AttentionCase) -> ReadFootprint:
        """FlashAttention-3: a key tile less one row on both sides
        (:data:`FA3_KEY_TILES`); FlashAttention-2 masks its loads."""
        if self.fa_version != 3:
            return NO_FOOTPRINT
        tile = next((rows for top, rows in FA3_KEY_TILES if case.head_dim <= top), FA3_KEY_TILES[-1][1])
        return ReadFootprint(tile - 1, tile - 1)

    def varlen(self, module: Any, plan: FlashAttentionPlan, q: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, softmax_scale: float | None, out: torch.Tensor | None) -> torch.Tensor:
        version = {} if self.fa_version is None else {"fa_version": self.fa_version}
        if plan.num_splits:  # an upper bound fixed for CUDA graphs, as vLLM's FlashAttention backend sets it
            version["num_splits"] = plan.num_splits
        return module.flash_attn_varlen_func(
            q, k_pages, v_pages, max_seqlen_q=plan.max_seqlen_q, cu_seqlens_q=plan.cu_seqlens_q,
            max_seqlen_k=plan.max_seqlen_k, seqused_k=plan.seqused_k, softmax_scale=softmax_scale, causal=True,
            block_table=plan.block_table, out=out, **version)
