"""The worker's side of a budget (docs/vllm.md "Under a budget"): what one
block id holds in this worker's cache, and giving back the pages of blocks
the engine core's scheduler released. The engine core decides and charges
(:mod:`vattn.integrations.vllm.engine_budget`); a worker never asks the
budget. It reaches a worker's cache in one of two ways: the block ids ride
on a step's ``SchedulerOutput`` (``RELEASE_ATTRIBUTE``, every process
layout), or, with the worker in the engine core's process, through the
:class:`WorkerPages` handle the worker hands it at start-up. At start-up each
rank tells the engine core what it costs which device (:class:`RankCharge`),
so that each device's budget is charged its own share."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .worker_cache import WorkerCache

RELEASE_ATTRIBUTE = "vattn_release"  # on a SchedulerOutput: block ids whose pages every worker gives back
RUNNER_ATTRIBUTE = "vattn_cache"  # vLLM's model runner holds its WorkerCache here (set by worker.py)


def block_bytes(cache: WorkerCache) -> int:
    """The bytes one block id holds in this worker: a page of every K and V buffer."""
    return cache.manager.page_size * cache.manager.config.num_buffers


def padding_bytes(cache: WorkerCache) -> int:
    """The bytes of the pages this worker's padding slices map from start-up (a kernel that runs in
    CUDA graphs: the framework's null block, and a scratch page where the kernel reads past a row):
    one block's bytes per distinct page id; 0 without padding slices."""
    ids: set[int] = set()
    for group in cache.groups:
        if group.padding is not None:
            ids.update(cache.manager.page_ids(group.placer.first_reqid + group.padding))
    return len(ids) * block_bytes(cache)


def release_blocks(cache: WorkerCache, ids: Sequence[int]) -> int:
    """In a worker, before its forward: gives back the pages of block ids the scheduler freed and
    decided to release, without waiting for the device. Finished requests' slices still map their
    last blocks (deferred reclamation): those the device is done reading are unmapped first. A slice
    that still maps one of them (a preempted request's, which vLLM resumes with new blocks; a block
    behind a sliding window not unmapped yet) is given up: its request gets a fresh slice, mapped
    again from its block table, at its next forward. Ids a slice the device still reads keeps mapped
    (its read fence not passed: the forward before this one, under asynchronous scheduling) wait in
    ``cache.release_backlog`` for the next release, counted in ``cache.releases_deferred``; a step
    never waits for the device here. Returns how many ids were mapped nowhere at the end (released,
    or never created)."""
    manager = cache.manager
    wanted = sorted({int(i) for i in ids} | cache.release_backlog)
    manager.reclaim_freed(wait=False)  # only slices whose readers the device has finished
    released = set(manager.release_pages(wanted))
    rest = {i for i in wanted if i not in released}
    backlog: set[int] = set()
    if rest:
        for group in cache.groups:
            group.placer.release_holding(rest)
        _, still_read = manager.reclaim_freed(wait=False)
        released.update(manager.release_pages(sorted(rest)))
        rest -= released
        if still_read:  # freed slices the device still reads keep some mapped; the rest was never created
            mapped = {page for group in cache.groups for reqid in group.placer.all_reqids.tolist()
                      for page in manager.page_ids(reqid)}
            backlog = rest & mapped
    cache.releases_deferred += len(backlog - cache.release_backlog)
    cache.release_backlog = backlog
    return len(wanted) - len(backlog)


@dataclasses.dataclass(frozen=True)
class WorkerPages:
    """A worker's cache as an engine core in the same process uses it: it
    releases blocks' pages directly when no step can carry the release (an
    idle engine core stepped by its caller). Handed over by the worker
    (``collective_rpc("vattn_worker_pages")``), never through a global."""

    cache: WorkerCache

    @property
    def block_bytes(self) -> int:
        """Bytes one block id holds in this worker."""
        return block_bytes(self.cache)

    def release(self, ids: Sequence[int]) -> int:
        """Gives back the pages of block ids ``ids`` now (:func:`release_blocks`)."""
        return release_blocks(self.cache, ids)


@dataclasses.dataclass(frozen=True)
class RankCharge:
    """What one rank's cache costs its device's budget, as the worker reports it to the engine core."""

    device: str  # "cpu", or the GPU's UUID: the same in every process on that GPU, whatever its numbering
    block_bytes: int  # the pages one block id holds in this rank's cache
    padding_bytes: int  # the pages this rank's padding slices hold from start-up (0 where none)


def rank_charge(cache: WorkerCache) -> RankCharge:
    """This rank's :class:`RankCharge`: its cache's device by UUID, a block's and the padding's bytes."""
    from vattn.budget.budget import resolve_device

    return RankCharge(resolve_device(cache.manager.device), block_bytes(cache), padding_bytes(cache))
