"""Which requests run each iteration, and the KV-cache bookkeeping that goes
with it: admission, pages for the iteration's tokens, preemption, forks and
retirement. The scheduler deals in reqids and token counts; the engine runs
the model and samples."""

from __future__ import annotations

import collections

from vattn import KVCacheManager, OutOfPages, OutOfSlots

from .prefix_cache import PrefixCache
from .requests import Request, RequestOutput

__all__ = ["Scheduler"]


class Scheduler:
    """The waiting queue and the running batch over one KV cache.

    Waiting requests are admitted first come, first served while reqids
    allow. Each iteration the running requests' new lengths go to
    ``kv.step``; when the pages are not there, cached prefixes are released
    first, then the most recently admitted request is preempted (recompute:
    its tokens so far become its prompt, and it waits at the head of the queue).
    """

    def __init__(self, kv: KVCacheManager, prefix_cache: PrefixCache | None, prefill_chunk_size: int | None) -> None:
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.prefill_chunk_size = prefill_chunk_size  # prompt tokens per request per iteration at most
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def chunk(self, req: Request) -> int:
        """Tokens of ``req`` this iteration computes."""
        pending = req.num_tokens - req.num_computed
        return min(pending, self.prefill_chunk_size or pending)

    def schedule(self, finished: list[RequestOutput]) -> list[tuple[Request, int]]:
        """Admits waiting requests and maps pages for this iteration: the batch
        as (request, tokens to compute). A request too large for the pool even
        alone finishes with an error (into ``finished``)."""
        while self.waiting and len(self.running) < self.kv.config.max_batch_size:
            req = self.waiting.popleft()
            req.reqid = self.kv.alloc_reqid(req.num_tokens)
            self._attach_cached_prefix(req)
            self.running.append(req)
        while self.running:
            lens = [0] * self.kv.config.max_batch_size
            for req in self.running:
                lens[req.reqid] = req.num_computed + self.chunk(req)
            if self.kv.step(lens):
                return [(req, self.chunk(req)) for req in self.running]
            if self.prefix_cache is not None and self.prefix_cache.evict():
                continue  # cached prefixes go before any running request
            victim = self.running.pop()  # the most recently admitted
            self.kv.free_reqid(victim.reqid)
            if not self.running:  # alone, and still too large for the pool
                finished.append(victim.finished("error", error=(
                    f"needs {lens[victim.reqid]} tokens of KV cache, more than the physical pool holds "
                    f"({self.kv.stats()['bytes_total']} bytes)")))
                break
            if victim.num_computed:  # not just admitted: its cache is lost, recompute later
                victim.preemptions += 1
                self.preemptions += 1
            victim.num_computed = 0
            self.waiting.appendleft(victim)
        return []

    def _attach_cached_prefix(self, req: Request) -> None:
        """Maps the longest cached whole-page prefix of a new request's tokens
        into its slice: those tokens need no prefill."""
        if self.prefix_cache is None:
            return
        handle, pages = self.prefix_cache.lookup(req.tokens)
        if pages:
            self.kv.map_pages([req.reqid], [0], handle.page_ids[:pages], [pages])
            req.num_computed = pages * self.prefix_cache.page_tokens

    def computed(self, req: Request) -> None:
        """``req``'s prompt was just computed: its whole pages go to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(self.kv, req.reqid, req.prompt)

    def fork(self, parent: Request, child: Request) -> bool:
        """Gives ``child`` a fork of ``parent``'s computed tokens and runs it;
        without a free reqid or page, it waits to be recomputed like a
        preempted request. True when it runs."""
        try:
            child.reqid = self.kv.fork(parent.reqid, parent.num_computed)
        except (OutOfSlots, OutOfPages):
            child.num_computed = 0
            self.waiting.appendleft(child)
            return False
        self.running.append(child)
        return True

    def retire(self, req: Request) -> None:
        """``req`` finished: it leaves the batch, its computed whole pages go
        to the prefix cache, its reqid is freed."""
        self.running.remove(req)
        if self.prefix_cache is not None:
            self.prefix_cache.insert(self.kv, req.reqid, req.tokens[:req.num_computed])
        self.kv.free_reqid(req.reqid)

    def bytes_needed(self) -> int:
        """Bytes of the pages that the running requests' cached tokens occupy."""
        kv, cfg = self.kv, self.kv.config
        pages = sum(cfg.pages_for(r.num_computed, kv.page_size) for r in self.running)
        return pages * kv.page_size * cfg.num_buffers
