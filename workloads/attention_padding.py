"""Attention calls stretched in time without more memory traffic: every
attention layer's kernel call (``impl.forward``) is followed by a busy wait
on the same thread of ``factor - 1`` times the call's own length, which
touches no memory (``vattn._testing.busy_wait``, the GIL released as the
kernel releases it).

benchmarks/vllm_serving.py ``--pad-attention FACTOR`` runs vattn so padded as
an engine of its own: beside stock vLLM, whose kernel takes longer, it tells
what the kernel's length alone does to the rest of the forward (the same
model code after it) from what the kernel's reads and writes do. Installed
into every worker before the forward clocks (workloads/forward_clocks.py),
so the wait counts as attention, by
``llm.collective_rpc(attention_padding.install, args=(factor, threads))``;
``threads`` above 1 spins the wait on threads started beside the calling
one, as a kernel's parallel region keeps several cores busy.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

PADDED = "_vattn_attention_padding"  # on the worker: the factor installed


def _padded(method: Callable[..., Any], extra: float, threads: int,
            busy_wait: Callable[[float, int], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def padded(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy_wait(min(60.0, extra * (time.perf_counter() - start)), threads)
    return padded


def install(worker: Any, factor: float, threads: int = 1) -> int:
    """Pads every attention layer's kernel call of ``worker`` to ``factor`` (> 1) times its length, the wait
    spun on ``threads`` threads at once (1: the calling thread; more: threads started beside it for the
    wait, as a kernel's parallel region keeps several cores busy); returns the number of layers padded.
    Installing twice is refused."""
    if not factor > 1.0:
        raise ValueError(f"factor must be above 1, got {factor}")
    if not 1 <= threads <= 64:
        raise ValueError(f"threads must be in [1, 64], got {threads}")
    if hasattr(worker, PADDED):
        raise RuntimeError("attention padding is already installed in this worker")
    from vattn._testing import busy_wait

    layers = 0
    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            impl.forward = _padded(impl.forward, factor - 1.0, threads, busy_wait)
            layers += 1
    setattr(worker, PADDED, (factor, threads))
    return layers
