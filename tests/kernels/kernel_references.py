"""CPU stand-ins for the GPU kernel libraries vattn calls, so that what vattn
hands a library (arguments, index tensors, strided views of the cache) is
checked on any machine; the libraries themselves run on a GPU only.

Each stand-in keeps the library's calling convention and the rules of its
arguments that vattn could break (dtypes, shapes, FlashInfer's 32-bit
strides), then attends with ``sdpa_dense`` on
exactly the rows the real kernel reads: reading a row the kernel would not
read faults on an unmapped page instead of passing.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vattn.kernels import sdpa_dense


def paged_varlen(q, k, v, cu_seqlens_q, key_lens, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
                 causal, page_multiple: int):
    """FlashAttention's varlen attention over a paged cache, by its
    documentation: request b's queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``,
    its key j sits in page ``block_table[b, j // page]`` at row ``j % page``,
    it has ``key_lens[b]`` keys, causal masks align to the end. Reads only
    those rows (others may be unmapped)."""
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1 and block_table.dim() == 2
    assert cu_seqlens_q.dtype == torch.int32 and causal
    assert k.shape[1] % page_multiple == 0, f"pages must be multiples of {page_multiple} tokens"
    assert max_seqlen_k >= int(key_lens.max()) and max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    out = torch.empty_like(q)
    page = k.shape[1]
    for b in range(len(key_lens)):
        start, end, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(key_lens[b])
        j = torch.arange(n)
        pages = block_table[b, j // page].long()
        out[start:end] = sdpa_dense(q[start:end], k[pages, j % page], v[pages, j % page], softmax_scale)
    return out


def package_varlen(calls: list, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                   causal=False, block_table=None):
    """The flash-attn package's ``flash_attn_varlen_func`` with a paged
    cache (``block_table``): pages of multiples of 256 tokens, the keys'
    lengths as running sums ``cu_seqlens_k``. Records each call's q."""
    assert cu_seqlens_k.dtype == torch.int32
    calls.append(q)
    return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k[1:] - cu_seqlens_k[:-1], max_seqlen_q, max_seqlen_k,
                        block_table, softmax_scale, causal, 256)


# FlashAttention-3's causal tiles for 16-bit K/V, (head dim up to, kBlockM, kBlockN), as tile_size_fwd_sm90 in
# hopper/tile_size.h of vLLM's fork of FlashAttention returns them for a causal call without a window
FA3_CAUSAL_TILES = ((64, 192, 128), (96, 192, 144), (128, 128, 128), (192, 128, 112), (256, 128, 80))


