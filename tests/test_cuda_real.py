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
