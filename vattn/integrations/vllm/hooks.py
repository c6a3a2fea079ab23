"""Where vattn's plugin hooks vLLM (installed once per process by
:func:`vattn.integrations.vllm.register`); the list with what each hook does is
in the package's docstring."""

from __future__ import annotations

from typing import Any

from . import budget as vllm_budget
from .attention import BACKEND_PATH
from .configuration import configure
from .worker import initialize_kv_cache_tensors, update_states, worker_block_bytes, worker_stats

_hooks_installed = False


def _skip_zeroing(runner: Any, block_ids: list[int]) -> None:
    """vLLM zeroes new blocks because its kernels read whole blocks; vattn's
    kernels read rows ``[0, seq_len)`` only, every one written first."""


def install_hooks() -> None:
    """Installs the hooks (once per process)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        configure(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    GPUModelRunner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
    GPUModelRunner._update_states = update_states(GPUModelRunner._update_states)
    GPUModelRunner._zero_block_ids = _skip_zeroing
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._zero_block_ids = _skip_zeroing
    Worker.vattn_stats = worker_stats
    Worker.vattn_block_bytes = worker_block_bytes
    vllm_budget.install()  # VATTN_BUDGET: the engine core joins it and its scheduler counts what it grants
