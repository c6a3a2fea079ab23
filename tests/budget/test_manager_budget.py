"""A KV cache manager in a budget, within one process: pages charged from
creation to release, step answering False at the limit with nothing changed,
pages of freed requests standing in for new ones, preallocation, idle release
(the host really gets the memory back), shedding under a lowered limit or
another member's wait, out of memory at page creation as a full pool (host
and the strict fake CUDA driver), the joining rules and a forked child.
tests/budget/test_manager_budget_processes.py has the same across processes."""

from __future__ import annotations

import errno
import gc
import os
import re
import threading
import time

import pytest
import torch
from budget_helpers import budget_name, run_in_child  # noqa: F401 (fixture)
from conftest import assert_invariants
from manager_helpers import (ID_BYTES, MiB, TOKENS_PER_PAGE, held_matches_created, make_kv, pages,
                             pool_bytes_committed, rss_shmem_bytes, wait_until)

import vattn


def quiet(**overrides):
    """No mapper, no eager pages: every page is created by the calls the test makes."""
    return dict(policy={"background": False, "eager": False}) | overrides


def test_pages_are_charged_from_creation_to_release(budget_name):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    committed = pool_bytes_committed()
    with make_kv(budget=budget_name, budget_label="charged", **quiet()) as kv:
        a = kv.alloc_reqid()
        assert kv.step(pages(a, 4 * TOKENS_PER_PAGE))  # 4 page ids
        assert budget.held_bytes == 4 * ID_BYTES == kv.stats()["bytes_created"]
        assert pool_bytes_committed() - committed == 4 * ID_BYTES  # the host holds what the budget counts
        assert kv.budget_share() == dict(budget=budget_name, held_bytes=4 * ID_BYTES, in_use_bytes=4 * ID_BYTES,
                                         free_held_bytes=0, detached="")
        wait_until(lambda: budget.usage().members[0].in_use_bytes == 4 * ID_BYTES, what="the keeper's report")
        kv.free_reqid(a)  # deferred reclaim: the pages stay, free-held
        assert kv.budget_share()["free_held_bytes"] == 4 * ID_BYTES
        wait_until(lambda: budget.usage().members[0].free_held_bytes == 4 * ID_BYTES, what="the report after free")
        assert budget.usage().members[0].label == "charged"
        assert kv.release_free_memory(1) == ID_BYTES  # a whole page id: one page in each buffer
        assert kv.release_free_memory() == 3 * ID_BYTES
        assert budget.held_bytes == 0 and kv.stats()["pages_released"] == 8
        assert pool_bytes_committed() == committed  # the holes are punched
        assert_invariants(kv)
    assert budget.usage().members == ()


def test_step_returns_false_at_the_limit_and_nothing_changes(budget_name):
    budget = vattn.Budget.create(budget_name, 6 * ID_BYTES)
    with make_kv(budget=budget, **quiet()) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = pages(a, 4 * TOKENS_PER_PAGE)
        assert kv.step(lens)
        kv.layer(0)[0][a, :10] = 7.0
        lens[b] = 4 * TOKENS_PER_PAGE  # 4 more ids, 2 left in the budget
        assert kv.step(lens) is False
        assert (kv.page_ids(a), kv.page_ids(b)) == ([0, 1, 2, 3], [])
        assert budget.held_bytes == 4 * ID_BYTES and held_matches_created(kv)
        assert budget.usage().members[0].waiting_bytes == 4 * ID_BYTES  # the refusal is a wait others see
        s = kv.stats()
        assert (s["failed_steps"], s["creations_refused"]) == (1, 1)
        budget.set_limit(8 * ID_BYTES)
        assert kv.step(lens)
        assert budget.usage().waiting_bytes == 0 and budget.held_bytes == 8 * ID_BYTES
        assert torch.all(kv.layer(0)[0][a, :10] == 7.0)
        assert_invariants(kv)


def test_a_refused_step_takes_pages_of_freed_requests_first(budget_name):
    vattn.Budget.create(budget_name, 6 * ID_BYTES)
    with make_kv(budget=budget_name, **quiet()) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(pages(a, 4 * TOKENS_PER_PAGE))
        kv.free_reqid(a)  # its 4 ids stay mapped in its free slot
        assert kv.step(pages(b, 6 * TOKENS_PER_PAGE))  # 6 ids: 2 new ones are all the budget grants
        assert sorted(kv.page_ids(b)) == [0, 1, 2, 3, 4, 5] and kv.page_ids(a) == []
        assert kv.stats()["bytes_created"] == 6 * ID_BYTES
        assert_invariants(kv)


