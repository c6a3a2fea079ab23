"""The vLLM worker's start-up, before its first forward, without a GPU.

vLLM 0.32's CUDA-graph memory profiling (``Worker.determine_available_memory``
-> ``GPUModelRunner.profile_cudagraph_memory``): a minimal KV cache of one
block per row, warm-ups and a capture whose rows read
``min(max_model_len, max_num_tokens // largest capture size)`` tokens, then
``_cleanup_profiling_kv_cache`` and the real cache; driven here in vLLM's
order on the fake CUDA driver, with the worker's own hooks and stand-ins for
vLLM's runner, builders and cleanup (vLLM's CPU build cannot run its CUDA
worker). The virtual address space a cache reserves at serving sizes (pure
arithmetic through the function the worker calls), metadata without vLLM's
CPU bound on the sequence lengths, and the block size a small-KV model gets.
"""

from __future__ import annotations

import gc
import logging
import sys
import types

import pytest
import torch

from backends.cuda_framework import Capture
from integrations.test_vllm_cuda_path import VllmInputs, fake_runner, fake_vllm_build, set_rows  # noqa: F401
from integrations.test_vllm_cuda_path import vllm_on_a_fake_stream
from vattn.integrations import block_placer
from vattn.integrations import vllm as plugin
from vattn.integrations.vllm import attention as vllm_attention
from vattn.integrations.vllm import configuration
from vattn.integrations.vllm import worker as vllm_worker
from vattn.integrations.vllm.forward_inputs import ForwardReader
from vattn.integrations.vllm.worker_cache import WorkerCache

GIB, TIB = 1 << 30, 1 << 40


class FullAttentionSpec(types.SimpleNamespace):
    """vLLM's ``FullAttentionSpec`` as the worker reads it."""


class SlidingWindowSpec(types.SimpleNamespace):
    """vLLM's ``SlidingWindowSpec`` as the worker reads it."""


class Builder:
    """vattn's metadata builder as ``VAttnMetadataBuilder.bind`` makes it (vLLM's class needs vLLM)."""

    def __init__(self, layer_name: str, max_num_seqs: int, max_num_tokens: int) -> None:
        self.layer_name, self.max_num_seqs, self.max_num_tokens = layer_name, max_num_seqs, max_num_tokens
        self.planner = self.reader = None

    def bind(self, cache, runner) -> None:
        self.planner = vllm_attention.ForwardPlanner(cache, cache.group_of[self.layer_name], torch.device("cpu"),
                                                     self.max_num_seqs, self.max_num_tokens)
        self.reader = self.planner.reader(runner)


def bind_kv_cache(kv_caches, forward_context, runner_kv_caches, kv_cache_groups=None) -> None:
    """vLLM's ``bind_kv_cache``: the runner's list and each layer's ``kv_cache`` hold the views."""
    for name, tensor in kv_caches.items():
        runner_kv_caches.append(tensor)
        forward_context[name] = types.SimpleNamespace(kv_cache=tensor)


@pytest.fixture
def vllm_stand_ins(monkeypatch):
    """What ``initialize_kv_cache_tensors`` imports from vLLM, and vLLM's stream."""
    interface = types.ModuleType("vllm.v1.kv_cache_interface")
    interface.FullAttentionSpec, interface.SlidingWindowSpec = FullAttentionSpec, SlidingWindowSpec
    utils = types.ModuleType("vllm.v1.worker.utils")
    utils.bind_kv_cache = bind_kv_cache
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger
    for module in (interface, utils, logger):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def kv_cache_config(spec, num_blocks: int) -> types.SimpleNamespace:
    group = types.SimpleNamespace(layer_names=["layer.0", "layer.1"], kv_cache_spec=spec)
    return types.SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group])


def vllm_cleanup_profiling_kv_cache(runner) -> None:
    """What vLLM 0.32's ``_cleanup_profiling_kv_cache`` drops of a KV cache: the runner's list, the
    attention groups (and so the builders), each layer's ``kv_cache``."""
    runner.kv_caches.clear()
    runner.attn_groups.clear()
    for layer in runner.compilation_config.static_forward_context.values():
        layer.kv_cache = torch.tensor([])
    gc.collect()


def initialize_kv_cache(runner, spec, num_blocks: int):
    """vLLM's ``initialize_kv_cache``: new builders, then the (hooked) ``initialize_kv_cache_tensors``."""
    runner.attn_groups = [[types.SimpleNamespace(metadata_builders=[Builder("layer.0", runner.input_batch.max_num_reqs,
                                                                            runner.max_num_tokens)])]]
    vllm_worker.initialize_kv_cache_tensors(runner, kv_cache_config(spec, num_blocks), [spec.block_size])
    return runner.attn_groups[0][0].metadata_builders[0]


