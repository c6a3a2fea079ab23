"""The worker's side of a budget (docs/vllm.md "Under a budget"): what one
block id holds in this worker's cache, and giving back the pages of blocks
the engine core's scheduler released. The engine core decides and charges
(:mod:`vattn.integrations.vllm.engine_budget`); a worker never asks the
budget. It reaches a worker's cache in one of two ways: the block ids ride
on a step's ``SchedulerOutput`` (``RELEASE_ATTRIBUTE``, every process
layout), or, with the worker in the engine core's process, through the
:class:`WorkerPages` handle the worker hands it at start-up."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .worker_cache import WorkerCache

RELEASE_ATTRIBUTE = "vattn_release"  # on a SchedulerOutput: block ids whose pages every worker gives back


def block_bytes(cache: WorkerCache) -> int:
    """The bytes one block id holds in this worker: a page of every K and V buffer."""
    return cache.manager.page_size * cache.manager.config.num_buffers


def release_blocks(cache: WorkerCache, ids: Sequence[int]) -> int:
    """In a worker, before its forward: gives back the pages of block ids the scheduler freed and
    decided to release. Finished requests' slices still map their last blocks (deferred
    reclamation): they are unmapped first. A slice that still maps one of them (a preempted
    request's, which vLLM resumes with new blocks; a block behind a sliding window not unmapped
    yet) is given up: its request gets a fresh slice, mapped again from its block table, at its next
    forward. Returns how many ids were mapped nowhere at the end (released, or never created)."""
    manager = cache.manager
    ids = [int(i) for i in ids]
    for group in cache.groups:
        group.placer.reclaim_free()
    released = set(manager.release_pages(ids))
    rest = {i for i in ids if i not in released}
    if rest:
        for group in cache.groups:
            group.placer.release_holding(rest)
        for group in cache.groups:
            group.placer.reclaim_free()
        manager.release_pages(sorted(rest))
    return len(ids)


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
