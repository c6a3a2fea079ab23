"""The worker's side of the plugin: the KV cache tensors vLLM's model runner
gets (vattn's, in place of ``allocate_kv_cache``), handed to the attention
metadata builders that map into them, and ``vattn_stats``."""

from __future__ import annotations

import functools
from typing import Any

import torch

from vattn.kernels import AttentionCase
from vattn.kernels import host as host_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

from . import budget as vllm_budget
from .configuration import loaded_kernel, serving_kernel
from .worker_cache import WorkerCache, check_groups

RUNNER_ATTRIBUTE = "vattn_cache"  # the model runner holds its WorkerCache here


def initialize_kv_cache_tensors(runner: Any, kv_cache_config: Any, kernel_block_sizes: Any,
                                kv_cache_allocation_context: Any = None) -> dict[str, torch.Tensor]:
    """Replaces ``GPUModelRunner.initialize_kv_cache_tensors``: builds the
    worker's vattn cache and hands it to whoever uses it: the runner holds it,
    the attention metadata builders vLLM made just before map into it, and the
    budget's scheduler side learns of it (:func:`vllm_budget.offer`)."""
    from vllm.logger import init_logger
    from vllm.v1.worker.utils import bind_kv_cache

    spec = check_groups(kv_cache_config, kernel_block_sizes)
    if runner.shared_kv_cache_layers:
        raise ValueError("vattn's vLLM integration does not support KV sharing across layers")
    case = AttentionCase(runner.device.type, spec.head_size, spec.dtype, spec.dtype,
                         num_kv_heads=spec.num_kv_heads, max_context_len=runner.max_model_len)
    # fails here, at engine construction, if it cannot load
    kernel = loaded_kernel(serving_kernel(case), spec.head_size)
    cache = WorkerCache.build(runner, kv_cache_config, spec, kernel, case)
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
                builder.bind(cache)
    vllm_budget.offer(cache)
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
    return None if cache is None else vllm_budget.block_bytes(cache)


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
            vllm_budget.worker_release(cache, scheduler_output)  # before this step's forward maps anything
        return out

    return _update_states