def test_preallocate_creates_the_pool_up_front_and_keeps_it(budget_name):
    with make_kv(preallocate=True, **quiet()) as kv:  # no budget: the pool is committed now
        assert kv.stats()["pages_created"] == kv.stats()["pages_total"]
        a = kv.alloc_reqid()
        assert kv.step(pages(a, 4 * TOKENS_PER_PAGE))
        assert kv.stats()["sync_page_maps"] == 8 and kv.stats()["pages_created"] == kv.stats()["pages_total"]
        kv.free_reqid(a)
        # kept whole until cleanup, asked or not (release_free_memory had released the pool)
        assert kv.release_free_memory() == 0 and kv.stats()["pages_created"] == kv.stats()["pages_total"]
        assert kv.stats()["pages_released"] == 0
        assert_invariants(kv)
    with make_kv(preallocate=True, page_allocator="external", **quiet()) as kv:
        assert kv.release_pages(list(range(kv.num_page_ids))) == []
        assert kv.stats()["pages_created"] == kv.stats()["pages_total"]
        with pytest.raises(ValueError, match="page_ids"):
            kv.release_pages([kv.num_page_ids])  # a bad id is still an error
    budget = vattn.Budget.create(budget_name, 16 * ID_BYTES)
    with pytest.raises(vattn.OutOfPages, match=rf"preallocate: .*budget '{budget_name}'.*cannot grant 8388608"):
        make_kv(preallocate=True, budget=budget_name)  # 64 ids, 16 allowed
    assert budget.usage().members == () and budget.held_bytes == 0
    budget.set_limit(64 * ID_BYTES)
    with make_kv(preallocate=True, budget=budget_name, idle_release_s=0.05) as kv:
        assert budget.held_bytes == 64 * ID_BYTES
        time.sleep(0.3)  # idle: a preallocated pool is not given back
        assert budget.held_bytes == 64 * ID_BYTES and kv.stats()["pages_released"] == 0
    assert budget.held_bytes == 0


def test_idle_release_gives_the_memory_back_on_its_own(budget_name):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    committed = pool_bytes_committed()
    with make_kv(budget=budget_name, idle_release_s=1.0) as kv:  # mapper and eager pages on
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = [0] * 4
        lens[a], lens[b] = 4 * TOKENS_PER_PAGE, 4 * TOKENS_PER_PAGE
        assert kv.step(lens)
        for r in (a, b):
            for t in kv.layer(0):  # K and V
                t[r, :4 * TOKENS_PER_PAGE] = 1.0  # resident now
        del t  # a view keeps the pages (and their share) past cleanup
        peak = rss_shmem_bytes()
        kv.free_reqid(a)
        # No call: after a second without a step the keeper gives back every
        # free page (a's, the eager slot's, the pool's), not b's ...
        wait_until(lambda: budget.held_bytes == len(kv.page_ids(b)) * ID_BYTES, what="idle release")
        assert len(kv.page_ids(b)) >= 4 and kv.stats()["pages_released"] >= 8
        # ... and the host really has them back: the memfd's blocks and resident memory
        assert pool_bytes_committed() - committed == budget.held_bytes
        assert rss_shmem_bytes() <= peak - 4 * ID_BYTES
        assert torch.all(kv.layer(0)[0][b, :100] == 1.0)
        assert kv.budget_share()["free_held_bytes"] == 0
        assert_invariants(kv)
        # busy again: pages come back as needed, eager ones too
        c = kv.alloc_reqid()
        assert kv.step(pages(c, 10))
        kv.wait_idle()
        assert kv.stats()["background_page_maps"] > 0 and held_matches_created(kv)
    assert budget.held_bytes == 0


