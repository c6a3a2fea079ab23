"""The cuda backend on a real GPU. Skips where torch has no CUDA or no driver."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import vattn

MiB = 1024 * 1024


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU and a CUDA build of torch"
    try:
        vattn.backends.cuda_info(0, "libcuda.so.1")
    except vattn.VAttnError as e:
        return f"CUDA driver unusable: {e}"
    return None


pytestmark = pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))


@pytest.fixture(autouse=True)
def real_driver(monkeypatch):
    monkeypatch.delenv("VATTN_CUDA_DRIVER_LIB", raising=False)


def make(**overrides):
    args = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16, max_batch_size=8,
                max_context_len=16384, device="cuda", physical_memory=512 * MiB)
    args.update(overrides)
    try:
        return vattn.KVCacheManager(**args)
    except vattn.DriverError as e:
        if "OUT_OF_MEMORY" in str(e):
            pytest.skip(f"GPU out of memory: {e}")
        raise


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_data_reads_back_on_gpu(layout):
    with make(layout=layout) as kv:
        reqs = [kv.alloc_reqid() for _ in range(3)]
        lens = [0] * 8
        written = {r: 0 for r in reqs}
        for target in (1, 100, 2048, 2049, 5000):
            for j, r in enumerate(reqs):
                lens[r] = target + j
            assert kv.step(lens)
            for r in reqs:
                k, v = kv.layer(2)
                n0, n1 = written[r], lens[r]
                k[r, n0:n1] = torch.arange(n0, n1, device="cuda", dtype=torch.float16).view(-1, 1, 1) + r
                written[r] = n1
        torch.cuda.synchronize()
        k, _ = kv.layer(2)
        for r in reqs:
            n = written[r]
            expect = torch.arange(0, n, device="cuda", dtype=torch.float16).view(-1, 1, 1) + r
            assert torch.equal(k[r, :n], expect.expand(-1, 8, 128))


def test_sdpa_gqa_on_gpu_cache_equals_dense():
    torch.manual_seed(0)
    with make() as kv:
        r = kv.alloc_reqid()
        n = 3000
        lens = [0] * 8
        lens[r] = n
        assert kv.step(lens)
        k, v = kv.layer(1)
        kd = torch.randn(n, 8, 128, device="cuda", dtype=torch.float16)
        vd = torch.randn(n, 8, 128, device="cuda", dtype=torch.float16)
        k[r, :n], v[r, :n] = kd, vd
        q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.float16)
        out = F.scaled_dot_product_attention(q, k[r, :n].transpose(0, 1)[None], v[r, :n].transpose(0, 1)[None],
                                             enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.double(), kd.transpose(0, 1)[None].double(),
                                             vd.transpose(0, 1)[None].double(), enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_step_from_another_thread_on_gpu():
    with make() as kv:
        r = kv.alloc_reqid()
        lens = [0] * 8
        lens[r] = 4000
        ok = []
        t = threading.Thread(target=lambda: ok.append(kv.step(lens)))
        t.start()
        t.join()
        assert ok == [True]
        k, _ = kv.layer(0)
        k[r, :4000] = 1.0
        torch.cuda.synchronize()
        assert float(k[r, :4000].float().sum()) == 4000 * 8 * 128


def test_out_of_pages_and_reclaim_on_gpu():
    with make(physical_memory=16 * 2 * MiB) as kv:  # 16 pages, 8 buffers
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = [0] * 8
        lens[a] = lens[b] = 1000  # 1 page per buffer each
        assert kv.step(lens)
        lens[b] = 2000
        assert not kv.step(lens)
        kv.free_reqid(a)
        lens[a] = 0
        assert kv.step(lens)
        assert kv.stats()["reclaimed_pages"] == 8


# ---- the driver rules of tests/backends/test_cuda_driver_rules.py, on the real driver ------------


def _current_context() -> int | None:
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    ctx = ctypes.c_void_p()
    assert lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value


def _lens(by_reqid: dict[int, int]) -> list[int]:
    """seq_lens for make()'s 8 reqids: these lengths, 0 elsewhere."""
    return [by_reqid.get(r, 0) for r in range(8)]


