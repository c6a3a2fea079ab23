"""The fake CUDA driver enforces each rule of the real one that vattn could
break (tests/backends/fake_cuda), shown here on the driver alone and, where
vattn meets the rule, on vattn too; tests/backends/test_cuda_driver_rules.py
holds the rules vattn once broke.

- a device access of an address not mapped with access faults, and the
  fault poisons the context: every later call returns ILLEGAL_ADDRESS;
- unmapping a page that queued work still uses is such a fault;
- CUDA graph capture: synchronizing, potentially unsafe calls in the
  capture's mode, the legacy stream beside a blocking capture, and waiting
  for a captured event fail and invalidate the capture;
- cuMemCreate's properties are checked as cuda.h states them;
- device memory is finite and other processes take it;
- alignment 0 in cuMemAddressReserve promises only the host page;
- the per-thread default stream is not the legacy one;
- driver calls can be given latency.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

import vattn
from backends.cuda_framework import (CAPTURE_GLOBAL, CAPTURE_RELAXED, CAPTURE_THREAD_LOCAL, CU_STREAM_PER_THREAD,
                                     CUDA_ERROR_CAPTURED_EVENT, CUDA_ERROR_ILLEGAL_ADDRESS,
                                     CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                                     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, Capture, Framework)

MiB = 1024 * 1024
G = 2 * MiB  # the fake's granularity
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY = 1, 2
CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_NOT_SUPPORTED = 101, 801


class Prop(ctypes.Structure):
    """CUmemAllocationProp (cuda.h; tests/backends/test_cuda_header_abi.py checks vattn's copy)."""

    class Flags(ctypes.Structure):
        _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", Flags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def good_prop() -> Prop:
    return Prop(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)  # pinned, on device 0


class Driver:
    """The raw VMM calls, in the framework's context."""

    def __init__(self, lib) -> None:
        self.lib = lib
        u64 = ctypes.c_ulonglong
        lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.POINTER(Prop), u64]
        lib.cuMemRelease.argtypes = [u64]
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        lib.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
        lib.cuMemMap.argtypes = [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64]
        lib.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
        lib.cuMemSetAccess.argtypes = [u64, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t]

    def create(self, size: int = G, prop: Prop | None = None, flags: int = 0) -> tuple[int, int]:
        h = ctypes.c_ulonglong()
        rc = self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(prop or good_prop()), flags)
        return rc, h.value

    def reserve(self, size: int, align: int) -> tuple[int, int]:
        p = ctypes.c_ulonglong()
        return self.lib.cuMemAddressReserve(ctypes.byref(p), size, align, 0, 0), p.value

    def page(self, access: int = 3) -> tuple[int, int, int]:
        """(base, handle, reservation size): one granule mapped with `access` in a 2-granule reservation."""
        rc, base = self.reserve(2 * G, G)
        assert rc == 0
        rc, h = self.create()
        assert rc == 0
        assert self.lib.cuMemMap(base, G, 0, h, 0) == 0
        if access:
            desc = AccessDesc(loc_type=1, loc_id=0, flags=access)
            assert self.lib.cuMemSetAccess(base, G, ctypes.byref(desc), 1) == 0
        return base, h, 2 * G

    def free(self, base: int, h: int, size: int) -> None:
        assert self.lib.cuMemUnmap(base, G) == 0
        assert self.lib.cuMemRelease(h) == 0
        assert self.lib.cuMemAddressFree(base, size) == 0


@pytest.fixture
def fw(fake_cuda):
    f = Framework(fake_cuda)
    f.init()
    yield f
    f.close()


@pytest.fixture
def drv(fake_cuda, fw):
    return Driver(fake_cuda)


def buf(n: int = 64):
    return (ctypes.c_char * n)()


# ---- faults poison the context -----------------------------------------------------------


@pytest.mark.parametrize("where", ["unmapped", "mapped-without-access", "write-to-read-only"])
def test_a_stray_access_faults_and_poisons_the_context(fake_cuda, fw, drv, where):
    access = {"unmapped": 3, "mapped-without-access": 0, "write-to-read-only": 1}[where]  # PROT_READWRITE, none, READ
    base, h, size = drv.page(access=access)
    addr = base + G if where == "unmapped" else base  # the reservation's second granule is not mapped
    assert fw.access(None, base, buf(), write=False) == (0 if where != "mapped-without-access" else 700)
    fake_cuda.expect_fault = True
    assert fw.access(None, addr, buf(), write=where != "unmapped") == CUDA_ERROR_ILLEGAL_ADDRESS
    assert fake_cuda.fake_cuda_context_poisoned(None)
    assert fake_cuda.fake_cuda_fault_address(None) == addr
    # sticky: every later call in the context fails the same way
    assert fw.memory_call() == CUDA_ERROR_ILLEGAL_ADDRESS
    assert fw.synchronize() == CUDA_ERROR_ILLEGAL_ADDRESS
    assert fake_cuda.cuMemUnmap(base, G) == CUDA_ERROR_ILLEGAL_ADDRESS
    assert fw.access(None, base, buf(), write=False) == CUDA_ERROR_ILLEGAL_ADDRESS


