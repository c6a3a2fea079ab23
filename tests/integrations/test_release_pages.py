"""Giving back the pages of a framework's freed blocks (page_allocator="external"):
``KVCacheManager.release_pages`` releases created ids that no reqid maps, the
budget's account drops by exactly their bytes, and mapping a released id again
creates (and charges) its pages afresh. What vLLM's block pool under a budget
uses (vattn/integrations/vllm/engine_budget.py, worker_budget.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants

PAGE = 64 << 10
ID_BYTES = 2 * PAGE  # one page of K and one of V


@pytest.fixture
def budget():
    b = vattn.Budget.create(f"release-{os.getpid()}", 16 * ID_BYTES)
    yield b
    b.remove(force=True)  # teardown: whatever a failed test left joined


def external(budget, **kw):
    return vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32,
                                max_batch_size=2, max_context_len=4096, page_size=PAGE,
                                physical_memory=32 * ID_BYTES, page_allocator="external",
                                budget=budget, policy={"background": False, "eager": False}, **kw)


def test_released_ids_leave_the_budget_and_come_back_when_mapped_again(budget):
    with external(budget.name) as kv:
        kv.alloc_reqid(reqid=0)
        kv.alloc_reqid(reqid=1)
        kv.map_pages([0, 1], [0, 0], [[3, 5, 6], [6, 9]])  # 6 is shared by both rows
        assert budget.held_bytes == 4 * ID_BYTES == kv.stats()["bytes_created"]
        k, _ = kv.layer(0)
        k[0, :256] = 1.0  # id 3's tokens
        # every id is mapped: nothing goes
        assert kv.release_pages([3, 5, 6, 9]) == []
        assert budget.held_bytes == 4 * ID_BYTES
        kv.unmap_pages([0, 1], [1, 1])  # row 0 keeps 3, row 1 keeps 6; 5 and 9 are free
        # 2 is uncreated, 3 and 6 are mapped; a repeated id is released once
        assert kv.release_pages(np.array([9, 2, 3, 5, 9, 6])) == [9, 5]
        assert budget.held_bytes == 2 * ID_BYTES == kv.stats()["bytes_created"]
        assert kv.budget_share()["held_bytes"] == 2 * ID_BYTES
        assert kv.stats()["pages_released"] == 4
        assert_invariants(kv)
        assert torch.all(k[0, :256] == 1.0)  # the mapped id kept its contents
        # a released id mapped again is created and charged again
        kv.map_pages([1], [1], [[5, 9]])
        assert budget.held_bytes == 4 * ID_BYTES == kv.stats()["bytes_created"]
        assert kv.page_ids(1) == [6, 5, 9]
        assert_invariants(kv)
        kv.unmap_pages([0, 1], [0, 0])
        assert sorted(kv.release_pages(range(32))) == [3, 5, 6, 9]
        assert budget.held_bytes == 0 and kv.stats()["bytes_created"] == 0
        assert_invariants(kv)
    assert budget.held_bytes == 0


def test_release_pages_refuses_bad_ids_and_managed_managers_unchanged(budget):
    with external(budget.name) as kv:
        kv.alloc_reqid(reqid=0)
        kv.map_pages([0], [0], [[1]])
        kv.unmap_pages([0], [0])
        for bad in ([32], [-1], [1, 40]):
            with pytest.raises(ValueError, match="num_page_ids"):
                kv.release_pages(bad)
        assert budget.held_bytes == ID_BYTES  # nothing released by a refused call
        with pytest.raises(TypeError):
            kv.release_pages([1.5])
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=2,
                              max_context_len=4096, page_size=PAGE, budget=False) as managed:
        with pytest.raises(ValueError, match="release_free_memory"):
            managed.release_pages([0])


def test_without_a_budget_released_pages_leave_the_process(budget):
    with external(False) as kv:
        kv.alloc_reqid(reqid=0)
        kv.map_pages([0], [0], [[0, 1, 2, 3]])
        kv.unmap_pages([0], [0])
        assert kv.stats()["bytes_created"] == 4 * ID_BYTES
        assert kv.release_pages([0, 1, 2, 3]) == [0, 1, 2, 3]
        assert kv.stats()["bytes_created"] == 0 and kv.budget_share() is None
        assert_invariants(kv)
