"""A process whose main thread returns while a daemon thread is inside a vattn call exits cleanly, and
vattn's own background thread is gone before the interpreter finalizes.

Python (3.11-3.13) ends a thread that takes the GIL back after finalization began by unwinding its
stack; where vattn took the GIL back in a noexcept destructor (pybind11's gil_scoped_release), or in
any destructor while the call's own exception unwound, that unwinding aborted the process ("terminate
called without an active exception", exit -6): an in-process vLLM engine with vattn's budget keeper
thread did so at exit now and then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vattn
from vattn import budget as vbudget
from vattn.common.background_thread import BackgroundThread

SCENARIOS = Path(__file__).with_name("exit_scenarios.py")
CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.parametrize("mode", [
    "budget-wait",  # a binding whose whole call runs without the GIL (gil_released)
    "attention",  # a binding that releases the GIL around its compute only (without_gil)
    "background-thread",  # vattn's own background thread, inside a torch op: stopped before finalization
    "raising",  # the call raises as the interpreter finalizes: the thread stops instead of unwinding twice
    "raising-when-finalizing",  # the same, every time: the call raises once it sees finalization begin
])
def test_a_daemon_thread_inside_vattn_does_not_abort_the_exit(mode, tmp_path):
    name = f"exit-{mode}-{os.getpid()}"
    vattn.Budget.create(name, 1 << 20)
    try:
        proc = subprocess.run([sys.executable, str(SCENARIOS), mode, name], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    finally:
        vbudget.remove(name, force=True)
    assert "exiting" in proc.stdout, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_background_thread_ticks_until_its_tick_ends_it_or_it_is_stopped():
    ticks = []
    ended = BackgroundThread(lambda: ticks.append(1) or len(ticks) < 3, 0.001, "vattn-test-ends")
    ended.start()
    ended.thread.join(10)
    assert not ended.thread.is_alive() and len(ticks) == 3 and not ended.stopping
    stopped = BackgroundThread(lambda: None, 0.001, "vattn-test-stopped")
    stopped.start()
    assert stopped.stop() and stopped.stopping and not stopped.thread.is_alive()
    with pytest.raises(ValueError, match="interval_s must be > 0 seconds, got 0"):
        BackgroundThread(lambda: None, 0, "vattn-test-bad")


def test_every_binding_releases_the_gil_through_without_gil():
    """The scenarios above reach a few bindings; the rest are held to the same mechanism by what they
    call: a scope guard or pybind11's call_guard takes the GIL back while a raised call unwinds."""
    header = CSRC / "common" / "released_gil.h"
    offenders = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cc") or path == header:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(word in line for word in ("ReleasedGil", "call_guard", "gil_scoped_release",
                                               "PyEval_SaveThread", "Py_BEGIN_ALLOW_THREADS")):
                offenders.append(f"{path.relative_to(CSRC)}:{number}: {line.strip()}")
    assert header.is_file() and not offenders, "\n".join(offenders)
    assert sum("without_gil(" in p.read_text() or "gil_released(" in p.read_text()
               for p in CSRC.rglob("*.cpp")) >= 5
