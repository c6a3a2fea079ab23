"""A daemon thread inside a vattn call that releases the GIL while the main thread returns and the
interpreter finalizes; run by tests/core/test_threads_at_exit.py. Prints ``exiting`` just before the
main thread returns.

``python exit_scenarios.py MODE BUDGET`` with MODE:

- ``budget-wait``: the thread waits on the full budget BUDGET (``wait_for_memory``, 50 ms at a time).
- ``attention``: the thread runs the host attention kernel on a 2048-token prompt, call after call.
- ``background-thread``: vattn's background thread (the one a vLLM engine's budget keeper runs in) ticks
  a torch matmul, whose binding releases the GIL pybind11's way: it must be stopped before finalization.
- ``raising``: another process holds BUDGET's lock; the thread's operations wait 50 ms for it and raise
  BudgetError, so the interpreter finalizes while a call unwinds its exception.
- ``raising-when-finalizing``: the thread's call (a test hook) waits without the GIL for the interpreter to
  begin finalizing and raises then, every time: the GIL is taken back with the exception pending.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import vattn

LOCK_HOLDER = ("import sys, vattn._testing as hooks; hooks.budget_lock_raw(sys.argv[1]); print('held', flush=True); "
               "sys.stdin.read()")  # until this process's end closes the pipe


def budget_wait(name: str, inside: threading.Event) -> None:
    budget = vattn.Budget.attach(name)
    assert budget.join("hog").try_grant(budget.limit)
    waiter = budget.join("waiter")
    while True:
        inside.set()
        waiter.wait_for_memory(0.05)


def attention(_: str, inside: threading.Event) -> None:
    import torch
    from torch.utils.dlpack import to_dlpack

    from vattn.attention import AttentionBatch
    from vattn.kernels import KERNELS
    from vattn.kernels.host import native

    # the kernel's own binding on capsules made once (it borrows them): no torch call in the loop, whose
    # bindings release the GIL as pybind11 does and would abort the exit on their own
    batch = AttentionBatch([0], [0], [2048])
    plan = batch.plan(KERNELS["host"]).native
    q, out = torch.randn(2048, 8, 64), torch.empty(2048, 8, 64)
    k_cache, v_cache = torch.randn(1, 2048, 2, 64), torch.randn(1, 2048, 2, 64)
    tensors = [to_dlpack(t) for t in (q, k_cache, v_cache, out)]
    while True:
        inside.set()
        native().attention(plan, *tensors, None, None, None, 0.125, 0.0, 0, None)


def background_thread(_: str, inside: threading.Event) -> None:
    import torch

    from vattn.common.background_thread import BackgroundThread

    a = torch.randn(384, 384)

    def tick() -> None:
        inside.set()
        for _ in range(20):  # ~ms each: the thread is inside torch most of the time
            torch.mm(a, a)

    BackgroundThread(tick, 0.001, "vattn-exit-scenario").start()  # its thread keeps it alive


def raising(name: str, inside: threading.Event) -> None:
    while True:
        inside.set()
        try:
            vattn.Budget.attach(name, lock_timeout_s=0.05).usage()
        except vattn.BudgetError:
            pass
        else:
            raise AssertionError("the budget's lock was free")


def raising_when_finalizing(_: str, inside: threading.Event) -> None:
    import vattn._testing as hooks

    while True:
        inside.set()
        try:
            hooks.raise_when_finalizing(0.05)
        except RuntimeError:
            pass


class SlowFinalization:
    """Held by this module until the interpreter clears it while finalizing: the finalization then lasts
    longer than one of the thread's calls, which returns meanwhile (and takes the GIL back then)."""

    def __del__(self, sleep=time.sleep) -> None:  # the module's names are None by then
        sleep(0.3)


def main(mode: str, name: str) -> None:
    holder = None
    if mode == "raising":
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, name], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        os.dup(holder.stdin.fileno())  # never closed: the holder keeps the lock until this process is gone
    inside = threading.Event()
    if mode == "background-thread":
        background_thread(name, inside)
    else:
        body = dict(budget_wait=budget_wait, attention=attention, raising=raising,
                    raising_when_finalizing=raising_when_finalizing)[mode.replace("-", "_")]
        threading.Thread(target=body, args=(name, inside), daemon=True).start()
    assert inside.wait(60)
    inside.clear()
    assert inside.wait(60)  # a second call began: the thread loops inside vattn now
    global finalization
    finalization = SlowFinalization()
    print("exiting", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