def test_cuda_graph_memory_profiling_builds_a_minimal_cache_vattn_drops_and_captures_its_long_rows(
        fake_cuda, fake_vllm_build, vllm_stand_ins, monkeypatch):
    """vLLM's profiling sequence with 2048-token blocks, 2 rows, 8192 batched tokens and full graphs of 2
    and 1 rows: the minimal cache has vLLM's 2 blocks and slices no longer than the profiling reads; the
    warm-up and the capture of 4096-token rows (8192 // 2) raise nothing and the capture maps nothing;
    after vLLM's cleanup the profiling cache's address range is released, and the real cache is the one
    reservation alive."""
    fw, stream = vllm_on_a_fake_stream(fake_cuda, monkeypatch)
    block = 2048  # 4 KV heads x 128 x fp16 = 1 KiB per token: one 2 MiB page per block and buffer
    spec = FullAttentionSpec(num_kv_heads=4, head_size=128, dtype=torch.float16, block_size=block)
    runner = fake_runner(torch.device("cuda", 0), 2, 4 * block, 4, full_graph_sizes=(2, 1), max_num_tokens=8192)
    runner.shared_kv_cache_layers, runner.kv_caches = {}, []
    runner.compilation_config = types.SimpleNamespace(static_forward_context={})
    # this torch has no CUDA: the cache's tensor views (and the page-size check that reads them) are stand-ins
    monkeypatch.setattr(WorkerCache, "kv_caches",
                        lambda cache: {name: torch.zeros(0) for g in cache.groups for name in g.layer_names})
    monkeypatch.setattr(vllm_worker, "FlashAttentionKernel", type("NoViewsHere", (), {}))
    cleanup = vllm_worker.cleanup_profiling_kv_cache(vllm_cleanup_profiling_kv_cache)
    reservations = fake_cuda.fake_cuda_live_reservations()
    try:
        assert vllm_worker.capture_tokens(runner) == 4096
        # _init_minimal_kv_cache_for_profiling: min(max_num_reqs, largest capture size) blocks
        builder = initialize_kv_cache(runner, spec, 2)
        profiling = runner.vattn_cache
        manager = profiling.manager
        # its pool's tokens; one page id more, FlashAttention-3's scratch page (its read footprint)
        assert manager.num_page_ids == 2 + 1 and manager.config.max_context_len == 4096
        assert manager.config.max_batch_size == 2 + 2 + 1  # rows, kept for reuse, padding
        # stock's minimal tensor, and the scratch page
        assert manager.stats()["pages_created"] == (2 + 1) * manager.config.num_buffers
        pad = profiling.groups[0].padding
        assert manager.page_ids(pad) == [plugin.NULL_BLOCK_ID] * 2 and profiling.padding_tokens == 4096
        inputs = VllmInputs(2, 4 * block)
        # _warmup_and_capture: warm-ups build ordinary metadata for rows without requests, then the capture
        set_rows(runner, {})
        builder.planner.build(builder.reader.read(inputs.common([1, 1], [4096, 4096])))
        capture_batch = inputs.common([1, 1], [4096, 4096], capture=True)
        maps = manager.stats()["sync_page_maps"]
        with Capture(fw, stream) as cap:
            md = vllm_attention.capture_metadata(builder.planner, builder.reader, capture_batch)
        assert cap.result == 0 and manager.stats()["sync_page_maps"] == maps
        assert md.plan.block_table[:, 0].tolist() == [pad] * 2
        assert fake_cuda.fake_cuda_live_reservations() == reservations + 1
        cleanup(runner)  # _cleanup_profiling_kv_cache
        assert manager.closed and not hasattr(runner, vllm_worker.RUNNER_ATTRIBUTE)
        del profiling, manager, builder, md
        gc.collect()
        assert fake_cuda.fake_cuda_live_reservations() == reservations  # the profiling range is released
        initialize_kv_cache(runner, spec, 24)  # initialize_from_config: the real cache
        assert fake_cuda.fake_cuda_live_reservations() == reservations + 1
        assert runner.vattn_cache.manager.config.max_context_len == 4 * block  # max_model_len: the pool is larger
    finally:
        cache = getattr(runner, vllm_worker.RUNNER_ATTRIBUTE, None)
        if cache is not None:
            cache.manager.cleanup()
        runner.kv_caches.clear()
        runner.attn_groups = []
        runner.compilation_config.static_forward_context.clear()
        gc.collect()
        fw.close()


