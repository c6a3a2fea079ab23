"""Where vLLM runs the model, asked of vLLM's platform at call time (every
part of the integration asks here, so a test can stand in for a CUDA build)."""

from __future__ import annotations


def platform_device() -> str:
    """The device type vLLM's platform runs the model on, as vattn serves it: ``cpu`` or ``cuda``."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"
