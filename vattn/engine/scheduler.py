"""Which requests run each iteration, and the KV-cache bookkeeping that goes
with it: admission, pages for the iteration's tokens, preemption, forks and
retirement. The scheduler deals in reqids and token counts; the engine runs
the model and samples.

Every KV-cache call here either completes or leaves the scheduler as it was
before the call (see the failure contract in :mod:`vattn.engine.engine`):
a request is always in exactly one of ``waiting``, ``running`` or the
finished outputs, and holds a reqid exactly while it is running.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection

from vattn.budget.membership import budget_wait_seconds
from vattn.common.errors import BudgetError, ClosedError, OutOfPages, OutOfReqids, VAttnError
from vattn.core import KVCacheManager, PrefixHandle

from .prefix_cache import PrefixCache
from .requests import Request, RequestOutput

__all__ = ["Scheduler"]

log = logging.getLogger("vattn.engine")


class Scheduler:
    """The waiting queue and the running batch over one KV cache.

    Waiting requests are admitted first come, first served while reqids
    allow. Each iteration the running requests' new lengths go to
    ``kv.step``; when the pages are not there, cached prefixes whose release
    returns pages are released first, then the most recently admitted request
    goes back to the head of the queue: preempted (recompute: its tokens so
    far become its prompt) when it had computed tokens in this cache, simply
    not admitted yet when it joined in this iteration.

    ``kv_retries``: iterations in a row a request may be retried after the KV
    cache raised in them; one more failure finishes it with an error.

    In a budget the limit decides, and the wait is bounded: a request refused
    alone that fits the pool and the budget's current limit waits at the head
    of the queue until others give memory back (:attr:`budget_wait` tells the
    engine to block on the budget before the next iteration); a request whose
    pages alone exceed the current limit is set aside (:attr:`over_limit`), so
    the requests behind it run, and waits at most ``budget_wait_s`` seconds
    for the limit to rise: back in the queue as soon as it fits, finished with
    an ``OutOfPages`` error naming the limit and its need once the time is up.
    A request larger than the pool fails at once.

    ``clock``: seconds, monotonic (``time.monotonic``; a test passes its own).
    """

    def __init__(self, kv: KVCacheManager, prefix_cache: PrefixCache | None, prefill_chunk_size: int | None,
                 kv_retries: int = 3, budget_wait_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.prefill_chunk_size = prefill_chunk_size  # prompt tokens per request per iteration at most
        self.kv_retries = kv_retries
        # requests running at once at most: the cache's reqids, less those its owner holds for itself
        self.max_running = kv.config.max_batch_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self.kv_errors = 0  # KV-cache exceptions met (and recovered from)
        self.last_kv_error: str | None = None
        self.budget_wait = False  # the last schedule ran nothing: a lone request waits for the budget
        self.budget_wait_s = budget_wait_seconds(budget_wait_s)  # longest wait for a limit to rise
        self.clock = clock
        # requests whose pages alone exceed the budget's current limit, with when they were set aside
        self.over_limit: list[tuple[Request, float]] = []
        self._admitted: set[int] = set()  # ids of the requests admitted in this iteration
        self._attached: set[PrefixHandle] = set()  # the cached prefixes they attached

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.over_limit)

    # ---- requests over the budget's limit ------------------------------------------

    def request_bytes(self, tokens: int) -> int:
        """Bytes of the pages one request of ``tokens`` tokens maps (every buffer)."""
        cfg = self.kv.config
        return cfg.pages_for(tokens, self.kv.page_size) * self.kv.page_size * cfg.num_buffers

    def _limit(self) -> int | None:
        """The budget's limit now; None outside a budget, or when it can no longer be read (removed,
        truncated): then no limit sets a request aside, and ``step`` says what happened to the budget."""
        if self.kv.budget is None:
            return None
        try:
            return self.kv.budget.limit
        except BudgetError:
            return None

    def _over_limit(self, req: Request, limit: int | None) -> bool:
        return limit is not None and self.request_bytes(req.num_tokens) > limit

    def _sort_over_limit(self, finished: list[RequestOutput]) -> None:
        """Sets waiting requests over the current limit aside, returns those that fit again to the
        queue (ahead of later arrivals, in arrival order), fails those that waited ``budget_wait_s``."""
        limit = self._limit()
        now = self.clock()
        back, kept = [], []
        for req, since in self.over_limit:
            if not self._over_limit(req, limit):
                back.append(req)
            elif now - since >= self.budget_wait_s:
                need = self.request_bytes(req.num_tokens)
                error = OutOfPages(
                    f"budget '{self.kv.budget.name}': this request needs {need} bytes of KV cache "
                    f"({req.num_tokens} tokens) alone, more than the budget's limit of {limit} bytes, and the "
                    f"limit did not rise within {self.budget_wait_s:g} s (VATTN_BUDGET_WAIT_S / budget_wait_s)")
                log.warning("vattn engine: request %s failed: %s", req.request_id, error)
                finished.extend(req.failed(f"{type(error).__name__}: {error}"))
            else:
                kept.append((req, since))
        self.over_limit = kept
        still = []
        for req in self.waiting:
            if self._over_limit(req, limit):
                self.over_limit.append((req, now))
                log.warning("vattn engine: request %s needs %d bytes of KV cache alone, over budget '%s''s "
                            "limit of %d bytes: it waits up to %g s for the limit to rise; the requests behind "
                            "it run", req.request_id, self.request_bytes(req.num_tokens), self.kv.budget.name,
                            limit, self.budget_wait_s)
            else:
                still.append(req)
        back.sort(key=lambda r: (r.arrival_time, r.request_id, r.sample_index))
        self.waiting = collections.deque(back + still)

    def seconds_to_deadline(self) -> float | None:
        """Seconds until the first request set aside over the limit fails; None when none is."""
        if not self.over_limit:
            return None
        return max(0.0, min(since for _, since in self.over_limit) + self.budget_wait_s - self.clock())

    def chunk(self, req: Request) -> int:
        """Tokens of ``req`` this iteration computes."""
        pending = req.num_tokens - req.num_computed
        return min(pending, self.prefill_chunk_size or pending)

    # ---- one iteration ---------------------------------------------------------

    def schedule(self, finished: list[RequestOutput]) -> list[tuple[Request, int]]:
        """Admits waiting requests and maps pages for this iteration: the batch
        as (request, tokens to compute). A request too large for the pool even
        alone, or failed by the KV cache ``kv_retries + 1`` times in a row,
        finishes with an error (into ``finished``).

        Raises what ``kv.step`` raises, with every request where it was: the
        engine then calls :meth:`failed`."""
        self._admitted, self._attached = set(), set()
        self.budget_wait = False
        self._sort_over_limit(finished)
        self._admit(finished)
        while self.running:
            lens = [0] * self.kv.config.max_batch_size
            for req in self.running:
                lens[req.reqid] = req.num_computed + self.chunk(req)
            if self.kv.step(lens):
                return [(req, self.chunk(req)) for req in self.running]
            # Pages whose unmap failed earlier wait for a retry that step makes
            # only for the reqids it grows; reclaim retries them all.
            if self.kv.stats()["pages_orphaned"] and self.kv.reclaim():
                continue
            # Cached prefixes whose pages no request maps go first, except the
            # ones this iteration's newcomers attached: those go once no
            # newcomer is left to send back, before any request is preempted
            # (or a lone request found too large).
            newcomer = id(self.running[-1]) in self._admitted and len(self.running) > 1
            if self._evict(spare=self._attached if newcomer else ()):
                continue
            victim = self.running.pop()  # the most recently admitted
            need = lens[victim.reqid]
            self._free(victim)
            # Alone and refused although it fits the pool: in a budget, other
            # processes hold the memory now; it waits at the head of the queue
            # (others give memory back when they see it wait), or, over the
            # limit, aside for a bounded time (the next schedule sets it aside).
            # Otherwise it can never run.
            if not self.running and (self.kv.budget is None or not self.kv.fits_alone(need)):
                finished.extend(victim.failed(self._refusal(need)))
                break
            self.budget_wait = not self.running
            if id(victim) not in self._admitted:  # its computed tokens are lost: recompute later
                victim.preemptions += 1
                self.preemptions += 1
            victim.num_computed = 0
            self.waiting.appendleft(victim)
        return []

    def _refusal(self, need: int) -> str:
        """Why a request of ``need`` tokens, alone in the batch, cannot run."""
        if self.kv.fits_alone(need):
            return (f"needs {need} tokens of KV cache, whose pages could not be created "
                    f"(the device or host is out of memory)")
        return (f"needs {need} tokens of KV cache, more than the physical pool holds "
                f"({self.kv.stats()['bytes_total']} bytes)")

    def _admit(self, finished: list[RequestOutput]) -> None:
        """Moves waiting requests to the batch while reqids are free. A request
        whose admission fails in the KV cache stays at the head of the queue
        (its reqid freed again) and admission stops for this iteration."""
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            reqid = -1
            try:
                reqid = self.kv.alloc_reqid(req.num_tokens)
                computed = self._attach_cached_prefix(reqid, req.tokens)
            except ClosedError:
                raise
            except VAttnError as e:
                self._note(e)
                if reqid >= 0:
                    self._free_reqid(reqid)
                self.waiting.popleft()
                if not self._retry(req, e, finished):
                    continue
                self.waiting.appendleft(req)
                return
            self.waiting.popleft()
            req.reqid, req.num_computed = reqid, computed
            self.running.append(req)
            self._admitted.add(id(req))

    def _attach_cached_prefix(self, reqid: int, tokens: list[int]) -> int:
        """Maps the longest cached whole-page prefix of a new request's tokens
        into its reqid's slice; returns the tokens it covers (no prefill needed)."""
        if self.prefix_cache is None:
            return 0
        handle, pages = self.prefix_cache.lookup(tokens)
        if not pages:
            return 0
        self.kv.map_pages([reqid], [0], [self.prefix_cache.page_ids(handle)[:pages]])
        self._attached.add(handle)
        return pages * self.prefix_cache.page_tokens

    def _evict(self, spare: Collection[PrefixHandle] = ()) -> bool:
        """Releases one cached prefix (not in ``spare``) whose pages would go
        back to the pool; entries whose pages running requests map stay
        (releasing them frees nothing). False when there is none."""
        if self.prefix_cache is None or not self.prefix_cache.entries:
            return False
        mapped = {page for req in self.running for page in self.kv.page_ids(req.reqid)}
        return self.prefix_cache.evict(mapped, spare)

    def failed(self, error: VAttnError, finished: list[RequestOutput]) -> None:
        """The KV cache raised during this iteration before any token was
        committed: every running request is retried in the next one (each
        keeps its reqid and computed tokens), or finished with an error once
        it has failed ``kv_retries + 1`` iterations in a row."""
        self._note(error)
        for req in list(self.running):
            if not self._retry(req, error, finished):
                self.running.remove(req)
                self._free(req)

    def _retry(self, req: Request, error: VAttnError, finished: list[RequestOutput]) -> bool:
        """Counts a failure of ``req``; False (and its error output into
        ``finished``) when it has failed too often."""
        req.kv_failures += 1
        if req.kv_failures <= self.kv_retries:
            return True
        finished.extend(req.failed(
            f"the KV cache failed {req.kv_failures} time{'s' if req.kv_failures > 1 else ''} in a row "
            f"(kv_retries={self.kv_retries}); last: {type(error).__name__}: {error}"))
        return False

    def _note(self, error: VAttnError) -> None:
        self.kv_errors += 1
        self.last_kv_error = f"{type(error).__name__}: {error}"
        log.warning("vattn engine: KV cache error, recovered: %s", self.last_kv_error)

    # ---- after the model ran -------------------------------------------------

    def computed(self, req: Request) -> None:
        """``req``'s prompt was just computed: its whole pages go to the prefix cache."""
        self._cache(req, req.prompt)

    def fork(self, parent: Request, child: Request) -> bool:
        """Gives ``child`` a fork of ``parent``'s computed tokens and runs it;
        when the fork fails (no free reqid or page, or a driver error), it
        waits to be recomputed like a preempted request. True when it runs."""
        try:
            child.reqid = self.kv.fork(parent.reqid, parent.num_computed)
        except ClosedError:
            raise
        except VAttnError as e:
            if not isinstance(e, (OutOfReqids, OutOfPages)):  # those are no error: the batch is full
                self._note(e)
            child.reqid, child.num_computed = -1, 0
            self.waiting.appendleft(child)
            return False
        child.num_computed = parent.num_computed
        self.running.append(child)
        return True

    def retire(self, req: Request) -> None:
        """``req`` finished: it leaves the batch, its computed whole pages go
        to the prefix cache, its reqid is freed."""
        self.running.remove(req)
        self._cache(req, req.tokens[:req.num_computed])
        self._free(req)

    def _cache(self, req: Request, tokens: list[int]) -> None:
        """Offers ``tokens`` (computed, in ``req``'s pages) to the prefix cache;
        a KV error only costs the entry."""
        if self.prefix_cache is None:
            return
        try:
            self.prefix_cache.insert(self.kv, req.reqid, tokens)
        except ClosedError:
            raise
        except VAttnError as e:
            self._note(e)

    def _free(self, req: Request) -> None:
        reqid, req.reqid = req.reqid, -1
        self._free_reqid(reqid)

    def _free_reqid(self, reqid: int) -> None:
        """Frees ``reqid``. The core frees it before unmapping anything, so an
        unmap that fails leaves the reqid free and its pages to be retried by
        the cache: noted, not raised."""
        try:
            self.kv.free_reqid(reqid)
        except ClosedError:
            raise
        except VAttnError as e:
            if self.kv.is_allocated(reqid):
                raise
            self._note(e)

    def bytes_needed(self) -> int:
        """Bytes of the pages that the running requests' cached tokens occupy."""
        kv, cfg = self.kv, self.kv.config
        pages = sum(cfg.pages_for(r.num_computed, kv.page_size) for r in self.running)
        return pages * kv.page_size * cfg.num_buffers