def test_a_poisoned_context_fails_vattn_and_a_fresh_one_works(fake_cuda, fw):
    fake_cuda.expect_fault = True
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=4096, device="cuda", physical_memory=16 * MiB,
                              policy={"background": False})
    r = kv.alloc_reqid()
    assert kv.step([100, 0] if r == 0 else [0, 100])
    beyond = kv.buffer_address(0) + r * kv.slice_bytes + kv.page_size  # the request's unmapped second page
    assert fw.access(None, beyond, buf(), write=False) == CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(vattn.DriverError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        kv.step([3000, 0] if r == 0 else [0, 3000])
    with pytest.raises(vattn.DriverError):
        kv.cleanup()
    del kv
    fw.close()
    assert fake_cuda.cuDevicePrimaryCtxReset_v2(0) == 0  # the way out: a new context
    fw.init()
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, device="cuda",
                              physical_memory=16 * MiB) as kv:
        kv.alloc_reqid()
        assert kv.step([3000])


def test_unmapping_a_page_that_queued_work_reads_faults(fake_cuda, fw, drv):
    s = fw.stream()
    base, h, size = drv.page()
    assert fw.access(s, base, buf(), write=False) == 0  # queued: not seen complete yet
    assert fake_cuda.cuStreamSynchronize(s) == 0  # now it is
    assert fake_cuda.cuMemUnmap(base, G) == 0 and not fake_cuda.fake_cuda_context_poisoned(None)
    assert fake_cuda.cuMemMap(base, G, 0, h, 0) == 0
    desc = AccessDesc(loc_type=1, loc_id=0, flags=3)
    assert fake_cuda.cuMemSetAccess(base, G, ctypes.byref(desc), 1) == 0
    assert fw.access(s, base + 64, buf(), write=True) == 0
    fake_cuda.expect_fault = True
    assert fake_cuda.cuMemUnmap(base, G) == 0  # the unmap itself succeeds; the kernel faults
    assert fake_cuda.fake_cuda_context_poisoned(None)
    assert fw.memory_call() == CUDA_ERROR_ILLEGAL_ADDRESS


