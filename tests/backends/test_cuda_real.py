"""The cuda backend's GPU tests, each run on three devices (tests/backends/kv_devices.py):
the host backend, the fake CUDA driver (faults on any access of an address
not mapped with access, graph capture rules) and a real GPU, which skips
where torch has no CUDA or no driver. So what a GPU will run has already run.

Each test sets the policies it counts with: the defaults (background mapper,
eager allocation) map pages ahead of the lengths stepped, which a test
counting pages must switch off or count in.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vattn
from backends.kv_devices import make_device, on_a_bare_thread

MiB = 1024 * 1024
HEADS, HEAD_DIM = 8, 128  # Device.make's shape: 2 KiB per token per buffer, 1024 tokens per 2 MiB page


@pytest.fixture(params=["host", "fake_cuda", "cuda"])
def device(request):
    d = make_device(request.param, request)
    yield d
    d.close()


def _lens(by_reqid: dict[int, int]) -> list[int]:
    """seq_lens for make()'s 8 reqids: these lengths, 0 elsewhere."""
    return [by_reqid.get(r, 0) for r in range(8)]


def _stamps(start: int, stop: int, offset: int) -> torch.Tensor:
    """Rows [start, stop) as fp16 values start + offset .. stop - 1 + offset, [n, HEADS, HEAD_DIM]."""
    values = (torch.arange(start, stop, dtype=torch.float32) + offset).half()  # each value rounds alike
    return values.view(-1, 1, 1).expand(-1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_data_reads_back(device, layout):
    with device.make(layout=layout) as kv:
        reqs = [kv.alloc_reqid() for _ in range(3)]
        written = {r: 0 for r in reqs}
        for target in (1, 100, 2048, 2049, 5000):
            lens = _lens({r: target + j for j, r in enumerate(reqs)})
            assert kv.step(lens)
            for r in reqs:
                device.write(kv, 2, r, written[r], _stamps(written[r], lens[r], r))
                written[r] = lens[r]
        for r in reqs:
            assert torch.equal(device.read(kv, 2, r, written[r]), _stamps(0, written[r], r))


def test_sdpa_gqa_on_the_cache_equals_dense(device):
    gen = torch.Generator().manual_seed(0)
    with device.make() as kv:
        r = kv.alloc_reqid()
        n = 3000
        assert kv.step(_lens({r: n}))
        kd = torch.randn(n, HEADS, HEAD_DIM, generator=gen).half()
        vd = torch.randn(n, HEADS, HEAD_DIM, generator=gen).half()
        device.write(kv, 1, r, 0, kd, kind=0)
        device.write(kv, 1, r, 0, vd, kind=1)
        q = torch.randn(1, 32, 4, HEAD_DIM, generator=gen).half()
        out = device.attend(kv, 1, r, n, q)
        ref = F.scaled_dot_product_attention(q.double(), kd.transpose(0, 1)[None].double(),
                                             vd.transpose(0, 1)[None].double(), enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_step_from_another_thread(device):
    with device.make() as kv:
        r = kv.alloc_reqid()
        assert on_a_bare_thread(lambda: kv.step(_lens({r: 4000})))
        device.write(kv, 0, r, 0, torch.ones(4000, HEADS, HEAD_DIM))
        assert float(device.read(kv, 0, r, 4000).float().sum()) == 4000 * HEADS * HEAD_DIM


def test_out_of_pages_and_reclaim(device):
    # no mapper or eager pages: the pool holds exactly what the steps ask for
    with device.make(physical_memory=16 * 2 * MiB, policy={"background": False, "eager": False}) as kv:  # 2 page ids
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(_lens({a: 1000, b: 1000}))  # 1 page per buffer each
        assert not kv.step(_lens({a: 1000, b: 2000}))
        kv.free_reqid(a)
        assert kv.step(_lens({b: 2000}))
        assert kv.stats()["reclaimed_pages"] == 8


# ---- the driver rules of tests/backends/test_cuda_driver_rules.py, on every device ------------


def test_the_frameworks_context_stays_current_and_a_bare_thread_stays_bare(device):
    if not device.has_contexts:
        pytest.skip("needs a CUDA backend: the host backend has no CUDA contexts")
    before = device.adopt_context()  # torch's context is current on this thread
    assert before is not None
    with device.make(policy={"background": True, "eager": True}) as kv:
        r = kv.alloc_reqid()
        assert kv.step(_lens({r: 5000}))
        assert device.current_context() == before
        kv.free_reqid(r)
        kv.reclaim()
        assert device.current_context() == before
    assert device.current_context() == before

    def bare_thread():  # no CUDA call of the framework's here: the thread has no context
        seen = [device.current_context()]
        with device.make() as kv2:
            r2 = kv2.alloc_reqid()
            assert kv2.step(_lens({r2: 3000}))
            seen.append(device.current_context())
        seen.append(device.current_context())
        return seen

    assert on_a_bare_thread(bare_thread) == [None, None, None]


def test_page_of_three_granules(device):
    g = device.granularity
    with device.make(layout="all_layers", page_size=3 * g, physical_memory=32 * 3 * g) as kv:
        r = kv.alloc_reqid()
        tokens_per_page = 3 * g // kv.config.token_bytes_per_buffer
        n = 2 * tokens_per_page + 5
        assert kv.step(_lens({r: n}))
        device.write(kv, 3, r, 0, _stamps(0, n, 0))
        assert torch.equal(device.read(kv, 3, r, n)[:, 0, 0], _stamps(0, n, 0)[:, 0, 0])


def test_what_the_unmap_probe_found_works_on_this_driver(device):
    if not device.has_contexts:
        pytest.skip("needs a CUDA backend: the host backend has no unmap probe (munmap takes any range)")
    # no mapper (its one-token lookahead would map a fourth page at 3 pages' tokens)
    # and no eager pages (reclaim would return those too): exactly 3 pages per buffer
    with device.make(physical_memory=64 * MiB, policy={"background": False, "eager": False}) as kv:  # 4 page ids
        tokens_per_page = kv.page_size // kv.config.token_bytes_per_buffer
        facts = dict(kv._pages.memory.backend.facts)
        assert facts["unmap"] in ("runs", "per_page"), facts
        print(f"driver {vattn.backends.cuda_info(0)['driver_version']}: unmap {facts['unmap']} "
              f"({facts['unmap_probe']})")
        a = kv.alloc_reqid()
        assert kv.step(_lens({a: 3 * tokens_per_page}))  # 3 adjacent pages per buffer
        assert kv.stats()["pages_mapped"] == 24
        kv.free_reqid(a)
        assert kv.reclaim() == 24
        b = kv.alloc_reqid()
        n = 4 * tokens_per_page
        assert kv.step(_lens({b: n}))  # every address maps again
        device.write(kv, 1, b, 0, torch.full((n, HEADS, HEAD_DIM), 3.0))
        assert float(device.read(kv, 1, b, n).float().sum()) == 3.0 * n * HEADS * HEAD_DIM


def test_reclaim_waits_for_a_kernel_still_reading_the_freed_pages(device):
    with device.make(sync_streams=device.sync_streams(), policy={"background": False, "eager": False}) as kv:
        r = kv.alloc_reqid()
        assert kv.step(_lens({r: 4000}))
        device.write(kv, 0, r, 0, torch.ones(4000, HEADS, HEAD_DIM))
        result = device.slow_read(kv, 0, r, 4000)  # still reading when reclaim comes
        kv.free_reqid(r)  # the read fence: after the read
        pages = -(-4000 * kv.config.token_bytes_per_buffer // kv.page_size) * kv.config.num_buffers
        assert kv.reclaim() == pages  # must wait for the read before unmapping
        assert bool((result() == 1.0).all())
        if device.has_contexts:
            assert int(dict(kv._pages.memory.backend.facts)["event_waits"]) >= 1


def test_cuda_graph_replays_after_step_while_the_mapper_maps_other_requests(device):
    # b decodes one token per step from 700; the mapper maps 256 tokens ahead,
    # so b's second page is mapped in the background while the graph replays
    with device.make(policy={"background": True, "eager": True, "lookahead_tokens": 256},
                     sync_streams=device.sync_streams()) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = _lens({a: 3000, b: 700})
        assert kv.step(lens)
        device.write(kv, 0, a, 0, torch.zeros(3000, HEADS, HEAD_DIM))
        program = device.graph_program(kv, a, 3000, 2.0)
        program.capture()  # inside graph_capture(): the mapper may have work now; it waits
        maps = kv.stats()["background_page_maps"]
        for i in range(1, 200):
            lens[b] += 1
            assert kv.step(lens)
            program.run(i)
        assert program.total() == 2.0 * 200 * HEADS * HEAD_DIM  # rows 0 (capture) .. 199
        kv.wait_idle()
        s = kv.stats()
        assert s["mapper_errors"] == 0 and s["background_page_maps"] > maps
        assert kv.mapped_tokens(b) >= 2 * kv.page_tokens  # no step needed b's second page: the mapper's
