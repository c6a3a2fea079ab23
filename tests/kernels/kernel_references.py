"""CPU stand-ins for the GPU kernel libraries vattn calls, so that what vattn
hands a library (arguments, index tensors, strided views of the cache) is
checked on any machine; the libraries themselves run on a GPU only.

Each stand-in keeps the library's calling convention and the rules of its
arguments that vattn could break, then attends with ``sdpa_dense`` on
exactly the rows the real kernel reads: reading a row the kernel would not
read faults on an unmapped page instead of passing.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vattn.kernels import sdpa_dense


def flash_attn_with_kvcache(calls: list, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            cache_batch_idx=None, softmax_scale=None, causal=False):
    """The flash-attn package's ``flash_attn_with_kvcache``: appends k / v at
    ``cache_seqlens`` of rows ``cache_batch_idx``, then attends causally,
    aligned to the end. Records each call's q."""
    assert causal and cache_seqlens.dtype == cache_batch_idx.dtype == torch.int32
    assert q.dim() == 4 and (k is None) == (v is None)
    calls.append(q)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        row, n = int(cache_batch_idx[b]), int(cache_seqlens[b])
        if k is not None:
            k_cache[row, n:n + q.shape[1]], v_cache[row, n:n + q.shape[1]] = k[b], v[b]
            n += q.shape[1]
        out[b] = sdpa_dense(q[b], k_cache[row, :n], v_cache[row, :n], softmax_scale)
    return out


def install_flash_attn(monkeypatch: pytest.MonkeyPatch) -> list:
    """``flash_attn`` replaced by the reference, and the FlashAttention kernel
    let onto CPU tensors; returns the list of recorded q's."""
    from vattn.kernels import FlashAttentionKernel

    calls: list = []
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = lambda *a, **kw: flash_attn_with_kvcache(calls, *a, **kw)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(FlashAttentionKernel, "devices", ("cuda", "cpu"))
    return calls