def test_a_cache_vllm_builds_again_without_its_cleanup_replaces_the_old_one(vllm_stand_ins, monkeypatch):
    """Whatever path vLLM takes, the runner holds one vattn cache: a second build closes the first."""
    monkeypatch.setattr(vllm_worker, "granularity", lambda device: 4096)
    spec = FullAttentionSpec(num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=32)
    runner = fake_runner(torch.device("cpu"), 2, 256, 8)
    runner.shared_kv_cache_layers, runner.kv_caches = {}, []
    runner.compilation_config = types.SimpleNamespace(static_forward_context={})
    initialize_kv_cache(runner, spec, 4)
    first = runner.vattn_cache.manager
    initialize_kv_cache(runner, spec, 8)
    try:
        assert first.closed and not runner.vattn_cache.manager.closed
    finally:
        runner.vattn_cache.manager.cleanup()


# ---- the address space a cache reserves -------------------------------------------------------------------------

def serving_runner(max_num_seqs: int, max_model_len: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device("cuda", 0), max_model_len=max_model_len,
                                 input_batch=types.SimpleNamespace(max_num_reqs=max_num_seqs))


def blocks_of(gpu_bytes: int, weights_bytes: int, block_bytes: int) -> int:
    """vLLM's block count: 90% of the GPU (its default utilisation) less weights and 4 GiB of activations."""
    return (int(gpu_bytes * 0.9) - weights_bytes - 4 * GIB) // block_bytes


@pytest.fixture
def cuda_granularity(monkeypatch):
    monkeypatch.setattr(vllm_worker, "granularity", lambda device: 2 << 20)
    monkeypatch.setattr(vllm_worker, "forward_streams", lambda device: None)


def test_llama_3_1_8b_at_131072_tokens_and_1024_sequences_starts_on_an_80_gib_gpu(cuda_granularity):
    """32 layers x 8 KV heads x 128, bf16, 32-token blocks (all_layers: one 2 MiB page per buffer), padding for
    CUDA graphs: 2049 slices of 131072 tokens x 64 KiB per token and buffer, 2 buffers: 32 TiB, under the 64
    TiB budget."""
    spec = types.SimpleNamespace(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=32)
    num_blocks = blocks_of(80 * GIB, 16 * GIB, 2 * (2 << 20))
    args = vllm_worker.cache_arguments(serving_runner(1024, 131072), spec, 32, num_blocks, padding_slices=1)
    assert (args["layout"], args["max_context_len"], args["max_batch_size"]) == ("all_layers", 131072, 2049)
    config = vllm_worker.KVCacheConfig(32, 8, 128, torch.bfloat16, 2049, 131072, "all_layers")
    assert config.reservation_bytes(2 << 20) == 2 * 2049 * 131072 * 65536 <= vllm_worker.ADDRESS_SPACE_BUDGET


def test_slices_are_no_longer_than_the_pool_and_no_more_than_vllm_keeps_alive(cuda_granularity):
    """Llama-3.1-70B's shapes (80 layers x 8 KV heads x 128, bf16; 64-token blocks) on a 31 GiB pool: a slice
    holds what the pool holds (not 131072 tokens), 1024 rows get 1024 spares, and the cache starts. A pool of 3
    blocks keeps 3 spares. Every group has a window: max_model_len, whatever the pool."""
    spec = types.SimpleNamespace(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=64)
    num_blocks = 1600  # 64-token blocks of 5 x 2 MiB per buffer: 31.25 GiB
    args = vllm_worker.cache_arguments(serving_runner(1024, 131072), spec, 80, num_blocks, padding_slices=1)
    assert (args["max_context_len"], args["max_batch_size"]) == (1600 * 64, 2049)
    shape = vllm_worker.slice_shape(1024, 131072, 3, 32, all_windows=False)
    assert (shape.live, shape.spare, shape.context_tokens) == (1024, 3, 96)
    assert vllm_worker.slice_shape(1024, 131072, 3, 32, all_windows=True).context_tokens == 131072
    assert vllm_worker.slice_shape(2, 8192, 2, 2048, False, 1, capture_tokens=4096).context_tokens == 4096


