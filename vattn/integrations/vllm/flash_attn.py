"""vLLM's bundled FlashAttention as the ``flash_attn_with_kvcache`` that
:class:`vattn.kernels.flash_attn.FlashAttentionKernel` calls.

vLLM does not ship the flash-attn package: it bundles its own build as
``vllm.vllm_flash_attn``, which in vLLM 0.32 exports ``flash_attn_varlen_func``
(paged K/V through ``block_table`` and ``seqused_k``) and no
``flash_attn_with_kvcache``. Over the vattn cache that function needs no block
table of vattn's own: each request's slice is one page of the paged cache (the
cache's ``[B_max, L, H, D]`` view with its slot stride as the page stride), so
the block table is ``cache_batch_idx`` as a column. New K/V are written in
first, with one indexed store.

Importing this module imports vLLM's build; on a vLLM without the CUDA
extensions (the CPU build) that raises ``ImportError``, so the vLLM
integration finds out at start-up, not at the first forward.
"""

from __future__ import annotations

import functools
import importlib

import torch

BUNDLED = "vllm.vllm_flash_attn"
# vLLM's FlashAttention-2 takes paged caches whose page (here: a slice) is a multiple of 16 tokens
PAGE_TOKENS_MULTIPLE = 16

_varlen = importlib.import_module(BUNDLED).flash_attn_varlen_func


def slot_tokens(k_cache: torch.Tensor) -> int:
    """Tokens from one slice's first row to the next slice's (the page of the
    paged view); ValueError unless they are a whole number of rows and a
    multiple of :data:`PAGE_TOKENS_MULTIPLE`."""
    slot, row = k_cache.stride(0), k_cache.stride(1)
    if slot % row or (slot // row) % PAGE_TOKENS_MULTIPLE:
        raise ValueError(f"vLLM's FlashAttention reads each slice as one page, which must be a multiple of "
                         f"{PAGE_TOKENS_MULTIPLE} tokens; this cache's slices are {slot / row:g} tokens apart "
                         "(choose a block size that is a multiple of 16 tokens)")
    return slot // row


@functools.lru_cache(maxsize=64)
def _query_starts(count: int, query_len: int, device: torch.device) -> torch.Tensor:
    # the same few shapes every forward: made once, never written
    return torch.arange(0, (count + 1) * query_len, query_len, dtype=torch.int32, device=device)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                            cache_seqlens: torch.Tensor, cache_batch_idx: torch.Tensor,
                            softmax_scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """flash-attn's function of that name, the part vattn uses.

    Args:
        q: ``[G, q_len, H_q, D]`` queries of G requests.
        k_cache, v_cache: ``[B_max, L, H_kv, D]`` views of the vattn cache.
        k, v: ``[G, q_len, H_kv, D]`` new tokens, written at rows
            ``cache_seqlens[g] ..`` of slice ``cache_batch_idx[g]`` first; None:
            already in the cache.
        cache_seqlens: ``[G]`` int32 tokens in the cache before ``k`` (all of
            them when ``k`` is None).
        cache_batch_idx: ``[G]`` int32 slices (reqids).

    Returns ``[G, q_len, H_q, D]``; causal masks align to each request's end.
    """
    count, query_len = q.shape[0], q.shape[1]
    seq_lens = cache_seqlens
    if k is not None:
        rows = cache_seqlens.long()[:, None] + torch.arange(query_len, device=q.device)
        slots = cache_batch_idx.long()[:, None]
        k_cache[slots, rows] = k
        v_cache[slots, rows] = v
        seq_lens = cache_seqlens + query_len
    tokens = slot_tokens(k_cache)
    paged = [c.as_strided((c.shape[0], tokens, *c.shape[2:]), c.stride()) for c in (k_cache, v_cache)]
    out = _varlen(q.reshape(count * query_len, *q.shape[2:]), paged[0], paged[1], max_seqlen_q=query_len,
                  cu_seqlens_q=_query_starts(count, query_len, q.device), max_seqlen_k=k_cache.shape[1],
                  seqused_k=seq_lens.to(torch.int32), softmax_scale=softmax_scale, causal=causal,
                  block_table=cache_batch_idx.to(torch.int32)[:, None])
    return out.reshape(q.shape)
