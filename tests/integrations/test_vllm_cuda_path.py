"""The vLLM integration's CUDA path, as far as it runs without a GPU.

Which FlashAttention the worker loads (vLLM's bundled build, at the version
vLLM picks for the GPU, before the flash-attn package, with the failure at
start-up when neither loads), the kernel over vLLM's build (one
``flash_attn_varlen_func`` call per layer over the vattn cache) against a
reference paged kernel that follows that function's documented contract, on
a real vattn cache of the host backend, the stream the worker's manager
fences on, and CUDA graphs as far as they run without a GPU: the builder's
plans at fixed addresses across forwards, padding that touches only the
padding slice, a capture build that maps nothing inside a stream capture on
the fake driver (tests/backends/fake_cuda), the support level per device. A
GPU run of the same path has not happened: these tests fix the choices and
the indexing, not the kernel.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

import vattn
from backends.cuda_framework import Capture, Framework
from kernels.kernel_references import vllm_varlen
from vattn.integrations import vllm as plugin
from vattn.integrations.block_placer import BlockPlacer
from vattn.integrations.vllm import attention as vllm_attention
from vattn.integrations.vllm import configuration
from vattn.integrations.vllm import worker as vllm_worker
from vattn.kernels import KERNELS, AttentionBatch, AttentionCase, sdpa_dense

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
                              policy={"background": False, "deferred_reclaim": False, "eager": False}) as kv:
        placer = BlockPlacer(kv, 16)
        keys, cached, query = ["b", "a", "c"], [20, 33, 0], [1, 1, 5]
        reqids = placer.reqids_of(keys)
        seq_lens = np.array(cached) + np.array(query)
        need = -(-seq_lens // 16)
        table = np.zeros((3, 7), dtype=np.int32)
        for i, n in enumerate(need):
            table[i, :n] = range(1 + 7 * i, 1 + 7 * i + n)
        placer.map(reqids, table, need.astype(np.int32), seq_lens)
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


def test_the_workers_manager_fences_on_vllms_stream_and_creates_the_pool_without_a_budget(monkeypatch):
    """On CUDA the manager is built with ``sync_streams`` = vLLM's current
    stream (unmaps wait for it, not for the whole device); on the CPU with
    none (the host backend has no streams). Without a budget it creates
    every block's pages at start-up; under one, on demand."""
    stream = object()
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.current_stream = lambda: stream
    monkeypatch.setitem(sys.modules, "vllm.utils.torch_utils", torch_utils)
    monkeypatch.setattr(vllm_worker, "granularity", lambda device: 4096 if device.type == "cpu" else 2 << 20)
    spec = types.SimpleNamespace(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=32)
    runner = types.SimpleNamespace(device=torch.device("cuda", 0), max_model_len=4096,
                                   input_batch=types.SimpleNamespace(max_num_reqs=16))
    args = vllm_worker.cache_arguments(runner, spec, 32, 100)
    assert args["sync_streams"] == [stream]
    assert (args["device"], args["layout"], args["page_size"]) == ("cuda:0", "all_layers", 2 << 20)
    runner.device = torch.device("cpu")
    spec = types.SimpleNamespace(num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=32)
    monkeypatch.delenv("VATTN_BUDGET", raising=False)
    args = vllm_worker.cache_arguments(runner, spec, 2, 10)
    assert args["sync_streams"] is None
    with vattn.KVCacheManager(**args) as kv:  # what the worker builds on the CPU
        assert kv.num_page_ids == 10
        # no budget: the whole pool is created at start-up, as stock vLLM allocates its cache tensor
        assert kv.stats()["pages_created"] == 10 * kv.config.num_buffers
    monkeypatch.setenv("VATTN_BUDGET", "some-budget")  # pages created on demand: the engine core charges them
    assert vllm_worker.cache_arguments(runner, spec, 2, 10)["preallocate"] is False


# ---- CUDA graphs: persistent plans, padding, capture builds -------------------------------------------------

CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901