def test_a_reservation_past_the_budget_is_refused_with_the_arithmetic_and_the_flags(cuda_granularity):
    """Llama-3.1-70B on a pool of 131072-token slices and 1024 sequences: 2 buffers x 2049 slices x 20 GiB is
    80 TiB; refused before any driver call, naming the factors and the flags."""
    spec = types.SimpleNamespace(num_kv_heads=8, head_size=128, dtype=torch.bfloat16, block_size=64)
    with pytest.raises(ValueError, match=r"would reserve 80\.0 TiB of virtual addresses, over the 64 TiB .* 2 "
                                         r"buffers x 1 KV cache group\(s\) x 2049 slices \(1024 for --max-num-seqs, "
                                         r"1024 kept for reuse, 1 padding\) x 21474836480 bytes \(131072 tokens x "
                                         r"163840 bytes .*lower --max-num-seqs or --max-model-len"):
        vllm_worker.cache_arguments(serving_runner(1024, 131072), spec, 80, 5000, padding_slices=1)
    args = vllm_worker.cache_arguments(serving_runner(512, 131072), spec, 80, 5000, padding_slices=1)
    assert args["max_batch_size"] == 1025  # half the sequences fit: 40 TiB


# ---- metadata without vLLM's CPU bound ----------------------------------------------------------------------------

def test_metadata_without_a_cpu_bound_reads_the_runners_cpu_lengths_not_the_device_tensor():
    """``seq_lens_cpu_upper_bound`` None (vLLM declares it optional), ``seq_lens`` on a device the host cannot
    read (the meta device here): the reader takes the runner's ``optimistic_seq_lens_cpu``."""
    runner = fake_runner(torch.device("cpu"), 4, 64, 4)
    set_rows(runner, {"a": [3, 4], "b": [5]})
    runner.optimistic_seq_lens_cpu[:2] = torch.tensor([20, 9])
    inputs = VllmInputs(4, 64)
    m = inputs.common([2, 1], [20, 9])
    m.seq_lens_cpu_upper_bound = None
    m.seq_lens = torch.empty(2, dtype=torch.int32, device="meta")
    reader = ForwardReader(runner, 0)
    read = reader.read(m)
    assert read.seq_lens.tolist() == [20, 9] and read.query_lens.tolist() == [2, 1]
    assert reader.longest_seq_len(m) == 20


# ---- the block size of small-KV models ----------------------------------------------------------------------------

def test_qwen2_0_5b_gets_the_smallest_block_any_layout_allows_and_the_warning_says_why(caplog):
    """24 layers x 2 KV heads x 64, bf16: 256 bytes per token and layer, 6144 for all layers (3 x 2 KiB). On
    CUDA's 2 MiB no layout gives 256-token blocks: all_layers takes multiples of 1024, per_layer of 8192; the
    plugin picks 1024 and warns that shorter shared prompts miss the prefix cache. On the host's 4 KiB pages
    blocks stay at vLLM's 16."""
    assert block_placer.smallest_block_size(24 * 256, 2 << 20) == 1024
    assert block_placer.smallest_block_size(256, 2 << 20) == 8192
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    with caplog.at_level(logging.INFO, logger="vllm.vattn"):
        assert configuration.fit_block_size(cache, 24, 2, 64, 2, 2 << 20, None) == 1024 == cache.block_size
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "blocks of 1024 tokens: vLLM's prefix cache hits whole blocks only" in warnings[0]
    assert "no layout makes them smaller: an all_layers page holds 6144 bytes per token" in warnings[0]
    caplog.clear()
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    with caplog.at_level(logging.INFO, logger="vllm.vattn"):
        assert configuration.fit_block_size(cache, 24, 2, 64, 2, 2 << 20, "per_layer") == 8192
    assert "VATTN_VLLM_LAYOUT=all_layers makes them 1024" in caplog.text
    caplog.clear()
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    with caplog.at_level(logging.INFO, logger="vllm.vattn"):
        assert configuration.fit_block_size(cache, 24, 2, 64, 2, 4096, None) == 16
    cache = types.SimpleNamespace(block_size=16, user_specified_block_size=False)
    assert configuration.fit_block_size(cache, 32, 8, 128, 2, 2 << 20, None) == 32  # Llama-3-8B: no warning
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_cleanup_hook_leaves_a_runner_without_a_cache_alone():
    runner = types.SimpleNamespace(kv_caches=[], attn_groups=[],
                                   compilation_config=types.SimpleNamespace(static_forward_context={}))
    vllm_worker.cleanup_profiling_kv_cache(vllm_cleanup_profiling_kv_cache)(runner)
    assert not hasattr(runner, vllm_worker.RUNNER_ATTRIBUTE)
