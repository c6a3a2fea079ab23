"""The core under abuse: threads, cleanup at awkward moments, failing driver and
OS calls, fork(), hostile sizes and types. Each test names the class of defect
it guards against (see the README's "Threads, processes and errors")."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants, assert_table_is_real, manager_state
from host_faults import FAULTY_HOST

HERE = Path(__file__).resolve().parent
PAGE = 4096
B = 4


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=B,
                max_context_len=512, page_size=PAGE)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


def only(reqid: int, n: int, also: dict[int, int] | None = None) -> list[int]:
    """seq_lens with n tokens for reqid (and `also`), 0 elsewhere."""
    out = [0] * B
    out[reqid] = n
    for r, m in (also or {}).items():
        out[r] = m
    return out


def run_scenario(name: str, reps: int = 2, timeout: int = 120) -> None:
    proc = subprocess.run([sys.executable, str(HERE / "reliability_scenarios.py"), name, str(reps)],
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0 and "held" in proc.stdout, (
        f"scenario {name} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# ---- threads and lifetime ------------------------------------------------------------


def test_concurrent_steps_of_disjoint_reqids_always_map_what_they_return():
    run_scenario("disjoint_steps", reps=int(os.environ.get("VATTN_STRESS_REPS", "3")))


def test_cleanup_while_calls_wait_on_a_mapper_batch():
    run_scenario("cleanup_while_waiting", reps=2)


def test_calls_waiting_for_the_managers_lock_let_other_python_threads_run(host_faults):
    """Every call that takes the manager's lock waits for it without the GIL: while a step holds the lock in
    slow driver calls, reads on other threads (stats, page_ids, a forward's mapping check ...) wait, and the
    rest of the interpreter runs on. (They waited holding the GIL: every Python thread stalled for as long as
    the step took.)"""
    with make(backend=FAULTY_HOST, policy={"eager": False}) as kv:
        r = kv.alloc_reqid()
        tokens = PAGE // (2 * 32 * 4)  # one page
        assert kv.step(only(r, tokens))
        handle = kv.retain_prefix(r, tokens)
        k, v = kv.layer(0)
        check = kv.mapped_check([r], [tokens], "forward")
        probes = {"stats": kv.stats, "is_allocated": lambda: kv.is_allocated(r),
                  "mapped_tokens": lambda: kv.mapped_tokens(r), "page_ids": lambda: kv.page_ids(r),
                  "reads_done": lambda: kv.reads_done(r), "bytes_mapped": lambda: kv.bytes_mapped,
                  "bytes_in_requests": lambda: kv.bytes_in_requests, "closed": lambda: kv.closed,
                  "check_mapped": lambda: kv.check_mapped(k, [r], [tokens]),
                  "mapped_check": lambda: check(k, v, "forward"),
                  "prefix page_ids": lambda: handle.page_ids}
        host_faults.delay(150_000)  # each page creation and map run: the next step holds the lock ~1 s
        stepper = threading.Thread(target=kv.step, args=(only(r, 2 * tokens),))
        stepper.start()
        time.sleep(0.05)  # the step is inside the backend now, holding the lock
        errors: list[BaseException] = []

        def read(probe):
            try:
                probe()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        readers = [threading.Thread(target=read, args=(p,)) for p in probes.values()]
        clock = [time.perf_counter()]  # this thread's clock, read after each start and each short sleep
        for t in readers:
            t.start()
            clock.append(time.perf_counter())
        while any(t.is_alive() for t in readers):
            time.sleep(0.001)
            clock.append(time.perf_counter())
        waited, longest = clock[-1] - clock[0], max(b - a for a, b in zip(clock, clock[1:]))
        stepper.join()
        host_faults.delay(0)
        assert not errors, errors
        assert waited > 0.3, f"the readers did not wait for the step ({waited:.3f} s): it was not holding the lock"
        assert longest < waited / 2, (f"this thread stalled {longest:.3f} s of the {waited:.3f} s the readers waited: "
                                      f"one of {sorted(probes)} waits for the lock holding the GIL")
        handle.release()
        assert_invariants(kv)


def test_concurrent_cleanup_init_and_dropped_managers_leak_nothing():
    run_scenario("concurrent_cleanup_and_drop", reps=4)


def test_alloc_of_a_chosen_reqid_waits_for_an_eager_batch_landing_on_it(host_faults):
    host_faults.delay(2000)  # the eager batch is slow: alloc arrives while it is in flight
    with make(policy={"background": True, "eager": True, "eager_tokens": 256}, backend=FAULTY_HOST) as kv:
        target = 0  # the eager slot: the first free one
        r = kv.alloc_reqid(0, reqid=target)
        assert r == target
        assert kv._pages.mapped_pages(target) == 0  # the batch landed, then was trimmed
        kv.wait_idle()
        assert kv._pages.mapped_pages(target) == 0  # and nothing lands later
        assert_invariants(kv)


def test_a_view_outliving_cleanup_reads_its_data_and_new_views_are_refused():
    kv = make()
    r = kv.alloc_reqid()
    assert kv.step(only(r, 40))
    k = kv.layer(0)[0]
    k[r, :40] = 3.0
    kv.cleanup()
    assert torch.all(k[r, :40] == 3.0)
    with pytest.raises(vattn.ClosedError):
        kv.layer(0)
    with pytest.raises(vattn.ClosedError):
        kv.stats()


# ---- driver and OS failures -------------------------------------------------------------


# a page creation (fallocate), a run of a map (mmap), the mmap of an unmap (whose
# ENOMEM takes the munmap fallback)
HOST_CALLS = ["create_pages", "map", "mmap_unmap"]


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("call", HOST_CALLS)
def test_host_call_failures_keep_the_table_exact(call, layout, host_faults):
    with make(layout=layout, policy={"deferred_reclaim": False}, backend=FAULTY_HOST) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step([100 if i == a else 0 for i in range(B)])
        k, v = kv.layer(1)
        k[a, :100] = 1.0
        for skip in range(4):
            host_faults.fail(call, skip, 1, errno.ENOMEM)
            try:
                kv.step([300 if i == a else 60 if i == b else 0 for i in range(B)])
                kv.free_reqid(b)
                b = kv.alloc_reqid()
            except vattn.DriverError:
                pass
            host_faults.clear()
            assert_table_is_real(kv)
            assert_invariants(kv)
            assert torch.all(k[a, :100] == 1.0)  # an active request never loses a page
            if not kv.is_allocated(b):
                b = kv.alloc_reqid()
        kv.reclaim()  # retries orphans
        assert kv.stats()["pages_orphaned"] == 0
        assert_table_is_real(kv)


def mapping_at(addr: int) -> str | None:
    """The /proc/self/maps line of the mapping holding ``addr`` (None: nothing is mapped there)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.strip()
    return None


def test_a_range_lost_at_max_map_count_is_never_touched_again(host_faults):
    """At vm.max_map_count an unmap falls back to munmap and then reserves the range again; when another
    mapping of the process took the range in between, the range is lost to the cache. Its pages are gone, so
    the table drops them (it had kept them as an orphan), and no retry, reclaim or cleanup maps over or
    unmaps that other mapping (the retry had mapped the pool over it, and cleanup had unmapped it: a
    crash for its owner)."""
    import ctypes

    kv = make(policy={"eager": False, "deferred_reclaim": False}, backend=FAULTY_HOST)
    try:
        a = kv.alloc_reqid()
        assert kv.step(only(a, 3 * 16))  # 3 pages a buffer (16 tokens a 4 KiB page), one run of 3 in each
        addr = kv.layer(0)[0][a].data_ptr()  # K of layer 0, reqid a's first page
        host_faults.fail("reserve_again", 0, 1)
        with pytest.raises(vattn.DriverError, match="could not be reserved again; that range of the cache is lost"):
            kv.unmap_pages([a], [0])
        host_faults.clear()
        other = mapping_at(addr)
        assert other is not None and " rw-p " in other and "vattn-kv-pool" not in other
        assert ctypes.c_uint8.from_address(addr).value == 0xA5
        # the lost pages are gone from the table as from memory; the buffers the error kept from being
        # unmapped are orphans, still mapped
        assert addr not in dict(kv._pages.table()) and kv.page_ids(a) == []
        assert_table_is_real(kv)
        assert_invariants(kv)
        kv.reclaim()  # orphans' retries: none touches it
        assert kv.stats()["pages_orphaned"] == 0
        assert mapping_at(addr) == other and ctypes.c_uint8.from_address(addr).value == 0xA5
        b = kv.alloc_reqid()
        assert kv.step(only(b, 3 * 16))  # the pool's pages serve other slices
        assert_table_is_real(kv)
    finally:
        kv.cleanup()
    assert mapping_at(addr) == other and ctypes.c_uint8.from_address(addr).value == 0xA5  # cleanup left it


def test_host_constructor_failures_leak_no_fd(host_faults):
    fds = len(os.listdir("/proc/self/fd"))
    for call in ("memfd_create", "ftruncate", "reserve"):
        host_faults.fail(call, 0, 1, errno.ENOMEM)
        with pytest.raises(vattn.DriverError):
            make(backend=FAULTY_HOST)
    host_faults.clear()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_failed_reservation_free_is_reported_not_crashing(host_faults):
    kv = make(backend=FAULTY_HOST)
    host_faults.fail("free_reservation", 0, 1, errno.EINVAL)
    with pytest.raises(vattn.DriverError, match="could not be freed"):
        kv.cleanup()
    assert kv.closed


def cuda_manager(**overrides) -> vattn.KVCacheManager:
    # 4 KiB per token per buffer: 512 tokens fill one 2 MiB page
    args = dict(device="cuda", page_size=2 << 20, num_kv_heads=8, head_dim=128, max_context_len=4096)
    args.update(overrides)
    return make(**args)


def assert_fake_driver_clean(fake_cuda) -> None:
    assert fake_cuda.fake_cuda_live_mappings() == fake_cuda.baseline_mappings
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles
    assert fake_cuda.fake_cuda_live_reservations() == fake_cuda.baseline_reservations


def test_unmap_failing_part_way_then_free_reqid(fake_cuda):
    # Once a SIGSEGV: cuMemUnmap fails in the middle of free_reqid's batch
    # (deferred reclaim off), and the slot is used again.
    kv = cuda_manager(policy={"deferred_reclaim": False})
    try:
        a = kv.alloc_reqid()
        assert kv.step(only(a, 2000))  # 4 positions x 4 buffers
        fake_cuda.fake_cuda_fail(b"cuMemUnmap", 3, 1, 1)
        with pytest.raises(vattn.DriverError, match="cuMemUnmap"):
            kv.free_reqid(a)
        fake_cuda.fake_cuda_clear_failures()
        assert not kv.is_allocated(a)  # the request ended; pages from the failed one on stay mapped
        assert kv.stats()["pages_orphaned"] == 16 - 3
        assert_table_is_real(kv, fake_cuda)
        assert_invariants(kv)
        r = kv.alloc_reqid(reqid=a)
        assert kv.step(only(r, 2000))  # maps over the orphan's address: it is retried first
        assert kv.stats()["pages_orphaned"] == 0
        assert_table_is_real(kv, fake_cuda)
        assert_invariants(kv)
        kv.free_reqid(r)
    finally:
        fake_cuda.fake_cuda_clear_failures()
        kv.cleanup()
    assert_fake_driver_clean(fake_cuda)


def test_unmap_failing_part_way_in_the_trim_of_alloc_reqid(fake_cuda):
    kv = cuda_manager()
    try:
        b = kv.alloc_reqid()
        assert kv.step(only(b, 2000))
        kv.free_reqid(b)  # deferred: its pages stay mapped
        fake_cuda.fake_cuda_fail(b"cuMemUnmap", 2, 1, 1)
        with pytest.raises(vattn.DriverError, match="cuMemUnmap"):
            kv.alloc_reqid(0, reqid=b)  # the trim of b's leftovers fails part-way
        fake_cuda.fake_cuda_clear_failures()
        assert not kv.is_allocated(b)
        assert_table_is_real(kv, fake_cuda)
        assert_invariants(kv)
        assert kv.alloc_reqid(0, reqid=b) == b and kv._pages.mapped_pages(b) == 0
        kv.reclaim()
        assert kv.stats()["pages_orphaned"] == 0 and kv.stats()["pages_in_use"] == 0
    finally:
        fake_cuda.fake_cuda_clear_failures()
        kv.cleanup()
    assert_fake_driver_clean(fake_cuda)


def test_synchronize_failure_before_reclaim_loses_no_page(fake_cuda):
    kv = cuda_manager()
    try:
        a = kv.alloc_reqid()
        assert kv.step(only(a, 3000))
        held = kv._pages.mapped_pages(a) * kv.config.num_buffers
        kv.free_reqid(a)
        before = manager_state(kv)
        fake_cuda.fake_cuda_fail(b"cuCtxSynchronize", 0, 1, 999)
        with pytest.raises(vattn.DriverError, match="cuCtxSynchronize"):
            kv.reclaim()
        fake_cuda.fake_cuda_clear_failures()
        assert manager_state(kv) == before  # nothing detached, nothing lost
        assert_table_is_real(kv, fake_cuda)
        assert kv.reclaim() == held  # every page comes back
        assert kv.stats()["pages_in_use"] == 0
    finally:
        fake_cuda.fake_cuda_clear_failures()
        kv.cleanup()
    assert_fake_driver_clean(fake_cuda)


def test_mapper_unmap_failure_becomes_orphans_and_the_next_step_raises(fake_cuda):
    kv = cuda_manager(policy={"background": True, "eager": False, "reclaim_threshold": 0.9},
                      physical_memory=32 * (2 << 20))
    try:
        a = kv.alloc_reqid()
        assert kv.step(only(a, 3000))  # 6 pages x 4 buffers of 32
        kv.wait_idle()
        fake_cuda.fake_cuda_fail(b"cuMemUnmap", 1, 1, 1)
        kv.free_reqid(a)  # below the floor: the mapper reclaims a's pages, one unmap fails
        kv.wait_idle()
        fake_cuda.fake_cuda_clear_failures()
        with pytest.raises(vattn.DriverError, match="cuMemUnmap"):
            kv.step([0] * B)
        assert_table_is_real(kv, fake_cuda)
        assert_invariants(kv)
        assert kv.step([0] * B)  # the error was raised once
    finally:
        fake_cuda.fake_cuda_clear_failures()
        kv.cleanup()
    assert_fake_driver_clean(fake_cuda)


def test_rlimit_fsize_is_refused_not_a_signal():
    run_scenario("rlimit_fsize", reps=1)


def test_rlimit_as_is_refused_before_the_system_call():
    run_scenario("rlimit_as", reps=1)


def test_max_map_count_exhaustion_keeps_the_table_exact():
    run_scenario("max_map_count", reps=1, timeout=300)


# ---- hostile sizes and types -------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,exc,match",
    [
        (dict(policy={"lookahead_tokens": 2**63}), ValueError, r"lookahead_tokens must be"),
        (dict(policy={"lookahead_tokens": 513}), ValueError, r"lookahead_tokens must be in \[0, 512\]"),
        (dict(policy={"eager_tokens": 2**64}), ValueError, r"eager_tokens must be"),
        (dict(max_context_len=2**62, dtype=torch.int8, num_kv_heads=1, head_dim=1), ValueError,
         r"virtual address space .* lower max_batch_size or max_context_len"),
        (dict(num_layers=2**63), ValueError, r"virtual address space"),
        (dict(num_kv_heads=2**64), ValueError, r"virtual address space"),
        (dict(head_dim=2**64), ValueError, r"virtual address space"),
        (dict(max_batch_size=2**63), ValueError, r"virtual address space"),
        (dict(max_context_len=2**40), ValueError, r"virtual address space"),
        (dict(page_size=2**63), ValueError, r"page_size must be at most"),
        (dict(physical_memory=2**70), None, None),  # capped at what every reqid can use: accepted
        (dict(device="cuda:99999999999999999999"), ValueError, r"device index must be in \[0, 2147483647\]"),
        (dict(device="cpu:1"), ValueError, r"one device"),
        (dict(device=3), TypeError, r"device must be a str"),
        (dict(policy={"reclaim_threshold": float("nan")}), ValueError, r"reclaim_threshold must be in \[0, 1\]"),
        (dict(page_allocator="mine"), ValueError, r"page_allocator must be one of"),
    ],
)
def test_hostile_sizes_are_refused_naming_the_argument(overrides, exc, match):
    if exc is None:
        make(**overrides).cleanup()
        return
    with pytest.raises(exc, match=match):
        make(**overrides)


