"""The vLLM integration's CUDA path, as far as it runs without a GPU.

Which FlashAttention the worker loads (vLLM's bundled build, at the version
vLLM picks for the GPU, before the flash-attn package, with the failure at
start-up when neither loads), the kernel over vLLM's build (one
``flash_attn_varlen_func`` call per layer over the vattn cache) against a
reference paged kernel that follows that function's documented contract, on
a real vattn cache of the host backend, and the stream the worker's manager
fences on. A GPU run of the same path has not
happened: these tests fix the choices and the indexing, not the kernel.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import vattn
from kernels.kernel_references import vllm_varlen
from vattn.integrations import vllm as plugin
from vattn.integrations.block_mapper import BlockMapper
from vattn.integrations.vllm import configuration
from vattn.integrations.vllm import worker_cache as vllm_cache
from vattn.kernels import KERNELS, AttentionBatch, sdpa_dense

CALLS: list = []  # (q, fa_version) of every call of the fake build


@pytest.fixture
def fake_vllm_build(monkeypatch):
    """A vLLM whose ``vllm.vllm_flash_attn`` loads (as on a CUDA build), with
    the reference of its ``flash_attn_varlen_func``, on a GPU where vLLM
    picks FlashAttention-3 (Hopper); the FlashAttention kernels let onto CPU
    tensors."""
    from vattn.kernels import FlashAttentionKernel

    build = types.ModuleType("vllm.vllm_flash_attn")
    build.flash_attn_varlen_func = lambda *a, **kw: vllm_varlen(CALLS, *a, **kw)
    fa_utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    fa_utils.get_flash_attn_version = lambda head_size=None, **_: 3
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", build)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.fa_utils", fa_utils)
    monkeypatch.setattr(FlashAttentionKernel, "devices", ("cuda", "cpu"))
    CALLS.clear()
    return build


def _without(monkeypatch, *modules: str) -> None:
    for name in modules:  # None in sys.modules: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, None)


def test_vllms_bundled_flash_attention_is_preferred(fake_vllm_build, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # the package too
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=128)
    assert isinstance(kernel, type(configuration.VLLM_FLASH_ATTN)) and kernel.module() is fake_vllm_build
    assert kernel.fa_version == 3 and kernel.name == "FlashAttention-3 (vLLM's build)"  # what stock vLLM runs


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
def test_vllms_build_reads_each_slice_as_one_page_in_one_call_per_layer(fake_vllm_build, layout):
    """Three requests of mixed query lengths (a prefill chunk, two decodes)
    in slices 2, 0, 3 of a cache whose slices are whole 16-token pages: one
    call per layer at vLLM's FlashAttention version, the new rows written,
    attention over exactly each request's rows."""
    torch.manual_seed(0)
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=32)
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                              max_context_len=100, page_size=4096 * (2 if layout == "all_layers" else 1),
                              physical_memory=40 * 4 * 4096, layout=layout, page_allocator="external",
                              background=False, deferred_reclaim=False, eager=False) as kv:
        mapper = BlockMapper(kv, 16)
        keys, cached, query = ["b", "a", "c"], [20, 33, 0], [1, 1, 5]
        reqids = mapper.reqids_of(keys)
        seq_lens = np.array(cached) + np.array(query)
        need = -(-seq_lens // 16)
        table = np.zeros((3, 7), dtype=np.int32)
        for i, n in enumerate(need):
            table[i, :n] = range(1 + 7 * i, 1 + 7 * i + n)
        mapper.map(reqids, table, need.astype(np.int32), seq_lens)
        k_cache, v_cache = kv.layer(1)
        assert kernel.slice_tokens(k_cache.stride(0), k_cache.stride(1)) == 112  # 100 tokens, whole pages
        for r, c in zip(reqids.tolist(), cached):
            k_cache[r, :c] = torch.randn(c, 2, 32)
            v_cache[r, :c] = torch.randn(c, 2, 32)
        batch = AttentionBatch.of_arrays(reqids, np.array(cached), np.array(query))
        plan = kernel.plan(batch)
        q = torch.randn(7, 4, 32)
        k_new, v_new = torch.randn(7, 2, 32), torch.randn(7, 2, 32)
        out = kernel.run(plan, q, k_cache, v_cache, k_new, v_new, softmax_scale=0.125)
        assert [fa for _, fa in CALLS] == [3]
        starts = batch.query_starts
        for i, (r, c) in enumerate(zip(reqids.tolist(), cached)):
            rows = slice(starts[i], starts[i + 1])
            assert torch.equal(k_cache[r, c:c + query[i]], k_new[rows])
            assert torch.equal(v_cache[r, c:c + query[i]], v_new[rows])
            want = sdpa_dense(q[rows], k_cache[r, :c + query[i]], v_cache[r, :c + query[i]], 0.125)
            torch.testing.assert_close(out[rows], want)


def test_vllms_build_refuses_slices_it_cannot_page(fake_vllm_build):
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"])
    cache = torch.zeros(4, 24, 2, 8)  # 24-token slices: not a multiple of 16
    with pytest.raises(ValueError, match=r"a multiple of 16 tokens; this cache's slices are 24 tokens apart"):
        kernel.slice_tokens(cache.stride(0), cache.stride(1))


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