def test_vattn_reclaim_waits_for_the_named_stream_and_faults_without_it(fake_cuda, fw):
    """A read queued on a stream vattn was told about is waited for; one on a
    stream it was not told about is still running when the page goes."""
    named, other = fw.stream(), fw.stream()
    args = dict(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                max_context_len=4096, device="cuda", physical_memory=16 * MiB,
                policy={"background": False, "eager": False}, sync_streams=named)
    with vattn.KVCacheManager(**args) as kv:
        r = kv.alloc_reqid()
        assert kv.step([1000 if i == r else 0 for i in range(2)])
        assert fw.access(named, kv.buffer_address(0) + r * kv.slice_bytes, buf(1024), write=False) == 0
        kv.free_reqid(r)
        assert kv.reclaim() == 2
        assert not fake_cuda.fake_cuda_context_poisoned(None)
    fake_cuda.expect_fault = True
    kv = vattn.KVCacheManager(**args)
    r = kv.alloc_reqid()
    assert kv.step([1000 if i == r else 0 for i in range(2)])
    assert fw.access(other, kv.buffer_address(0) + r * kv.slice_bytes, buf(1024), write=False) == 0
    kv.free_reqid(r)
    try:
        kv.reclaim()  # the K page's unmap faults the read; a later call in the reclaim may see it
    except vattn.DriverError as e:
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(e)
    assert fake_cuda.fake_cuda_context_poisoned(None)
    assert fw.memory_call() == CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(vattn.DriverError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        kv.cleanup()


# ---- CUDA graph capture ----------------------------------------------------------------


def test_synchronizing_during_a_capture_fails_and_invalidates_it(fake_cuda, fw):
    s = fw.stream()
    with Capture(fw, s) as cap:
        assert fw.synchronize() == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED  # the context holds a capture
        assert cap.status() == 2  # CU_STREAM_CAPTURE_STATUS_INVALIDATED
    assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and not cap.graph.value
    with Capture(fw, s) as cap:
        assert fake_cuda.cuStreamSynchronize(s) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    with Capture(fw, s) as cap:  # a clean capture records work instead of running it
        assert fw.access(s, 0x1000, buf(), write=False) == 0  # not run: no fault at a bogus address
    assert cap.result == 0 and not fake_cuda.fake_cuda_context_poisoned(None)


def test_events_and_the_legacy_stream_during_a_capture(fake_cuda, fw):
    s, other = fw.stream(), fw.stream()
    e = ctypes.c_void_p()
    assert fake_cuda.cuEventCreate(ctypes.byref(e), 2) == 0
    with Capture(fw, s) as cap:
        assert fake_cuda.cuEventRecord(e, other) == 0  # outside the capture: legal
        assert fake_cuda.cuEventSynchronize(e) == 0
        assert cap.status() == 1
        assert fake_cuda.cuEventRecord(e, s) == 0  # joins the graph ...
        assert fake_cuda.cuEventSynchronize(e) == CUDA_ERROR_CAPTURED_EVENT  # ... and cannot be waited for
    assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    blocking = fw.stream(flags=0)
    with Capture(fw, blocking) as cap:  # the legacy stream waits for blocking streams: it would join
        assert fake_cuda.cuEventRecord(e, None) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    with Capture(fw, s) as cap:  # beside a non-blocking capture the legacy stream is free
        assert fake_cuda.cuEventRecord(e, None) == 0
    assert cap.result == 0
    assert fake_cuda.cuStreamBeginCapture_v2(None, CAPTURE_GLOBAL) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert fake_cuda.cuEventDestroy_v2(e) == 0


@pytest.mark.parametrize("mode", [CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED])
def test_unsafe_calls_during_a_capture_follow_its_mode(fake_cuda, fw, drv, mode):
    s = fw.stream()

    def other_thread_creates(thread_mode: int) -> int:
        out = []

        def run():
            assert fake_cuda.cuCtxPushCurrent_v2(fw.ctx) == 0
            m = ctypes.c_int(thread_mode)
            assert fake_cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(m)) == 0
            rc, h = drv.create()
            out.append(rc)
            if rc == 0:
                fake_cuda.cuMemRelease(h)
            fake_cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
            fake_cuda.cuCtxPopCurrent_v2(None)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out[0]

    with Capture(fw, s, mode) as cap:
        relaxed_elsewhere = other_thread_creates(CAPTURE_RELAXED)
        global_elsewhere = other_thread_creates(CAPTURE_GLOBAL)
        rc, h = drv.create()  # on the capturing thread
        if rc == 0:
            fake_cuda.cuMemRelease(h)
    assert relaxed_elsewhere == 0  # a relaxed thread may always
    assert global_elsewhere == (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED if mode == CAPTURE_GLOBAL else 0)
    assert rc == (0 if mode == CAPTURE_RELAXED else CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    assert cap.result == (0 if mode == CAPTURE_RELAXED else CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)


def test_vattn_inside_a_capture_leaves_it_valid_and_without_graph_capture_breaks_it(fake_cuda, fw):
    side = fw.stream()
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB,
                              policy={"background": True, "eager": False, "lookahead_tokens": 2048},
                              sync_streams=0) as kv:
        a = kv.alloc_reqid()
        assert kv.step([100 if i == a else 0 for i in range(2)])
        kv.wait_idle()
        with kv.graph_capture(), Capture(fw, side) as cap:
            assert kv.step([2000 if i == a else 0 for i in range(2)])  # gives the mapper work it holds back
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.step([6000 if i == a else 0 for i in range(2)])
            time.sleep(0.05)
        assert cap.result == 0, "vattn reached the driver during the capture"
        kv.wait_idle()
        assert kv.mapped_tokens(a) >= 4096  # the mapper's lookahead, after the capture
        with Capture(fw, side) as cap:  # no graph_capture(): the step's cuMemCreate meets the capture
            with pytest.raises(vattn.DriverError, match="STREAM_CAPTURE_UNSUPPORTED"):
                kv.step([8000 if i == a else 0 for i in range(2)])
        assert cap.result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED


