"""Helpers of the budget tests: unique budget names removed after each test,
the segment's file, and children forked to act as other processes."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import struct
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

import vattn
from vattn.budget import budget as vbudget

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()


def segment_path(name: str) -> Path:
    return SHM_DIR / f"vattn-budget-{name}"


@pytest.fixture
def budget_name():
    """A name no other test (or concurrent test run) uses; the budget is removed afterwards."""
    name = f"t{os.getpid()}-{next(_counter)}"
    yield name
    try:
        vbudget.remove(name, force=True)  # members a failed test's traceback keeps alive must not keep it
    except vattn.BudgetError:
        pass  # the test removed it


# The stable prefix of every format version: magic u64, version u32,
# header_bytes u32, entry_bytes u32, max_members u32.
PREFIX = struct.Struct("<QIIII")


def read_prefix(name: str) -> tuple[int, int, int, int, int]:
    return PREFIX.unpack(segment_path(name).read_bytes()[: PREFIX.size])


def patch_prefix(name: str, **fields: int) -> None:
    """Overwrites fields of the segment's prefix in place."""
    keys = ("magic", "version", "header_bytes", "entry_bytes", "max_members")
    values = dict(zip(keys, read_prefix(name)))
    values.update(fields)
    with open(segment_path(name), "r+b") as f:
        f.write(PREFIX.pack(*(values[k] for k in keys)))


class Child:
    """A forked process running ``body(conn)``; talks over a pipe of lines.

    A separate process (not a thread): its own pid, start time, address space
    and lock ownership, as another engine on the machine would have.
    """

    def __init__(self, body: Callable[["Child"], Any]):
        self._to_child_r, self._to_child_w = os.pipe()
        self._to_parent_r, self._to_parent_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(self._to_child_w)
                os.close(self._to_parent_r)
                self._in = os.fdopen(self._to_child_r, "r")
                self._out = os.fdopen(self._to_parent_w, "w")
                body(self)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(self._to_child_r)
        os.close(self._to_parent_w)
        self._in = os.fdopen(self._to_parent_r, "r")
        self._out = os.fdopen(self._to_child_w, "w")
        self.reaped = False

    def send(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def recv(self, timeout_s: float | None = None) -> str:
        """The next line; AssertionError when none comes within ``timeout_s``
        seconds (None: wait as long as it takes)."""
        if timeout_s is not None:
            import select

            if not select.select([self._in], [], [], timeout_s)[0]:
                raise AssertionError(f"process {self.pid} said nothing for {timeout_s} s")
        line = self._in.readline()
        if not line:
            raise EOFError("the other process closed its pipe (it died or failed: see its traceback above)")
        return line.rstrip("\n")

    def kill(self) -> None:
        """SIGKILL, not reaped: the child stays a zombie until wait()."""
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        """Reaps the child; its exit status (negative: killed by that signal)."""
        _, status = os.waitpid(self.pid, 0)
        self.reaped = True
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        for f in (self._in, self._out):
            try:
                f.close()
            except OSError:
                pass
        if not self.reaped:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait()


def run_in_child(fn: Callable[[], Any], timeout_s: float) -> str:
    """Runs ``fn`` in a forked child and returns what it printed as its result
    line ("ok" or the error), or "timeout" if it did not finish in time (the
    child is then killed): a call that could hang forever must not hang pytest."""
    import select

    def body(c: Child) -> None:
        try:
            fn()
            c.send("ok")
        except Exception as e:  # reported to the parent, which asserts on it
            import traceback
            where = traceback.extract_tb(e.__traceback__)[-1]
            c.send(f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})")

    child = Child(body)
    try:
        ready, _, _ = select.select([child._in], [], [], timeout_s)
        return child.recv() if ready else "timeout"
    finally:
        child.close()


_thread_exit_ready = False


FRESH_PROCESS = "VATTN_TEST_FRESH_PROCESS"


def run_in_fresh_process(request: pytest.FixtureRequest, timeout_s: float = 900) -> bool:
    """For tests whose children are forked from the test process: a process
    with other threads (the suite's earlier tests leave OpenMP pools and
    mapper threads behind) may be forked while one of them holds a lock the
    child then needs. Outside a fresh process this runs the test alone in a
    new interpreter (one thread when it forks) and returns True, having
    asserted that it passed; inside it returns False (run the test here)."""
    import subprocess
    import sys

    if os.environ.get(FRESH_PROCESS) == "1":
        return False
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           request.node.nodeid],
                          cwd=root, env=dict(os.environ, **{FRESH_PROCESS: "1"}), capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return True


def prepare_thread_exit() -> None:
    """Lets a child forked after this call end its main thread with
    pthread_exit: glibc loads libgcc_s (under the loader's lock) at a
    process's first thread exit by unwinding; done once here, the children
    inherit it loaded, and cannot block on a lock another thread of this
    process held at fork time."""
    global _thread_exit_ready
    if _thread_exit_ready:
        return
    import ctypes
    import threading

    import time

    # Never joined: a thread that leaves by pthread_exit skips Python's own
    # end of thread, so join() would wait forever; its task entry going is the end.
    t = threading.Thread(target=lambda: ctypes.CDLL(None).pthread_exit(None), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while t.native_id is None or os.path.exists(f"/proc/self/task/{t.native_id}"):
        assert time.monotonic() < deadline, "a thread did not end by pthread_exit"
        time.sleep(0.001)
    _thread_exit_ready = True


_STUCK_HOLDER = ("import sys, vattn._testing as hooks; hooks.budget_lock_raw(sys.argv[1]); print('held', flush=True); "
                 "sys.stdin.readline(); hooks.budget_unlock_raw(sys.argv[1]); print('released', flush=True)")


@contextlib.contextmanager
def stuck_lock_holder(name: str) -> Iterator[Callable[[], None]]:
    """Another process holds budget ``name``'s lock (a stopped or stuck holder) from entry until the
    function yielded is called (or the block ends: the holder is killed, which frees the lock)."""
    holder = subprocess.Popen([sys.executable, "-c", _STUCK_HOLDER, name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def let_go() -> None:
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"

    try:
        assert holder.stdout.readline().strip() == "held"
        yield let_go
    finally:
        holder.kill()
        holder.wait()
