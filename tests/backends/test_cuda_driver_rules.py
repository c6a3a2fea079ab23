"""The cuda backend against driver rules it once broke, on the fake driver
(tests/backends/fake_cuda), which enforces each rule the way the real driver does:

- the caller's current context is restored after every call (context stack);
- the primary context's reference count: vattn never destroys a context a
  framework uses, nor leaves one current that it may destroy later;
- cuMemAddressReserve takes alignment 0 or a power of two;
- cuMemUnmap over adjacent pages mapped by separate calls: probed at run time,
  both answers handled;
- reclaim waits for the streams the caller names, not the whole device;
- graph_capture(): no driver call from vattn while a CUDA graph is captured.

tests/backends/test_cuda_fake_rules.py shows the fake enforcing each rule
(faults, capture rules, cuMemCreate's properties, device memory, alignment,
default streams, latency).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import pytest
import torch

import vattn
from backends.cuda_framework import Capture, Framework, device_read, device_write
from conftest import manager_state

MiB = 1024 * 1024
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_UNKNOWN = 999


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    # 4 heads x 128 x fp16 = 1 KiB per token per buffer: 2048 tokens per 2 MiB page
    args = dict(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                max_context_len=8192, device="cuda", physical_memory=64 * MiB)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


def lens_with(n: int, *reqids: int, batch: int = 4) -> list[int]:
    return [n if r in reqids else 0 for r in range(batch)]


def row_address(kv, buffer: int, reqid: int, token: int) -> int:
    return kv.buffer_address(buffer) + reqid * kv.slice_bytes + token * kv.config.token_bytes_per_buffer


def table_matches_driver(kv, lib) -> None:
    """The page table (mapped prefixes and orphans) names exactly the
    addresses the fake driver has mapped in the cache's range."""
    table = {addr for addr, _page in kv._pages.table()}
    for r in range(kv.config.max_batch_size):
        n = kv._pages.mapped_pages(r)
        for b in range(kv.config.num_buffers):
            base = kv.buffer_address(b) + r * kv.slice_bytes
            for p in range(kv.slice_bytes // kv.page_size):
                addr = base + p * kv.page_size
                mapped = lib.fake_cuda_handle_at(addr) != 0
                assert mapped == (addr in table), f"reqid {r} buffer {b} page {p}: driver {mapped}, table {not mapped}"
                assert p >= n or mapped, f"reqid {r} buffer {b} page {p} is in the prefix but not mapped"


@pytest.fixture
def framework(fake_cuda):
    fw = Framework(fake_cuda)
    assert fw.current() is None, "a previous test left a context current on this thread"
    yield fw
    fw.close()
    gc.collect()


def a_full_lifecycle(lib, check, **overrides) -> None:
    """Everything vattn does with a device, calling ``check()`` after each step."""
    kv = make(**overrides)
    check()
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    assert kv.step(lens_with(3000, a, b))
    check()
    device_write(lib, row_address(kv, 0, a, 2999), bytes([7]) * 1024)
    kv.free_reqid(a)
    check()
    assert kv.reclaim() > 0  # synchronize + unmap
    check()
    c = kv.fork(b, 2500)  # synchronize + copy
    check()
    kv.free_reqid(c)
    kv.wait_idle()
    kv.cleanup()
    check()
    del kv
    gc.collect()
    check()


# ---- 1. the caller's context is restored ---------------------------------------------


def test_a_thread_without_context_keeps_none(fake_cuda, framework):
    a_full_lifecycle(fake_cuda, lambda: (framework.current() is None) or pytest.fail("vattn left a context current"))


def test_a_threads_own_context_stays_current(fake_cuda, framework):
    own = framework.push_own_context()

    def check():
        assert framework.current() == own, "vattn switched the caller's context"
        assert fake_cuda.fake_cuda_context_depth() == 1
        assert framework.memory_call() == 0

    a_full_lifecycle(fake_cuda, check)
    a_full_lifecycle(fake_cuda, check, policy={"background": True, "eager": True})
    vattn.backends.cuda_info(0)
    check()
    fake_cuda.fake_cuda_destroy_context(own)


def test_mapper_and_other_threads_end_without_a_context(fake_cuda, framework):
    before = fake_cuda.fake_cuda_threads_left_with_context()
    with make(policy={"background": True, "eager": True, "eager_tokens": 3000}) as kv:
        kv.wait_idle()
        r = kv.alloc_reqid()
        t = threading.Thread(target=lambda: kv.step(lens_with(5000, r)))
        t.start()
        t.join()
        kv.wait_idle()
        assert kv.stats()["background_page_maps"] > 0 and kv.stats()["mapper_errors"] == 0
    # the mapper thread is joined by cleanup; neither it nor t kept a context
    assert fake_cuda.fake_cuda_threads_left_with_context() == before


# ---- 6. contexts vattn did not make ------------------------------------------------


def test_context_a_framework_holds_survives_everything(fake_cuda, framework):
    ctx = framework.init()  # the framework came first: it retained the primary context
    assert fake_cuda.fake_cuda_primary_refs() == 1

    def check():
        assert framework.current() == ctx
        assert fake_cuda.fake_cuda_context_alive(ctx)
        assert framework.memory_call() == 0

    a_full_lifecycle(fake_cuda, check)
    vattn.backends.cuda_info(0)
    check()
    assert fake_cuda.fake_cuda_primary_refs() == 1  # all vattn's references are gone, the framework's stays
    assert framework.primary_active()


def test_framework_initialised_after_vattn_gets_a_live_context(fake_cuda, framework):
    # vattn first, on a thread with no context; the framework initialises lazily
    # later on the same thread and adopts whatever it finds current there.
    kv = make()
    r = kv.alloc_reqid()
    assert kv.step(lens_with(100, r))
    ctx = framework.init()
    kv.cleanup()
    del kv
    gc.collect()  # vattn's last reference to the primary context goes
    # Had vattn left its context current, the framework would have adopted it
    # without a reference of its own, and it would be destroyed by now.
    assert fake_cuda.fake_cuda_context_alive(ctx), "the framework's context was destroyed under it"
    assert framework.memory_call() == 0
    assert framework.retained and fake_cuda.fake_cuda_primary_refs() == 1


def test_device_probe_leaves_no_trace(fake_cuda, framework):
    creations = fake_cuda.fake_cuda_primary_creations()
    info = vattn.backends.cuda_info(0)
    assert info["granularity"] == 2 * MiB and info["free_bytes"] > 0
    assert framework.current() is None
    assert not framework.primary_active()  # it created the context for the query, and only that one went
    assert fake_cuda.fake_cuda_primary_creations() == creations + 1
    ctx = framework.init()
    creations = fake_cuda.fake_cuda_primary_creations()
    vattn.backends.cuda_info(0)
    assert fake_cuda.fake_cuda_primary_creations() == creations  # the framework's was used, not remade
    assert framework.current() == ctx and fake_cuda.fake_cuda_primary_refs() == 1


# ---- 2. reservation alignment ------------------------------------------------------


def test_page_of_three_granules_reserves_and_maps(fake_cuda):
    # an all-layers page: 3 x 2 MiB is a multiple of the granularity but not a power of two
    page = 6 * MiB
    with make(page_size=page, layout="all_layers", num_layers=3, physical_memory=128 * MiB) as kv:
        assert kv.page_size == page
        assert kv.buffer_address(0) % (2 * MiB) == 0
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        tokens_per_page = page // kv.config.token_bytes_per_buffer
        assert kv.step(lens_with(2 * tokens_per_page + 1, a, b))
        for buf in range(kv.config.num_buffers):
            for r, value in ((a, 0x41), (b, 0x42)):
                addr = row_address(kv, buf, r, 2 * tokens_per_page)
                device_write(fake_cuda, addr, bytes([value + buf]) * kv.config.token_bytes_per_buffer)
                assert device_read(fake_cuda, addr, 4) == bytes([value + buf]) * 4
        table_matches_driver(kv, fake_cuda)


# ---- 3. unmapping runs of adjacent pages ---------------------------------------------


def backend_facts(kv) -> dict:
    return dict(kv._pages.memory.backend.facts)


@pytest.mark.parametrize("spans", [False, True], ids=["driver-refuses-runs", "driver-accepts-runs"])
def test_unmap_uses_runs_only_where_the_driver_accepts_them(fake_cuda, monkeypatch, spans):
    if spans:
        monkeypatch.setenv("FAKE_CUDA_UNMAP_SPANS", "1")
    baseline = (fake_cuda.fake_cuda_live_mappings(), fake_cuda.fake_cuda_live_handles(),
                fake_cuda.fake_cuda_live_reservations())
    with make(physical_memory=32 * MiB) as kv:  # 16 pages: 4 ids
        facts = backend_facts(kv)
        assert facts["unmap"] == ("runs" if spans else "per_page"), facts
        assert facts["unmap_probe"].startswith("accepted" if spans else "refused"), facts
        # the probe left nothing behind
        assert fake_cuda.fake_cuda_live_mappings() == baseline[0]
        assert fake_cuda.fake_cuda_live_handles() == baseline[1]
        assert fake_cuda.fake_cuda_live_reservations() == baseline[2] + 1  # the cache's own
        a = kv.alloc_reqid()
        assert kv.step(lens_with(3 * 2048, a))  # 3 adjacent pages in each of 4 buffers
        kv.free_reqid(a)
        calls = fake_cuda.fake_cuda_unmap_calls()
        assert kv.reclaim() == 12
        assert fake_cuda.fake_cuda_unmap_calls() - calls == (4 if spans else 12)  # one per run, or per page
        assert fake_cuda.fake_cuda_live_mappings() == baseline[0]
        b = kv.alloc_reqid()
        assert kv.step(lens_with(4 * 2048, b))  # the unmapped addresses map again
        table_matches_driver(kv, fake_cuda)
    assert fake_cuda.fake_cuda_live_mappings() == baseline[0]
    assert fake_cuda.fake_cuda_live_reservations() == baseline[2]


def test_unmap_probe_failing_leaves_a_clean_state_and_maps_per_page(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_UNMAP_SPANS", "1")
    mappings, handles = fake_cuda.fake_cuda_live_mappings(), fake_cuda.fake_cuda_live_handles()
    fake_cuda.fake_cuda_fail(b"cuMemUnmap", 0, 1, CUDA_ERROR_UNKNOWN)  # the probe's joint unmap
    with make() as kv:
        facts = backend_facts(kv)
        assert facts["unmap"] == "per_page" and "CUDA_ERROR_UNKNOWN" in facts["unmap_probe"], facts
        assert fake_cuda.fake_cuda_live_mappings() == mappings
        assert fake_cuda.fake_cuda_live_handles() == handles
    fake_cuda.fake_cuda_fail(b"cuMemCreate", 1, 1, 2)  # the probe's second page
    with make() as kv:
        facts = backend_facts(kv)
        assert facts["unmap"] == "per_page" and "cuMemCreate" in facts["unmap_probe"], facts
        assert fake_cuda.fake_cuda_live_handles() == handles


def test_a_failed_run_unmap_retries_page_by_page(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_UNMAP_SPANS", "1")
    with make(physical_memory=32 * MiB) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(3 * 2048, a))
        kv.free_reqid(a)
        fake_cuda.fake_cuda_fail(b"cuMemUnmap", 0, 1, CUDA_ERROR_UNKNOWN)  # the first run's call
        assert kv.reclaim() == 12  # its pages went one by one
        assert fake_cuda.fake_cuda_live_mappings() == fake_cuda.baseline_mappings
        b = kv.alloc_reqid()
        assert kv.step(lens_with(3 * 2048, b))
        kv.free_reqid(b)
        # the run and then its first page fail: every page stays mapped, kept as orphans
        fake_cuda.fake_cuda_fail(b"cuMemUnmap", 0, 2, CUDA_ERROR_UNKNOWN)
        with pytest.raises(vattn.DriverError, match="cuMemUnmap"):
            kv.reclaim()
        table_matches_driver(kv, fake_cuda)
        fake_cuda.fake_cuda_clear_failures()
        kv.reclaim()
        assert kv.stats()["pages_orphaned"] == 0
    assert fake_cuda.fake_cuda_live_mappings() == fake_cuda.baseline_mappings


# ---- 4. waiting for the readers, not the device -------------------------------------


class StreamLike:
    """What torch.cuda.Stream offers vattn: the raw handle as .cuda_stream."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def launch(lib, stream: int, n: int = 1) -> None:
    """Queues n fake kernels on the stream."""
    for _ in range(n):
        lib.fake_cuda_launch(stream)


def reclaim_one_request(kv) -> None:
    a = kv.alloc_reqid()
    assert kv.step(lens_with(100, a))
    kv.free_reqid(a)
    assert kv.reclaim() == 4


def test_reclaim_waits_for_the_reads_queued_before_free(fake_cuda, framework):
    framework.init()
    s1, s2 = framework.stream(), framework.stream()
    events = fake_cuda.fake_cuda_live_events()
    with make(sync_streams=[s1, StreamLike(s2)]) as kv:
        ctx_syncs = fake_cuda.fake_cuda_sync_calls()
        a = kv.alloc_reqid()
        assert kv.step(lens_with(3000, a))
        launch(fake_cuda, s1, 2)  # the forward passes that read a
        launch(fake_cuda, s2, 1)
        kv.free_reqid(a)  # its read fence: an event on each stream
        launch(fake_cuda, s1, 3)  # later iterations of other requests
        launch(fake_cuda, s2, 3)
        assert kv.reclaim() == 8
        # the unmap waited for a's readers, not for the 3 kernels queued after
        assert [fake_cuda.fake_cuda_stream_completed(s) for s in (s1, s2)] == [2, 1]
        assert fake_cuda.fake_cuda_sync_calls() == ctx_syncs  # nor for the device
        assert backend_facts(kv)["sync"] == "events on 2 stream(s)"

        # The latest fence covers earlier ones; a fence already waited for costs no call.
        b, c = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens_with(100, b, c))
        kv.free_reqid(c)
        launch(fake_cuda, s1)
        kv.free_reqid(b)
        waits = int(backend_facts(kv)["event_waits"])
        kv.unmap_pages([b], [0])  # b's fence: both streams
        assert int(backend_facts(kv)["event_waits"]) == waits + 2
        assert fake_cuda.fake_cuda_stream_completed(s1) == 6
        syncs = [fake_cuda.fake_cuda_stream_syncs(s) for s in (s1, s2)]
        kv.unmap_pages([c], [0])  # c's earlier fence: covered
        assert [fake_cuda.fake_cuda_stream_syncs(s) for s in (s1, s2)] == syncs
        assert int(backend_facts(kv)["fence_waits_skipped"]) >= 1

        # fork copies once the work queued so far on the streams is done
        d = kv.alloc_reqid()
        assert kv.step(lens_with(2500, d))
        launch(fake_cuda, s2, 4)
        kv.fork(d, 2500)
        assert fake_cuda.fake_cuda_stream_completed(s2) == 8
        assert fake_cuda.fake_cuda_sync_calls() == ctx_syncs
    del kv
    gc.collect()
    assert fake_cuda.fake_cuda_live_events() == events  # vattn's events are destroyed with it


def test_trim_of_a_reused_reqid_waits_for_its_old_readers(fake_cuda, framework):
    framework.init()
    s = framework.stream()
    with make(sync_streams=s) as kv:
        ctx_syncs = fake_cuda.fake_cuda_sync_calls()
        a = kv.alloc_reqid()
        assert kv.step(lens_with(5000, a))  # 3 pages
        launch(fake_cuda, s, 2)
        kv.free_reqid(a)
        launch(fake_cuda, s, 5)
        assert kv.alloc_reqid(100, reqid=a) == a  # trims a's leftover pages to 1
        assert kv.mapped_tokens(a) == 2048
        assert fake_cuda.fake_cuda_stream_completed(s) == 2
        assert fake_cuda.fake_cuda_sync_calls() == ctx_syncs


def test_without_streams_every_wait_is_the_device(fake_cuda, framework):
    framework.init()
    s = framework.stream()
    with make() as kv:
        assert backend_facts(kv)["sync"] == "cuCtxSynchronize"
        syncs = fake_cuda.fake_cuda_sync_calls()
        reclaim_one_request(kv)
        assert fake_cuda.fake_cuda_sync_calls() == syncs + 1
        kv.set_sync_streams([s, s])  # duplicates count once; the switch waits for the device once
        assert fake_cuda.fake_cuda_sync_calls() == syncs + 2
        assert backend_facts(kv)["sync"] == "events on 1 stream(s)"
        launch(fake_cuda, s, 2)
        reclaim_one_request(kv)
        assert fake_cuda.fake_cuda_stream_completed(s) == 2
        launch(fake_cuda, s, 1)
        kv.set_sync_streams(None)  # back to the device: waits for the named stream's work first
        assert fake_cuda.fake_cuda_stream_completed(s) == 3
        assert fake_cuda.fake_cuda_sync_calls() == syncs + 2
        reclaim_one_request(kv)
        assert fake_cuda.fake_cuda_sync_calls() == syncs + 3


def test_a_fence_ring_that_wrapped_still_covers_old_reads(fake_cuda, framework):
    framework.init()
    s = framework.stream()
    with make(sync_streams=[s], max_batch_size=4) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(100, a))
        launch(fake_cuda, s, 1)
        kv.free_reqid(a)  # fence 1
        for _ in range(70):  # more fences than the ring holds: a's slot was re-recorded
            b = kv.alloc_reqid(reqid=(a + 1) % 4)
            launch(fake_cuda, s, 1)
            kv.free_reqid(b)
        kv.unmap_pages([a], [0])
        # a later fence was waited for: it covers a's reads (and more)
        assert fake_cuda.fake_cuda_stream_completed(s) >= 1
        assert kv.mapped_tokens(a) == 0


def test_reads_done_answers_each_fence_from_its_own_events(fake_cuda, framework):
    # 200 requests finish in one wave, more fences than 64 event sets: each
    # fence must still be answered by its own events, exactly.
    fake_cuda.fake_cuda_finish_upto.argtypes = [ctypes.c_void_p, ctypes.c_long]
    framework.init()
    s = framework.stream()
    n = 200
    with make(sync_streams=[s], max_batch_size=n, max_context_len=2048, physical_memory=8 * MiB) as kv:
        reqids = [kv.alloc_reqid() for _ in range(n)]
        covers = {}
        for r in reqids:
            covers[r] = fake_cuda.fake_cuda_launch(s)  # the forward that read r, then r finishes
            kv.free_reqid(r)
        assert int(backend_facts(kv)["fence_event_sets"]) > 64  # the ring grew instead of recording over a fence
        assert not any(kv._pages.reads_done(r) for r in reqids)  # nothing ran yet
        for done in (1, 37, 64, 65, 130, 199, 200):
            fake_cuda.fake_cuda_finish_upto(s, done)
            answers = {r: kv._pages.reads_done(r) for r in reqids}
            assert answers == {r: covers[r] <= done for r in reqids}, f"after {done} kernels finished"
        # finished fences give their events to later ones: no new set is made
        sets = int(backend_facts(kv)["fence_event_sets"])
        for r in reqids[:50]:
            assert kv.alloc_reqid(reqid=r) == r
            fake_cuda.fake_cuda_launch(s)
            kv.free_reqid(r)
        assert int(backend_facts(kv)["fence_event_sets"]) == sets
        assert not kv._pages.reads_done(reqids[0])
        fake_cuda.fake_cuda_finish(s)
        assert all(kv._pages.reads_done(r) for r in reqids)


def test_mapper_reclaim_waits_for_the_named_streams(fake_cuda, framework):
    framework.init()
    s = framework.stream()
    with make(physical_memory=16 * MiB, policy={"reclaim_threshold": 0.5, "background": True, "eager": False},
              sync_streams=[s]) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(4000, a))
        kv.wait_idle()
        ctx_syncs = fake_cuda.fake_cuda_sync_calls()
        launch(fake_cuda, s, 3)
        kv.free_reqid(a)
        kv.wait_idle()
        assert kv.stats()["background_reclaimed_pages"] == 4
        assert fake_cuda.fake_cuda_stream_completed(s) == 3
        assert fake_cuda.fake_cuda_sync_calls() == ctx_syncs


def test_sync_streams_are_checked_when_named(fake_cuda, framework):
    framework.init()
    good = framework.stream()
    with make() as kv:
        with pytest.raises(TypeError, match="sync_streams"):
            kv.set_sync_streams(["stream"])
        with pytest.raises(ValueError, match="sync_streams"):
            kv.set_sync_streams([-1])
        # a stream of another context cannot carry vattn's events: refused now, not at reclaim
        other = framework.push_own_context()
        foreign = framework.stream()
        fake_cuda.cuCtxPopCurrent_v2(None)
        framework.pushed -= 1
        with pytest.raises(vattn.DriverError, match="cuEventRecord"):
            kv.set_sync_streams([good, foreign])
        reclaim_one_request(kv)  # the old setting (the whole device) still holds
        fake_cuda.fake_cuda_destroy_context(other)
    with pytest.raises(ValueError, match="sync_streams"):
        vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, sync_streams=[good])


# ---- 7. CUDA graphs: step, then replay; nothing reaches the driver during capture --------


def pages_accessible(kv, lib, reqid: int, tokens: int) -> bool:
    """Every page the first `tokens` rows of reqid need is mapped with access, in every buffer."""
    pages = -(-tokens * kv.config.token_bytes_per_buffer // kv.page_size)
    return all(lib.fake_cuda_accessible(kv.buffer_address(b) + reqid * kv.slice_bytes + p * kv.page_size)
               for b in range(kv.config.num_buffers) for p in range(pages))


def test_step_returns_once_the_mappers_batch_for_its_lengths_landed(fake_cuda, monkeypatch):
    # A slow driver: the mapper's lookahead batch is still mapping when the
    # next step asks for those pages; a graph replayed after step must find them.
    monkeypatch.setenv("FAKE_CUDA_MAP_DELAY_US", "10000")
    with make(policy={"background": True, "eager": False, "lookahead_tokens": 4096}) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(100, a))  # the mapper now maps 2 more pages in 4 buffers (80 ms)
        time.sleep(0.02)
        sync_maps = kv.stats()["sync_page_maps"]
        assert kv.step(lens_with(4000, a))
        assert pages_accessible(kv, fake_cuda, a, 4000)
        s = kv.stats()
        assert s["step_wait_us"] > 0, "step did not wait for the round in flight"
        assert s["sync_page_maps"] == sync_maps  # the mapper's pages, not mapped twice


def test_decode_loop_with_mapper_finds_every_stepped_row_mapped(fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_MAP_DELAY_US", "300")
    with make(policy={"background": True, "eager": True}, max_batch_size=2) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        for n in range(1900, 4300, 25):  # crosses page boundaries while the mapper runs
            lens = [0, 0]
            lens[a], lens[b] = n, n + 7
            assert kv.step(lens)
            # what a replay launched now reads
            assert pages_accessible(kv, fake_cuda, a, n) and pages_accessible(kv, fake_cuda, b, n + 7)
        assert kv.stats()["mapper_errors"] == 0


def test_graph_capture_pauses_the_mapper_and_fails_other_threads_calls(fake_cuda):
    with make(policy={"background": True, "eager": False, "lookahead_tokens": 4096}) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens_with(100, a, b))
        kv.wait_idle()
        maps, unmaps = fake_cuda.fake_cuda_live_mappings(), fake_cuda.fake_cuda_unmap_calls()
        outcome = []

        def grow_b():
            try:
                outcome.append(kv.step(lens_with(8000, b)))
            except vattn.DriverError as e:
                outcome.append(e)

        with kv.graph_capture():
            # the capturing thread's step gives the mapper lookahead work it must not start
            assert kv.step(lens_with(4000, a, b))
            t = threading.Thread(target=grow_b)
            t.start()
            t.join(timeout=10)
            assert not t.is_alive(), "another thread's call blocked during the capture"
            assert isinstance(outcome[0], vattn.DriverError) and "another thread" in str(outcome[0])
            assert kv.step(lens_with(4000, a, b))  # no deadlock: the lock is free
            time.sleep(0.1)
            assert fake_cuda.fake_cuda_live_mappings() == maps, "a driver call during the capture"
            assert fake_cuda.fake_cuda_unmap_calls() == unmaps
        kv.wait_idle()  # the mapper does its lookahead now
        assert fake_cuda.fake_cuda_live_mappings() > maps
        assert kv.stats()["mapper_errors"] == 0
        assert kv.step(lens_with(8000, b))


def test_graph_capture_refuses_driver_calls_on_the_capturing_thread(fake_cuda, framework):
    framework.init()
    s = framework.stream()
    with make(sync_streams=s) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens_with(100, a, b))
        before = manager_state(kv)
        records = fake_cuda.fake_cuda_stream_records(s)
        with kv.graph_capture():
            assert kv.step(lens_with(100, a, b))  # needs no driver call
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.step(lens_with(3000, a))
            assert manager_state(kv)[1:] == before[1:]
            kv.free_reqid(b)  # deferred reclaim: no unmap, and no event on the capturing stream
            assert fake_cuda.fake_cuda_stream_records(s) == records
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.reclaim()
        assert kv.reclaim() == 4  # b's reads are waited for "now" instead
        assert kv.step(lens_with(3000, a))  # after the capture it maps
        with pytest.raises(RuntimeError, match="already"):
            with kv.graph_capture():
                with kv.graph_capture():
                    pass
        assert kv.step(lens_with(5000, a))  # the failed reentry left nothing paused or closed


def test_graph_capture_on_the_host_backend_pauses_only_the_mapper():
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2,
                              policy={"background": True, "eager": True}) as kv:
        r = kv.alloc_reqid()
        with kv.graph_capture():
            assert kv.step([100 if i == r else 0 for i in range(2)])
            kv.wait_idle()  # returns: a paused mapper counts as idle
        kv.wait_idle()


def test_an_error_inside_graph_capture_reopens_the_driver_and_the_mapper(fake_cuda):
    with make(policy={"background": True, "eager": False, "lookahead_tokens": 4096}) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(100, a))
        kv.wait_idle()
        with pytest.raises(KeyError):
            with kv.graph_capture():
                assert kv.step(lens_with(2000, a))  # gives the paused mapper lookahead work
                raise KeyError("the block's own error comes through")
        kv.wait_idle()  # the mapper resumed and did it
        assert kv.mapped_tokens(a) >= 2000 + 4096
        assert kv.step(lens_with(7000, a))  # the driver is open again
        assert kv.stats()["mapper_errors"] == 0


# ---- 8. releases wait for the end of a capture ------------------------------------------


def test_releases_during_a_capture_are_issued_after_it(fake_cuda, framework):
    framework.init()
    side = framework.stream()
    with make(physical_memory=16 * MiB) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(3000, a))  # 2 ids: 8 pages
        kv.free_reqid(a)
        assert kv.reclaim() == 8  # unmapped, still created in the free pool
        handles = fake_cuda.fake_cuda_live_handles()
        releases = fake_cuda.fake_cuda_releases_during_capture()
        with kv.graph_capture(), Capture(framework, side) as cap:
            assert kv.release_free_memory() == 8 * kv.page_size
            assert fake_cuda.fake_cuda_releases_during_capture() == releases, "a release during the capture"
            assert fake_cuda.fake_cuda_live_handles() == handles
            stats = kv.stats()  # the pages are out of the pool, their memory still held
            assert stats["pages_created"] == 0 and stats["pages_unreleased"] == 8
        assert cap.result == 0, "the capture was invalidated"
        assert fake_cuda.fake_cuda_live_handles() == handles - 8  # released when the capture ended
        assert backend_facts(kv)["deferred_releases"] == "1"
        stats = kv.stats()  # and the count says so as soon as the gate opened, not at the next creation
        assert stats["pages_unreleased"] == 0 and stats["pages_created"] == 0
        a = kv.alloc_reqid()
        assert kv.step(lens_with(3000, a))  # created again: fresh memory, the held ids' charge carried
        assert kv.stats()["pages_unreleased"] == 0
        assert fake_cuda.fake_cuda_live_handles() == handles


def test_a_manager_closed_during_a_capture_is_torn_down_after_it(fake_cuda, framework):
    framework.init()
    side = framework.stream()
    s = framework.stream()
    handles, mappings = fake_cuda.fake_cuda_live_handles(), fake_cuda.fake_cuda_live_mappings()
    reservations, events = fake_cuda.fake_cuda_live_reservations(), fake_cuda.fake_cuda_live_events()
    kv = make(sync_streams=[s])
    a = kv.alloc_reqid()
    assert kv.step(lens_with(3000, a))
    kv.free_reqid(a)  # a fence: events to destroy
    releases = fake_cuda.fake_cuda_releases_during_capture()
    with kv.graph_capture(), Capture(framework, side) as cap:
        kv.cleanup()  # no error: the teardown waits for the capture's end
        assert fake_cuda.fake_cuda_releases_during_capture() == releases, "a release during the capture"
        assert fake_cuda.fake_cuda_live_mappings() == mappings + 8
    assert cap.result == 0, "the capture was invalidated"
    assert fake_cuda.fake_cuda_live_mappings() == mappings
    assert fake_cuda.fake_cuda_live_handles() == handles
    assert fake_cuda.fake_cuda_live_reservations() == reservations
    del kv
    gc.collect()
    assert fake_cuda.fake_cuda_live_events() == events
    assert fake_cuda.fake_cuda_releases_during_capture() == releases


class StandInGraph:
    """torch.cuda.CUDAGraph's capture calls (torch here has no CUDA): vattn's hook wraps them."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass


def test_a_manager_closed_during_a_framework_capture_is_torn_down_after_it(fake_cuda, framework, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    framework.init()
    side = framework.stream()
    handles, reservations = fake_cuda.fake_cuda_live_handles(), fake_cuda.fake_cuda_live_reservations()
    kv = make()
    a = kv.alloc_reqid()
    assert kv.step(lens_with(3000, a))
    releases = fake_cuda.fake_cuda_releases_during_capture()
    graph = StandInGraph()
    graph.capture_begin()  # the hook closes the manager's gate
    try:
        with Capture(framework, side) as cap:
            kv.cleanup()
            assert fake_cuda.fake_cuda_live_handles() > handles  # kept until the capture ends
    finally:
        graph.capture_end()  # the hook owes the closed manager's backend this end
    assert cap.result == 0, "the capture was invalidated"
    assert fake_cuda.fake_cuda_releases_during_capture() == releases
    assert fake_cuda.fake_cuda_live_handles() == handles
    assert fake_cuda.fake_cuda_live_reservations() == reservations
