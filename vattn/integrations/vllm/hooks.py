"""Where vattn's plugin hooks vLLM: every patch, installed once per process
by :func:`vattn.integrations.vllm.register`. The list with what each hook
does is in the package's docstring; which process role each runs in is
docs/design.md section 8. The hooks' logic lives in the module of the role
that runs it (``configuration``: every process; ``engine_attach``, ``engine_budget``:
the engine core; ``worker``: the workers); this module only wires it in."""

from __future__ import annotations

import functools
from typing import Any

from . import engine_attach, engine_wait
from .attention import BACKEND_PATH
from .configuration import configure
from .worker import cleanup_profiling_kv_cache, initialize_kv_cache_tensors, update_states, worker_block_bytes
from .worker import worker_padding_bytes, worker_pages, worker_stats

_hooks_installed = False  # read and set by install_hooks alone


def _skip_zeroing(runner: Any, block_ids: list[int]) -> None:
    """vLLM zeroes new blocks because its kernels read whole blocks; vattn's
    kernels read rows ``[0, seq_len)`` only, every one written first."""


def install_hooks() -> None:
    """Installs the hooks (once per process)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    _install_configuration()
    _install_worker()
    _install_engine_core()
    _install_api_server()


def _install_configuration() -> None:
    """Every process: the configuration's checks, the attention backend."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        configure(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def _install_worker() -> None:
    """The workers: vattn's cache in the model runner, the worker's RPCs."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    GPUModelRunner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
    GPUModelRunner._update_states = update_states(GPUModelRunner._update_states)
    GPUModelRunner._cleanup_profiling_kv_cache = cleanup_profiling_kv_cache(GPUModelRunner._cleanup_profiling_kv_cache)
    GPUModelRunner._zero_block_ids = _skip_zeroing
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._zero_block_ids = _skip_zeroing
    Worker.vattn_stats = worker_stats
    Worker.vattn_block_bytes = worker_block_bytes
    Worker.vattn_padding_bytes = worker_padding_bytes
    Worker.vattn_worker_pages = worker_pages


def _install_engine_core() -> None:
    """The engine core: under ``VATTN_BUDGET`` it joins the budget and its scheduler counts what the
    budget grants (inert without one: the scheduler has no pool then)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    # EngineCore.__init__ loads vLLM's plugins itself (this hook, in an engine-core process of its own), so
    # wrapping __init__ comes too late there: this is the first method it calls once its scheduler exists
    stock_scheduler_ready = EngineCore._initialize_effective_attention_block_size

    @functools.wraps(stock_scheduler_ready)
    def scheduler_ready(engine: Any, *args: Any, **kwargs: Any) -> Any:
        out = stock_scheduler_ready(engine, *args, **kwargs)
        engine_attach.attach(engine)
        return out

    EngineCore._initialize_effective_attention_block_size = scheduler_ready
    EngineCore.vattn_budget_stats = engine_attach.engine_stats
    stock_sleep = EngineCore.sleep

    @functools.wraps(stock_sleep)
    def sleep(engine: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        out = stock_sleep(engine, level, *args, **kwargs)
        engine_attach.after_sleep(engine, level)
        return out

    EngineCore.sleep = sleep
    stock_shutdown = EngineCore.shutdown

    @functools.wraps(stock_shutdown)
    def shutdown(engine: Any) -> None:
        pool = engine_attach.pool_of(getattr(engine, "scheduler", None))  # before vLLM tears the scheduler down
        try:
            stock_shutdown(engine)
        finally:
            if pool is not None:
                pool.close()  # the engine core leaves the budget

    EngineCore.shutdown = shutdown
    for name, before, after in engine_attach.SCHEDULER_METHODS:
        setattr(Scheduler, name, engine_attach.locked(getattr(Scheduler, name), before, after))
    stock_has_requests = Scheduler.has_requests

    @functools.wraps(stock_has_requests)
    def has_requests(scheduler: Any) -> bool:
        return engine_wait.has_requests(engine_attach.pool_of(scheduler), stock_has_requests(scheduler))

    Scheduler.has_requests = has_requests
    for name in ("step", "step_with_batch_queue"):  # the second with asynchronous scheduling
        setattr(EngineCore, name, _blocking_before(getattr(EngineCore, name)))


def _blocking_before(stock_step: Any) -> Any:
    """``EngineCore.step`` or ``step_with_batch_queue``, which the engine core in the caller's process runs
    in the caller's loop: no busy loop while the budget refuses."""

    @functools.wraps(stock_step)
    def step(engine: Any) -> Any:
        engine_wait.block_before_step(engine_attach.pool_of(getattr(engine, "scheduler", None)))
        return stock_step(engine)

    return step


def _install_api_server() -> None:
    """The API server's process (vLLM's ``AsyncLLM``): a request the engine core finished over the
    budget's limit is answered with the reason, which names the limit and what it needs
    (:func:`engine_wait.over_limit_error`), where vLLM says only "Internal server error"."""
    from vllm.v1.engine.async_llm import AsyncLLM

    stock_generate = AsyncLLM.generate

    @functools.wraps(stock_generate)
    async def generate(engine: Any, *args: Any, **kwargs: Any) -> Any:
        reason = None
        async for output in stock_generate(engine, *args, **kwargs):
            reason = engine_wait.over_limit_reason(output)
            if reason is None:
                yield output
        if reason is not None:  # the request's last output: its stream has ended
            raise engine_wait.over_limit_error(reason)

    AsyncLLM.generate = generate
