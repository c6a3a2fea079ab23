"""workloads/attention_padding.py and the busy wait under it: every attention
call is stretched to the factor times its length, on its own thread or on
helper threads beside it too, with the GIL released; bad factors, thread
counts or a second install are refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vattn._testing import busy_wait
from workloads import attention_padding


class Impl:
    def __init__(self) -> None:
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        time.sleep(0.01)
        return "out"


def worker_with(impls: list[Impl]) -> SimpleNamespace:
    context = {f"layer.{i}": SimpleNamespace(impl=impl) for i, impl in enumerate(impls)}
    context["no_attention"] = SimpleNamespace()  # other static-context entries have no impl
    return SimpleNamespace(model_runner=SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=context)))


def test_every_attention_call_takes_the_factor_times_its_length():
    impls = [Impl(), Impl()]
    worker = worker_with(impls)
    assert attention_padding.install(worker, 3.0) == 2
    for impl in impls:
        start = time.perf_counter()
        assert impl.forward() == "out"  # the call's result passes through
        elapsed = time.perf_counter() - start
        assert impl.calls == 1 and elapsed >= 3 * 0.01
    with pytest.raises(RuntimeError, match="already installed"):
        attention_padding.install(worker, 2.0)


def thread_cpu_seconds() -> dict[int, float]:
    """Each thread of this process: its seconds on a CPU (Linux's schedstat, in ns)."""
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            seconds[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return seconds


@pytest.mark.skipif(not Path("/proc/self/task").exists() or not Path("/proc/self/schedstat").exists(),
                    reason="needs Linux's /proc/<pid>/task/<tid>/schedstat: per-thread CPU time")
def test_more_threads_spin_the_wait_beside_the_calling_thread():
    impl = Impl()
    assert attention_padding.install(worker_with([impl]), 11.0, threads=2) == 1
    caller = threading.get_native_id()
    before = thread_cpu_seconds()
    start = time.perf_counter()
    impl.forward()  # 0.01 s of sleep, then 0.1 s of waiting on two threads
    assert time.perf_counter() - start >= 0.11
    after = thread_cpu_seconds()
    others = sum(t - before.get(tid, 0.0) for tid, t in after.items() if tid != caller)
    # the helper spins the 0.1 s too (at least a share of it on a machine that other work keeps busy); the
    # calling thread alone would leave the others' time where it was
    assert others >= 0.02, others


@pytest.mark.parametrize("factor,threads,message", [(1.0, 1, "factor must be above 1"),
                                                    (0.5, 1, "factor must be above 1"),
                                                    (float("nan"), 1, "factor must be above 1"),
                                                    (2.0, 0, r"threads must be in \[1, 64\]")])
def test_a_factor_not_above_one_or_no_thread_is_refused(factor, threads, message):
    impl = Impl()
    with pytest.raises(ValueError, match=message):
        attention_padding.install(worker_with([impl]), factor, threads)
    assert impl.forward() == "out" and impl.calls == 1


def test_the_busy_wait_spins_its_time_with_the_gil_released():
    start = time.perf_counter()
    busy_wait(0.05)
    assert time.perf_counter() - start >= 0.05
    counted = []

    def count() -> None:  # Python work in another thread: it runs only while the wait holds no GIL
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            counted.append(1)

    other = threading.Thread(target=count)
    other.start()
    busy_wait(0.1)
    seen_during_wait = len(counted)
    other.join()
    assert seen_during_wait > 1000
    for bad in (-1.0, 61.0, float("nan")):
        with pytest.raises(ValueError, match=r"seconds must be in \[0, 60\]"):
            busy_wait(bad)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"threads must be in \[1, 64\]"):
            busy_wait(0.0, bad)