def fa3_tma_tiles(q, k, max_seqlen_q, seqused_k, block_table) -> None:
    """What FlashAttention-3's TMA path reads of a paged cache beyond the
    keys it attends to: it is taken when the page is a multiple of the key
    tile and the query rows (times the GQA group) pass the row tile, and
    loads every key tile of a request whole, from the page's row 0 up to
    the tile holding its last key, with no length mask. Reads those rows
    for real, so an unmapped one faults here as it would on a GPU."""
    d, page = q.shape[-1], k.shape[1]
    _, block_m, block_n = next(t for t in FA3_CAUSAL_TILES if d <= t[0])
    if page % block_n or max_seqlen_q * (q.shape[1] // k.shape[2]) <= block_m:
        return
    for b, n in enumerate(seqused_k.tolist()):
        end = min(-(-n // block_n) * block_n, page)
        if n:
            float(k[int(block_table[b, 0]), :end].sum())  # one page per request: the vattn slice


def vllm_varlen(calls: list, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                softmax_scale=None, causal=False, block_table=None, out=None, fa_version=2, **_):
    """vLLM's ``vllm.vllm_flash_attn.flash_attn_varlen_func``: pages of
    multiples of 16 tokens, the keys' lengths as ``seqused_k``, an ``out``
    to write into, the FlashAttention version; FlashAttention-3 also reads
    the whole key tiles of its TMA path (:func:`fa3_tma_tiles`). Records
    (q, fa_version)."""
    assert seqused_k.dtype == torch.int32 and cu_seqlens_k is None
    calls.append((q, fa_version))
    if fa_version == 3:
        fa3_tma_tiles(q, k, max_seqlen_q, seqused_k, block_table)
    result = paged_varlen(q, k, v, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
                          causal, 16)
    if out is None:
        return result
    out.copy_(result)
    return out


def torch_flash_forward(calls: list, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        is_causal, return_debug_mask, *, scale=None, seqused_k=None, **_):
    """torch's ``aten._flash_attention_forward`` in its varlen form, by its
    source (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp,
    ``mha_varlen_fwd``): ``[rows, H, D]`` tensors with a unit last stride,
    int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` of ``n + 1`` and ``seqused_k`` of
    ``n``; with ``seqused_k`` request b's keys are rows ``cu_seqlens_k[b] ..
    cu_seqlens_k[b] + seqused_k[b] - 1`` (the next entry is not read, so the
    starts need not ascend). Reads only those rows. Records (q, starts) of
    each call; returns the op's tuple."""
    n = seqused_k.numel()
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.dim() == 1
    assert cu_seqlens_q.numel() == n + 1 and cu_seqlens_k.numel() == n + 1
    assert q.dim() == k.dim() == v.dim() == 3 and all(t.stride(-1) == 1 for t in (q, k, v))
    assert dropout_p == 0.0 and is_causal and not return_debug_mask
    assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape
    assert max_seqlen_k >= int(seqused_k.max()) and max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    calls.append((q, cu_seqlens_k))
    out = torch.empty_like(q)
    for b in range(n):
        start, end, first, keys = (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b]),
                                   int(seqused_k[b]))
        assert 0 <= first and first + keys <= k.shape[0]
        out[start:end] = sdpa_dense(q[start:end], k[first:first + keys], v[first:first + keys], scale)
    return out, None, None, None, None


UINT32_MASK = (1 << 32) - 1


class PagedWrapper:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` /
    ``BatchPrefillWithPagedKVCacheWrapper`` (NHD): ``plan`` takes the page
    arrays (host or device int32), ``run`` reads each request's pages
    ``indices[indptr[i]:indptr[i + 1]]`` of the pool, the last one up to
    ``last_page_len``. Strides wrap at 32 bits as in ``paged_kv_t``, so a
    pool FlashInfer would misread is misread here too."""

    def __init__(self, kind: str, workspace: torch.Tensor, layout: str, log: list) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.kind, self.log, self.planned = kind, log, None

    def plan(self, *args, **kwargs):
        if self.kind == "prefill":
            qo_indptr, *args = args
            assert kwargs.pop("causal") is True
        else:
            qo_indptr = None
        indptr, indices, last_page_len, heads_q, heads_kv, head_dim, page_size = args
        for t in (indptr, indices, last_page_len) + ((qo_indptr,) if qo_indptr is not None else ()):
            assert t.dtype == torch.int32 and t.dim() == 1
        n = last_page_len.numel()
        assert indptr.numel() == n + 1 and indices.numel() == int(indptr[-1])
        assert bool((last_page_len >= 1).all()) and bool((last_page_len <= page_size).all())
        self.planned = dict(qo_indptr=qo_indptr, indptr=indptr.cpu(), indices=indices.cpu(),
                            last_page_len=last_page_len.cpu(), heads=(heads_q, heads_kv, head_dim),
                            page_size=page_size, **kwargs)
        self.log.append(("plan", self.kind, self.planned))

    def run(self, q, paged_kv):
        k_pool, v_pool = paged_kv
        p = self.planned
        heads_q, heads_kv, head_dim = p["heads"]
        assert k_pool.shape[1:] == (p["page_size"], heads_kv, head_dim) and v_pool.shape == k_pool.shape
        assert q.shape[1:] == (heads_q, head_dim) and q.dtype == p["q_data_type"]
        self.log.append(("run", self.kind, (k_pool.data_ptr(), tuple(k_pool.shape), k_pool.stride())))
        pools = [self._as_flashinfer_reads(pool) for pool in (k_pool, v_pool)]
        indptr, indices, last = p["indptr"].tolist(), p["indices"].tolist(), p["last_page_len"].tolist()
        q_starts = p["qo_indptr"].tolist() if p["qo_indptr"] is not None else list(range(len(last) + 1))
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[indptr[i]:indptr[i + 1]]
            keys, values = ([pool[page, :p["page_size"] if j < len(pages) - 1 else last[i]]
                             for j, page in enumerate(pages)] for pool in pools)
            out[q_starts[i]:q_starts[i + 1]] = sdpa_dense(q[q_starts[i]:q_starts[i + 1]], torch.cat(keys),
                                                          torch.cat(values), p["sm_scale"])
        return out

    @staticmethod
    def _as_flashinfer_reads(pool: torch.Tensor) -> torch.Tensor:
        """The pool as paged_kv_t sees it: its strides kept in 32 bits."""
        strides = tuple(s & UINT32_MASK for s in pool.stride())
        return pool.as_strided(pool.shape, strides, pool.storage_offset())


def install_flash_attn(monkeypatch: pytest.MonkeyPatch) -> list:
    """``flash_attn`` replaced by the reference, and the FlashAttention kernel
    let onto CPU tensors; returns the list of recorded q's."""
    from vattn.kernels import FlashAttentionKernel

    calls: list = []
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = lambda *a, **kw: package_varlen(calls, *a, **kw)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(FlashAttentionKernel, "devices", ("cuda", "cpu"))
    return calls


def install_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list:
    """``flashinfer`` replaced by :class:`PagedWrapper`, and the FlashInfer
    kernel let onto CPU tensors; returns the log of plans and runs."""
    from vattn.kernels import FlashInferKernel

    log: list = []
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = lambda ws, layout: PagedWrapper("decode", ws, layout, log)
    module.BatchPrefillWithPagedKVCacheWrapper = lambda ws, layout: PagedWrapper("prefill", ws, layout, log)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(FlashInferKernel, "devices", ("cuda", "cpu"))
    return log


def install_torch_flash(monkeypatch: pytest.MonkeyPatch) -> list:
    """torch's FlashAttention-2 op replaced by :func:`torch_flash_forward`,
    and the kernel let onto CPU tensors; returns the list of (q, key starts)
    of each call."""
    from vattn.kernels import TorchFlashKernel

    calls: list = []
    monkeypatch.setattr(TorchFlashKernel, "op", lambda self: lambda *a, **kw: torch_flash_forward(calls, *a, **kw))
    monkeypatch.setattr(TorchFlashKernel, "devices", ("cuda", "cpu"))
    return calls