def test_a_refused_step_is_not_activity_after_an_idle_release(budget_name):
    """A step refused for its input changes nothing: not the idle clock, and the mapper stays asleep (it
    had woken and created the eager pages again, charging them to the budget)."""
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    with make_kv(budget=budget_name, idle_release_s=1.0) as kv:  # mapper and eager pages on
        a = kv.alloc_reqid()
        assert kv.step(pages(a, 2 * TOKENS_PER_PAGE))
        kv.free_reqid(a)
        wait_until(lambda: budget.held_bytes == 0, what="idle release")
        created = kv.stats()["pages_created"]
        bad = [0] * 4
        for index, value, match in ((a, -1, r"seq_lens\[\d\] must be in \[0, \d+\]"),
                                    ((a + 1) % 4, 5, "is not allocated")):
            bad[index] = value
            with pytest.raises(ValueError, match=match):
                kv.step(bad)
            bad[index] = 0
        deadline = time.monotonic() + 0.5  # half the idle time: the mapper wakes within milliseconds
        while time.monotonic() < deadline:
            assert budget.held_bytes == 0 and kv.stats()["pages_created"] == created, "a refused step woke the mapper"
            time.sleep(0.01)
        assert kv.step(bad)  # an accepted step is activity: the eager pages come back
        wait_until(lambda: budget.held_bytes > 0, what="the eager pages after a step")
        assert_invariants(kv)


def test_a_lowered_limit_takes_free_pages_not_pages_under_requests(budget_name):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    with make_kv(budget=budget_name, idle_release_s=None, **quiet()) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = [0] * 4
        lens[a], lens[b] = 4 * TOKENS_PER_PAGE, 6 * TOKENS_PER_PAGE
        assert kv.step(lens)
        kv.free_reqid(b)  # 6 ids free-held
        budget.set_limit(7 * ID_BYTES)
        wait_until(lambda: budget.held_bytes <= 7 * ID_BYTES, what="shedding to the limit")
        assert budget.held_bytes == 7 * ID_BYTES  # free pages went until the total fit, no more
        budget.set_limit(ID_BYTES)
        wait_until(lambda: budget.held_bytes == 4 * ID_BYTES, what="shedding every free page")
        time.sleep(0.1)
        assert budget.held_bytes == 4 * ID_BYTES and len(kv.page_ids(a)) == 4  # a's pages stay
        assert_invariants(kv)


def test_another_members_wait_makes_the_manager_give_back_and_stop_running_ahead(budget_name):
    budget = vattn.Budget.create(budget_name, 8 * ID_BYTES)
    other = budget.join("other")
    with make_kv(budget=budget_name, idle_release_s=None) as kv:  # mapper and eager pages on
        kv.wait_idle()
        assert kv.stats()["bytes_created"] > 0  # the next reqid's eager pages, free-held
        stop = threading.Event()

        def keep_waiting() -> None:  # more than the limit: refused, and renewed before the 1 s expiry
            while not stop.is_set():
                assert not other.try_grant(9 * ID_BYTES)
                stop.wait(0.05)

        waiter = threading.Thread(target=keep_waiting)
        waiter.start()
        try:
            wait_until(lambda: budget.held_bytes == 0, what="free pages given back for the wait")
            a = kv.alloc_reqid()
            kv.free_reqid(a)  # new work for the mapper: no eager pages while someone waits
            kv.wait_idle()
            time.sleep(0.1)
            assert kv.stats()["bytes_created"] == 0
        finally:
            stop.set()
            waiter.join()
        other.clear_wait()
        assert other.try_grant(8 * ID_BYTES)
        other.leave()


def test_out_of_memory_at_creation_is_a_full_pool_on_the_host(host_faults):
    # fallocate's ENOSPC is the host out of memory (a tmpfs or cgroup limit):
    # step answers False, fork and map_pages raise OutOfPages, nothing changes.
    with make_kv(backend="host_faulty", **quiet()) as kv:
        a = kv.alloc_reqid()
        assert kv.step(pages(a, 2 * TOKENS_PER_PAGE))
        host_faults.fail("fallocate", skip=1, times=1, errno=errno.ENOSPC)  # the second page of the next step
        lens = pages(a, 5 * TOKENS_PER_PAGE)
        assert kv.step(lens) is False
        assert kv.page_ids(a) == [0, 1] and kv.stats()["pages_created"] == 4
        assert kv.step(lens)
        kv.layer(0)[0][a, 5 * TOKENS_PER_PAGE - 1] = 3.0
        host_faults.fail("fallocate", times=-1, errno=errno.ENOMEM)
        with pytest.raises(vattn.OutOfPages, match="host has no memory left"):
            kv.fork(a, 5 * TOKENS_PER_PAGE - 10)  # the partial last page is a new one
        assert kv.stats()["forks"] == 0 and kv.stats()["reqids_allocated"] == 1
        host_faults.clear()
        assert_invariants(kv)
    with make_kv(backend="host_faulty", page_allocator="external") as kv:
        a = kv.alloc_reqid()
        kv.map_pages([a], [0], [[5, 6]])
        host_faults.fail("fallocate", times=-1, errno=errno.ENOSPC)
        with pytest.raises(vattn.OutOfPages, match="cannot create 2 page"):
            kv.map_pages([a], [0], [[5, 6, 7]])
        assert kv.page_ids(a) == [5, 6]
        host_faults.fail("fallocate", times=-1, errno=errno.EIO)  # not out of memory: a driver error
        with pytest.raises(vattn.DriverError, match="fallocate"):
            kv.map_pages([a], [0], [[5, 6, 7]])
        host_faults.clear()
        kv.map_pages([a], [0], [[5, 6, 7]])
        assert_invariants(kv)