def test_a_graph_replays_its_accesses_with_indices_read_at_launch(fake_cuda, fw, drv):
    s = fw.stream()
    base, h, size = drv.page()
    index, src = ctypes.c_longlong(0), buf(8)
    src.value = b"vattn!!"
    with Capture(fw, s) as cap:
        assert fw.access(s, base, src, write=True, index=index, stride=4096) == 0
    assert cap.result == 0
    for i in (1, 3, 7):
        index.value = i
        assert cap.replay(s) == 0
    assert fake_cuda.cuStreamSynchronize(s) == 0
    for i in (1, 3, 7):
        assert ctypes.string_at(base + i * 4096, 7) == b"vattn!!"
    assert ctypes.string_at(base, 7) == b"\0" * 7  # the capture itself wrote nothing
    index.value = 512  # 512 x 4 KiB: the unmapped second granule
    fake_cuda.expect_fault = True
    assert cap.replay(s) == CUDA_ERROR_ILLEGAL_ADDRESS


# ---- cuMemCreate's properties, device memory, alignment ---------------------------------------


def prop_with(**fields) -> Prop:
    p = good_prop()
    for name, value in fields.items():
        if name in ("compressionType", "gpuDirectRDMACapable", "usage"):
            setattr(p.allocFlags, name, value)
        else:
            setattr(p, name, value)
    return p


@pytest.mark.parametrize("fields,rc", [
    ({}, 0),
    (dict(type=0), CUDA_ERROR_INVALID_VALUE),  # CU_MEM_ALLOCATION_TYPE_INVALID
    (dict(type=2), CUDA_ERROR_INVALID_VALUE),  # MANAGED: not for cuMemCreate
    (dict(loc_type=0), CUDA_ERROR_INVALID_VALUE),  # no location
    (dict(loc_type=4), CUDA_ERROR_INVALID_VALUE),  # HOST_NUMA_CURRENT: documented as invalid
    (dict(loc_type=2), CUDA_ERROR_NOT_SUPPORTED),  # host memory: not modelled
    (dict(loc_id=1), CUDA_ERROR_INVALID_DEVICE),
    (dict(requestedHandleTypes=1), 0),  # POSIX file descriptor
    (dict(requestedHandleTypes=2), CUDA_ERROR_INVALID_VALUE),  # Win32 on Linux
    (dict(requestedHandleTypes=16), CUDA_ERROR_INVALID_VALUE),  # no such type
    (dict(win32HandleMetaData=8), CUDA_ERROR_INVALID_VALUE),  # must be zero without Win32 handles
    (dict(compressionType=2), CUDA_ERROR_INVALID_VALUE),
    (dict(gpuDirectRDMACapable=2), CUDA_ERROR_INVALID_VALUE),
    (dict(usage=4), CUDA_ERROR_INVALID_VALUE),
])
def test_cumemcreate_checks_its_properties(fake_cuda, drv, fields, rc):
    handles = fake_cuda.fake_cuda_live_handles()
    got, h = drv.create(prop=prop_with(**fields))
    assert got == rc
    if got == 0:
        assert fake_cuda.cuMemRelease(h) == 0
    assert fake_cuda.fake_cuda_live_handles() == handles


def test_cumemcreate_checks_size_and_flags(fake_cuda, drv):
    assert drv.create(size=G + 4096)[0] == CUDA_ERROR_INVALID_VALUE  # not a multiple of the granularity
    assert drv.create(size=0)[0] == CUDA_ERROR_INVALID_VALUE
    assert drv.create(flags=1)[0] == CUDA_ERROR_INVALID_VALUE  # "must be zero now"


def test_device_memory_others_take_is_gone_for_vattn(fake_cuda, fw, drv):
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert fake_cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    held = total.value - free.value  # allocations of earlier tests (some leak on purpose)
    fake_cuda.fake_cuda_set_total_mem(held + 64 * MiB)
    assert fake_cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    assert (free.value, total.value) == (64 * MiB, held + 64 * MiB)
    assert fake_cuda.fake_cuda_other_process_alloc(60 * MiB)
    assert not fake_cuda.fake_cuda_other_process_alloc(8 * MiB)  # only 4 MiB left
    assert fake_cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    assert free.value == 4 * MiB
    assert vattn.backends.cuda_info(0)["free_bytes"] == 4 * MiB
    ok = [drv.create() for _ in range(3)]
    assert [rc for rc, _ in ok] == [0, 0, CUDA_ERROR_OUT_OF_MEMORY]
    for rc, h in ok[:2]:
        fake_cuda.cuMemRelease(h)
    fake_cuda.fake_cuda_other_process_free(60 * MiB)
    assert fake_cuda.fake_cuda_free_mem() == 64 * MiB


