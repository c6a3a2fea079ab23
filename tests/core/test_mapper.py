"""Latency hiding: the background mapper, deferred reclamation, eager allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vattn

HERE = Path(__file__).resolve().parent
PAGE = 4096
TOKENS_PER_PAGE = 16  # 2 KV heads x 32 x fp32 = 256 B per token per buffer


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                max_context_len=512, page_size=PAGE)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": True, "eager": False, **(policy or {})})


def lens_with(n: int, reqid: int, b: int = 4) -> list[int]:
    lens = [0] * b
    lens[reqid] = n
    return lens


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_lookahead_keeps_decode_off_the_critical_path():
    with make(policy={"lookahead_tokens": 1}) as kv:
        r = kv.alloc_reqid()
        assert kv.step(lens_with(10, r))  # prefill: 1 page per buffer, mapped in step
        prefill_maps = kv.stats()["sync_page_maps"]
        assert prefill_maps == 4
        for n in range(11, 200):  # crosses 12 page boundaries
            kv.wait_idle()  # stands for the model's compute between steps
            assert kv.step(lens_with(n, r))
        s = kv.stats()
        assert s["sync_page_maps"] == prefill_maps
        assert s["background_page_maps"] == (13 - 1) * 4
        assert kv._pages.mapped_pages(r) == 13  # ceil(200 / 16): one token ahead of 199


def test_decode_steps_inside_a_page_do_not_wake_the_mapper():
    with make(policy={"lookahead_tokens": 1}) as kv:
        r = kv.alloc_reqid()
        assert kv.step(lens_with(1, r))
        kv.wait_idle()
        wakeups = kv.stats()["mapper_wakeups"]
        for n in range(2, 16):  # tokens 2..15 and the lookahead token stay in page 0
            assert kv.step(lens_with(n, r))
            kv.wait_idle()
        assert kv.stats()["mapper_wakeups"] == wakeups
        assert kv.step(lens_with(16, r))  # the lookahead token 17 needs page 1
        kv.wait_idle()
        s = kv.stats()
        assert s["mapper_wakeups"] == wakeups + 1
        assert kv._pages.mapped_pages(r) == 2 and s["sync_page_maps"] == 4


def test_without_mapper_every_boundary_maps_in_step():
    with make(policy={"background": False}) as kv:
        r = kv.alloc_reqid()
        for n in range(10, 200):
            assert kv.step(lens_with(n, r))
        s = kv.stats()
        assert s["sync_page_maps"] == 13 * 4 and s["background_page_maps"] == 0
        assert s["mapper_rounds"] == 0


def test_eager_premaps_the_next_slot():
    with make(policy={"eager": True, "eager_tokens": 40}) as kv:
        kv.wait_idle()
        assert kv._pages.mapped_pages(0) == 3  # ceil(40 / 16), before any request exists
        r = kv.alloc_reqid()
        assert r == 0
        assert kv.step(lens_with(40, r))
        assert kv.stats()["sync_page_maps"] == 0  # the prefill mapped nothing on the critical path
        kv.wait_idle()
        assert kv._pages.mapped_pages(1) == 3  # the next slot alloc_reqid will return
        assert kv.alloc_reqid() == 1


@pytest.mark.parametrize(
    "policy,exc,match",
    [
        ({"background": 1}, TypeError, "background"),
        ({"eager": "yes"}, TypeError, "eager"),
        ({"lookahead_tokens": -1}, ValueError, "lookahead_tokens"),
        ({"eager_tokens": -5}, ValueError, "eager_tokens"),
        ({"reclaim_threshold": 1.5}, ValueError, r"reclaim_threshold must be in \[0, 1\]"),
        ({"reclaim_threshold": "0.1"}, TypeError, "reclaim_threshold"),
    ],
)
def test_bad_policy_arguments(policy, exc, match):
    with pytest.raises(exc, match=match):
        make(policy=policy)


def test_eager_needs_the_mapper():
    with make(policy={"background": False, "eager": True}) as kv:
        assert kv.policy["eager"] is False
        assert kv._pages.mapped_pages(0) == 0


def test_threshold_reclaim_by_the_mapper():
    # 20 pages; floor = 50% = 10 free pages
    with make(physical_memory=20 * PAGE, policy={"reclaim_threshold": 0.5}) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(60, a))  # 4 pages per buffer = 16 pages (61 with lookahead: still 4)
        kv.wait_idle()
        b = kv.alloc_reqid()
        kv.free_reqid(a)  # 4 free < 10: the mapper cuts a's tail to get back above the floor
        kv.wait_idle()
        s = kv.stats()
        assert kv._pages.mapped_pages(a) == 2  # two page rows (8 pages) reclaimed, prefix kept
        assert s["background_reclaimed_pages"] == s["reclaimed_pages"] == 8
        assert s["pages_free"] >= 10
        kv.free_reqid(b)


def test_no_background_reclaim_above_threshold():
    with make(physical_memory=40 * PAGE, policy={"reclaim_threshold": 0.1}) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(60, a))
        kv.free_reqid(a)
        kv.wait_idle()
        assert kv._pages.mapped_pages(a) == 4 and kv.stats()["reclaimed_pages"] == 0
        assert kv.alloc_reqid() == a  # its pages are reused by the next request


def test_last_resort_reclaim_inside_step():
    with make(physical_memory=20 * PAGE, policy={"reclaim_threshold": 0.0}) as kv:  # the mapper never reclaims
        a = kv.alloc_reqid()
        assert kv.step(lens_with(60, a))
        b = kv.alloc_reqid()
        kv.free_reqid(a)
        kv.wait_idle()
        assert kv.stats()["reclaimed_pages"] == 0
        assert kv.step(lens_with(48, b))  # 12 pages: 4 free + 8 reclaimed from a inside step
        s = kv.stats()
        assert s["reclaimed_pages"] == 8 and s["background_reclaimed_pages"] == 0
        assert kv._pages.mapped_pages(a) == 2


def test_no_deferral_unmaps_at_free():
    with make(policy={"deferred_reclaim": False}) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(64, a))
        kv.wait_idle()
        kv.free_reqid(a)
        assert kv._pages.mapped_pages(a) == 0
        assert kv.stats()["pages_mapped"] == 0


def test_all_switches_off_is_the_synchronous_manager():
    with make(policy={"background": False, "deferred_reclaim": False, "eager": False}) as kv:
        threads = thread_count()
        a = kv.alloc_reqid()
        assert kv.step(lens_with(100, a))
        assert kv._pages.mapped_pages(a) == 7
        kv.free_reqid(a)
        assert kv.stats()["pages_mapped"] == 0
        assert thread_count() == threads


def test_mapper_thread_starts_and_stops_with_the_manager():
    before = thread_count()
    kv = make(policy={"eager": True})
    assert thread_count() == before + 1
    r = kv.alloc_reqid()
    assert kv.step(lens_with(100, r))
    kv.cleanup()
    assert thread_count() == before
    with pytest.raises(vattn.ClosedError):
        kv.step(lens_with(0, r))


def test_failed_step_with_mapper_keeps_state():
    with make(physical_memory=16 * PAGE) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_with(32, a))
        kv.wait_idle()
        lens = lens_with(32, a)
        b = kv.alloc_reqid()
        lens[b] = 64  # 16 more pages; 8 held by a (+ lookahead), pool of 16
        assert not kv.step(lens)
        assert kv._pages.mapped_pages(b) == 0
        assert kv.step(lens_with(33, a))


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE)


def test_interpreter_exit_with_a_live_manager():
    proc = run_python("""
        import torch, vattn
        kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=32, max_batch_size=4,
                                  max_context_len=512, page_size=4096, policy={"background": True, "eager": True})
        vattn.init(num_layers=1, num_kv_heads=1, head_dim=64, policy={"background": True})
        r = kv.alloc_reqid()
        for n in range(1, 300):
            assert kv.step([n if i == r else 0 for i in range(4)])
        print("exiting without cleanup")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "exiting without cleanup" in proc.stdout