def fake_runner(device: torch.device, max_num_reqs: int, max_model_len: int, max_blocks: int,
                full_graph_sizes: tuple[int, ...] = (), max_num_tokens: int = 64) -> types.SimpleNamespace:
    """vLLM's model runner as the worker cache reads it: its device, its persistent batch's rows
    (request ids) and CPU block table (one KV cache group), its CPU sequence lengths, and its CUDA-graph
    dispatcher's full-graph capture sizes (largest first, as vLLM's ``get_capture_descs`` lists them)."""
    table = types.SimpleNamespace(block_table=types.SimpleNamespace(np=np.zeros((max_num_reqs, max_blocks), np.int32)),
                                  num_blocks_per_row=np.zeros(max_num_reqs, np.int32))
    batch = types.SimpleNamespace(max_num_reqs=max_num_reqs, req_ids=[], block_table=[table])
    full = types.SimpleNamespace(name="FULL")
    descs = [(full, [types.SimpleNamespace(num_tokens=n) for n in full_graph_sizes])] if full_graph_sizes else []
    return types.SimpleNamespace(device=device, max_model_len=max_model_len, input_batch=batch,
                                 max_num_tokens=max_num_tokens, optimistic_seq_lens_cpu=torch.zeros(max_num_reqs,
                                                                                                    dtype=torch.int32),
                                 cudagraph_dispatcher=types.SimpleNamespace(get_capture_descs=lambda: descs))


def set_rows(runner, rows: dict[str, list[int]]) -> None:
    """The persistent batch's rows: request ids in order, each with its blocks."""
    batch = runner.input_batch
    batch.req_ids = list(rows)
    table = batch.block_table[0]
    table.block_table.np[:] = 0
    table.num_blocks_per_row[:] = 0
    for i, ids in enumerate(rows.values()):
        table.block_table.np[i, :len(ids)] = ids
        table.num_blocks_per_row[i] = len(ids)


class VllmInputs:
    """vLLM's persistent attention inputs (``GPUModelRunner.query_start_loc``, ``seq_lens``,
    ``optimistic_seq_lens_cpu``), filled as ``_prepare_inputs`` and ``_dummy_run`` fill them: a
    padded batch's rows past the requests repeat the last query start (length 0) and have
    ``seq_lens`` 0. ``common`` returns the ``CommonAttentionMetadata`` fields the builder reads."""

    def __init__(self, max_num_reqs: int, max_model_len: int) -> None:
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32)  # the device copy
        self.query_start_loc_cpu = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)  # the device copy
        self.seq_lens_cpu = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.max_model_len = max_model_len

    def common(self, query_lens: list[int], seq_lens: list[int], num_reqs: int | None = None,
               num_tokens: int | None = None, capture: bool = False) -> types.SimpleNamespace:
        n, total = len(query_lens), sum(query_lens)
        num_reqs, num_tokens = num_reqs or n, num_tokens or total
        self.query_start_loc_cpu[0] = 0
        self.query_start_loc_cpu[1:n + 1] = torch.tensor(np.cumsum(query_lens))
        self.query_start_loc_cpu[n + 1:] = total
        self.seq_lens_cpu[:n] = torch.tensor(seq_lens)
        self.seq_lens_cpu[n:] = 0
        self.query_start_loc.copy_(self.query_start_loc_cpu)
        self.seq_lens.copy_(self.seq_lens_cpu)
        return types.SimpleNamespace(
            query_start_loc=self.query_start_loc[:num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[:num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu_upper_bound=self.seq_lens_cpu[:num_reqs], num_reqs=num_reqs,
            num_actual_tokens=num_tokens, max_query_len=max(query_lens),
            max_seq_len=self.max_model_len if capture else max(seq_lens))


def test_the_forward_adapter_reads_vllms_arrays_in_place():
    """``ForwardReader.read``: the group's block table and row counts are vLLM's own arrays, the request keys
    its rows' ids (rows without a request get keys of their own), lengths only of the rows with queries;
    the padded view, vLLM's persistent tensors, only for a kernel that runs in CUDA graphs."""
    from vattn.integrations.vllm.forward_inputs import WARM_UP, ForwardReader

    runner = fake_runner(torch.device("cpu"), 4, 64, 4)
    set_rows(runner, {"a": [3, 4], "b": [5]})
    inputs = VllmInputs(4, 64)
    m = inputs.common([2, 1], [20, 9], num_reqs=4, num_tokens=4)  # padded to 4 rows: rows 2, 3 have no query
    read = ForwardReader(runner, 0).read(m)
    table = runner.input_batch.block_table[0]
    assert read.block_table is table.block_table.np and read.num_blocks is table.num_blocks_per_row
    assert read.batch_request_keys is runner.input_batch.req_ids and read.request_keys == ["a", "b"]
    assert read.seq_lens.tolist() == [20, 9] and read.query_lens.tolist() == [2, 1] and not read.warm_up_rows
    assert read.seq_lens.dtype == np.int64 and read.padded is None
    padded = ForwardReader(runner, 0, graphs=True).read(m).padded
    assert (padded.num_rows, padded.num_tokens) == (4, 4)
    assert padded.query_start_loc.data_ptr() == inputs.query_start_loc.data_ptr()  # where a graph reads it
    set_rows(runner, {"a": [3, 4]})
    read = ForwardReader(runner, 0).read(inputs.common([2, 1], [20, 9]))
    assert read.request_keys == ["a", (WARM_UP, 1)] and read.warm_up_rows


def one_group_config(spec, num_blocks: int) -> types.SimpleNamespace:
    group = types.SimpleNamespace(layer_names=["layer.0", "layer.1"], kv_cache_spec=spec)
    return types.SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group])


