"""A page whose release fails keeps its budget charge: the budget counts
memory, and the driver (cuMemRelease, on the fake driver) or the OS (the
hole punch, on the fault-injecting host backend) did not give it back. The
page table stays exact, and creating the page again reuses that memory
without a second charge."""

from __future__ import annotations

import torch
from budget_helpers import budget_name  # noqa: F401 (fixture)
from conftest import assert_invariants
from manager_helpers import ID_BYTES, make_kv

import vattn

MiB = 1024 * 1024
CUDA_ERROR_INVALID_VALUE = 1


def test_failed_cuMemRelease_keeps_the_charge(budget_name, fake_cuda):  # noqa: F811
    # 2 MiB pages, 1 layer: a page id is K and V, 4 MiB of device memory.
    budget = vattn.Budget.create(budget_name, 64 * MiB, device="cuda:0")
    handles = fake_cuda.fake_cuda_live_handles()
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB, budget=budget_name,
                              policy={"background": False, "eager": False})
    try:
        a = kv.alloc_reqid()
        lens = [0, 0]
        lens[a] = 3 * 2048  # three ids
        assert kv.step(lens)
        assert budget.held_bytes == 12 * MiB
        kv.free_reqid(a)
        kv.reclaim()
        # The second cuMemRelease fails: one page of one id keeps its memory.
        fake_cuda.fake_cuda_fail(b"cuMemRelease", 1, 1, CUDA_ERROR_INVALID_VALUE)
        assert kv.release_free_memory() == 12 * MiB  # the bytes taken out of the pool
        fake_cuda.fake_cuda_clear_failures()
        assert fake_cuda.fake_cuda_live_handles() - handles == 1  # the driver still holds that allocation
        assert budget.held_bytes == 4 * MiB  # ... and the budget still counts its id
        stats = kv.stats()
        assert stats["pages_release_failed"] == 1 and stats["pages_unreleased"] == 2
        assert stats["pages_released"] == 5
        assert_invariants(kv)
        # Creating pages again reuses the held one, with no second charge.
        lens[a] = 0
        b = kv.alloc_reqid()
        lens[b] = 3 * 2048
        assert kv.step(lens)
        assert budget.held_bytes == 12 * MiB and kv.budget_share()["held_bytes"] == 12 * MiB
        assert fake_cuda.fake_cuda_live_handles() - handles == 6
        assert kv.stats()["pages_unreleased"] == 0
        assert_invariants(kv)
    finally:
        kv.cleanup()
    assert budget.held_bytes == 0
    assert fake_cuda.fake_cuda_live_handles() == handles


def test_failed_hole_punch_keeps_the_charge(budget_name, host_faults):  # noqa: F811
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    with make_kv(backend="host_faulty", budget=budget_name, policy={"background": False, "eager": False}) as kv:
        a = kv.alloc_reqid()
        lens = [0] * kv.config.max_batch_size
        lens[a] = kv.page_size // kv.config.token_bytes_per_buffer * 2  # two ids
        assert kv.step(lens)
        assert budget.held_bytes == 2 * ID_BYTES
        kv.free_reqid(a)
        kv.reclaim()
        host_faults.fail("release_pages", skip=0, times=1, errno=5)
        assert kv.release_free_memory() == 2 * ID_BYTES
        host_faults.clear()
        assert budget.held_bytes == ID_BYTES  # the id whose page kept its memory
        assert kv.stats()["pages_release_failed"] == 1
        assert_invariants(kv)
        a = kv.alloc_reqid()
        lens = [0] * kv.config.max_batch_size
        lens[a] = kv.page_size // kv.config.token_bytes_per_buffer * 2
        assert kv.step(lens)
        assert budget.held_bytes == 2 * ID_BYTES and kv.stats()["pages_unreleased"] == 0
    assert budget.held_bytes == 0


