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
``S`` is the batch's rows plus as many spare slices (fewer where the pool
has fewer blocks), so that a finished request's slice can wait, still
mapped, until the device is done with it and a new request that shares its
first blocks takes it (``vattn.integrations.vllm.worker.slice_shape``). The pages a sliding
window leaves behind, which vLLM frees, become holes at the front of the
slice (:class:`vattn.integrations.block_placer.BlockPlacer`).

With a kernel that runs in CUDA graphs (:attr:`vattn.kernels.Kernel.graphs`)
each group has one more slice, the padding slice, handed to no request: its
first pages map vLLM's null block (block 0, never a request's) from start-up
on, as many as the longest capture batch vLLM builds reads (its CUDA-graph
memory profiling reads more than one token per row), so a captured batch's
padded tokens write their K/V there and a graph-capture batch reads only
there, and neither maps anything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch

from vattn.core import KVCacheManager
from vattn.integrations import block_placer
from vattn.integrations.block_placer import BlockPlacer
from vattn.integrations.subpage_placer import SubPageBlockPlacer
from vattn.kernels import AttentionCase, Kernel

from .forward_inputs import ForwardInputs

@dataclasses.dataclass
class GroupSlices:
    """One KV cache group: its layers, its window and the placer of its rows."""

    layer_names: list[str]  # vLLM's names, in the group's order: layer j uses buffer pair j
    window: int | None  # tokens a query sees (sliding-window groups), else None
    placer: BlockPlacer  # requests -> the group's reqids, and their blocks mapped into them
    padding: int | None = None  # the padding slice, in the group's cache views (after the placer's); None: none

    @property
    def num_slices(self) -> int:
        """Slices of the group's cache views: the placer's and the padding slice."""
        return self.placer.slices + (self.padding is not None)


SERIES_FORWARDS = 1 << 16
"""Forwards the per-forward series of ``vattn_stats`` keep (the latest ones)."""


def series() -> collections.deque:
    return collections.deque(maxlen=SERIES_FORWARDS)