def forward(md, kv_caches: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            layer: str) -> None:
    """What ``VAttnAttentionImpl.forward`` runs for one layer."""
    vllm_attention.attend(md, q, k, v, kv_caches[layer], out, 0.125)


def plan_pointers(plan) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (plan.block_table, plan.cu_seqlens_k, plan.token_reqids, plan.token_positions,
                                        plan.cu_seqlens_q, plan.seqused_k))


def host_worker_cache(kernel: Any) -> tuple[types.SimpleNamespace, Any]:
    """(runner, cache): vLLM's worker cache as the worker builds it, on the host backend, for ``kernel``:
    2 KV heads of 32 fp32, 16-token blocks, 40 blocks, a runner of 4 rows of 64 tokens."""
    spec = types.SimpleNamespace(num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=16)
    runner = fake_runner(torch.device("cpu"), 4, 64, 4)
    case = AttentionCase("cpu", 32, torch.float32, torch.float32, num_kv_heads=2, max_context_len=64)
    return runner, vllm_worker.build_cache(runner, one_group_config(spec, 40), spec, kernel, case)


def test_graph_plans_keep_their_addresses_and_padding_touches_only_the_padding_slice(fake_vllm_build, monkeypatch):
    """Four forwards of different batches through the builder's planner on a
    host cache, with vLLM's FlashAttention build: two prefills, a decode
    padded to a captured size of 4 rows and 4 tokens, a mixed batch, then a
    padded decode again. Every index tensor the kernel reads stays at one
    address; the plan is made without allocating; padded rows read no key
    (seqused_k 0, block-table entry the padding slice); padded tokens write
    row 0 of the padding slice and nothing else; the requests' rows change
    only where their new tokens go, and their outputs are exact."""
    torch.manual_seed(0)
    seen = []  # what the build was handed at each call: (block table, seqused_k, cu_seqlens_q)

    def recording(*a, **kw):
        seen.append((kw["block_table"].clone(), kw["seqused_k"].clone(), kw["cu_seqlens_q"].clone()))
        return vllm_varlen(CALLS, *a, **kw)

    monkeypatch.setattr(fake_vllm_build, "flash_attn_varlen_func", recording)
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=32)
    runner, cache = host_worker_cache(kernel)
    try:
        group = cache.groups[0]
        pad = group.padding
        assert (pad, group.placer.slices, cache.padding_tokens) == (8, 8, 16)  # 2 slices per row, then padding
        # mapped at start-up: the null block, then FlashAttention-3's tiles past it read the scratch page (id 40,
        # one past vLLM's 40 blocks) to the slice's end
        assert cache.manager.page_ids(pad) == [plugin.NULL_BLOCK_ID, 40, 40, 40]
        kv_caches = cache.kv_caches()
        assert kv_caches["layer.0"].shape[1] == 9  # the views hold the padding slice
        planner = vllm_attention.ForwardPlanner(cache, 0, torch.device("cpu"), 4, 32, num_splits=16, split_tokens=8)
        reader = planner.reader(runner)
        inputs = VllmInputs(4, 64)
        blocks = {"a": [3, 4], "b": [5], "c": [6, 7]}
        lens = {"a": 0, "b": 0, "c": 0}
        steps = [({"a": 20, "b": 5}, None), ({"a": 1, "b": 1}, 4), ({"a": 1, "b": 1, "c": 17}, None),
                 ({"a": 1, "b": 1, "c": 1}, 4)]
        pointers = set()
        allocations = []
        for queries, padded in steps:
            set_rows(runner, {key: blocks[key] for key in queries})
            for key, n in queries.items():
                lens[key] += n
            m = inputs.common(list(queries.values()), [lens[key] for key in queries], padded, padded)
            with monkeypatch.context() as counting:  # the build allocates no tensor
                for name in ("tensor", "empty", "zeros"):
                    real = getattr(torch, name)
                    counting.setattr(torch, name, lambda *a, _real=real, _name=name, **kw:
                                     allocations.append(_name) or _real(*a, **kw))
                md = planner.build(reader.read(m))
            plan = md.plan
            pointers.add(plan_pointers(plan))
            n, t = len(queries), sum(queries.values())
            rows, tokens = padded or n, padded or t
            assert md.num_tokens == tokens and plan.num_splits == (16 if tokens <= 8 else 0)
            reqids = plan.block_table[:n, 0].tolist()
            assert plan.block_table[n:rows, 0].tolist() == [pad] * (rows - n)
            assert plan.token_reqids[t:].tolist() == [pad] * (tokens - t)
            assert plan.token_positions[t:].tolist() == [0] * (tokens - t)
            q = torch.randn(tokens, 4, 32)
            k_new, v_new = torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32)
            for layer in ("layer.0", "layer.1"):
                k_cache, v_cache = kv_caches[layer]
                before = {r: k_cache[r, :lens[key]].clone() for r, key in zip(reqids, queries)}
                pad_before = k_cache[pad, :16].clone()
                out = torch.zeros(tokens, 4, 32)
                seen.clear()
                forward(md, kv_caches, q, k_new, v_new, out, layer)
                table, used, _ = seen[0]
                assert used[n:].tolist() == [0] * (rows - n) and table[n:, 0].tolist() == [pad] * (rows - n)
                at = 0
                for r, key in zip(reqids, queries):
                    new = queries[key]
                    old = lens[key] - new
                    assert torch.equal(k_cache[r, :old], before[r][:old])  # rows before the new ones kept
                    assert torch.equal(k_cache[r, old:lens[key]], k_new[at:at + new])
                    assert torch.equal(v_cache[r, old:lens[key]], v_new[at:at + new])
                    want = sdpa_dense(q[at:at + new], k_cache[r, :lens[key]], v_cache[r, :lens[key]], 0.125)
                    torch.testing.assert_close(out[at:at + new], want)
                    at += new
                if tokens > t:  # one of the padded tokens' K landed in row 0 of the padding slice, nothing else
                    assert any(torch.equal(k_cache[pad, 0], k_new[i]) for i in range(t, tokens))
                    assert torch.equal(k_cache[pad, 1:16], pad_before[1:])
                else:
                    assert torch.equal(k_cache[pad, :16], pad_before)
        assert len(pointers) == 1, "an index tensor moved between forwards"
        assert pointers.pop()[4:] == (inputs.query_start_loc.data_ptr(), inputs.seq_lens.data_ptr())  # vLLM's own
        assert allocations == []
    finally:
        cache.manager.cleanup()


