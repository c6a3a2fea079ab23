"""Attaching a budget to vLLM's engine core, and the scheduler's wrappers
that :mod:`vattn.integrations.vllm.hooks` installs: at start-up the engine
core asks every rank for its device and bytes, joins each device's budget
and gives its scheduler a :class:`~vattn.integrations.vllm.engine_budget.BudgetedBlockPool`
(docs/vllm.md "Under a budget"); the scheduler's block operations then run
under the pool's lock, each with what precedes and follows it."""

from __future__ import annotations

import functools
from typing import Any, Callable

from vattn.budget.membership import ENV_VAR, budget_name_from_environment

from .engine_budget import BudgetedBlockPool, idle_release_setting
from .engine_member import bytes_by_device, data_parallel_rank, join_ranks, member_label, worker_rank_charge
from .worker_budget import WorkerPages

POOL_ATTRIBUTE = "_vattn_budget"  # on vLLM's Scheduler: its BudgetedBlockPool, when under a budget


def pool_of(scheduler: Any) -> BudgetedBlockPool | None:
    """The budget's view of ``scheduler``'s block pool; None outside a budget."""
    return getattr(scheduler, POOL_ATTRIBUTE, None)


def worker_pages_here(executor: Any) -> WorkerPages | None:
    """The worker's handle when vLLM's executor runs it in this process (the in-process executor
    returns the object itself); None with worker processes of their own, whose results come back
    pickled."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if not isinstance(executor, UniProcExecutor):
        return None
    (pages,) = executor.collective_rpc("vattn_worker_pages")
    return pages


def attach(engine: Any) -> None:
    """Gives ``engine``'s scheduler the budget's view of its block pool, when ``VATTN_BUDGET`` is set
    and the workers serve on vattn: the engine core joins the budget of every device its ranks lie
    on, each charged for the ranks there. Once per engine."""
    name = budget_name_from_environment()
    if pool_of(engine.scheduler) is not None or not name:
        return
    executor = engine.model_executor
    charges = executor.collective_rpc(worker_rank_charge)
    if not charges or any(c is None for c in charges):
        return  # a worker without vattn's cache
    config = engine.vllm_config
    parallel = config.parallel_config
    label = member_label(config.model_config.served_model_name, parallel.tensor_parallel_size,
                         parallel.pipeline_parallel_size, data_parallel_rank(parallel))
    member = join_ranks(name, charges, label, f"environment variable {ENV_VAR}={name}")
    queue = getattr(engine, "input_queue", None)
    wake = None
    if queue is not None:
        from vllm.v1.engine import EngineCoreRequestType

        wake = functools.partial(queue.put_nowait, (EngineCoreRequestType.WAKEUP, None))

    world = len(charges)
    _, padding = bytes_by_device(charges)
    pool = BudgetedBlockPool(engine.scheduler, member, member.budget, member.unit_bytes, world, idle_release_setting(),
                             confirm=lambda: executor.collective_rpc(_processed), wake=wake,
                             local_pages=worker_pages_here(executor) if world == 1 else None, padding_bytes=padding)
    setattr(engine.scheduler, POOL_ATTRIBUTE, pool)
    pool.waits.start_up_warning(config.model_config.max_model_len)


def _processed(worker: Any) -> None:
    """A no-op every rank runs in order after the steps sent before it (a barrier for ``confirm``)."""


def engine_stats(engine: Any) -> dict[str, Any] | None:
    """``EngineCore.vattn_budget_stats``: the engine core's budget counters; None outside a budget."""
    pool = pool_of(engine.scheduler)
    return pool.stats() if pool is not None else None


def after_sleep(engine: Any, level: int) -> None:
    """After ``EngineCore.sleep(level)``: vLLM-CPU keeps the cache through sleep(); under a budget
    every free block's pages go back (level 1 and above)."""
    pool = pool_of(engine.scheduler)
    if pool is not None and level >= 1:
        pool.release_all()


def locked(method: Any, before: Callable[[BudgetedBlockPool, tuple, dict], None] | None = None,
           after: Callable[[BudgetedBlockPool, Any, tuple, dict], None] | None = None) -> Any:
    """``method`` of the scheduler under the budget's lock, after ``before(pool, args, kwargs)``; then,
    still under it, ``after(pool, result, args, kwargs)`` (the step's releases) and the engine's
    activity noted."""

    @functools.wraps(method)
    def wrapper(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        pool = pool_of(scheduler)
        if pool is None:
            return method(scheduler, *args, **kwargs)
        with pool.lock:
            if before is not None:
                before(pool, args, kwargs)
            out = method(scheduler, *args, **kwargs)
            if after is not None:
                after(pool, out, args, kwargs)
            pool.note_activity()
            return out

    return wrapper


def before_schedule(pool: BudgetedBlockPool, args: tuple, kwargs: dict) -> None:
    if not pool.detached:
        pool.guarded(pool.waits.before_schedule)  # requests over the limit aside, back, or failed


def after_schedule(pool: BudgetedBlockPool, scheduler_output: Any, args: tuple, kwargs: dict) -> None:
    pool.attach_release(scheduler_output)  # schedule's result: the step's output
    if not pool.detached:
        pool.guarded(pool.waits.after_schedule, scheduler_output.total_num_scheduled_tokens)


def after_update_from_output(pool: BudgetedBlockPool, outputs: Any, args: tuple, kwargs: dict) -> None:
    pool.confirm_release(args[0] if args else kwargs["scheduler_output"])  # update_from_output's argument
    pool.waits.report_failed(outputs)


def before_finish_requests(pool: BudgetedBlockPool, args: tuple, kwargs: dict) -> None:
    pool.waits.take_back(args[0] if args else kwargs.get("request_ids"))  # aborted while set aside


SCHEDULER_METHODS = (("schedule", before_schedule, after_schedule),
                     ("update_from_output", None, after_update_from_output),
                     ("finish_requests", before_finish_requests, None), ("reset_prefix_cache", None, None))
"""The scheduler's block operations run under the budget's lock, each with what precedes and follows it."""