def test_step_returns_false_when_another_process_took_the_memory(fake_cuda, fw):
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB,
                              policy={"background": False, "eager": False}) as kv:
        a = kv.alloc_reqid()
        assert kv.step([2000 if i == a else 0 for i in range(2)])
        assert fake_cuda.fake_cuda_other_process_alloc(fake_cuda.fake_cuda_free_mem())  # torch took the rest
        assert kv.step([6000 if i == a else 0 for i in range(2)]) is False


def test_alignment_zero_promises_only_the_host_page(fake_cuda, drv):
    rc, base = drv.reserve(4 * G, 0)
    assert rc == 0 and base % 4096 == 0 and base % G != 0  # the driver's choice: no more than a host page
    assert fake_cuda.cuMemAddressFree(base, 4 * G) == 0
    rc, base = drv.reserve(4 * G, 2 * G)
    assert rc == 0 and base % (2 * G) == 0
    assert fake_cuda.cuMemAddressFree(base, 4 * G) == 0
    assert drv.reserve(4 * G, 3 * G)[0] == CUDA_ERROR_INVALID_VALUE  # not a power of two
    assert drv.reserve(G + 100, G)[0] == CUDA_ERROR_INVALID_VALUE  # not a multiple of the host page


# ---- default streams, latency ----------------------------------------------------------------


def test_the_per_thread_default_stream_is_not_the_legacy_one(fake_cuda, fw):
    fake_cuda.fake_cuda_launch(CU_STREAM_PER_THREAD)
    fake_cuda.fake_cuda_launch(CU_STREAM_PER_THREAD)
    legacy_before = fake_cuda.fake_cuda_stream_completed(None)
    assert fake_cuda.cuStreamSynchronize(None) == 0  # the legacy stream ...
    assert fake_cuda.fake_cuda_stream_completed(CU_STREAM_PER_THREAD) == 2  # ... waits for blocking streams
    fake_cuda.fake_cuda_launch(CU_STREAM_PER_THREAD)
    seen = []

    def other():  # another thread's per-thread stream is another stream
        fake_cuda.cuCtxPushCurrent_v2(fw.ctx)
        seen.append(fake_cuda.fake_cuda_stream_completed(CU_STREAM_PER_THREAD))
        assert fake_cuda.cuStreamSynchronize(CU_STREAM_PER_THREAD) == 0
        fake_cuda.cuCtxPopCurrent_v2(None)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [0]
    assert fake_cuda.fake_cuda_stream_completed(CU_STREAM_PER_THREAD) == 2  # this thread's third is still queued
    assert fake_cuda.fake_cuda_stream_completed(None) == legacy_before
    nonblocking = fw.stream()
    fake_cuda.fake_cuda_launch(nonblocking)
    assert fake_cuda.cuStreamSynchronize(1) == 0  # CU_STREAM_LEGACY: non-blocking streams are not waited for
    assert fake_cuda.fake_cuda_stream_completed(nonblocking) == 0
    assert fake_cuda.fake_cuda_stream_completed(CU_STREAM_PER_THREAD) == 3


def test_vattn_refuses_the_per_thread_stream_as_a_sync_stream(fake_cuda, fw):
    # On every thread it names that thread's own stream: a fence recorded by the
    # mapper thread would cover none of the caller's kernels.
    with pytest.raises(ValueError, match="CU_STREAM_PER_THREAD"):
        vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, device="cuda", sync_streams=2)


def test_driver_calls_take_the_latency_asked_for(fake_cuda, fw, drv):
    fake_cuda.fake_cuda_set_latency(b"cuMemCreate", 20_000)
    t = time.perf_counter()
    rc, h = drv.create()
    assert rc == 0 and time.perf_counter() - t >= 0.02
    t = time.perf_counter()
    assert fake_cuda.cuMemRelease(h) == 0 and time.perf_counter() - t < 0.02  # only the call named
    fake_cuda.fake_cuda_set_latency(b"*", 300)
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=64 * MiB,
                              policy={"background": True, "eager": True}) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        for n in range(1900, 4300, 50):  # every call slow: the mapper's rounds land later
            assert kv.step([n, n + 7] if a == 0 else [n + 7, n])
            for r, m in ((a, n), (b, n + 7)):
                for buffer in range(kv.config.num_buffers):
                    last = kv.buffer_address(buffer) + r * kv.slice_bytes + (m - 1) * kv.config.token_bytes_per_buffer
                    assert fw.access(None, last, buf(1024), write=False) == 0
        assert kv.stats()["mapper_errors"] == 0