def test_plans_into_buffers_refuse_what_does_not_fit(fake_vllm_build):
    from vattn.kernels.flash_attn import FlashAttentionBuffers

    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=32)
    buffers = FlashAttentionBuffers(2, 4, "cpu")
    batch = AttentionBatch([0, 1], [3, 0], [1, 3])
    starts, used = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32)
    args = dict(padding_reqid=5, cu_seqlens_q=starts, seqused_k=used, max_seqlen_q=3, max_seqlen_k=4)
    plan = kernel.plan_into(buffers, batch, num_rows=2, num_tokens=4, **args)
    assert plan.token_reqids.tolist() == [0, 1, 1, 1] and plan.token_positions.tolist() == [3, 0, 1, 2]
    assert plan.cu_seqlens_k.tolist() == [0, 4, 7] and plan.block_table[:, 0].tolist() == [0, 1]
    three_rows = dict(args, cu_seqlens_q=torch.tensor([0, 1, 4, 4], dtype=torch.int32),
                      seqused_k=torch.tensor([4, 3, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"padded to 3 rows and 4 tokens does not fit buffers of 2 rows"):
        kernel.plan_into(buffers, batch, num_rows=3, num_tokens=4, **three_rows)
    with pytest.raises(ValueError, match=r"padded to 2 rows and 3 tokens"):  # fewer tokens than the batch's
        kernel.plan_into(buffers, batch, num_rows=2, num_tokens=3, **args)
    with pytest.raises(ValueError, match=r"seqused_k must be \[2\] int32"):
        kernel.plan_into(buffers, batch, num_rows=2, num_tokens=4, **dict(args, seqused_k=used.long()))
    cache = torch.zeros(4, 16, 2, 32)  # 4 slices: the padding slice 5 is not one of them
    with pytest.raises(ValueError, match=r"padding slice 5 is not in this cache's 4 slices"):
        kernel.run(plan, torch.zeros(4, 2, 32), cache, cache.clone())


def vllm_on_a_fake_stream(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Framework, Any]:
    """The fake driver's framework, initialised, and a stream of it that vLLM's ``current_stream`` returns
    (the stream the worker's cache fences its unmaps on)."""
    fw = Framework(fake_cuda)
    fw.init()
    stream = fw.stream()
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.current_stream = lambda: stream
    monkeypatch.setitem(sys.modules, "vllm.utils.torch_utils", torch_utils)
    return fw, stream


def test_a_capture_build_maps_nothing_inside_a_cuda_graph_capture(fake_cuda, fake_vllm_build, monkeypatch):
    """On the fake CUDA driver, the worker's cache as vLLM's CUDA worker
    builds it: the padding slice is mapped at start-up; a build for a graph
    capture, inside a (global-mode) stream capture, maps, unmaps and
    creates nothing (the capture stays valid), leaves the requests of the
    persistent batch alone, and points every row and token at the padding
    slice. The ordinary build of the same batch without requests (vLLM's
    warm-up rows) would map, and invalidates the capture: what the test
    would see if a capture build mapped."""
    fw, stream = vllm_on_a_fake_stream(fake_cuda, monkeypatch)
    block = 2048  # 4 KV heads x 128 x fp16 = 1 KiB per token: one 2 MiB page per block and buffer
    spec = types.SimpleNamespace(num_kv_heads=4, head_size=128, dtype=torch.float16, block_size=block)
    runner = fake_runner(torch.device("cuda", 0), 4, 4 * block, 4)
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=128)
    case = AttentionCase("cuda", 128, torch.float16, torch.float16, num_kv_heads=4, max_context_len=4 * block)
    cache = vllm_worker.build_cache(runner, one_group_config(spec, 24), spec, kernel, case)
    try:
        manager, pad = cache.manager, cache.groups[0].padding
        assert manager.page_ids(pad) == [plugin.NULL_BLOCK_ID]
        planner = vllm_attention.ForwardPlanner(cache, 0, torch.device("cpu"), 4, 64)
        reader = planner.reader(runner)
        inputs = VllmInputs(4, 4 * block)
        set_rows(runner, {"a": [3, 4], "b": [5]})
        planner.build(reader.read(inputs.common([1, 1], [3000, 10])))  # a real forward maps its requests
        a, b = cache.groups[0].placer.reqids_of(["a", "b"]).tolist()
        mem = manager._pages.memory

        def driver_state():
            s = manager.stats()
            return (fake_cuda.fake_cuda_mappings_in(mem.base, mem.base + mem.nbytes), fake_cuda.fake_cuda_unmap_calls(),
                    fake_cuda.fake_cuda_live_handles(), s["sync_page_maps"], s["page_unmaps"])

        before = driver_state()
        capture_batch = inputs.common([1] * 4, [1] * 4, capture=True)  # _dummy_run's uniform decode of 4 rows
        with Capture(fw, stream) as cap:
            md = vllm_attention.capture_metadata(planner, reader, capture_batch)
        assert cap.result == 0, f"the capture was invalidated: CUresult {cap.result}"
        assert driver_state() == before
        assert (manager.page_ids(a), manager.page_ids(b)) == ([3, 4], [5])
        plan = md.plan
        assert plan.batch is None and md.num_tokens == 4 and plan.max_seqlen_k == 4 * block
        assert plan.block_table[:, 0].tolist() == [pad] * 4
        assert plan.token_reqids.tolist() == [pad] * 4 and plan.token_positions.tolist() == [0] * 4
        with pytest.raises(RuntimeError, match=r"reads 2049 tokens per row; the padding slice it reads maps 2048"):
            vllm_attention.capture_metadata(planner, reader, inputs.common([1] * 4, [2049] * 4, capture=True))
        set_rows(runner, {})  # warm-up rows: the ordinary build maps the null block into slices of their own
        with Capture(fw, stream) as cap, pytest.raises(vattn.DriverError):
            planner.build(reader.read(capture_batch))
        assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    finally:
        cache.manager.cleanup()
        fw.close()


def test_cuda_graph_support_follows_the_kernel_vattn_serves():
    """FlashAttention on CUDA captures uniform single-token decodes; the host
    kernel on the CPU, and cases no CUDA kernel serves, never."""
    support = vllm_attention.cudagraph_support
    assert support("cuda", 128, torch.bfloat16) == support("cuda", 64, torch.float16) == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert support("cpu", 128, torch.bfloat16) == "NEVER"
    assert support("cuda", 128, torch.float32) == "NEVER"  # FlashAttention takes fp16/bf16 only
    assert support("cuda", 512, torch.float16) == "NEVER"  # past its head-dim limit


def test_flash_attention_3_gets_vllms_split_bound_for_graph_sized_batches(fake_vllm_build):
    full = types.SimpleNamespace(has_full_cudagraphs=lambda: True)
    config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=full, max_cudagraph_capture_size=512),
        attention_config=types.SimpleNamespace(flash_attn_max_num_splits_for_cuda_graph=32))
    fa3 = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=128)
    assert vllm_attention.graph_splits(config, fa3) == (32, 512)
    assert vllm_attention.graph_splits(config, type(fa3)(2)) == (0, 0)  # FlashAttention-2: its own choice
    config.compilation_config.cudagraph_mode = types.SimpleNamespace(has_full_cudagraphs=lambda: False)
    assert vllm_attention.graph_splits(config, fa3) == (0, 0)