def test_a_fork_refused_at_creation_changes_nothing(budget_name, host_faults):
    """fork creates its copied tail's new pages before it empties the destination reqid: a creation that
    the budget or the host refuses raises OutOfPages with every reqid's pages as they were (the
    destination's cached pages were unmapped first, and stayed so), and another free reqid's cached pages
    stand in for refused ones, as in step."""
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    tail = 2 * TOKENS_PER_PAGE + TOKENS_PER_PAGE // 2  # two whole pages shared, the half page copied to a new one

    def lens(**by_reqid):
        return [by_reqid.get(f"r{r}", 0) for r in range(kv.config.max_batch_size)]

    def state():
        s = kv.stats()
        return ([kv.page_ids(r) for r in range(kv.config.max_batch_size)], s["pages_created"], s["pages_mapped"],
                s["forks"], s["reqids_allocated"], budget.held_bytes)

    with make_kv(backend="host_faulty", budget=budget_name, max_batch_size=2, **quiet()) as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens(**{f"r{a}": tail}))
        d = kv.fork(a, 2 * TOKENS_PER_PAGE)  # shares a's two whole pages
        kv.free_reqid(d)  # keeps them mapped (deferred reclaim): the next fork's destination, the only free reqid
        assert len(kv.page_ids(d)) == 2
        budget.set_limit(budget.held_bytes)
        before = state()
        with pytest.raises(vattn.OutOfPages, match="cannot grant"):
            kv.fork(a, tail)
        assert state() == before
        budget.set_limit(32 * ID_BYTES)
        host_faults.fail("fallocate", times=-1, errno=errno.ENOMEM)
        with pytest.raises(vattn.OutOfPages, match="host has no memory left"):
            kv.fork(a, tail)
        assert state() == before
        host_faults.clear()
        assert kv.fork(a, tail) == d and len(kv.page_ids(d)) == 3
        assert_invariants(kv)

    with make_kv(budget=budget_name, max_batch_size=3, **quiet()) as kv:
        a, c = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens(**{f"r{a}": tail, f"r{c}": 3 * TOKENS_PER_PAGE}))
        kv.layer(0)[0][a, :tail] = torch.arange(tail, dtype=torch.float32)[:, None, None]
        kv.free_reqid(c)  # its 3 pages stay cached in its free slot
        d = kv.fork(a, 2 * TOKENS_PER_PAGE)
        kv.free_reqid(d)  # 2 shared pages: the emptier free reqid, the next destination
        budget.set_limit(budget.held_bytes)
        held = budget.held_bytes
        assert kv.fork(a, tail) == d  # the new page is refused: one of c's cached pages stands in
        assert budget.held_bytes == held and len(kv.page_ids(d)) == 3 and len(kv.page_ids(c)) == 2
        assert torch.equal(kv.layer(0)[0][d, :tail], kv.layer(0)[0][a, :tail])
        assert_invariants(kv)


def test_out_of_memory_at_creation_gives_the_charge_back(budget_name, host_faults):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    with make_kv(backend="host_faulty", budget=budget_name, **quiet()) as kv:
        a = kv.alloc_reqid()
        host_faults.fail("fallocate", skip=3, times=1, errno=errno.ENOSPC)
        assert kv.step(pages(a, 4 * TOKENS_PER_PAGE)) is False
        assert budget.held_bytes == 0 and held_matches_created(kv)
        assert kv.step(pages(a, 4 * TOKENS_PER_PAGE))
        assert budget.held_bytes == 4 * ID_BYTES
        assert_invariants(kv)


