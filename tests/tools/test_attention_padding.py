"""workloads/attention_padding.py and the busy wait under it: every attention
call is stretched to the factor times its length, on its own thread or on
helper threads beside it too, with the GIL released; bad factors, thread
counts or a second install are refused."""

from __future__ import annotations

import os
import threading
import time
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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores: two threads spinning at once")
def test_more_threads_spin_the_wait_beside_the_calling_thread():
    impl = Impl()
    assert attention_padding.install(worker_with([impl]), 2.0, threads=2) == 1
    busy = []
    for _ in range(3):
        start_cpu, start = time.process_time(), time.perf_counter()
        impl.forward()
        busy.append((time.process_time() - start_cpu) / (time.perf_counter() - start))
    # the process's CPU time over the call's wall time: the sleep is none of it, the wait (about half the
    # call) two threads' worth, so close to 1; the calling thread alone spinning would make it about 0.5
    assert max(busy) > 0.8, busy


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
