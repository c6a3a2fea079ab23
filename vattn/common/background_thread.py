"""A daemon thread that runs a function every few milliseconds and is gone before the interpreter finalizes.

Python 3.11-3.13 end a daemon thread that takes the GIL back after finalization began by unwinding its
stack (``pthread_exit``). vattn's bindings let that unwinding through (docs/design.md, "Threads at
exit"), but a thread that runs other libraries' code meets their guards too: torch's and pybind11's take
the GIL back in noexcept destructors, where the unwinding aborts the process ("terminate called without
an active exception", exit -6). So vattn's own background threads never reach finalization: each stops
and is joined at exit, before finalization begins (``atexit`` runs first), as well as when its owner
closes it.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable

JOIN_AT_EXIT_S = 5.0  # the longest the exit waits for a tick under way (a tick takes milliseconds)


class BackgroundThread:
    """Calls ``tick()`` every ``interval_s`` seconds in a daemon thread named ``name``, from
    :meth:`start` until ``tick`` returns False, :meth:`stop` is called, or the interpreter exits. An
    exception out of ``tick`` ends the thread (``tick`` handles the ones it can go on after)."""

    def __init__(self, tick: Callable[[], bool | None], interval_s: float, name: str) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self._tick = tick
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        # a weak reference: the registration for the exit must not keep a stopped thread's owner alive
        self._at_exit = _stop_at_exit(weakref.ref(self))

    def start(self) -> None:
        """Starts the thread (once)."""
        atexit.register(self._at_exit)
        self.thread.start()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (or the interpreter is exiting)."""
        return self._stopping.is_set()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            if self._tick() is False:
                return

    def pause(self, seconds: float) -> bool:
        """Inside ``tick``: waits ``seconds`` unless the thread is stopped meanwhile. Returns whether
        it was (the tick should return False then)."""
        return self._stopping.wait(seconds)

    def stop(self, timeout_s: float = JOIN_AT_EXIT_S) -> bool:
        """Ends the thread after the tick under way, waiting up to ``timeout_s`` seconds for it (not
        from the thread itself). Returns whether the thread has ended."""
        self._stopping.set()
        atexit.unregister(self._at_exit)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout_s)
        return not self.thread.is_alive()


def _stop_at_exit(ref: weakref.ref[BackgroundThread]) -> Callable[[], None]:
    def stop() -> None:
        owner = ref()
        if owner is not None:
            owner.stop()

    return stop