def test_the_share_ends_with_the_pages_not_with_cleanup(budget_name):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    kv = make_kv(budget=budget_name, **quiet())
    a = kv.alloc_reqid()
    assert kv.step(pages(a, 100))
    views = kv.layer(0)
    kv.cleanup()
    assert budget.held_bytes == ID_BYTES  # the views keep the page mapped, so it stays counted
    del views
    gc.collect()
    assert budget.held_bytes == 0 and budget.usage().members == ()


def test_joining_by_name_object_or_environment(budget_name, monkeypatch):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    monkeypatch.setenv("VATTN_BUDGET", budget_name)
    with make_kv(budget=None) as kv:  # what an engine a framework starts does
        assert kv.budget.name == budget_name and kv.stats()["budget"] == budget_name
        assert [m.label for m in budget.usage().members] == ["kv 1x1x64 float32"]
    with make_kv(budget=False) as kv:  # opted out
        assert kv.budget is None and kv.budget_share() is None
    monkeypatch.setenv("VATTN_BUDGET", budget_name + "-missing")
    with pytest.raises(vattn.BudgetError, match=rf"environment variable VATTN_BUDGET={budget_name}-missing: no budget '.*-missing'"):
        make_kv(budget=None)
    monkeypatch.setenv("VATTN_BUDGET", "bad/name")
    with pytest.raises(ValueError, match="environment variable VATTN_BUDGET=bad/name: budget name 'bad/name' is invalid"):
        make_kv(budget=None)
    monkeypatch.delenv("VATTN_BUDGET")
    with make_kv(budget=None) as kv:
        assert kv.budget is None


def test_bad_budget_arguments(budget_name):
    vattn.Budget.create(budget_name, MiB, device="GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(ValueError, match=rf"budget '{budget_name}' governs device GPU-0000.*lives on cpu"):
        make_kv(budget=budget_name)
    with pytest.raises(TypeError, match="budget must be a vattn.Budget"):
        make_kv(budget=3)
    with pytest.raises(ValueError, match=r"idle_release_s must be in \(0, 1e9\]"):
        make_kv(idle_release_s=0)
    with pytest.raises(TypeError, match="idle_release_s must be a number"):
        make_kv(idle_release_s="10")
    with pytest.raises(TypeError, match="preallocate must be a bool"):
        make_kv(preallocate=1)
    with make_kv(page_allocator="external") as kv, pytest.raises(ValueError, match="owned by the caller"):
        kv.release_free_memory()
    assert vattn.Budget.attach(budget_name).usage().members == ()  # nothing joined on the way


def test_a_forked_child_cannot_act_on_the_parents_share(budget_name):
    budget = vattn.Budget.create(budget_name, 32 * ID_BYTES)
    with make_kv(budget=budget_name, **quiet()) as kv:
        a = kv.alloc_reqid()
        assert kv.step(pages(a, 100))
        for call in (kv.budget_share, kv.release_free_memory, lambda: kv.step(pages(a, 1000))):
            assert run_in_child(call, 10).startswith("ForkedError")
        assert budget.held_bytes == ID_BYTES and len(budget.usage().members) == 1  # the child left nothing
        assert kv.budget_share()["held_bytes"] == ID_BYTES


def test_the_cuda_path_against_the_fake_driver(budget_name, fake_cuda):
    # 2 MiB pages, 1 layer: a page id is 4 MiB of device memory (K and V).
    budget = vattn.Budget.create(budget_name, 8 * MiB, device="cuda:0")
    assert budget.device.startswith("GPU-")
    handles = fake_cuda.fake_cuda_live_handles()
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB, budget=budget_name,
                              idle_release_s=0.2, policy={"background": False, "eager": False})
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    lens = [0, 0]
    lens[a] = 2048  # one page id
    assert kv.step(lens)
    assert fake_cuda.fake_cuda_live_handles() - handles == 2 and budget.held_bytes == 4 * MiB
    lens[a], lens[b] = 2048, 4096  # two more ids, one allowed
    assert kv.step(lens) is False
    assert fake_cuda.fake_cuda_live_handles() - handles == 2 and kv.page_ids(b) == []
    budget.set_limit(12 * MiB)
    assert kv.step(lens)
    assert fake_cuda.fake_cuda_live_handles() - handles == 6 and held_matches_created(kv)
    # torch took the rest of the device: out of memory at cuMemCreate gives the charge back
    budget.set_limit(64 * MiB)
    assert fake_cuda.fake_cuda_other_process_alloc(fake_cuda.fake_cuda_free_mem())
    lens[b] = 8192
    assert kv.step(lens) is False
    assert budget.held_bytes == 12 * MiB and budget.usage().waiting_bytes == 0  # no budget wait: the device said no
    fake_cuda.fake_cuda_other_process_free(2**63)
    kv.free_reqid(b)
    wait_until(lambda: budget.held_bytes == 4 * MiB, what="idle release through cuMemRelease")
    assert fake_cuda.fake_cuda_live_handles() - handles == 2
    assert_invariants(kv)
    kv.cleanup()
    assert budget.held_bytes == 0 and fake_cuda.fake_cuda_live_handles() == handles