def test_torchs_context_stays_current_and_a_bare_thread_stays_bare():
    torch.zeros(1, device="cuda")  # torch's context is current on this thread
    before = _current_context()
    assert before is not None
    with make(background=True, eager=True) as kv:
        r = kv.alloc_reqid()
        assert kv.step(_lens({r: 5000}))
        assert _current_context() == before
        kv.free_reqid(r)
        kv.reclaim()
        assert _current_context() == before
    assert _current_context() == before
    seen = []

    def bare_thread():  # no CUDA call of torch's here: the thread has no context
        seen.append(_current_context())
        with make() as kv2:
            r2 = kv2.alloc_reqid()
            assert kv2.step(_lens({r2: 3000}))
            seen.append(_current_context())
        seen.append(_current_context())

    t = threading.Thread(target=bare_thread)
    t.start()
    t.join()
    assert seen == [None, None, None]


def test_page_of_three_granules_on_gpu():
    g = vattn.backends.cuda_info(0)["granularity"]
    with make(layout="all_layers", page_size=3 * g, physical_memory=32 * 3 * g) as kv:
        r = kv.alloc_reqid()
        tokens_per_page = 3 * g // kv.config.token_bytes_per_buffer
        n = 2 * tokens_per_page + 5
        assert kv.step(_lens({r: n}))
        k, v = kv.layer(3)
        k[r, :n] = torch.arange(n, device="cuda", dtype=torch.float16).view(-1, 1, 1)
        torch.cuda.synchronize()
        assert torch.equal(k[r, :n, 0, 0], torch.arange(n, device="cuda", dtype=torch.float16))


def test_what_the_unmap_probe_found_works_on_this_driver():
    with make(physical_memory=64 * MiB) as kv:  # 32 pages, 8 buffers: 4 page ids
        tokens_per_page = kv.page_size // kv.config.token_bytes_per_buffer
        facts = dict(kv._pages.memory.backend.facts)
        assert facts["unmap"] in ("runs", "per_page"), facts
        print(f"driver {vattn.backends.cuda_info(0)['driver_version']}: unmap {facts['unmap']} "
              f"({facts['unmap_probe']})")
        a = kv.alloc_reqid()
        assert kv.step(_lens({a: 3 * tokens_per_page}))  # 3 adjacent pages per buffer
        kv.free_reqid(a)
        assert kv.reclaim() == 24
        b = kv.alloc_reqid()
        n = 4 * tokens_per_page
        assert kv.step(_lens({b: n}))  # every address maps again
        k, _ = kv.layer(1)
        k[b, :n] = 3.0
        torch.cuda.synchronize()
        assert float(k[b, :n].float().sum()) == 3.0 * n * 8 * 128


def test_reclaim_waits_for_a_kernel_still_reading_the_freed_pages():
    stream = torch.cuda.current_stream()
    with make(sync_streams=stream) as kv:
        r = kv.alloc_reqid()
        assert kv.step(_lens({r: 4000}))
        k, _ = kv.layer(0)
        k[r, :4000] = 1.0
        out = torch.zeros(4000, 8, 128, device="cuda", dtype=torch.float16)
        torch.cuda._sleep(200_000_000)  # the stream spins ~0.1 s, then reads the pages
        out.copy_(k[r, :4000])
        kv.free_reqid(r)  # the read fence: after the copy
        pages = -(-4000 * kv.config.token_bytes_per_buffer // kv.page_size) * kv.config.num_buffers
        assert kv.reclaim() == pages  # must wait for the copy before unmapping
        torch.cuda.synchronize()
        assert bool((out == 1.0).all())
        assert int(dict(kv._pages.memory.backend.facts)["event_waits"]) >= 1


def test_cuda_graph_replays_after_step_while_the_mapper_maps_other_requests():
    with make(background=True, eager=True, sync_streams=torch.cuda.current_stream()) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = _lens({a: 3000, b: 100})
        assert kv.step(lens)
        k, _ = kv.layer(0)
        k[a, :3000] = 0.0
        pos = torch.zeros(1, dtype=torch.long, device="cuda")  # the row the graph writes
        row = torch.full((1, 8, 128), 2.0, device="cuda", dtype=torch.float16)
        total = torch.zeros((), device="cuda", dtype=torch.float32)

        def forward():
            k[a].index_copy_(0, pos, row)
            total.copy_(k[a, :3000].float().sum())

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with kv.graph_capture(), torch.cuda.graph(graph):  # the mapper may have work now: it waits
            forward()
        maps = kv.stats()["background_page_maps"]
        for i in range(1, 200):
            lens[b] += 50  # b grows: the mapper maps its pages while the graph replays
            assert kv.step(lens)
            pos.fill_(i)
            graph.replay()
        torch.cuda.synchronize()
        assert float(total) == 2.0 * 200 * 8 * 128
        s = kv.stats()
        assert s["mapper_errors"] == 0 and s["background_page_maps"] > maps
