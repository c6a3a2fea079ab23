"""First-contact defects of the CUDA path, against the fake driver
(tests/backends/fake_cuda) (the budget kept for failed releases:
tests/budget/test_release_failures.py):

- no manager's background threads call the driver while a framework captures
  a CUDA graph through torch.cuda.CUDAGraph, outside graph_capture();
- device info, then a manager, creates the primary context once."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import assert_invariants

import vattn
from vattn.backends import cuda as cuda_backends

MiB = 1024 * 1024
CUDA_ERROR_INVALID_VALUE = 1


# ---- 2. no background driver work during a framework's graph capture ---------------


class StandInGraph:
    """torch.cuda.CUDAGraph's capture API (torch here has no CUDA): what vattn wraps."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.begun = True

    def capture_end(self):
        self.begun = False


def test_mapper_waits_during_a_framework_capture(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    # Slow driver calls and one page per batch: the mapper has long work queued.
    fake_cuda.fake_cuda_set_latency(b"cuMemMap", 2000)
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                              max_context_len=65536, device="cuda", physical_memory=512 * MiB,
                              policy={"max_round_ids": 1, "background": True, "lookahead_tokens": 65536})
    try:
        r = kv.alloc_reqid()
        lens = [0] * 4
        lens[r] = 2048
        assert kv.step(lens)  # the mapper maps 31 more pages ahead of it, one id per batch
        time.sleep(0.05)
        g = StandInGraph()
        g.capture_begin()
        try:
            calls = fake_cuda.fake_cuda_calls()
            time.sleep(0.3)
            assert fake_cuda.fake_cuda_calls() == calls, "the mapper called the driver during the capture"
            lens[r] = 65536  # far more than the mapper can have mapped: the step must map
            with pytest.raises(vattn.DriverError, match="captured"):
                kv.step(lens)  # a foreground call that would map raises, as in graph_capture()
        finally:
            g.capture_end()
        calls = fake_cuda.fake_cuda_calls()
        deadline = time.monotonic() + 10
        while fake_cuda.fake_cuda_calls() == calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake_cuda.fake_cuda_calls() > calls, "the mapper did not resume after the capture"
        kv.wait_idle()
        assert_invariants(kv)
    finally:
        fake_cuda.fake_cuda_set_latency(b"*", -1)
        kv.cleanup()


def test_framework_capture_nests_with_graph_capture(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB) as kv:
        g = StandInGraph()
        r = kv.alloc_reqid()
        lens = [0, 0]
        lens[r] = 8192  # four pages: a step to it maps
        with kv.graph_capture():
            g.capture_begin()
            with pytest.raises(vattn.DriverError, match="captur"):
                kv.step(lens)
            g.capture_end()
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.step(lens)  # still inside graph_capture()
        g.capture_begin()  # a framework's capture alone closes the gate too
        with pytest.raises(vattn.DriverError, match="being captured"):
            kv.step(lens)
        g.capture_end()
        assert kv.step(lens)  # both gates open again


# ---- 3. device info, then a manager: one primary context -----------------------------


def test_device_info_then_manager_creates_one_context(fake_cuda):
    if fake_cuda.fake_cuda_primary_refs() != 0:
        pytest.skip("needs an unheld primary context: an earlier test left it held")
    creations = fake_cuda.fake_cuda_primary_creations()
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB)
    try:
        assert fake_cuda.fake_cuda_primary_creations() == creations + 1
        assert fake_cuda.fake_cuda_primary_refs() == 1  # the backend's own, the info's went
        assert fake_cuda.fake_cuda_threads_left_with_context() == 0
    finally:
        kv.cleanup()
        del kv
    import gc

    gc.collect()
    assert fake_cuda.fake_cuda_primary_refs() == 0


def test_kept_context_goes_back_when_no_backend_follows(fake_cuda):
    creations = fake_cuda.fake_cuda_primary_creations()
    info = cuda_backends.cuda_info(0, keep_context=True)
    assert info["context_kept"]
    assert fake_cuda.fake_cuda_primary_refs() == 1
    assert cuda_backends.release_cuda_context(0)
    assert fake_cuda.fake_cuda_primary_refs() == 0 and not cuda_backends.release_cuda_context(0)
    # A resolution that fails after the query gives the reference back too.
    with pytest.raises(ValueError):
        vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                             max_context_len=8192, device="cuda", physical_memory=32 * MiB, page_size=3 * MiB)
    assert fake_cuda.fake_cuda_primary_refs() == 0
    assert fake_cuda.fake_cuda_primary_creations() == creations + 2
    # Without keep_context the query leaves nothing behind.
    cuda_backends.cuda_info(0)
    assert fake_cuda.fake_cuda_primary_refs() == 0


def test_device_info_leaves_no_context_current(fake_cuda):
    seen = {}

    def query():
        cuda_backends.cuda_info(0, keep_context=True)
        cuda_backends.release_cuda_context(0)
        seen["done"] = True

    before = fake_cuda.fake_cuda_threads_left_with_context()
    t = threading.Thread(target=query)
    t.start()
    t.join()
    assert seen["done"] and fake_cuda.fake_cuda_threads_left_with_context() == before
