"""The mapping check travels with the plan: a batch built for a manager's
cache carries a check built for it once, which per layer looks nothing up
by address; views handed without saying whose they are (the function API)
are still checked, found by address."""

from __future__ import annotations

import pytest
import torch

import vattn
from vattn.attention import host_attention, sdpa_attention
from kernels.mapping_checks import count_mapping_checks
from vattn.core import mapped_check
from vattn.kernels import AttentionBatch
from vattn.kernels.select import HOST, SDPA

L = 64  # max_context_len; a 4 KiB page holds 8 tokens of [2 heads x 64] float32


def manager() -> vattn.KVCacheManager:
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=4,
                              max_context_len=L, page_size=4096,
                              policy=vattn.Policy(background=False, eager=False, deferred_reclaim=False))
    for reqid in range(3):
        kv.alloc_reqid(reqid=reqid)
    assert kv.step([8, 16, 0, 0])  # reqid 0: one page, reqid 1: two, reqid 2: none
    return kv


@pytest.fixture
def no_address_lookup(monkeypatch):
    """Fails any lookup of a view's cache by address."""
    def refuse(view, what):
        raise AssertionError("a view's cache was looked up by address")
    monkeypatch.setattr(mapped_check, "view_owner", refuse)


@pytest.mark.parametrize("kernel", [HOST, SDPA], ids=["host", "sdpa"])
def test_a_plan_for_a_managers_cache_carries_its_check(kernel, no_address_lookup):
    q, new = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    with manager() as a:
        good = AttentionBatch([1], [15], [1], cache=a)
        plan = kernel.plan(good)
        assert plan.check is good.mapped and plan.check.mapped is not None  # built with the plan, for a
        for layer in range(2):
            kernel.run(plan, q, *a.layer(layer), new, new)
        for batch, message in ((AttentionBatch([0], [8], [1], cache=a), "reqid 0 would read 9 tokens but has 8 mapped"),
                               (AttentionBatch([2], [0], [1], cache=a), "reqid 2 would read 1 tokens but has 0"),
                               (AttentionBatch([3], [0], [1], cache=a), "reqid 3 is not allocated")):
            with pytest.raises(ValueError, match=f"{kernel.name}: {message}"):
                kernel.run(kernel.plan(batch), q, *a.layer(1), new, new)
        a.free_reqid(1)  # between two layers: the next layer's check asks the core again
        with pytest.raises(ValueError, match="reqid 1 is not allocated"):
            kernel.run(plan, q, *a.layer(0), new, new)


def test_views_sliced_along_the_reqids_are_checked_from_their_first_reqid(no_address_lookup):
    q = torch.randn(1, 2, 64)
    with manager() as a:
        k, v = (t[1:] for t in a.layer(0))  # row 0 is reqid 1
        SDPA.run(SDPA.plan(AttentionBatch([0], [15], [1], cache=a, first_reqid=1)), q, k, v)
        with pytest.raises(ValueError, match="reqid 1 would read 17 tokens but has 16 mapped"):
            SDPA.run(SDPA.plan(AttentionBatch([0], [16], [1], cache=a, first_reqid=1)), q, k, v)


def test_the_function_api_checks_plain_views_by_address():
    q = torch.randn(1, 2, 64)
    with manager() as a:
        for fn in (host_attention, sdpa_attention):
            fn(q, *a.layer(0), AttentionBatch([1], [15], [1]))
            with pytest.raises(ValueError, match="reqid 0 would read 9 tokens but has 8 mapped"):
                fn(q, *a.layer(1), AttentionBatch([0], [8], [1]))
            with pytest.raises(ValueError, match="reqid 1 would read 17 tokens but has 16 mapped"):  # from the origin
                fn(q, *(t[:, 15:] for t in a.layer(0)), AttentionBatch([1], [1], [1]))
        plain = torch.zeros(4, L, 2, 64)  # no cache's memory: bounded by its shape only
        host_attention(q, plain, plain, AttentionBatch([3], [L - 1], [1]))


def test_a_batch_without_its_cache_binds_to_the_first_views_and_asks_the_core_once_a_layer(monkeypatch):
    """The K and V views of one layer, found by address, share one check of
    the core's: the first binds the batch to their cache, the second is the
    same cache at the same origin. The plan's check stays bound across
    layers, with no further lookup."""
    made, lookups = count_mapping_checks(monkeypatch)
    q = torch.randn(1, 2, 64)
    with manager() as a:
        plan = SDPA.plan(AttentionBatch([1], [15], [1]))
        SDPA.run(plan, q, *a.layer(0))
        first = (len(made), len(lookups))
        SDPA.run(plan, q, *a.layer(1))
        assert first == (1, 2) and (len(made), len(lookups)) == (1, 2)
        with pytest.raises(ValueError, match="reqid 0 would read 9 tokens but has 8 mapped"):
            SDPA.run(SDPA.plan(AttentionBatch([0], [8], [1])), q, *a.layer(1))


def test_another_caches_views_are_checked_against_that_cache():
    """A plan built for a, handed b's views, checks b's rows (found by address), not a's."""
    q = torch.randn(1, 2, 64)
    with manager() as a, manager() as b:
        b.free_reqid(1)
        batch = AttentionBatch([1], [15], [1], cache=a)
        SDPA.run(SDPA.plan(batch), q, *a.layer(0))
        with pytest.raises(ValueError, match="reqid 1 is not allocated"):
            SDPA.run(SDPA.plan(batch), q, *b.layer(0))


def test_a_cache_that_is_no_manager_is_refused():
    with pytest.raises(TypeError, match="cache must be a vattn.KVCacheManager or None, got Tensor"):
        AttentionBatch([0], [0], [1], cache=torch.zeros(1))
    with manager() as a, pytest.raises(ValueError, match=r"first_reqid must be in \[0, 3\]"):
        AttentionBatch([0], [0], [1], cache=a, first_reqid=4)
