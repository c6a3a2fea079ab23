"""The worker's side of the plugin: the KV cache tensors vLLM's model runner
gets (vattn's, in place of ``allocate_kv_cache``, built from vLLM's KV cache
config and runner at start-up), handed to the attention metadata builders
that map into them; ``vattn_stats``, ``vattn_block_bytes`` and the handle an
engine core in this process releases pages through (``vattn_worker_pages``);
the requests and blocks each step's scheduler output gives back."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from vattn.budget.membership import budget_name_from_environment
from vattn.kernels import AttentionCase, Kernel
from vattn.kernels import host as host_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

from .configuration import LAYOUT_SETTING, choose_layout, granularity, loaded_kernel, serving_kernel
from .worker_budget import RELEASE_ATTRIBUTE, WorkerPages, block_bytes, release_blocks
from .worker_cache import WorkerCache

RUNNER_ATTRIBUTE = "vattn_cache"  # the model runner holds its WorkerCache here


def forward_streams(device: torch.device) -> list[Any] | None:
    """CUDA: the stream vLLM's forward launches its kernels and graph replays
    on (vLLM's ``current_stream()``, a stream of its own per worker), for
    vattn to fence unmaps on instead of synchronising the whole device. None
    on other devices."""
    if device.type != "cuda":
        return None
    from vllm.utils.torch_utils import current_stream

    return [current_stream()]


SLICES_PER_ROW = 2
"""Slices per row of the persistent batch, in each KV cache group: a
finished request's slice keeps its pages until the device is done with
them, and for a later request that shares its first blocks, while a new
request takes another (virtual address space is cheap)."""


def cache_arguments(runner: Any, spec: Any, num_layers: int, num_blocks: int, num_groups: int = 1,
                    padding_slices: int = 0) -> dict[str, Any]:
    """The :class:`KVCacheManager` arguments for a worker: ``num_layers``
    layers (per group) of vLLM's KV cache spec ``spec``, ``SLICES_PER_ROW``
    slices per (group, row of the runner's persistent batch) plus
    ``padding_slices`` per group, a pool of exactly ``num_blocks`` page ids
    (one per vLLM block), pages owned by vLLM, fences on vLLM's stream."""
    layout, page_size = choose_layout(num_layers, spec.num_kv_heads, spec.head_size,
                                     spec.dtype.itemsize, spec.block_size, granularity(runner.device),
                                     os.environ.get(LAYOUT_SETTING))
    num_buffers = 2 * num_layers if layout == "per_layer" else 2
    return dict(num_layers=num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, dtype=spec.dtype,
                max_batch_size=num_groups * (SLICES_PER_ROW * runner.input_batch.max_num_reqs + padding_slices),
                max_context_len=runner.max_model_len,
                page_size=page_size, physical_memory=num_blocks * page_size * num_buffers, layout=layout,
                device=str(runner.device), page_allocator="external", background=False, deferred_reclaim=False,
                eager=False, sync_streams=forward_streams(runner.device),
                # under VATTN_BUDGET the engine core is the member and charges every rank's pages before a
                # forward creates them (integrations/vllm/engine_budget.py): a worker's cache never asks the budget.
                # Without one vLLM holds its whole block pool, as stock allocates its cache tensor at start-up:
                # created now, so no forward creates (on the host: zeroes) the pages of a block's first use
                budget=False, preallocate=not budget_name_from_environment())


def check_groups(kv_cache_config: Any, kernel_block_sizes: Any) -> Any:
    """The one attention spec every KV cache group shares (heads, head
    size, dtype, block size); ValueError naming what vattn does not serve
    otherwise. Groups may differ in their window only."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if not groups or any(type(g.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec) for g in groups):
        raise ValueError("vattn's vLLM integration serves attention layers with full or sliding-window KV caches; "
                         f"this model's KV cache groups are {kinds}; unset VATTN_VLLM for this model")
    shapes = {(s.num_kv_heads, s.head_size, s.dtype, s.block_size) for s in (g.kv_cache_spec for g in groups)}
    if len(shapes) != 1:
        raise ValueError(f"vattn: the KV cache groups {kinds} differ in heads, head size, dtype or block size "
                         f"({sorted(map(str, shapes))}); vattn needs one page shape; unset VATTN_VLLM for this model")
    spec = groups[0].kv_cache_spec
    if list(kernel_block_sizes) != [spec.block_size] * len(groups):
        raise ValueError(f"vattn: kernel block sizes {kernel_block_sizes} differ from block_size {spec.block_size}")
    return spec



def build_cache(runner: Any, kv_cache_config: Any, spec: Any, kernel: Kernel, case: AttentionCase) -> WorkerCache:
    """The worker's cache for vLLM's ``kv_cache_config`` (its groups share ``spec``, :func:`check_groups`)
    and ``runner`` (its device, rows and longest context), served by ``kernel``."""
    groups = kv_cache_config.kv_cache_groups
    per_group = max(len(g.layer_names) for g in groups)
    pad = 1 if kernel.graphs else 0  # a padding slice per group for CUDA graphs' padded batches
    arguments = cache_arguments(runner, spec, per_group, kv_cache_config.num_blocks, len(groups), pad)
    layout = [(list(g.layer_names), getattr(g.kv_cache_spec, "sliding_window", None)) for g in groups]
    return WorkerCache.build(arguments, layout, spec.block_size, kv_cache_config.num_blocks, kernel, case)


def initialize_kv_cache_tensors(runner: Any, kv_cache_config: Any, kernel_block_sizes: Any,
                                kv_cache_allocation_context: Any = None) -> dict[str, torch.Tensor]:
    """Replaces ``GPUModelRunner.initialize_kv_cache_tensors``: builds the
    worker's vattn cache and hands it to whoever uses it: the runner holds it
    (an engine core in this process asks for it: :func:`worker_pages`), and
    the attention metadata builders vLLM made just before map into it, each
    reading the runner's forwards through its own
    :class:`~vattn.integrations.vllm.forward_inputs.ForwardReader`."""
    from vllm.logger import init_logger
    from vllm.v1.worker.utils import bind_kv_cache

    spec = check_groups(kv_cache_config, kernel_block_sizes)
    if runner.shared_kv_cache_layers:
        raise ValueError("vattn's vLLM integration does not support KV sharing across layers")
    case = AttentionCase(runner.device.type, spec.head_size, spec.dtype, spec.dtype,
                         num_kv_heads=spec.num_kv_heads, max_context_len=runner.max_model_len)
    # fails here, at engine construction, if it cannot load
    kernel = loaded_kernel(serving_kernel(case), spec.head_size)
    cache = build_cache(runner, kv_cache_config, spec, kernel, case)
    manager = cache.manager
    if isinstance(kernel, FlashAttentionKernel):
        k = manager.layer(0)[0]
        try:
            kernel.slice_tokens(k.stride(0), k.stride(1))  # its page-size rule, at start-up
        except ValueError:
            manager.cleanup()
            raise
    setattr(runner, RUNNER_ATTRIBUTE, cache)
    for groups in runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                builder.bind(cache, runner)
    kv_caches = cache.kv_caches()
    bind_kv_cache(kv_caches, runner.compilation_config.static_forward_context, runner.kv_caches,
                  kv_cache_groups=kv_cache_config.kv_cache_groups)
    init_logger("vllm.vattn").info(
        "vattn: KV cache on vattn (%s layout): %d blocks of %d tokens = %d page ids of %d bytes x %d buffers; "
        "%d KV cache group(s) (windows %s) x %d slices (max_num_seqs) of %d tokens; attention: %s",
        manager.config.layout, kv_cache_config.num_blocks, spec.block_size, manager.num_page_ids, manager.page_size,
        manager.config.num_buffers, len(cache.groups), [g.window for g in cache.groups],
        runner.input_batch.max_num_reqs, runner.max_model_len, kernel.name)
    return kv_caches


def worker_stats(worker: Any) -> dict[str, Any] | None:
    """``LLM.collective_rpc("vattn_stats")``: the cache's stats, its KV cache
    groups and, for every forward, its ``time.monotonic()``, the bytes
    mapped and the tokens attended; on the host, ``host_attention``: the host
    kernel's path and its calls in this worker
    (:func:`vattn.kernels.host.info`). None without vattn."""
    cache = getattr(worker.model_runner, RUNNER_ATTRIBUTE, None)
    if cache is None:
        return None
    host = host_kernel.info() if cache.manager.device.type == "cpu" else None
    return dict(cache.stats(), host_attention=host)


def worker_block_bytes(worker: Any) -> int | None:
    """``collective_rpc("vattn_block_bytes")``: the bytes one block id holds in this worker (a page of
    every K and V buffer of its layers and heads); None without vattn. The engine core adds up every
    rank's to charge a block to a budget."""
    cache = getattr(worker.model_runner, RUNNER_ATTRIBUTE, None)
    return None if cache is None else block_bytes(cache)


def worker_pages(worker: Any) -> WorkerPages | None:
    """``collective_rpc("vattn_worker_pages")`` from an engine core in this process (vLLM's in-process
    executor hands back the object itself): the handle it releases pages through when no step can
    carry a release. None without vattn."""
    cache = getattr(worker.model_runner, RUNNER_ATTRIBUTE, None)
    return None if cache is None else WorkerPages(cache)


def update_states(stock: Any) -> Any:
    """Wraps ``GPUModelRunner._update_states``: after vLLM updates its
    persistent batch from the scheduler's output, the requests that finished
    and those resumed after a preemption (their blocks are new) give their
    slices back; a resumed request gets a fresh one at its next forward. Under a budget, the blocks
    the scheduler released give their pages back here, before the forward maps anything."""

    @functools.wraps(stock)
    def _update_states(runner: Any, scheduler_output: Any) -> Any:
        out = stock(runner, scheduler_output)
        cache = getattr(runner, RUNNER_ATTRIBUTE, None)
        if cache is not None:
            ended = scheduler_output.finished_req_ids
            resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
            if ended or resumed:
                cache.release([*ended, *resumed])
            released = getattr(scheduler_output, RELEASE_ATTRIBUTE, None)  # the budget's; before the forward maps
            if released:
                release_blocks(cache, released)
        return out

    return _update_states
