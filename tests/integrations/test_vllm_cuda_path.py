"""The vLLM integration's CUDA path, as far as it runs without a GPU.

Which FlashAttention the worker loads (vLLM's bundled build before the
flash-attn package, with the failure at start-up when neither loads), the
adapter that serves vLLM's build (``flash_attn_varlen_func`` over the vattn
cache) against a reference paged kernel that follows that function's
documented contract, on a real vattn cache of the host backend, and the
stream the worker's manager fences on. A GPU run of the same path has not
happened: these tests fix the choices and the indexing, not the kernel.
"""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch

import vattn
from vattn.integrations import vllm as plugin
from vattn.integrations.vllm import configuration
from vattn.integrations.vllm import worker_cache as vllm_cache
from vattn.integrations.block_mapper import BlockMapper
from vattn.kernels import KERNELS

ADAPTER = "vattn.integrations.vllm.flash_attn"


def reference_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
                     causal=False, block_table=None, **_):
    """``flash_attn_varlen_func`` with a paged cache, by its documentation:
    request b's queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``, its
    key j sits in page ``block_table[b, j // page]`` at row ``j % page``, it
    has ``seqused_k[b]`` keys, causal masks align to the end. Reads only
    those rows (others may be unmapped)."""
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert k.shape[1] % 16 == 0 and max_seqlen_k >= int(seqused_k.max())
    out = torch.empty_like(q)
    page, group = k.shape[1], q.shape[1] // k.shape[2]
    for b in range(len(seqused_k)):
        start, end, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert end - start <= max_seqlen_q
        j = torch.arange(n)
        pages = block_table[b, j // page].long()
        keys = k[pages, j % page].repeat_interleave(group, dim=1)  # [n, H_q, D]
        values = v[pages, j % page].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * softmax_scale
        if causal:
            visible = j[None, :] <= torch.arange(end - start)[:, None] + n - (end - start)
            scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


@pytest.fixture
def fake_vllm_build(monkeypatch):
    """A vLLM whose ``vllm.vllm_flash_attn`` loads (as on a CUDA build), with
    the reference kernel; the adapter imported against it, and forgotten
    afterwards."""
    build = types.ModuleType("vllm.vllm_flash_attn")
    build.flash_attn_varlen_func = reference_varlen
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", build)
    sys.modules.pop(ADAPTER, None)
    yield importlib.import_module(ADAPTER)
    sys.modules.pop(ADAPTER, None)
    monkeypatch.delattr(importlib.import_module("vattn.integrations.vllm"), "flash_attn", raising=False)


def _without(monkeypatch, *modules: str) -> None:
    for name in modules:  # None in sys.modules: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    sys.modules.pop(ADAPTER, None)


def test_vllms_bundled_flash_attention_is_preferred(fake_vllm_build, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # the package too
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"])
    assert kernel is configuration.VLLM_FLASH_ATTN and kernel.name == "FlashAttention-2"
    assert kernel.module().flash_attn_with_kvcache is fake_vllm_build.flash_attn_with_kvcache


def test_without_vllms_build_the_flash_attn_package_serves(monkeypatch):
    _without(monkeypatch, "vllm.vllm_flash_attn")
    package = types.ModuleType("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"])
    assert kernel is KERNELS["flash_attn"] and kernel.module() is package


def test_no_flash_attention_fails_at_start_up_naming_both(monkeypatch):
    _without(monkeypatch, "vllm.vllm_flash_attn", "flash_attn")
    with pytest.raises(RuntimeError, match=r"vattn: no attention kernel loads in this vLLM worker: vLLM's bundled "
                                           r"FlashAttention \(vllm.vllm_flash_attn, in vLLM's CUDA builds\) is not "
                                           r"installed: .*; FlashAttention-2 \(pip install flash-attn\) is not "
                                           r"installed: .*; install one, or unset VATTN_VLLM"):
        plugin.loaded_kernel(KERNELS["flash_attn"])
    assert plugin.loaded_kernel(KERNELS["host"]) is KERNELS["host"]  # the host kernel is built with vattn


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_adapter_reads_each_slice_as_one_page_and_writes_the_new_rows(fake_vllm_build, layout):
    """Three requests in rows 2, 0, 3 of a cache whose slices are whole
    16-token blocks; one appends 3 tokens per request (a prefill chunk), the
    result must be attention over exactly the request's rows."""
    torch.manual_seed(0)
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                              max_context_len=100, page_size=4096 * (2 if layout == "all_layers" else 1),
                              physical_memory=40 * 4 * 4096, layout=layout, page_allocator="external",
                              background=False, deferred_reclaim=False, eager=False) as kv:
        mapper = BlockMapper(kv, 16)
        rows, cached, q_len = [2, 0, 3], [20, 33, 0], 3
        table = np.zeros((4, 7), dtype=np.int32)
        counts = np.zeros(4, dtype=np.int32)
        seq_lens = np.zeros(4, dtype=np.int64)
        next_id = 1
        for r, c in zip(rows, cached):
            need = -(-(c + q_len) // 16)
            table[r, :need] = range(next_id, next_id + need)
            counts[r], seq_lens[r], next_id = need, c + q_len, next_id + need
        mapper.map_rows(table, counts, seq_lens)
        k_cache, v_cache = kv.layer(1)
        assert fake_vllm_build.slot_tokens(k_cache) == 112  # 100 tokens rounded up to whole 16-token pages
        for r, c in zip(rows, cached):
            k_cache[r, :c] = torch.randn(c, 2, 32)
            v_cache[r, :c] = torch.randn(c, 2, 32)
        q = torch.randn(3, q_len, 4, 32)
        k_new, v_new = torch.randn(3, q_len, 2, 32), torch.randn(3, q_len, 2, 32)
        out = fake_vllm_build.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=torch.tensor(cached, dtype=torch.int32),
            cache_batch_idx=torch.tensor(rows, dtype=torch.int32), softmax_scale=0.125, causal=True)
        assert out.shape == q.shape
        for g, (r, c) in enumerate(zip(rows, cached)):
            assert torch.equal(k_cache[r, c:c + q_len], k_new[g]) and torch.equal(v_cache[r, c:c + q_len], v_new[g])
            keys = k_cache[r, :c + q_len].repeat_interleave(2, dim=1).transpose(0, 1)
            values = v_cache[r, :c + q_len].repeat_interleave(2, dim=1).transpose(0, 1)
            mask = torch.ones(q_len, c + q_len, dtype=torch.bool).tril(c)
            want = torch.nn.functional.scaled_dot_product_attention(q[g].transpose(0, 1), keys, values,
                                                                    attn_mask=mask, scale=0.125)
            torch.testing.assert_close(out[g], want.transpose(0, 1))


