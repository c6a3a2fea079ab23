"""Shared fixtures: the fake CUDA driver and small helpers for state snapshots."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import vattn

HERE = Path(__file__).resolve().parent
FAKE_CUDA_SOURCE = HERE / "fake_cuda" / "fake_cuda.c"


@pytest.fixture(scope="session")
def fake_cuda_lib(tmp_path_factory) -> Path:
    """Builds the test driver library (tests/fake_cuda/fake_cuda.c) once."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_CUDA_SOURCE), "-lpthread"], check=True)
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
    lib.fake_cuda_clear_failures()
    # Counters are process-wide: a test that injects an unmap failure leaves its
    # mapping behind on purpose, so leak checks compare with these baselines.
    lib.baseline_mappings = lib.fake_cuda_live_mappings()
    lib.baseline_handles = lib.fake_cuda_live_handles()
    lib.baseline_reservations = lib.fake_cuda_live_reservations()
    yield lib
    lib.fake_cuda_clear_failures()


def manager_state(kv: vattn.KVCacheManager) -> tuple:
    """Everything observable about a manager's bookkeeping, for equality checks."""
    b = kv.config.max_batch_size
    return (
        tuple(sorted(kv.stats().items())),
        tuple(kv._pages.mapped_pages(r) for r in range(b)),
        tuple(kv.is_allocated(r) for r in range(b)),
    )
