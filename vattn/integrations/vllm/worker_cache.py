"""The vLLM worker's KV cache on vattn: KV cache groups as ranges of slices.

vLLM puts the attention layers of a model in KV cache groups, each with a
block table of its own: one group for a model whose layers all attend alike,
several for a model that mixes sliding-window and global layers (Gemma-2,
Gemma-3). The groups draw their blocks from one block pool, and stock vLLM
lets the ``i``-th layer of every group use the same memory (a block id is
held by one group at a time), so the pool holds ``num_blocks`` blocks of one
group's layers.

vattn does the same with one :class:`vattn.KVCacheManager`: its layers are
the layers of one group (``layers_per_group``), its reqids ``G x S`` (group
``g``, slice ``i``: reqid ``g * S + i``) and its pool the ``num_blocks`` page
ids. Layer ``j`` of group ``g`` reads and writes buffer pair ``j`` through
its group's slices, so every (group, request) is one contiguous slice, each
group maps into slices of its own, and one physical page pool serves them
all, as vLLM's one block pool does. A request keeps its slices from the
first forward that sees it until it finishes (or is preempted, which
replaces its blocks), whatever row of the persistent batch it sits in;
``S`` is twice the batch's rows, so that a finished request's slice can
wait, still mapped, until the device is done with it and a new request
that shares its first blocks takes it. The pages a sliding
window leaves behind, which vLLM frees, become holes at the front of the
slice (:class:`vattn.integrations.block_mapper.BlockMapper`).

With a kernel that runs in CUDA graphs (:attr:`vattn.kernels.Kernel.graphs`)
each group has one more slice, the padding slice, handed to no request: its
first page maps vLLM's null block (block 0, never a request's) from start-up
on, so a captured batch's padded tokens write their K/V there and a
graph-capture batch reads only there, and neither maps anything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Any

import numpy as np
import torch

from vattn.budget.membership import budget_name_from_environment
from vattn.core import KVCacheManager
from vattn.integrations import block_mapper
from . import budget as vllm_budget
from vattn.integrations.block_mapper import BlockMapper
from vattn.kernels import AttentionCase, Kernel

LAYOUT_SETTING = "VATTN_VLLM_LAYOUT"


def granularity(device: torch.device) -> int:
    """Bytes a vattn page must be a multiple of on ``device``'s backend."""
    from vattn.backends import cuda_info, host_granularity

    return host_granularity() if device.type == "cpu" else cuda_info(device.index or 0)["granularity"]


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
    layout, page_size = block_mapper.choose_layout(num_layers, spec.num_kv_heads, spec.head_size,
                                                   spec.dtype.itemsize, spec.block_size, granularity(runner.device),
                                                   os.environ.get(LAYOUT_SETTING), setting=LAYOUT_SETTING)
    num_buffers = 2 * num_layers if layout == "per_layer" else 2
    return dict(num_layers=num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, dtype=spec.dtype,
                max_batch_size=num_groups * (SLICES_PER_ROW * runner.input_batch.max_num_reqs + padding_slices),
                max_context_len=runner.max_model_len,
                page_size=page_size, physical_memory=num_blocks * page_size * num_buffers, layout=layout,
                device=str(runner.device), page_allocator="external", background=False, deferred_reclaim=False,
                eager=False, sync_streams=forward_streams(runner.device),
                # under VATTN_BUDGET the engine core is the member and charges every rank's pages before a
                # forward creates them (integrations/vllm/budget.py): a worker's cache never asks the budget.
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


@dataclasses.dataclass
class GroupSlices:
    """One KV cache group: its layers, its window and the mapper of its rows."""

    layer_names: list[str]  # vLLM's names, in the group's order: layer j uses buffer pair j
    window: int | None  # tokens a query sees (sliding-window groups), else None
    mapper: BlockMapper  # requests -> the group's reqids, and their blocks mapped into them
    padding: int | None = None  # the padding slice, in the group's cache views (after the mapper's); None: none

    @property
    def num_slices(self) -> int:
        """Slices of the group's cache views: the mapper's and the padding slice."""
        return self.mapper.slices + (self.padding is not None)


SERIES_FORWARDS = 1 << 16
"""Forwards the per-forward series of ``vattn_stats`` keep (the latest ones)."""

WARM_UP = "vattn:warm-up-row"  # the key of a row vLLM's warm-up forwards fill without a request


def series() -> collections.deque:
    return collections.deque(maxlen=SERIES_FORWARDS)


@dataclasses.dataclass
class WorkerCache:
    """One worker's vattn cache, its groups, and what it recorded per forward."""

    manager: KVCacheManager
    groups: list[GroupSlices]
    runner: Any  # vLLM's model runner: its input batch holds the requests' rows and CPU block tables
    kernel: Kernel  # the attention kernel
    case: AttentionCase  # what the kernel plans each forward with: the cache's device, shapes and dtype
    group_of: dict[str, int] = dataclasses.field(default_factory=dict)  # layer name -> group index
    # per forward, the last SERIES_FORWARDS of them (a server runs for days: the series must not grow forever)
    time_s: collections.deque = dataclasses.field(default_factory=lambda: series())  # time.monotonic()
    # distinct pages the requests' slices map, all buffers (not what free slices kept for reuse still map)
    bytes_in_requests: collections.deque = dataclasses.field(default_factory=lambda: series())
    tokens: collections.deque = dataclasses.field(default_factory=lambda: series())  # attended tokens
    behind_windows: collections.deque = dataclasses.field(default_factory=lambda: series())  # bytes of window holes
    map_ns: int = 0  # time spent mapping and unmapping, all forwards
    forwards: int = 0
    padding_tokens: int = 0  # rows of each padding slice that are mapped (one block); 0: no padding slices
    _warm_up_rows: bool = False  # the last forward had rows without a request

    @classmethod
    def build(cls, runner: Any, kv_cache_config: Any, spec: Any, kernel: Kernel,
              case: AttentionCase) -> WorkerCache:
        groups = kv_cache_config.kv_cache_groups
        per_group = max(len(g.layer_names) for g in groups)
        pad = 1 if kernel.graphs else 0  # a padding slice per group for CUDA graphs' padded batches
        arguments = cache_arguments(runner, spec, per_group, kv_cache_config.num_blocks, len(groups), pad)
        manager = KVCacheManager(**arguments)
        if manager.num_page_ids != kv_cache_config.num_blocks:
            manager.cleanup()
            raise RuntimeError(f"vattn: the page pool holds {manager.num_page_ids} ids for vLLM's "
                               f"{kv_cache_config.num_blocks} blocks")
        per = manager.config.max_batch_size // len(groups)
        slices = [GroupSlices(list(g.layer_names), getattr(g.kv_cache_spec, "sliding_window", None),
                              BlockMapper(manager, spec.block_size, first_reqid=i * per, slices=per - pad,
                                          window=getattr(g.kv_cache_spec, "sliding_window", None)),
                              padding=per - 1 if pad else None)
                  for i, g in enumerate(groups)]
        if pad:
            try:  # at start-up, so that no forward (a graph capture least of all) maps for padding
                reqids = np.array([i * per + per - 1 for i in range(len(groups))], dtype=np.int64)
                for reqid in reqids:
                    manager.alloc_reqid(reqid=int(reqid))
                zeros = np.zeros(len(reqids), dtype=np.int64)
                manager.map_pages(reqids, zeros, np.full(len(reqids), block_mapper.NULL_BLOCK_ID, dtype=np.int64),
                                  np.ones(len(reqids), dtype=np.int64))
            except BaseException:
                manager.cleanup()
                raise
        group_of = {name: i for i, g in enumerate(slices) for name in g.layer_names}
        return cls(manager, slices, runner, kernel, case, group_of, padding_tokens=spec.block_size if pad else 0)

    @functools.cached_property
    def has_windows(self) -> bool:
        """Whether any group has a sliding window (its holes are recorded per forward)."""
        return any(g.window for g in self.groups)

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Each layer's ``[2, S, L, H, D]`` K/V view: its buffer pair, its group's slices."""
        out = {}
        for group in self.groups:
            own = slice(group.mapper.first_reqid, group.mapper.first_reqid + group.num_slices)
            for j, name in enumerate(group.layer_names):
                out[name] = self.manager.kv_tensor(j)[:, own]
        return out

    def request_keys(self, num_rows: int) -> list[Any]:
        """The request in each of the forward's first ``num_rows`` rows;
        rows vLLM fills without a request (warm-up forwards) get a key of
        their own per row, released at the next forward with requests only."""
        req_ids = self.runner.input_batch.req_ids
        keys = req_ids[:num_rows]
        if len(keys) < num_rows or None in keys:
            keys = [(WARM_UP, row) if key is None else key for row, key in
                    enumerate(keys + [None] * (num_rows - len(keys)))]
            self._warm_up_rows = True
        elif self._warm_up_rows:
            for group in self.groups:
                group.mapper.release_all_but(keys + list(req_ids[num_rows:]))
            self._warm_up_rows = False
        return keys

    def map_batch(self, group: int, seq_lens: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
        """Maps group ``group``'s requests for this forward (its block table,
        its window); returns their slices in the group's cache views (the
        reqids its kernel reads). The forward is recorded once the last group
        is mapped."""
        mapper = self.groups[group].mapper
        start = time.perf_counter_ns()
        table = self.runner.input_batch.block_table[group]
        blocks, num_blocks = table.block_table.np, table.num_blocks_per_row
        reqids = mapper.reqids_of(self.request_keys(len(seq_lens)), blocks, num_blocks)
        mapper.map(reqids, blocks, num_blocks, seq_lens, query_lens)
        self.map_ns += time.perf_counter_ns() - start
        if group == len(self.groups) - 1:
            self.forwards += 1
            self.time_s.append(time.monotonic())
            self.bytes_in_requests.append(self.manager.bytes_in_requests)
            self.tokens.append(int(seq_lens.sum()))
            if self.has_windows:
                page_id_bytes = self.manager.config.num_buffers * self.manager.page_size  # a position, every buffer
                self.behind_windows.append(sum(g.mapper.holes for g in self.groups) * page_id_bytes)
        return reqids - mapper.first_reqid

    def release(self, req_ids: Any) -> None:
        """vLLM's requests that finished, or whose blocks vLLM replaced
        (resumed after a preemption): their slices go back to the pool."""
        for group in self.groups:
            group.mapper.release(req_ids)

    def stats(self) -> dict[str, Any]:
        """The cache's stats, its groups, the mapping's work against its
        lower bound, and the per-forward series (the last SERIES_FORWARDS
        forwards)."""
        stats = self.manager.stats()
        buffers = self.manager.config.num_buffers
        mapping = dict(positions_mapped=(stats["sync_page_maps"] + stats["background_page_maps"]) // buffers,
                       positions_unmapped=stats["page_unmaps"] // buffers,
                       positions_needed=sum(g.mapper.positions_needed for g in self.groups),
                       positions_reused=sum(g.mapper.positions_reused for g in self.groups),
                       forwards=self.forwards,
                       forwards_mapping=sum(g.mapper.forwards_mapping for g in self.groups),
                       live_requests=max(g.mapper.live_requests for g in self.groups))
        return dict(stats, layout=self.manager.config.layout, kernel=self.kernel.name, map_ns=self.map_ns,
                    mapping=mapping, time_s_series=list(self.time_s), bytes_mapped_series=list(self.bytes_in_requests),
                    tokens_series=list(self.tokens), bytes_behind_windows_series=list(self.behind_windows),
                    groups=[dict(layers=len(g.layer_names), window=g.window) for g in self.groups],
                    block_pool_budget=vllm_budget.stats())