# ---- the kernel's read footprint: rows read past a request's own are mapped ------------------------------------

TILE_READS = r"""
import sys, types
import numpy as np, torch
import vattn
from kernels.kernel_references import vllm_varlen
from vattn.integrations.block_placer import BlockPlacer
from vattn.integrations.vllm.flash_attn import VllmFlashAttentionKernel
from vattn.kernels import AttentionBatch, AttentionCase, FlashAttentionKernel

build = types.ModuleType("vllm.vllm_flash_attn")
build.flash_attn_varlen_func = lambda *a, **kw: vllm_varlen([], *a, **kw)
sys.modules["vllm.vllm_flash_attn"] = build
FlashAttentionKernel.devices = ("cuda", "cpu")
kernel = VllmFlashAttentionKernel(3)
case = AttentionCase("cpu", 32, torch.float32, torch.float32, num_q_heads=4, num_kv_heads=2)
footprint = kernel.read_footprint(case) if sys.argv[1] == "footprint" else None
# 2 KV heads x 32 fp32 = 256 bytes per token: a 4 KiB page holds a 16-token block; slices of 512 rows (4 key tiles)
with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=2,
                          max_context_len=512, page_size=4096, physical_memory=41 * 2 * 4096,
                          page_allocator="external",
                          policy={"background": False, "deferred_reclaim": False, "eager": False}) as kv:
    extra = {} if footprint is None else dict(rows_past_end=footprint.past_end,
                                              rows_below_start=footprint.below_start, scratch_page_id=40)
    placer = BlockPlacer(kv, 16, **extra)
    reqids = placer.reqids_of(["a"])
    table = np.arange(1, 33, dtype=np.int32)[None]
    placer.map(reqids, table, np.array([7], np.int32), np.array([100]))  # a 100-token prompt: 7 blocks
    batch = AttentionBatch.of_arrays(reqids, np.array([0]), np.array([100]))
    q, k_new = torch.randn(100, 4, 32), torch.randn(100, 2, 32)
    out = kernel.run(kernel.plan(batch), q, *kv.layer(0), k_new, torch.randn(100, 2, 32))
    print("ok", kv.page_ids(int(reqids[0])))
"""


