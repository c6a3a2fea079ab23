"""The engine core's side of a budget: vLLM's block pool under a machine-wide
budget (docs/vllm.md "Under a budget", docs/elastic.md). The workers' side
is :mod:`vattn.integrations.vllm.worker_budget`; :mod:`vattn.integrations.vllm.hooks`
installs the wrappers this module makes.

With ``VATTN_BUDGET`` set, the **engine core** (the process of vLLM's
scheduler) is the budget's member, whatever the process layout: the worker
in the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or workers
of their own (vLLM-CPU's default multiprocessing executor, tensor and
pipeline parallel ranks). The workers' caches are no members: they create a
block's pages when a forward first maps it, with no budget check, and give
them back when the scheduler says so. vLLM's ``num_blocks`` is only the
virtual size of the pool.

- **Charging.** Each device's budget is charged the pages one block id
  holds on the ranks on that device (each worker reports its device, by
  UUID, and its bytes at start-up; on the host every rank's go to the host's
  budget): :class:`vattn.budget.devices.DeviceMember`, which grants a block
  only when every device has room and undoes a grant one device refused on
  the others. ``block_bytes`` is a block on every rank together. The
  scheduler charges them when ``get_new_blocks`` hands out a block without
  pages, before any worker can create them; inside ``allocate_slots`` the
  bytes the request may take are granted first (``headroom``), so the free
  count the scheduler decides with is backed by a grant and a forward never
  finds its memory taken by another process.
- **What the scheduler sees.** ``BlockPool.get_num_free_blocks()`` is the free
  blocks with pages plus as many free blocks without pages as the budget can
  grant, less the blocks owed when the limit was lowered below what the
  members hold: vLLM waits or preempts, as for a full pool. Inside
  ``allocate_slots`` blocks without pages count only as far as the headroom
  and pending releases back them (bytes another process took between a look
  and a grant leave the request waiting), with the limit as at the call's
  start; when vLLM's free queue would hand out more of them than that, free
  blocks with pages move to its head first. So a hand-out never lacks its
  grant; one outside ``allocate_slots`` that does waits ``GRANT_WAIT_S`` and
  then detaches the engine from the budget rather than end it.
- **Giving back.** The scheduler picks free blocks (those serving no cached
  prefix first, then cached ones in vLLM's eviction order, each dropped from
  vLLM's cached-block map first) and their ids ride on the next
  ``SchedulerOutput`` (attribute ``vattn_release``; vLLM pickles the object to
  worker processes, instance attributes included). Every worker unmaps freed
  slices and releases those pages in ``_update_states``, before its forward
  maps anything. The bytes are uncharged when ``update_from_output`` gets
  that step's output: vLLM returns it from one rank only, after a forward
  every rank took part in (tensor-parallel collectives, pipeline stages
  sending on); a step without a forward is confirmed by a no-op call on
  every rank. Blocks handed out in the same step as a release take over the
  released blocks' charge: every rank releases before it creates.
- **Overlapping steps** (asynchronous scheduling: vLLM's batch queue keeps
  two steps in flight). A block freed while steps are in flight (its request
  finished or preempted while the next step's forward reads it) is given
  back only once the last step scheduled before it was freed has its output
  back: until then neither its pages nor its charge go anywhere.
- **When.** When another member waits or the limit is lowered (a
  keeper thread polls the budget every 50 ms), and for every free block
  after ``VATTN_VLLM_IDLE_RELEASE_S`` seconds (default 30) without a request.
  An idle engine core is woken through its input queue to run one step that
  carries the release; with the engine core in the caller's process
  (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the worker in it
  too, the keeper releases directly.

How the engine core reaches the workers: ``collective_rpc(worker_rank_charge)``
at start-up (every rank's device and bytes, in any layout), block ids on a step's
``SchedulerOutput`` (``worker_budget.RELEASE_ATTRIBUTE``), a no-op
``collective_rpc`` as a barrier; and with vLLM's in-process executor, the
worker's :class:`~vattn.integrations.vllm.worker_budget.WorkerPages` handle,
asked of the executor when the pool is attached.

- **Waits** (requests over the limit, an engine idle while refused): :mod:`.engine_wait`.
- **A budget removed or damaged** never stops the engine: at the first
  ``BudgetError`` it logs once that it serves on without it (vLLM's own pool).
- **A budget's lock held by a stopped or stuck process** past its
  ``lock_timeout_s`` (``BudgetLockTimeout``) is no such error: the budget is
  sound, and the engine stays within it. Grants are refused (requests wait,
  or go on in blocks that have pages), uncharges are kept and made once the
  lock is free, and the scheduler waits on that lock once, not per call: the
  keeper looks for it to come free (:class:`~vattn.budget.devices.DeviceMember`).
- **Padding.** vLLM's null block is charged only where a worker created its
  pages (the padding slice of a kernel that runs in CUDA graphs).

Threads: the scheduler's block operations (``schedule``, ``update_from_output``,
``finish_requests``, ``reset_prefix_cache``) and the keeper take one lock.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from vattn.budget.devices import DeviceMember, DeviceShare
from vattn.budget.membership import (DEFAULT_IDLE_RELEASE_S, ENV_VAR, budget_name_from_environment,
                                     idle_release_seconds)
from vattn.common.background_thread import BackgroundThread
from vattn.common.errors import BudgetError

from .engine_wait import BudgetWaits
from .worker_budget import RELEASE_ATTRIBUTE, WorkerPages

IDLE_SETTING = "VATTN_VLLM_IDLE_RELEASE_S"
KEEPER_INTERVAL_S = 0.05  # how often the keeper looks at the budget (a lock-free read when nothing is asked)
GRANT_WAIT_S = 5.0  # how long a hand-out the budget still refuses waits for other members to give back
START_WAIT_S = 30.0  # how long start-up waits for the null block's bytes
UNCHARGE_ATTRIBUTE = "vattn_uncharge"  # on the engine core's SchedulerOutput: bytes to uncharge at its output
STEP_ATTRIBUTE = "vattn_step"  # on the engine core's SchedulerOutput: its step's number (from 1)


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
    """The budget's view of one vLLM scheduler's ``BlockPool``; the engine core's membership.

    ``member``: a :class:`~vattn.budget.devices.DeviceMember` (the ranks'
    devices' budgets), or one device's ``BudgetMember`` of ``budget``.
    ``block_bytes``: the pages one block id holds on every rank together.
    ``padding_bytes``: the pages the workers created for vLLM's null block
    (charged from start-up; 0 where none did).
    ``confirm``: called (in the engine core's thread) before uncharging the
    release of a step without a forward, when several ranks ran it; returns
    once every rank has processed the step. ``wake``: makes an idle engine
    core run a step (None: none can be woken). ``local_pages``: the
    worker's handle when it is in this process (None otherwise).
    """

    def __init__(self, scheduler: Any, member: Any, budget: Any, block_bytes: int, world_size: int,
                 idle_release_s: float, confirm: Callable[[], None] | None = None,
                 wake: Callable[[], None] | None = None, local_pages: WorkerPages | None = None,
                 padding_bytes: int = 0) -> None:
        self.scheduler = scheduler
        self.kv_manager = scheduler.kv_cache_manager
        self.pool = self.kv_manager.block_pool
        if not isinstance(member, DeviceMember):  # one device: its budget's figures, unscaled
            member = DeviceMember(budget.name, [DeviceShare(budget, member, block_bytes)])
        self.member = member
        self.budget = member.budget  # every device's budget as one, in bytes over every rank
        self.block_bytes = block_bytes
        self.padding_bytes = padding_bytes
        self.detached: str | None = None  # why the budget can no longer be used; None while it can
        self.world_size = world_size
        self.idle_release_s = idle_release_s
        self.confirm = confirm
        self.wake = wake
        self.local_pages = local_pages
        self.block_size = scheduler.block_size
        self.num_groups = len(scheduler.kv_cache_config.kv_cache_groups)
        # blocks with pages in the workers, or that may have them from the next forward on (charged); the
        # null block counts as such (never free; charged as ``padding_bytes``)
        self.with_pages = np.zeros(self.pool.num_gpu_blocks, dtype=bool)
        self.with_pages[self.pool.null_block.block_id] = True
        self.num_with_pages = 1
        self.pending: list[int] = []  # block ids the next SchedulerOutput tells the workers to release
        self.credit = 0  # of the pending blocks, those whose charge no block handed out took over yet
        self.in_flight = 0  # blocks released by outputs not back yet, still charged
        self.headroom = 0  # blocks granted ahead of one allocate_slots call
        # steps numbered from 1 as schedule() makes them; a block freed after step k was scheduled may be
        # read by forwards up to k (vLLM's batch queue keeps two in flight under asynchronous scheduling)
        self.steps_scheduled = 0
        self.steps_confirmed = 0  # the last step whose output is back (outputs come back in order)
        self.freed_after_step = np.zeros(self.pool.num_gpu_blocks, dtype=np.int64)
        self.lock = threading.RLock()
        self.last_active = time.monotonic()
        self.idle_released = False
        self.last_report = (-1, -1)
        self.counters = dict(blocks_released=0, cached_blocks_dropped=0, budget_limited_allocations=0,
                             waits_recorded=0, releases_sent=0, releases_confirmed=0, direct_releases=0,
                             grant_waits=0, sleeps=0)
        self.waits = BudgetWaits(scheduler, self.budget, self.member, self.blocks_alone, block_bytes, padding_bytes)
        self._stock_get_new_blocks = self.pool.get_new_blocks
        self.pool.get_num_free_blocks = self.num_free_blocks  # instance attributes: this pool only
        self.pool.get_new_blocks = self.get_new_blocks
        stock_free = self.pool.free_blocks

        @functools.wraps(stock_free)
        def free_blocks(ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)  # vLLM may pass an iterator
            self.freed_after_step[[b.block_id for b in blocks]] = self.steps_scheduled
            stock_free(blocks)

        self.pool.free_blocks = free_blocks
        stock_reset = self.pool.reset_prefix_cache

        @functools.wraps(stock_reset)
        def reset_prefix_cache() -> bool:
            del self.pool.get_num_free_blocks  # vLLM's own count: it checks that every block is free
            try:
                return stock_reset()
            finally:
                self.pool.get_num_free_blocks = self.num_free_blocks

        self.pool.reset_prefix_cache = reset_prefix_cache
        stock_allocate = self.kv_manager.allocate_slots

        @functools.wraps(stock_allocate)
        def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            with self.lock:
                if self.detached:
                    return stock_allocate(request, num_new_tokens, *args, **kwargs)
                self.headroom_cap = self._blocks_wanted(request, num_new_tokens, args, kwargs)
                # one figure for the whole call: a limit lowered meanwhile must not shrink what it counted
                self.allocation_excess = self.guarded(self._excess_blocks)
                try:
                    blocks = stock_allocate(request, num_new_tokens, *args, **kwargs)
                finally:
                    self.headroom_cap = 0
                    self.allocation_excess = None
                    self.guarded(self._return_headroom)
                if blocks is None:
                    self.guarded(self._note_refusal, num_new_tokens)
                return blocks

        self.headroom_cap = 0
        self.allocation_excess: int | None = None  # inside allocate_slots: blocks held above the limit at its start
        self.kv_manager.allocate_slots = allocate_slots
        self._charge_null_block()
        self.keeper = BackgroundThread(self._keeper_step, KEEPER_INTERVAL_S, "vattn-vllm-budget")
        self.keeper.start()

    # ---- what the scheduler sees ----------------------------------------------------------

    def _charge_null_block(self) -> None:
        """Charges the null block's pages where workers created them (none: nothing to charge)."""
        deadline = time.monotonic() + START_WAIT_S
        while self.padding_bytes and not self.member.try_grant(self.padding_bytes):
            if time.monotonic() >= deadline:
                self.member.leave()
                raise RuntimeError(
                    f"vattn: budget '{self.budget.name}' has {self.budget.available_bytes} bytes free, and this "
                    f"engine needs {self.padding_bytes} bytes (its padding block) to start; raise its limit "
                    f"(python -m vattn budget set {self.budget.name} --limit ...) or unset {ENV_VAR}")
            self.member.wait_for_memory(1.0)

    # ---- a budget removed or damaged -----------------------------------------------------------

    def guarded(self, operation: Callable[..., Any], *args: Any) -> Any:
        """``operation(*args)``; a ``BudgetError`` (the budget removed, its segment truncated or
        damaged) detaches the engine from the budget instead of escaping into vLLM's engine core."""
        try:
            return operation(*args)
        except BudgetError as e:
            self.detach(e)
            return None

    def detach(self, error: BaseException) -> None:
        """The budget can no longer be used: the engine serves without it from now on (vLLM's own
        block pool, nothing charged), and says so once. Caller holds the lock (or the keeper)."""
        if self.detached:
            return
        self.detached = str(error)
        self.headroom = self.credit = self.in_flight = 0  # nothing more to uncharge: releases still go out
        try:
            self.waits.give_back()  # requests set aside over the limit wait in vLLM's queue again
        except BudgetError:
            pass
        for name in ("get_num_free_blocks", "get_new_blocks", "reset_prefix_cache"):
            self.pool.__dict__.pop(name, None)  # vLLM's own methods again
        self.member.leave()  # quiet on a removed or truncated segment
        from vllm.logger import init_logger

        init_logger("vllm.vattn").warning(
            "vattn: budget '%s' can no longer be used (%s); this engine goes on serving without it: vLLM's "
            "own block pool from now on, nothing charged (python -m vattn budget ls / top show what became of "
            "the budget; restart the engine to join one again)", self.budget.name, error)

    def _excess_now(self) -> int:
        """Blocks held above the limit as this engine counts them now: inside ``allocate_slots``, as at
        its start."""
        return self._excess_blocks() if self.allocation_excess is None else self.allocation_excess

    def _excess_blocks(self) -> int:
        """Blocks the members hold above a lowered limit (0 within it)."""
        excess = self.budget.held_bytes - self.budget.limit
        return -(-excess // self.block_bytes) if excess > 0 else 0

    def _transferable(self, excess: int) -> int:
        """Pending blocks whose charge a block handed out now may take over: not those owed to a lowered limit."""
        return max(0, self.credit - excess)

    def _free_split(self) -> tuple[int, int]:
        """(free blocks with pages, free blocks without). Every block in use has pages."""
        free = self.pool.free_block_queue.num_free_blocks
        in_use = self.pool.num_gpu_blocks - 1 - free
        with_pages = min(free, max(0, self.num_with_pages - 1 - in_use))
        return with_pages, free - with_pages

    def num_free_blocks(self) -> int:
        """``BlockPool.get_num_free_blocks`` under the budget: blocks vLLM can really get now. Inside
        ``allocate_slots`` the bytes of the blocks the request may take are granted first."""
        if not self.detached:
            try:
                return self._budgeted_free_blocks()
            except BudgetError as e:
                self.detach(e)
        return self.pool.free_block_queue.num_free_blocks

    def _budgeted_free_blocks(self) -> int:
        with_pages, without = self._free_split()
        excess = self._excess_now()
        transferable = self._transferable(excess)
        if self.headroom_cap and not excess:
            want = min(without, self.headroom_cap) - transferable - self.headroom
            grant = min(want, self.budget.available_bytes // self.block_bytes)
            if grant > 0 and self.member.try_grant(grant * self.block_bytes, record_wait=False):
                self.headroom += grant
        owed = max(0, excess - self.credit - self.in_flight)  # what releases under way do not cover yet
        grantable = transferable + self.headroom
        if grantable < min(without, self.headroom_cap):
            # inside allocate_slots, short of a grant (another process took the bytes meanwhile): only
            # what is reserved counts, so nothing handed out can find its bytes taken
            return max(0, with_pages + min(without, grantable) - owed)
        # every block this allocation may take without pages is backed: free bytes beyond count toward
        # vLLM's margins (its watermark, blocks kept for requests in flight), never handed out here
        grantable += self.budget.available_bytes // self.block_bytes
        return max(0, with_pages + min(without, grantable) - owed)

    def blocks_alone(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens needs on its own, every KV cache group (a
        sliding-window group at most its window's blocks and one more)."""
        total = 0
        for manager in self.kv_manager.coordinator.single_type_managers:
            blocks = -(-tokens // self.block_size)
            window = getattr(manager.kv_cache_spec, "sliding_window", None)
            if window:
                blocks = min(blocks, -(-window // self.block_size) + 1)
            total += blocks
        return total

    def _blocks_wanted(self, request: Any, num_new_tokens: int, args: tuple, kwargs: dict) -> int:
        """At most how many blocks ``allocate_slots`` may hand out for ``request`` (every KV cache group)."""
        named = dict(zip(("num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
                          "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens",
                          "full_sequence_must_fit"), args))
        named.update(kwargs)
        tokens = (request.num_computed_tokens + named.get("num_new_computed_tokens", 0) + num_new_tokens
                  + named.get("num_lookahead_tokens", 0) + named.get("num_external_computed_tokens", 0))
        if named.get("full_sequence_must_fit"):
            tokens = max(tokens, request.num_tokens)
        managers = self.kv_manager.coordinator.single_type_managers
        held = min(len(m.req_to_blocks.get(request.request_id, ())) for m in managers)
        return max(0, -(-tokens // self.block_size) - held) * self.num_groups

    def _return_headroom(self) -> None:
        if self.headroom:
            self.member.release(self.headroom * self.block_bytes)
            self.headroom = 0

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        with self.lock:
            if not self.detached:
                self._pages_first(num_blocks)
            blocks = self._stock_get_new_blocks(num_blocks)  # checks num_free_blocks()
            if not self.detached:
                try:
                    self._charge_new(blocks)
                except BudgetError as e:
                    self.detach(e)
            return blocks

    def _pages_first(self, num_blocks: int) -> None:
        """Before vLLM takes ``num_blocks`` from the head of its free queue: when the blocks without
        pages among them are more than the engine's own charge covers (headroom, pending releases),
        free blocks with pages move to the head, so that vLLM reuses them instead (blocks serving no
        cached prefix first, then cached ones in eviction order). The free count promised vLLM no
        more than that: it counts the free blocks with pages, and blocks without pages only as far as
        the budget backs them. Reusing a block a forward in flight still reads is vLLM's own reuse (the
        device orders the writes after the reads); giving its pages back is not (``freed_after_step``)."""
        queue = self.pool.free_block_queue
        head, block = [], queue.fake_free_list_head.next_free_block
        while len(head) < num_blocks and block is not None and block is not queue.fake_free_list_tail:
            head.append(block)
            block = block.next_free_block
        with_pages = [b for b in head if self.with_pages[b.block_id]]
        covered = self.headroom + self._transferable(self._excess_now())
        missing = len(head) - len(with_pages) - covered  # blocks without pages the engine's charge does not cover
        if missing <= 0:
            return
        plain, cached = [], []
        while block is not None and block is not queue.fake_free_list_tail:
            if self.with_pages[block.block_id]:
                (cached if block.block_hash is not None else plain).append(block)
            block = block.next_free_block
        front = with_pages + (plain + cached)[:missing]
        if len(front) == len(with_pages):
            return  # no other free block has pages
        for b in front:
            queue.remove(b)
        queue.prepend_n(front)
        self.counters["budget_limited_allocations"] += 1

    def _charge_new(self, blocks: list[Any]) -> None:
        """Charges the blocks handed out that have no pages yet, before any worker can create them: from
        the headroom and pending releases (what the free count inside ``allocate_slots`` promised
        rests on those alone), otherwise granted now. A hand-out past what the count backed (vLLM
        taking blocks outside ``allocate_slots``) waits up to ``GRANT_WAIT_S`` for other members to
        give memory back, then detaches the engine from the budget rather than end it."""
        fresh = [b.block_id for b in blocks if not self.with_pages[b.block_id]]
        need = self._cover(len(fresh))
        deadline = time.monotonic() + GRANT_WAIT_S
        while need and not self.member.try_grant(need * self.block_bytes):
            # the refusal is recorded as a wait: other members give free pages back
            self.counters["grant_waits"] += 1
            if time.monotonic() >= deadline:
                self.detach(BudgetError(
                    f"vLLM's scheduler handed out {need} blocks without pages past what the budget backed, "
                    f"and their {need * self.block_bytes} bytes were not granted within {GRANT_WAIT_S:g} s"))
                return
            self.member.wait_for_memory(0.2)
        self.with_pages[fresh] = True
        self.num_with_pages += len(fresh)

    def _cover(self, need: int) -> int:
        """Charges ``need`` blocks handed out from the headroom, then from pending releases' charge (the
        workers release those blocks before they create these); returns how many are still to be
        granted."""
        take = min(need, self.headroom)
        self.headroom -= take
        need -= take
        take = min(need, self._transferable(self._excess_now()))
        self.credit -= take
        return need - take

    def _note_refusal(self, num_new_tokens: int) -> None:
        """A refused allocation that stock vLLM would have granted waits on the budget: other members
        see it as pressure and give memory back."""
        if self.pool.free_block_queue.num_free_blocks <= self.num_free_blocks():
            return  # the pool itself is full: nothing the budget could change
        want = max(1, -(-num_new_tokens // self.block_size)) * self.block_bytes
        if self.member.try_grant(want):  # the memory came free meanwhile: not needed as a grant
            self.member.release(want)
        else:
            self.counters["waits_recorded"] += 1
            self.waits.refused = want

    # ---- giving pages back ----------------------------------------------------------------

    @property
    def steps_in_flight(self) -> int:
        """Steps scheduled whose output is not back yet (0-2 with vLLM's batch queue)."""
        return self.steps_scheduled - self.steps_confirmed

    def _free_blocks_with_pages(self) -> list[Any]:
        """Free blocks that have pages and that no forward in flight reads, in the order they go back:
        blocks serving no cached prefix first, then cached ones in vLLM's eviction order (the free
        queue's). A block freed while a step was in flight (under asynchronous scheduling a request
        finishes, or is preempted, while the step after it reads its blocks) waits for that step's
        output: its pages are not given back, nor its charge handed on, before the device is done."""
        plain, cached = [], []
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        tail = self.pool.free_block_queue.fake_free_list_tail
        while block is not None and block is not tail:
            if self.with_pages[block.block_id] and self.freed_after_step[block.block_id] <= self.steps_confirmed:
                (cached if block.block_hash is not None else plain).append(block)
            block = block.next_free_block
        return plain + cached

    def release(self, max_blocks: int | None) -> int:
        """Decides to give back the pages of up to ``max_blocks`` free blocks (all when None): out of
        vLLM's prefix cache now, released by every worker before its next forward, uncharged once that
        step's output is back. Caller holds the lock. Returns how many."""
        candidates = self._free_blocks_with_pages()
        if max_blocks is not None:
            candidates = candidates[:max(0, max_blocks)]
        for block in candidates:
            # out of vLLM's prefix cache before the contents go
            if block.block_hash is not None and self.pool._maybe_evict_cached_block(block):
                self.counters["cached_blocks_dropped"] += 1
        ids = [b.block_id for b in candidates]
        self.with_pages[ids] = False
        self.num_with_pages -= len(ids)
        self.pending.extend(ids)
        self.credit += len(ids)
        self.counters["blocks_released"] += len(ids)
        return len(ids)

    def attach_release(self, scheduler_output: Any) -> None:
        """In ``schedule``: the pending releases ride on this step's output, numbered."""
        self.steps_scheduled += 1
        setattr(scheduler_output, STEP_ATTRIBUTE, self.steps_scheduled)
        self._return_headroom()
        if not self.pending:
            return
        setattr(scheduler_output, RELEASE_ATTRIBUTE, self.pending)
        setattr(scheduler_output, UNCHARGE_ATTRIBUTE, self.credit)
        self.in_flight += self.credit
        self.pending, self.credit = [], 0
        self.counters["releases_sent"] += 1

    def confirm_release(self, scheduler_output: Any) -> None:
        """In ``update_from_output``: the step's output is back, so every rank released its blocks and
        finished the forward (the device too: the output holds its sampled tokens)."""
        self.steps_confirmed = max(self.steps_confirmed, getattr(scheduler_output, STEP_ATTRIBUTE, 0))
        blocks = getattr(scheduler_output, UNCHARGE_ATTRIBUTE, 0)
        if not getattr(scheduler_output, RELEASE_ATTRIBUTE, None):
            return
        if self.world_size > 1 and not scheduler_output.total_num_scheduled_tokens and self.confirm:
            self.confirm()  # no forward: no collective proved that every rank processed the step
        if blocks and not self.detached:
            self.guarded(self.member.release, blocks * self.block_bytes)
            self.in_flight -= blocks
        self.counters["releases_confirmed"] += 1

    def _release_here(self) -> None:
        """The worker is in this process and no step is under way: release and uncharge now."""
        assert self.local_pages is not None
        ids, blocks = self.pending, self.credit
        self.pending, self.credit = [], 0
        self.local_pages.release(ids)
        if blocks and not self.detached:
            self.guarded(self.member.release, blocks * self.block_bytes)
        self.counters["direct_releases"] += 1

    def kick(self) -> None:
        """Pending releases on an engine that may be idle: get them carried out. Caller holds the lock."""
        if not self.pending:
            return
        if self.wake is not None:
            self.wake()
        elif self.local_pages is not None and not self.steps_in_flight and not self._busy():
            self._release_here()
        # otherwise the next step carries them (an engine core stepped by its caller)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def _busy(self) -> bool:
        return bool(self.scheduler.running) or bool(len(self.scheduler.waiting))

    def _keeper_step(self) -> bool:
        """One look of the keeper thread; False ends it (closed, or the budget can no longer be used)."""
        if self.detached:
            return False
        try:
            self._keeper_tick()
        except BudgetError as e:  # removed or damaged: the engine serves without it
            with self.lock:
                self.detach(e)
            self.kick()
            return False
        except Exception as e:  # noqa: BLE001 - shutdown; logged
            if self.keeper.stopping:
                return False
            from vllm.logger import init_logger

            init_logger("vllm.vattn").warning("vattn: giving KV pages back failed: %s", e)
            return not self.keeper.pause(1.0)
        return True

    def _keeper_tick(self) -> None:
        self.member.recover()  # a stuck budget lock: waited on here, not by the scheduler; owed uncharges made
        with self.lock:
            wake = self.waits.keeper_tick()
        if wake and self.wake is not None:
            self.wake()  # an engine idle while the budget refused: something changed
        want = self.member.pressure()
        idle = not self.idle_released and time.monotonic() - self.last_active >= self.idle_release_s
        with self.lock:
            if want or idle:
                busy = self._busy()
                if busy:
                    self.note_activity()
                if idle and not busy:
                    self.release(None)
                    self.idle_released = True
                elif want:
                    blocks = -(-want // self.block_bytes) - self.credit - self.in_flight
                    if blocks > 0:
                        self.release(blocks)
                self.kick()
            self._report()

    def _report(self) -> None:
        """Tells the budget the split of what this engine holds (``python -m vattn top``)."""
        with_pages, _ = self._free_split()
        in_use = self.pool.num_gpu_blocks - 1 - self.pool.free_block_queue.num_free_blocks
        split = (in_use * self.block_bytes, with_pages * self.block_bytes)
        if split != self.last_report and sum(split) <= self.member.held_bytes and self.member.report(*split):
            self.last_report = split

    def note_activity(self) -> None:
        if self._busy():
            self.last_active = time.monotonic()
            self.idle_released = False

    def release_all(self) -> None:
        """Every free block's pages go back (the engine was put to sleep)."""
        with self.lock:
            self.release(None)
            self.counters["sleeps"] += 1
            self.kick()

    def close(self) -> None:
        self.keeper.stop()
        self.member.leave()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            with_pages, without = self._free_split()
            return dict(self.counters, **self.waits.stats(), blocks_with_pages=int(self.num_with_pages),
                        free_blocks_with_pages=with_pages, free_blocks_without_pages=without,
                        block_bytes=self.block_bytes, padding_bytes=self.padding_bytes,
                        held_bytes=self.member.held_bytes, held_by_device=self.member.held_by_device(),
                        grants_undone=self.member.counters["grants_undone"],
                        lock_timeouts=self.member.counters["lock_timeouts"],
                        unreturned_bytes=self.member.unreturned_bytes, budget=self.budget.name,
                        label=self.member.label,
                        world_size=self.world_size, idle_release_s=self.idle_release_s, detached=self.detached)


def check_config(vllm_config: Any) -> None:
    """At start-up, in every process: what a budget needs of vLLM's configuration."""
    if not budget_name_from_environment():
        return
    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        # the engine core charges every rank's pages to the budget of its own host; Ray's ranks may lie on
        # other machines, whose memory only a budget there, charged by the workers there, could govern
        raise ValueError(f"vattn: {ENV_VAR} is one machine's budget, charged by the engine core for every "
                         f"rank; vLLM's executor 'ray' places ranks on other machines, whose pages it cannot "
                         f"count or take back (that needs a budget per machine); use the mp executor on one "
                         f"machine, or unset {ENV_VAR} to serve on vattn without a budget")
    if parallel.distributed_executor_backend not in ("uni", "mp", None):
        raise ValueError(f"vattn: {ENV_VAR} with vLLM works with its own executors (uni, mp), not "
                         f"{parallel.distributed_executor_backend!r}; or unset {ENV_VAR}")
    if getattr(parallel, "nnodes", 1) > 1:
        # the same reason as Ray's: the budgets are this machine's; the engine core cannot charge another's
        raise ValueError(f"vattn: {ENV_VAR} names this machine's budgets (one per device), charged by the engine "
                         f"core; with nnodes={parallel.nnodes} ranks lie on other machines, whose pages it cannot "
                         f"count or take back; serve on one machine, or unset {ENV_VAR}")