def test_many_layers_speak_of_the_users_arguments():
    kv = make(num_layers=600, max_context_len=64)  # 1200 per-layer buffers
    kv.cleanup()


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_cpu_devices_torch_accepts(device):
    with make(device=device) as kv:
        assert kv.device == torch.device("cpu")


def test_loose_types_are_refused_and_arrays_of_any_stride_accepted():
    with make() as kv:
        r = kv.alloc_reqid()
        other = (r + 1) % B
        kv.alloc_reqid(reqid=other)
        before = manager_state(kv)
        bad = [
            (TypeError, lambda: kv.step({r: 300, other: 300})),
            (TypeError, lambda: kv.step([True, 0, 0, 0])),
            (TypeError, lambda: kv.step(torch.ones(B, dtype=torch.bool))),
            (TypeError, lambda: kv.step(torch.ones(B, dtype=torch.uint8) > 0)),
            (TypeError, lambda: kv.step(np.ones(B, dtype=bool))),
            (TypeError, lambda: kv.step(torch.zeros(B))),
            (ValueError, lambda: kv.step(torch.zeros(B, dtype=torch.long, device="meta"))),
            (ValueError, lambda: kv.step([2**64, 0, 0, 0])),
            (TypeError, lambda: kv.step("0000")),
            (TypeError, lambda: kv.buffer_address(1.5)),
            (TypeError, lambda: kv.buffer_address(True)),
            (TypeError, lambda: kv.buffer_address("0")),
            (ValueError, lambda: kv.free_reqid(2**63)),
            (ValueError, lambda: kv.free_reqid(2**64)),
            (ValueError, lambda: kv.alloc_reqid(reqid=2**64)),
            (ValueError, lambda: kv.mapped_tokens(-2**70)),
            (TypeError, lambda: kv.is_allocated(np.float32(1))),
            (ValueError, lambda: kv.reclaim(2**64)),
        ]
        for exc, call in bad:
            with pytest.raises(exc):
                call()
            assert manager_state(kv) == before
        strided = np.zeros(2 * B, dtype=np.int64)[::2]  # a non-contiguous view is readable
        strided[r] = 20
        assert kv.step(strided)
        for dtype in (np.int32, np.uint16, np.int8):
            assert kv.step(np.array([20 if i == r else 0 for i in range(B)], dtype=dtype))
        t = torch.zeros(B, 2, dtype=torch.int32)[:, 1]
        t[r] = 30
        assert kv.step(t)
        assert kv.step([np.int64(31) if i == r else 0 for i in range(B)])
        assert kv.mapped_tokens(r) >= 31