@pytest.mark.parametrize("mapping", ["footprint", "blocks only"])
def test_flash_attention_3_tiles_past_a_prompt_read_mapped_rows(mapping, tmp_path):
    """FlashAttention-3's TMA path (a 100-token prefill of 4 query / 2 KV
    heads of 32: 200 query rows pass its 192-row tile, and 512-row slices
    are whole 128-row key tiles) loads rows 0-127 of the slice, past the
    prompt's 7 blocks (112 rows). With the kernel's read footprint the
    placer maps the scratch page past the prompt's blocks and the forward
    runs; with its blocks only, the tile reads an unmapped page of the host
    backend and the process dies of SIGSEGV, as a GPU faults on an illegal
    address. The stand-in build reads the tiles for real
    (``kernel_references.fa3_tma_tiles``), in a subprocess."""
    import os
    import signal
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "tests"), root]))
    done = subprocess.run([sys.executable, "-c", TILE_READS, mapping], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    if mapping == "footprint":
        assert done.returncode == 0, done.stderr
        # 7 blocks, then the scratch page up to row 100 + 191: positions 7 .. 18
        assert done.stdout.split("ok ")[1].strip() == str(list(range(1, 8)) + [40] * 12)
    else:
        assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr)


def test_flash_attention_3_declares_a_key_tile_of_footprint_and_the_masking_kernels_none(fake_vllm_build):
    from vattn.integrations.vllm.flash_attn import VllmFlashAttentionKernel
    from vattn.kernels import ReadFootprint

    fa3, fa2 = VllmFlashAttentionKernel(3), VllmFlashAttentionKernel(2)
    tiles = {64: 192, 96: 144, 128: 176, 192: 128, 256: 96}
    for head_dim, tile in tiles.items():
        case = AttentionCase("cuda", head_dim, torch.bfloat16, torch.bfloat16)
        assert fa3.read_footprint(case) == ReadFootprint(tile - 1, tile - 1)
        assert not fa2.read_footprint(case)
        for key in ("flash_attn", "torch_flash", "sdpa", "host", "flashinfer"):
            assert not KERNELS[key].read_footprint(case), key