def test_concurrency_stress_in_subprocess():
    proc = subprocess.run([sys.executable, str(HERE / "mapper_stress.py"), "0", "120"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("OK ")


# ---- the mapper on the cuda backend, through the test driver ------------------------

MiB = 1024 * 1024


def make_cuda(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                max_context_len=8192, device="cuda", physical_memory=64 * MiB)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": True, "eager": False, **(policy or {})})


def test_cuda_mapper_sets_its_context(fake_cuda):
    # The fake driver refuses memory calls on a thread without a current context.
    with make_cuda(policy={"eager": True, "eager_tokens": 3000}) as kv:
        kv.wait_idle()
        s = kv.stats()
        assert s["mapper_errors"] == 0 and s["background_page_maps"] == 2 * 4
        r = kv.alloc_reqid()
        assert kv.step(lens_with(3000, r))
        assert kv.stats()["sync_page_maps"] == 0


def test_cuda_mapper_failure_surfaces_in_next_step(fake_cuda):
    kv = make_cuda()
    r = kv.alloc_reqid()
    assert kv.step(lens_with(2048, r))  # exactly one 2 MiB page per buffer, mapped in step
    kv.wait_idle()
    assert kv._pages.mapped_pages(r) == 2  # lookahead: token 2049 starts page 2
    fake_cuda.fake_cuda_fail(b"cuMemMap", 0, 1, 2)  # the next cuMemMap fails once
    assert kv.step(lens_with(4096, r))  # page 2 is there; the mapper now maps page 3 and fails
    kv.wait_idle()
    assert kv.stats()["mapper_errors"] == 1
    mappings = fake_cuda.fake_cuda_live_mappings()
    with pytest.raises(vattn.DriverError, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        kv.step(lens_with(4097, r))
    assert fake_cuda.fake_cuda_live_mappings() == mappings  # nothing half-mapped
    assert kv.step(lens_with(4097, r))  # reported once; the step now maps page 3 itself
    assert kv._pages.mapped_pages(r) >= 3
    kv.cleanup()
    assert fake_cuda.fake_cuda_live_mappings() == fake_cuda.baseline_mappings
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles


def test_cuda_reclaim_by_mapper_synchronizes_first(fake_cuda):
    with make_cuda(physical_memory=16 * MiB, policy={"reclaim_threshold": 0.5}) as kv:  # 8 pages, floor 4
        a = kv.alloc_reqid()
        assert kv.step(lens_with(4000, a))  # 2 pages per buffer = 8
        kv.wait_idle()
        syncs = fake_cuda.fake_cuda_sync_calls()
        kv.free_reqid(a)
        kv.wait_idle()
        assert kv.stats()["background_reclaimed_pages"] == 4
        assert fake_cuda.fake_cuda_sync_calls() > syncs


def test_mapper_keeps_created_pages_in_reserve():
    # The pool is exactly 5 mapped page rows + a reserve of one row per request,
    # so nothing can be created after the reserve and the counts are exact.
    with make(physical_memory=(5 + 2) * 4 * PAGE) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = [0] * 4
        lens[a], lens[b] = 20, 40
        assert kv.step(lens)
        kv.wait_idle()
        s = kv.stats()
        assert s["pages_mapped"] == (2 + 3) * 4
        assert s["pages_created"] == s["pages_total"] == s["pages_mapped"] + 2 * 4  # the reserve
        lens[a], lens[b] = 33, 49  # both cross into a new page before the mapper could map it
        assert kv.step(lens)
        after = kv.stats()
        assert after["sync_page_maps"] == s["sync_page_maps"] + 2 * 4
        assert after["pages_mapped"] == after["pages_total"]  # the reserve was mapped, not created