# ---- fork -----------------------------------------------------------------------


def test_a_forked_child_cannot_touch_the_parent_and_exits_normally():
    run_scenario("fork_child_cannot_touch_parent", reps=2)


def test_module_level_calls_in_a_forked_child_raise_forked_error():
    run_scenario("module_level_in_forked_child", reps=2)


def test_steps_last_resort_reclaim_settles_orphans_left_in_free_slots(host_faults):
    """A free slot's cached pages whose unmap failed stay orphans; once the driver works again, a step that
    needs those pages settles them and maps, instead of reporting a full pool (it did: the reclaim plan only
    counted mapped positions)."""
    tokens = PAGE // (2 * 32 * 4)  # tokens per page
    with make(backend=FAULTY_HOST, physical_memory=4 * 4 * PAGE,
              policy={"deferred_reclaim": True, "eager": False}) as kv:
        assert kv.num_page_ids == 4
        a = kv.alloc_reqid(reqid=0)
        assert kv.step(only(a, 4 * tokens))
        kv.free_reqid(a)  # its 4 pages stay mapped in the free slot, cached for reuse
        b = kv.alloc_reqid(reqid=1)  # another slot: a's pages must be reclaimed from slot 0
        host_faults.fail("unmap", 0, 1, errno.EIO)
        with pytest.raises(vattn.DriverError):
            kv.step(only(b, 4 * tokens))  # the reclaim's unmap fails: the pages become orphans
        assert kv.stats()["pages_orphaned"] > 0
        assert_invariants(kv)
        assert kv.step(only(b, 4 * tokens))  # the driver works again: the orphans are settled, b maps
        assert kv.stats()["pages_orphaned"] == 0 and kv._pages.mapped_pages(b) == 4
        assert_invariants(kv)