def test_the_scratch_page_holds_zeros_whatever_its_fresh_memory_held(fake_vllm_build, monkeypatch):
    """FlashAttention-3's tiles read the scratch page past a request's end and
    weigh its rows by zero: a NaN there would still reach the output. A
    device's fresh memory holds whatever it held, so the build zeroes the page
    (stood in for here by filling every page the build maps with NaN as it is
    mapped)."""
    real_map_pages = vattn.KVCacheManager.map_pages

    def map_pages_onto_garbage(manager, reqids, starts, page_ids, counts=None):
        real_map_pages(manager, reqids, starts, page_ids, counts)
        for buffer in manager.buffers():
            for reqid in np.atleast_1d(reqids):
                buffer[int(reqid)].fill_(float("nan"))  # the padding slice is mapped whole (4 blocks of 16 rows)

    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=32)
    monkeypatch.setattr(vattn.KVCacheManager, "map_pages", map_pages_onto_garbage)
    _, cache = host_worker_cache(kernel)
    try:
        pad = cache.groups[0].padding
        assert cache.manager.page_ids(pad) == [plugin.NULL_BLOCK_ID, 40, 40, 40]
        for buffer in cache.manager.buffers():
            assert torch.isnan(buffer[pad, :16]).all()  # the null block: never read as keys, left as it is
            assert torch.equal(buffer[pad, 16:], torch.zeros_like(buffer[pad, 16:]))  # the scratch page, thrice
    finally:
        cache.manager.cleanup()