def _budget_gone_while_in_use(budget_name: str, budget_device: str, gone: str, **shape) -> None:
    """A manager holding pages under a request while its budget is removed
    (`rm --force`) or its segment truncated: it keeps working on what it
    holds, its keeper stops drawing from the budget (no error from a step
    that needs nothing new), a step that needs more pages detaches the cache
    from the budget (logged once, in budget_share's ``detached``) and runs
    within its own pool, so the requests go on, and cleanup gives everything
    back. Runs in a child: a truncated segment once killed the process with
    SIGBUS."""
    from budget_helpers import segment_path

    budget = vattn.Budget.create(budget_name, 128 * MiB, device=budget_device)
    kv = vattn.KVCacheManager(budget=budget_name, idle_release_s=0.05, **shape)
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    tokens = kv.page_tokens
    lens = [0] * kv.config.max_batch_size
    lens[a], lens[b] = 2 * tokens, tokens
    assert kv.step(lens)
    kv.wait_idle()  # the mapper's pages ahead of need are made
    if gone == "removed":
        vattn.budget.remove(budget_name, force=True)
        why = "was removed"
    else:
        os.truncate(segment_path(budget_name), 0)
        why = "truncated"
    # A keeper tick that began before the budget went is over after this;
    # only then is b's page freed, so that every tick that could give it
    # back sees the budget gone (the keeper releases idle free pages of a
    # live budget after idle_release_s).
    time.sleep(0.2)
    kv.free_reqid(b)  # a free page the keeper would give back to a live budget
    lens[b] = 0
    held = kv.budget_share()["held_bytes"]
    assert held == kv.stats()["bytes_created"] and kv.stats()["pages_free"] > 0, kv.stats()
    time.sleep(0.2)  # ten idle keeper ticks on a budget that is gone
    lens[a] = 2 * tokens - 1  # within what it holds
    assert kv.step(lens)
    assert kv.step(lens)
    before = kv.page_ids(a)
    assert kv.page_ids(a) == before
    assert kv.stats()["bytes_created"] == held  # the keeper released nothing into a budget that is gone
    assert kv.budget_share()["detached"] == ""  # nothing asked the budget for more yet
    lens[a] = 12 * tokens  # more pages than it holds: the cache goes on without the budget, within its pool
    assert kv.step(lens)
    assert kv.page_ids(a)[:len(before)] == before and kv.mapped_tokens(a) >= 12 * tokens
    kv.wait_idle()  # the mapper's pages ahead of need, made after the step returned, are counted below
    share = kv.budget_share()
    assert re.search(rf"'{budget_name}'.*{why}", share["detached"]), share
    assert share["held_bytes"] == kv.stats()["bytes_created"] > held  # counted by the cache alone now
    with pytest.raises(vattn.BudgetError, match=why):
        budget.usage()
    lens[a] = 0
    kv.free_reqid(a)
    assert_invariants(kv)
    kv.cleanup()


@pytest.mark.parametrize("gone", ["removed", "truncated"])
def test_a_budget_removed_or_truncated_under_a_manager_on_the_host(budget_name, gone):
    shape = dict(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=4,
                 max_context_len=4096, page_size=64 << 10, physical_memory=64 * ID_BYTES)
    assert run_in_child(lambda: _budget_gone_while_in_use(budget_name, "cpu", gone, **shape), 60) == "ok"


@pytest.mark.parametrize("gone", ["removed", "truncated"])
def test_a_budget_removed_or_truncated_under_a_manager_on_the_fake_cuda_driver(budget_name, fake_cuda, gone):
    shape = dict(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                 max_context_len=32768, device="cuda", physical_memory=64 * MiB)
    assert run_in_child(lambda: _budget_gone_while_in_use(budget_name, "cuda:0", gone, **shape), 60) == "ok"