def test_adapter_refuses_slices_vllms_kernel_cannot_page(fake_vllm_build):
    cache = torch.zeros(4, 24, 2, 8)  # 24-token slices: not a multiple of 16
    with pytest.raises(ValueError, match=r"a multiple of 16 tokens; this cache's slices are 24 tokens apart"):
        fake_vllm_build.slot_tokens(cache)


def test_the_workers_manager_fences_on_vllms_stream(monkeypatch):
    """On CUDA the manager is built with ``sync_streams`` = vLLM's current
    stream (unmaps wait for it, not for the whole device); on the CPU with
    none (the host backend has no streams)."""
    stream = object()
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.current_stream = lambda: stream
    monkeypatch.setitem(sys.modules, "vllm.utils.torch_utils", torch_utils)
    monkeypatch.setattr(vllm_cache, "granularity", lambda device: 4096 if device.type == "cpu" else 2 << 20)
    spec = types.SimpleNamespace(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=32)
    runner = types.SimpleNamespace(device=torch.device("cuda", 0), max_model_len=4096,
                                   input_batch=types.SimpleNamespace(max_num_reqs=16))
    args = vllm_cache.cache_arguments(runner, spec, 32, 100)
    assert args["sync_streams"] == [stream]
    assert (args["device"], args["layout"], args["page_size"]) == ("cuda:0", "all_layers", 2 << 20)
    runner.device = torch.device("cpu")
    spec = types.SimpleNamespace(num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=32)
    args = vllm_cache.cache_arguments(runner, spec, 2, 10)
    assert args["sync_streams"] is None
    with vattn.KVCacheManager(**args) as kv:  # what the worker builds on the CPU
        assert kv.num_page_ids == 10