@dataclasses.dataclass
class WorkerCache:
    """One worker's vattn cache, its groups, and what it recorded per forward."""

    manager: KVCacheManager
    groups: list[GroupSlices]
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
    padding_tokens: int = 0  # rows of each padding slice that are mapped (whole blocks); 0: no padding slices
    # a budget's released block ids whose pages a slice the device still reads kept: released at a later step
    release_backlog: set[int] = dataclasses.field(default_factory=set)
    releases_deferred: int = 0  # block ids whose release waited for a later step that way
    _warm_up_rows: bool = False  # the last forward had rows without a request

    @classmethod
    def build(cls, arguments: Mapping[str, object], groups: Sequence[tuple[list[str], int | None]], block_size: int,
              num_blocks: int, kernel: Kernel, case: AttentionCase, padding_tokens: int = 1) -> WorkerCache:
        """The cache of a manager made with ``arguments`` (its ``max_batch_size``
        split evenly among ``groups``, each ``(layer names, window in tokens or
        None)``), whose pool must hold exactly ``num_blocks`` page ids of
        ``block_size`` tokens; with a kernel that runs in CUDA graphs the last
        slice of each group is its padding slice, whose first
        ``padding_tokens`` rows (rounded up to whole blocks: what the longest
        capture batch reads) map the null block now."""
        footprint = kernel.read_footprint(case)
        scratch = num_blocks if footprint else None  # the scratch page's id: one past vLLM's blocks
        manager = KVCacheManager(**arguments)
        if manager.num_page_ids != num_blocks + bool(footprint):
            manager.cleanup()
            raise RuntimeError(f"vattn: the page pool holds {manager.num_page_ids} ids for vLLM's "
                               f"{num_blocks} blocks{' and the scratch page' if footprint else ''}")
        pad = 1 if kernel.graphs else 0  # a padding slice per group for CUDA graphs' padded batches
        if footprint and not pad:
            manager.cleanup()
            raise RuntimeError(f"vattn: {kernel.name} reads rows past a request's (its read footprint) but has no "
                               f"padding slice to hold the scratch page those rows map")
        per = manager.config.max_batch_size // len(groups)
        blocks_per_page = manager.page_tokens // block_size
        if blocks_per_page > 1:
            slices = [cls._subpage_group(manager, groups, block_size, blocks_per_page, num_blocks, footprint, pad, per)]
        else:
            slices = [GroupSlices(list(names), window,
                                  BlockPlacer(manager, block_size, first_reqid=i * per, slices=per - pad, window=window,
                                              rows_past_end=footprint.past_end,
                                              rows_below_start=footprint.below_start, scratch_page_id=scratch),
                                  padding=per - 1 if pad else None)
                      for i, (names, window) in enumerate(groups)]
        padding_blocks = -(-max(1, padding_tokens) // block_size) if pad else 0
        if pad:
            try:  # at start-up, so that no forward (a graph capture least of all) maps for padding
                reqids = np.array([i * per + per - 1 for i in range(len(groups))], dtype=np.int64)
                for reqid in reqids:
                    manager.alloc_reqid(reqid=int(reqid))
                # past the null block, the rows a capture batch's tiles read: the scratch page, which stays
                # mapped here for the cache's life, so its memory is never given back and made anew
                positions = manager.slice_bytes // manager.page_size
                reach = min(-(-(max(1, padding_tokens) + footprint.past_end) // block_size), positions)
                ids = [block_placer.NULL_BLOCK_ID] * padding_blocks + [scratch] * max(reach - padding_blocks, 0)
                zeros = np.zeros(len(reqids), dtype=np.int64)
                manager.map_pages(reqids, zeros, np.tile(np.array(ids, dtype=np.int64), len(reqids)),
                                  np.full(len(reqids), len(ids), dtype=np.int64))
                if reach > padding_blocks and (manager.device.type == "cpu" or torch.cuda.is_available()):
                    # A tile multiplies the rows it reads past a request's end by zero weights: they must hold
                    # finite values, and a device's fresh memory (cuMemCreate's) holds whatever it held. (A
                    # torch without CUDA cannot view a CUDA cache: only the fake driver's tests make one.)
                    rows = slice(padding_blocks * block_size, (padding_blocks + 1) * block_size)
                    for buffer in manager.buffers():
                        buffer[int(reqids[0]), rows].zero_()
            except BaseException:
                manager.cleanup()
                raise
        group_of = {name: i for i, g in enumerate(slices) for name in g.layer_names}
        return cls(manager, slices, kernel, case, group_of, padding_tokens=padding_blocks * block_size)

    @staticmethod
    def _subpage_group(manager: KVCacheManager, groups: Sequence[tuple[list[str], int | None]], block_size: int,
                       blocks_per_page: int, num_blocks: int, footprint: object, pad: int, per: int) -> GroupSlices:
        """The one group of a cache whose pages hold several blocks
        (:class:`SubPageBlockPlacer`); its last slice, one of the spares, is
        the placer's staging slice. Raises RuntimeError for what that placer
        does not serve (start-up refuses it first: ``check_subpage_blocks``)."""
        if len(groups) != 1 or groups[0][1] or footprint or pad:
            manager.cleanup()
            raise RuntimeError(f"vattn: {blocks_per_page} blocks per page serve one full-attention KV cache group "
                               f"and a kernel without CUDA graphs that reads no rows past a request's, not "
                               f"{len(groups)} group(s) with windows {[w for _, w in groups]}, footprint {footprint}, "
                               f"{pad} padding slice(s)")
        try:
            placer = SubPageBlockPlacer(manager, block_size, blocks_per_page, num_blocks, staging_reqid=per - 1,
                                        slices=per - 1)
        except BaseException:
            manager.cleanup()
            raise
        return GroupSlices(list(groups[0][0]), None, placer)

    def late_copies(self, group: int) -> tuple[np.ndarray, ...] | None:
        """Rows the forward mapped last must copy after each layer's K/V
        writes (:attr:`SubPageBlockPlacer.late_copies`), as slices of the
        group's cache views: ``(dst_slice, dst_row, src_slice, src_row)``,
        ``[n]`` int64 each; None where there are none."""
        placer = self.groups[group].placer
        late = getattr(placer, "late_copies", None)
        if late is None:
            return None
        dst_reqid, dst_row, src_reqid, src_row = late
        return dst_reqid - placer.first_reqid, dst_row, src_reqid - placer.first_reqid, src_row

    @functools.cached_property
    def has_windows(self) -> bool:
        """Whether any group has a sliding window (its holes are recorded per forward)."""
        return any(g.window for g in self.groups)

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Each layer's ``[2, S, L, H, D]`` K/V view: its buffer pair, its group's slices."""
        out = {}
        for group in self.groups:
            own = slice(group.placer.first_reqid, group.placer.first_reqid + group.num_slices)
            for j, name in enumerate(group.layer_names):
                out[name] = self.manager.kv_tensor(j)[:, own]
        return out

    def request_keys(self, inputs: ForwardInputs) -> list[Hashable]:
        """The request in each row of the forward; rows vLLM filled without
        a request (warm-up forwards) have keys of their own per row, released
        at the next forward with requests only."""
        if inputs.warm_up_rows:
            self._warm_up_rows = True
        elif self._warm_up_rows:
            for group in self.groups:
                group.placer.release_all_but(inputs.batch_request_keys)
            self._warm_up_rows = False
        return inputs.request_keys

    def map_forward(self, group: int, inputs: ForwardInputs) -> np.ndarray:
        """Maps group ``group``'s requests for the forward ``inputs`` (its
        block table, its window); returns their slices in the group's cache
        views (``[n]`` int64, the reqids its kernel reads). The forward is
        recorded once the last group is mapped."""
        placer = self.groups[group].placer
        start = time.perf_counter_ns()
        seq_lens, blocks, num_blocks = inputs.seq_lens, inputs.block_table, inputs.num_blocks
        reqids = placer.reqids_of(self.request_keys(inputs), blocks, num_blocks)
        placer.map(reqids, blocks, num_blocks, seq_lens, inputs.query_lens)
        self.map_ns += time.perf_counter_ns() - start
        if group == len(self.groups) - 1:
            self.forwards += 1
            self.time_s.append(time.monotonic())
            self.bytes_in_requests.append(self.manager.bytes_in_requests)
            self.tokens.append(int(seq_lens.sum()))
            if self.has_windows:
                page_id_bytes = self.manager.config.num_buffers * self.manager.page_size  # a position, every buffer
                self.behind_windows.append(sum(g.placer.holes for g in self.groups) * page_id_bytes)
        return reqids - placer.first_reqid

    def release(self, req_ids: Iterable[Hashable]) -> None:
        """vLLM's requests that finished, or whose blocks vLLM replaced
        (resumed after a preemption): their slices go back to the pool."""
        for group in self.groups:
            group.placer.release(req_ids)

    def stats(self) -> dict[str, object]:
        """The cache's stats, its groups, the mapping's work against its
        lower bound, and the per-forward series (the last SERIES_FORWARDS
        forwards)."""
        stats = self.manager.stats()
        buffers = self.manager.config.num_buffers
        mapping = dict(positions_mapped=(stats["sync_page_maps"] + stats["background_page_maps"]) // buffers,
                       positions_unmapped=stats["page_unmaps"] // buffers,
                       positions_needed=sum(g.placer.positions_needed for g in self.groups),
                       positions_reused=sum(g.placer.positions_reused for g in self.groups),
                       forwards=self.forwards,
                       forwards_mapping=sum(g.placer.forwards_mapping for g in self.groups),
                       live_requests=max(g.placer.live_requests for g in self.groups),
                       # several blocks per page: rows of partially hit pages copied, whole pages of hits mapped
                       rows_copied=sum(getattr(g.placer, "rows_copied", 0) for g in self.groups),
                       pages_shared=sum(getattr(g.placer, "pages_shared", 0) for g in self.groups),
                       late_copy_forwards=sum(getattr(g.placer, "late_copy_forwards", 0) for g in self.groups))
        return dict(stats, layout=self.manager.config.layout, kernel=self.kernel.name, map_ns=self.map_ns,
                    mapping=mapping, time_s_series=list(self.time_s), bytes_mapped_series=list(self.bytes_in_requests),
                    tokens_series=list(self.tokens), bytes_behind_windows_series=list(self.behind_windows),
                    groups=[dict(layers=len(g.layer_names), window=g.window) for g in self.groups],
                    releases_deferred=self.releases_deferred, release_backlog=len(self.release_backlog))
