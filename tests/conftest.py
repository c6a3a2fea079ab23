"""Shared fixtures: the fake CUDA driver, the fault-injecting host backend and
small helpers for state snapshots."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import vattn
from host_faults import faulty_host_backend
from vattn import _testing

HERE = Path(__file__).resolve().parent
FAKE_CUDA_SOURCE = HERE / "backends" / "fake_cuda" / "fake_cuda.c"
FAKE_UVM_SOURCE = HERE / "backends" / "fake_uvm" / "fake_uvm.c"


def c_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@pytest.fixture(scope="session")
def fake_cuda_lib(tmp_path_factory) -> Path:
    """Builds the test driver library (tests/backends/fake_cuda/fake_cuda.c) once."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_CUDA_SOURCE), "-lpthread"], check=True)
    return out


@pytest.fixture(scope="session")
def fake_uvm_lib(tmp_path_factory) -> Path:
    """Builds the patched nvidia-uvm stand-in (tests/backends/fake_uvm/fake_uvm.c) once,
    for LD_PRELOAD."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler to build the nvidia-uvm stand-in")
    out = tmp_path_factory.mktemp("fake_uvm") / "libfakeuvm.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_UVM_SOURCE), "-ldl", "-lpthread"],
                   check=True)
    return out


@pytest.fixture
def fake_cuda(fake_cuda_lib, monkeypatch):
    """Points the cuda backend at the fake driver; yields its control handle."""
    monkeypatch.setenv("VATTN_CUDA_DRIVER_LIB", str(fake_cuda_lib))
    monkeypatch.delenv("FAKE_CUDA_GRANULARITY", raising=False)
    monkeypatch.delenv("FAKE_CUDA_UNMAP_SPANS", raising=False)
    lib = ctypes.CDLL(str(fake_cuda_lib))  # same path, so the same loaded instance as vattn's
    lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    for name in ("live_handles", "live_mappings", "live_reservations", "sync_calls", "primary_refs",
                 "unmap_calls", "primary_creations", "live_events", "threads_left_with_context"):
        getattr(lib, f"fake_cuda_{name}").restype = ctypes.c_long
    lib.fake_cuda_accessible.argtypes = [ctypes.c_ulonglong]
    lib.fake_cuda_handle_at.argtypes = [ctypes.c_ulonglong]
    lib.fake_cuda_handle_at.restype = ctypes.c_ulonglong
    # contexts and streams are opaque pointers
    lib.fake_cuda_create_context.restype = ctypes.c_void_p
    lib.fake_cuda_create_context.argtypes = [ctypes.c_int]
    for name in ("destroy_context", "context_alive"):
        getattr(lib, f"fake_cuda_{name}").argtypes = [ctypes.c_void_p]
    for name in ("stream_syncs", "stream_records", "stream_completed", "launch"):
        getattr(lib, f"fake_cuda_{name}").argtypes = [ctypes.c_void_p]
        getattr(lib, f"fake_cuda_{name}").restype = ctypes.c_long
    lib.fake_cuda_handle_at.restype = ctypes.c_ulonglong
    lib.fake_cuda_handle_at.argtypes = [ctypes.c_ulonglong]
    lib.fake_cuda_mappings_in.restype = ctypes.c_long
    lib.fake_cuda_mappings_in.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.fake_cuda_clear_failures()
    lib.fake_cuda_uvm_reset()  # the nvidia-uvm descriptor follows this test's environment
    # Counters are process-wide: a test that injects an unmap failure leaves its
    # mapping behind on purpose, so leak checks compare with these baselines.
    lib.baseline_mappings = lib.fake_cuda_live_mappings()
    lib.baseline_handles = lib.fake_cuda_live_handles()
    lib.baseline_reservations = lib.fake_cuda_live_reservations()
    yield lib
    lib.fake_cuda_clear_failures()


@pytest.fixture
def host_faults() -> Iterator[_testing.FaultPlan]:
    """The fault-injecting host backend (backend="host_faulty") for one test; yields its plan."""
    with faulty_host_backend() as plan:
        yield plan


def manager_state(kv: vattn.KVCacheManager) -> tuple:
    """Everything observable about a manager's bookkeeping, for equality checks."""
    b = kv.config.max_batch_size
    return (
        tuple(sorted(kv.stats().items())),
        tuple(kv._pages.mapped_pages(r) for r in range(b)),
        tuple(kv.is_allocated(r) for r in range(b)),
    )


def host_mappings(kv: vattn.KVCacheManager) -> dict[int, int]:
    """What the kernel really maps in kv's range: address -> page of the memfd
    pool, for every page mapped from the pool (read from /proc/self/maps)."""
    mem = kv._pages.memory
    base, end, page = mem.base, mem.base + mem.nbytes, kv.page_size
    out: dict[int, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi <= base or lo >= end or len(parts) < 6 or "vattn-kv-pool" not in parts[5]:
                continue
            offset = int(parts[2], 16)
            for addr in range(max(lo, base), min(hi, end), page):
                out[addr] = (offset + addr - lo) // page
    return out


def assert_table_is_real(kv: vattn.KVCacheManager, fake_cuda=None) -> None:
    """The page table (orphans included) describes exactly what is mapped:
    on the host, address by address and page by page; on the fake driver,
    the same addresses, and one allocation handle per physical page."""
    table = dict(kv._pages.table())
    if fake_cuda is None:
        assert host_mappings(kv) == table
        return
    mem = kv._pages.memory
    assert fake_cuda.fake_cuda_mappings_in(mem.base, mem.base + mem.nbytes) == len(table)
    handle_of: dict[int, int] = {}
    for addr, page in table.items():
        handle = fake_cuda.fake_cuda_handle_at(addr)
        assert handle != 0, f"the table maps {addr:#x} but the driver does not"
        assert handle_of.setdefault(page, handle) == handle, f"page {page} is two allocations"
    assert len(set(handle_of.values())) == len(handle_of), "two pages share one allocation"


def assert_invariants(kv: vattn.KVCacheManager) -> None:
    problem = kv._pages.check_invariants()
    assert problem == "", problem
