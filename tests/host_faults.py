"""The fault-injecting host backend the tests use, added through the backend
registry from the test side (no library file names it). Kept apart from
conftest so that scenario scripts run in subprocesses can use it without
importing pytest."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vattn import _testing
from vattn.backends import get_backend, register_backend, unregister_backend

FAULTY_HOST = "host_faulty"  # the name tests pass as backend= for the fault-injecting host backend


@contextlib.contextmanager
def faulty_host_backend(name: str = FAULTY_HOST) -> Iterator[_testing.FaultPlan]:
    """Registers, for the block, the host backend whose calls fail or are slow
    as the yielded plan says (vattn._testing: a decorator around the host
    backend, plus the host's own system calls that it recovers from): a
    backend added through the registry from here, no library file touched."""
    plan = _testing.FaultPlan()
    register_backend(
        name,
        device="cpu",
        factory=lambda spec: _testing.make_faulty_host_backend(spec.page_size, spec.num_pages, plan),
        defaults=get_backend("host").defaults,
        description="the host backend, failing and delaying the calls a vattn._testing.FaultPlan names",
    )
    try:
        yield plan
    finally:
        unregister_backend(name)
