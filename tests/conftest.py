"""Shared fixtures: the fake CUDA driver, the fault-injecting host backend and
small helpers for state snapshots."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import vattn
from host_faults import faulty_host_backend
from vattn import _testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent / "benchmarks"
FAKE_CUDA_SOURCES = sorted((HERE / "backends" / "fake_cuda").glob("*.c"))
FAKE_UVM_SOURCE = HERE / "backends" / "fake_uvm" / "fake_uvm.c"


def load_setup():
    """The repository's setup.py as a module, for what it declares (extensions, each kernel unit's ISA
    flags, the build command class): its setup() runs only as __main__."""
    spec = importlib.util.spec_from_file_location("vattn_setup", HERE.parent / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, loaded by path (the benchmarks are
    scripts, not a package). What it imports from benchmarks/ (the harness,
    a sibling benchmark) loads the same way, under the name a script run
    from benchmarks/ finds it by."""
    if name in sys.modules:
        return sys.modules[name]
    finder = _BenchmarkFinder()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)


class _BenchmarkFinder:
    """Finds ``benchmarks/<name>.py`` for ``import <name>`` while a benchmark loads."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        source = BENCHMARKS / f"{fullname}.py"
        if "." in fullname or not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def c_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@pytest.fixture(scope="session")
def fake_cuda_lib(tmp_path_factory) -> Path:
    """Builds the test driver library (tests/backends/fake_cuda/*.c) once."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("needs a C compiler: cc builds the fake CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run([cc, "-O1", "-Wall", "-shared", "-fPIC", "-o", str(out), *map(str, FAKE_CUDA_SOURCES), "-lpthread"],
                   check=True)
    return out


@pytest.fixture(scope="session")
def fake_uvm_lib(tmp_path_factory) -> Path:
    """Builds the patched nvidia-uvm stand-in (tests/backends/fake_uvm/fake_uvm.c) once,
    for LD_PRELOAD."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("needs a C compiler: cc builds the nvidia-uvm stand-in")
    out = tmp_path_factory.mktemp("fake_uvm") / "libfakeuvm.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_UVM_SOURCE), "-ldl", "-lpthread"],
                   check=True)
    return out


def declare_fake_cuda(lib: ctypes.CDLL) -> ctypes.CDLL:
    """ctypes signatures of the fake driver's control functions."""
    ptr, ull, long_ = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_long
    lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, long_, long_, ctypes.c_int]
    lib.fake_cuda_set_latency.argtypes = [ctypes.c_char_p, long_]
    for name in ("live_handles", "live_mappings", "live_reservations", "sync_calls", "primary_refs",
                 "unmap_calls", "primary_creations", "live_events", "threads_left_with_context", "faults", "calls"):
        getattr(lib, f"fake_cuda_{name}").restype = long_
    lib.fake_cuda_accessible.argtypes = [ull]
    lib.fake_cuda_handle_at.argtypes = [ull]
    lib.fake_cuda_handle_at.restype = ull
    lib.fake_cuda_mappings_in.argtypes = [ull, ull]
    lib.fake_cuda_mappings_in.restype = long_
    # contexts, streams and graphs are opaque pointers
    lib.fake_cuda_create_context.restype = ptr
    lib.fake_cuda_create_context.argtypes = [ctypes.c_int]
    for name in ("destroy_context", "context_alive", "context_poisoned", "fault_address"):
        getattr(lib, f"fake_cuda_{name}").argtypes = [ptr]
    lib.fake_cuda_fault_address.restype = ull
    for name in ("stream_syncs", "stream_records", "stream_completed", "launch"):
        getattr(lib, f"fake_cuda_{name}").argtypes = [ptr]
        getattr(lib, f"fake_cuda_{name}").restype = long_
    lib.fake_cuda_finish.argtypes = [ptr]
    lib.fake_cuda_device_access.argtypes = [ptr, ull, ctypes.POINTER(ctypes.c_longlong), ull, ull, ctypes.c_int, ptr]
    lib.fake_cuda_set_total_mem.argtypes = [ull]
    lib.fake_cuda_other_process_alloc.argtypes = [ull]
    lib.fake_cuda_other_process_free.argtypes = [ull]
    lib.fake_cuda_free_mem.restype = ull
    lib.cuDevicePrimaryCtxReset_v2.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture
def fake_cuda(fake_cuda_lib, monkeypatch):
    """Points the cuda backend at the fake driver; yields its control handle.

    A device access that faults poisons the primary context for good, as on
    a GPU: a test that means to fault sets ``fake_cuda.expect_fault = True``;
    any other test that leaves the context poisoned fails. Either way the
    context is reset afterwards, so the next test starts clean."""
    monkeypatch.setenv("VATTN_CUDA_DRIVER_LIB", str(fake_cuda_lib))
    for name in ("FAKE_CUDA_GRANULARITY", "FAKE_CUDA_UNMAP_SPANS", "FAKE_CUDA_CALL_LATENCY_US", "FAKE_CUDA_TOTAL_MEM"):
        monkeypatch.delenv(name, raising=False)
    lib = declare_fake_cuda(ctypes.CDLL(str(fake_cuda_lib)))  # same path: the instance vattn loads
    lib.fake_cuda_clear_failures()
    lib.fake_cuda_uvm_reset()  # the nvidia-uvm descriptor follows this test's environment
    lib.expect_fault = False
    # Counters are process-wide: a test that injects an unmap failure leaves its
    # mapping behind on purpose, so leak checks compare with these baselines.
    lib.baseline_mappings = lib.fake_cuda_live_mappings()
    lib.baseline_handles = lib.fake_cuda_live_handles()
    lib.baseline_reservations = lib.fake_cuda_live_reservations()
    yield lib
    lib.fake_cuda_clear_failures()
    lib.fake_cuda_set_latency(b"*", -1)
    lib.fake_cuda_set_total_mem(0)
    lib.fake_cuda_other_process_free(2**63)
    gc.collect()  # managers the test dropped give their context references back
    poisoned = bool(lib.fake_cuda_context_poisoned(None))
    if poisoned:
        assert lib.cuInit(0) == 0
        assert lib.cuDevicePrimaryCtxReset_v2(0) == 0
    if poisoned and not lib.expect_fault:
        pytest.fail(f"a device access faulted at {lib.fake_cuda_fault_address(None):#x}: the context is poisoned")


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
