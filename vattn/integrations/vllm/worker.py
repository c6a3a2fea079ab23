"""The worker's side of the plugin: the KV cache tensors vLLM's model runner
gets (vattn's, in place of ``allocate_kv_cache``, built from vLLM's KV cache
config and runner at start-up), handed to the attention metadata builders
that map into them; ``vattn_stats``, ``vattn_block_bytes`` and the handle an
engine core in this process releases pages through (``vattn_worker_pages``);
the requests and blocks each step's scheduler output gives back."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from vattn.budget.membership import budget_name_from_environment
from vattn.common.config import KVCacheConfig
from vattn.kernels import AttentionCase, Kernel
from vattn.kernels import host as host_kernel
from vattn.kernels.flash_attn import FlashAttentionKernel

from .configuration import (SWITCH, granularity, layout_setting, loaded_kernel, page_bytes_setting, page_geometry,
                            serving_kernel)
from .worker_budget import RELEASE_ATTRIBUTE, RUNNER_ATTRIBUTE, WorkerPages, block_bytes, padding_bytes, release_blocks
from .worker_cache import WorkerCache


def forward_streams(device: torch.device) -> list[Any] | None:
    """CUDA: the stream vLLM's forward launches its kernels and graph replays
    on (vLLM's ``current_stream()``, a stream of its own per worker), for
    vattn to fence unmaps on instead of synchronising the whole device. None
    on other devices."""
    if device.type != "cuda":
        return None
    from vllm.utils.torch_utils import current_stream

    return [current_stream()]


ADDRESS_SPACE_BUDGET = 64 << 40
"""Bytes of virtual address space one worker's cache may reserve (64 TiB).
x86-64 Linux gives a process 128 TiB of user addresses, and CUDA's unified
addressing puts device reservations in the same range as the host's
mappings (the process's heap and libraries, torch's pinned and pageable
memory, the driver's own ranges); half of it is left to those. The host
backend reserves in the same 128 TiB."""


@dataclasses.dataclass(frozen=True)
class SliceShape:
    """How many slices the worker's cache has and how long each is, from
    what vLLM can have alive. Per KV cache group: one slice per request
    vLLM can run at once (``max_num_seqs``), ``spare`` more that keep a
    finished request's pages for a later request that shares its first
    blocks (at most one per block of the pool: a free slice is kept for the
    blocks it still maps), and the padding slice of a kernel that runs in
    CUDA graphs."""

    live: int  # slices per group a forward can need at once: vLLM's max_num_seqs
    spare: int  # free slices per group kept mapped for reuse: min(max_num_seqs, num_blocks)
    padding: int  # 1 where the kernel runs in CUDA graphs (the padding slice), else 0
    context_tokens: int  # tokens of each slice: the longest row a forward or a capture batch can read

    @property
    def per_group(self) -> int:
        return self.live + self.spare + self.padding


def slice_shape(max_num_seqs: int, max_model_len: int, num_blocks: int, block_size: int, all_windows: bool,
                padding: int = 0, capture_tokens: int = 0) -> SliceShape:
    """The slices of a cache of ``num_blocks`` blocks of ``block_size``
    tokens for ``max_num_seqs`` requests of up to ``max_model_len`` tokens.

    A slice never needs more rows than the pool can map into it: every
    position a request maps holds a distinct block of a full-attention
    group, so a request is at most ``num_blocks * block_size`` tokens long
    (vLLM admits no more), unless every group has a sliding window (blocks
    behind it go back to the pool, so a request may outgrow it: such a
    cache keeps ``max_model_len``). A capture batch of CUDA graphs reads
    ``capture_tokens`` of the padding slice (:func:`capture_tokens`)."""
    pool_tokens = num_blocks * block_size
    context = max_model_len if all_windows else min(max_model_len, max(pool_tokens, capture_tokens))
    return SliceShape(max_num_seqs, min(max_num_seqs, num_blocks), padding, context)


def capture_tokens(runner: Any) -> int:
    """Tokens per row the longest batch vLLM builds attention metadata for
    a full CUDA graph with reads (vLLM 0.32's ``GPUModelRunner``):
    ``profile_cudagraph_memory`` captures the largest full-graph batch with
    ``min(max_model_len, max_num_tokens // its tokens)`` per row; every
    other capture reads one token per row (uniform single-token decodes).
    0 without full graphs. Read from vLLM's dispatcher, whose capture
    sizes are resolved before the KV cache tensors are made."""
    full = [descs for mode, descs in runner.cudagraph_dispatcher.get_capture_descs() if mode.name == "FULL"]
    if not full or not full[0]:
        return 0
    return max(1, min(runner.max_model_len, runner.max_num_tokens // full[0][0].num_tokens))


def cache_arguments(runner: Any, spec: Any, num_layers: int, num_blocks: int, num_groups: int = 1,
                    padding_slices: int = 0, all_windows: bool = False, padding_tokens: int = 0,
                    scratch_pages: int = 0) -> dict[str, Any]:
    """The :class:`KVCacheManager` arguments for a worker: ``num_layers``
    layers (per group) of vLLM's KV cache spec ``spec``, the slices of
    :func:`slice_shape` per group (``padding_slices`` of them padding,
    whose capture batches read ``padding_tokens``), a pool of exactly
    ``num_blocks`` page ids (one per vLLM block) and ``scratch_pages``
    more (the scratch page of a kernel's read footprint), pages owned by vLLM,
    fences on vLLM's stream. Raises ValueError, with the arithmetic and the
    flags that change it, where the reservation would pass
    ``ADDRESS_SPACE_BUDGET``."""
    geometry = page_geometry(num_layers, spec.num_kv_heads, spec.head_size, spec.dtype.itemsize, spec.block_size,
                             granularity(runner.device), layout_setting(), page_bytes_setting())
    layout, page_size = geometry.layout, geometry.page_size
    num_buffers = 2 * num_layers if layout == "per_layer" else 2
    shape = slice_shape(runner.input_batch.max_num_reqs, runner.max_model_len, num_blocks, spec.block_size,
                        all_windows, padding_slices, padding_tokens)
    arguments = dict(num_layers=num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                     dtype=spec.dtype, max_batch_size=num_groups * shape.per_group,
                     max_context_len=shape.context_tokens,
                     page_size=page_size, physical_memory=(num_blocks + scratch_pages) * page_size * num_buffers,
                     layout=layout,
                     device=str(runner.device), page_allocator="external",
                     policy={"background": False, "deferred_reclaim": False, "eager": False},
                     sync_streams=forward_streams(runner.device),
                     # under VATTN_BUDGET the engine core is the member and charges every rank's pages before a
                     # forward creates them (integrations/vllm/engine_budget.py): a worker's cache never asks the
                     # budget. Without one vLLM holds its whole block pool, as stock allocates its cache tensor at
                     # start-up: created now, so no forward creates (on the host: zeroes) the pages of a block's
                     # first use
                     # with several blocks per page the pool's ids bound the worst case (a page per block:
                     # SubPageBlockPlacer), not what it holds: its pages are created as they are used
                     budget=False, preallocate=not budget_name_from_environment() and geometry.blocks_per_page == 1)
    check_address_space(arguments, shape, num_groups)
    return arguments


def check_address_space(arguments: dict[str, Any], shape: SliceShape, num_groups: int) -> int:
    """The virtual bytes a cache made with ``arguments`` reserves; raises
    ValueError, before any driver call, naming the arithmetic and the flags
    that lower it where that passes ``ADDRESS_SPACE_BUDGET``."""
    config = KVCacheConfig(arguments["num_layers"], arguments["num_kv_heads"], arguments["head_dim"],
                           arguments["dtype"], arguments["max_batch_size"], arguments["max_context_len"],
                           arguments["layout"])
    page_size = arguments["page_size"]
    reserved = config.reservation_bytes(page_size)
    if reserved > ADDRESS_SPACE_BUDGET:
        raise ValueError(
            f"vattn: the KV cache would reserve {reserved / (1 << 40):.1f} TiB of virtual addresses, over the "
            f"{ADDRESS_SPACE_BUDGET >> 40} TiB a process can spare (CUDA shares one 128 TiB range with the host): "
            f"{config.num_buffers} buffers x {num_groups} KV cache group(s) x {shape.per_group} slices "
            f"({shape.live} for --max-num-seqs, {shape.spare} kept for reuse, {shape.padding} padding) x "
            f"{config.slice_bytes(page_size)} bytes ({shape.context_tokens} tokens x "
            f"{config.token_bytes_per_buffer} bytes per token and buffer, whole {page_size}-byte pages); lower "
            f"--max-num-seqs or --max-model-len (LLM(max_num_seqs=..., max_model_len=...)), or unset {SWITCH}")
    return reserved


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
    and ``runner`` (its device, rows, longest context and, with CUDA graphs, capture sizes), served by
    ``kernel``. A profiling config (vLLM's minimal cache for CUDA-graph memory profiling: one block per
    row) gets a cache of its few blocks: slices no longer than its pool, the pool's pages only."""
    groups = kv_cache_config.kv_cache_groups
    per_group = max(len(g.layer_names) for g in groups)
    pad = 1 if kernel.graphs else 0  # a padding slice per group for CUDA graphs' padded batches
    padding_tokens = max(1, capture_tokens(runner)) if pad else 0
    windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
    arguments = cache_arguments(runner, spec, per_group, kv_cache_config.num_blocks, len(groups), pad,
                                all_windows=all(windows), padding_tokens=padding_tokens,
                                scratch_pages=int(bool(kernel.read_footprint(case))))
    layout = [(list(g.layer_names), window) for g, window in zip(groups, windows)]
    return WorkerCache.build(arguments, layout, spec.block_size, kv_cache_config.num_blocks, kernel, case,
                             padding_tokens)


def drop_cache(runner: Any) -> None:
    """Closes the vattn cache ``runner`` holds, if any: its pages and address range go back once vLLM has
    dropped the tensor views (vLLM's ``_cleanup_profiling_kv_cache`` does), and the runner forgets it."""
    cache = getattr(runner, RUNNER_ATTRIBUTE, None)
    if cache is not None:
        delattr(runner, RUNNER_ATTRIBUTE)
        cache.manager.cleanup()


def cleanup_profiling_kv_cache(stock: Any) -> Any:
    """Wraps ``GPUModelRunner._cleanup_profiling_kv_cache``: vLLM drops the minimal KV cache it made for
    CUDA-graph memory profiling (its tensors, the metadata builders), and vattn closes the cache built for
    it, so that one cache is alive when vLLM builds the real one (vLLM also calls it at shutdown)."""

    @functools.wraps(stock)
    def _cleanup_profiling_kv_cache(runner: Any) -> Any:
        out = stock(runner)
        drop_cache(runner)
        return out

    return _cleanup_profiling_kv_cache


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
    drop_cache(runner)  # a cache vLLM replaced without its cleanup: never two alive
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
        "%d KV cache group(s) (windows %s) x %d slices (%d for max_num_seqs) of %d tokens; %d bytes of "
        "virtual addresses; attention: %s",
        manager.config.layout, kv_cache_config.num_blocks, spec.block_size, manager.num_page_ids, manager.page_size,
        manager.config.num_buffers, len(cache.groups), [g.window for g in cache.groups],
        manager.config.max_batch_size // len(cache.groups), runner.input_batch.max_num_reqs,
        manager.config.max_context_len, manager.config.reservation_bytes(manager.page_size), kernel.name)
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


def worker_padding_bytes(worker: Any) -> int:
    """``collective_rpc("vattn_padding_bytes")``: the bytes of vLLM's null block this worker created
    (its padding slices map it from start-up), 0 where none; the engine core charges their sum."""
    cache = getattr(worker.model_runner, RUNNER_ATTRIBUTE, None)
    return 0 if cache is None else padding_bytes(cache)


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
