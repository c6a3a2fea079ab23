"""Scenarios that could crash, hang or poison the process that runs them:
threads racing the core, fork(), resource limits. tests/core/test_reliability.py
runs each in a subprocess with a timeout; exit status 0 means it held.

    python tests/core/reliability_scenarios.py NAME [REPETITIONS]
"""

from __future__ import annotations

import gc
import os
import random
import resource
import signal
import sys
import threading
import time

import numpy as np
import torch

import vattn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: shared helpers
from host_faults import FAULTY_HOST, faulty_host_backend  # noqa: E402

B, L = 16, 1024
PAGE = 4096  # 16 tokens of 2 heads x 32 fp32 per page: many page crossings


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=B,
                max_context_len=L, page_size=PAGE)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": True, "eager": True, "eager_tokens": 64,
                                                **(policy or {})})


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


# ---- threads ---------------------------------------------------------------------


def disjoint_steps(reps: int) -> None:
    """Threads each allocate, step only their own reqids, write and read back,
    while a churn thread allocates and frees and the main thread finally
    calls cleanup: a True step always means mapped, nothing crashes or hangs,
    and every call after cleanup raises ClosedError."""
    for rep in range(reps):
        kv = make(physical_memory=(B * 8) * 4 * PAGE)  # 8 pages per reqid on average: some steps fail
        errors: list[BaseException] = []
        stop = threading.Event()
        mapped_true = [0]

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    try:
                        r = kv.alloc_reqid()
                    except vattn.OutOfReqids:
                        time.sleep(0.0005)
                        continue
                    written = 0
                    value = float(seed * 1000 + r)
                    for _ in range(rng.randint(1, 12)):
                        n = min(L, written + rng.randint(1, 40))
                        lens = np.zeros(B, dtype=np.int64)
                        lens[r] = n
                        if not kv.step(lens):
                            break
                        mapped_true[0] += 1
                        assert kv.mapped_tokens(r) >= n, f"step returned True but reqid {r} holds {kv.mapped_tokens(r)} < {n}"
                        for layer in range(2):
                            k, v = kv.layer(layer)
                            k[r, written:n] = value
                            v[r, written:n] = -value
                        for layer in range(2):
                            k, v = kv.layer(layer)
                            assert torch.all(k[r, :n] == value) and torch.all(v[r, :n] == -value), "data lost"
                        written = n
                    kv.free_reqid(r)
            except vattn.ClosedError:
                pass  # cleanup ran: every call now raises this
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def churn() -> None:
            try:
                while not stop.is_set():
                    try:
                        r = kv.alloc_reqid(prompt_len=random.randint(0, 200))
                    except vattn.OutOfReqids:
                        time.sleep(0.0005)
                        continue
                    kv.free_reqid(r)
                    kv.reclaim(8)
            except vattn.ClosedError:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(rep * 100 + i,)) for i in range(6)]
        threads.append(threading.Thread(target=churn))
        for t in threads:
            t.start()
        time.sleep(0.3)
        kv.cleanup()  # while everyone is busy
        stop.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a thread hangs after cleanup"
        if errors:
            raise errors[0]
        assert mapped_true[0] > 0
        for call in (lambda: kv.step([0] * B), kv.alloc_reqid, kv.stats, lambda: kv.layer(0)):
            try:
                call()
            except vattn.ClosedError:
                continue
            raise AssertionError("a call after cleanup did not raise ClosedError")


def cleanup_while_waiting(reps: int) -> None:
    """Steps that wait for a slow mapper round when cleanup() runs either
    finish before cleanup takes the manager or raise ClosedError: none
    carries on after it."""
    with faulty_host_backend() as faults:
        for _ in range(reps):
            faults.delay(3000)  # every page map takes 3 ms: batches are slow
            # the mapper starts a long eager batch at once
            kv = make(policy={"eager_tokens": L}, backend=FAULTY_HOST)
            results: list[tuple[str, float]] = []

            def stepper() -> None:
                try:
                    r = kv.alloc_reqid()
                    lens = [0] * B
                    lens[r] = 600
                    ok = kv.step(lens)
                    results.append(("ok" if ok else "false", ""))
                except vattn.ClosedError as e:
                    # the manager's own refusal, not a backend's pool that closed under a running call
                    results.append(("closed", str(e)))

            threads = [threading.Thread(target=stepper) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep(0.01)
            kv.cleanup()
            faults.delay(0)
            for t in threads:
                t.join(timeout=30)
                assert not t.is_alive()
            assert len(results) == 3
            for what, message in results:
                assert what != "closed" or "manager was cleaned up" in message, message


def concurrent_cleanup_and_drop(reps: int) -> None:
    """cleanup() from two threads at once, module-level init/cleanup from
    threads, and managers dropped without cleanup (mapper busy or idle, views
    alive or not): no crash, no hang, nothing leaked."""
    with faulty_host_backend() as faults:
        gc.collect()
        fds0, threads0 = fd_count(), thread_count()
        ranges: list[tuple[int, int]] = []  # every reservation made, to check none is left
        for rep in range(reps):
            faults.delay(500 if rep % 2 else 0)  # odd reps: the mapper is busy
            kv = make(backend=FAULTY_HOST)
            ranges.append((kv._pages.memory.base, kv._pages.memory.nbytes))
            r = kv.alloc_reqid()
            assert kv.step([300 if i == r else 0 for i in range(B)])
            ts = [threading.Thread(target=kv.cleanup) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=30)
                assert not t.is_alive()
            assert kv.closed

            outcomes: list[str] = []

            def init_cleanup() -> None:
                try:
                    vattn.init(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2, max_context_len=128,
                               page_size=PAGE, backend=FAULTY_HOST)
                    outcomes.append("init")
                except vattn.VAttnError:
                    outcomes.append("init-refused")
                try:
                    vattn.cleanup()
                    outcomes.append("cleanup")
                except vattn.ClosedError:
                    outcomes.append("cleanup-refused")

            ts = [threading.Thread(target=init_cleanup) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=30)
                assert not t.is_alive()
            assert outcomes.count("init") >= 1 and outcomes.count("init") == outcomes.count("cleanup")

            for keep_view in (False, True):
                kv = make(backend=FAULTY_HOST)
                ranges.append((kv._pages.memory.base, kv._pages.memory.nbytes))
                r = kv.alloc_reqid()
                assert kv.step([200 if i == r else 0 for i in range(B)])
                k = kv.layer(1)[0]
                k[r, :200] = 5.0
                view = k if keep_view else None
                del k, kv  # never cleaned up: the destructor does it, mapper busy or not
                gc.collect()
                if view is not None:
                    assert torch.all(view[r, :200] == 5.0)  # the view keeps its memory
                    del view
                    gc.collect()
        faults.delay(0)
        gc.collect()
        assert fd_count() == fds0, "a pool fd leaked"
        assert thread_count() == threads0, "a mapper thread leaked"
        maps = open("/proc/self/maps").read()
        assert "vattn-kv-pool" not in maps, "a page is still mapped"
        for line in maps.splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            assert (lo, hi - lo) not in ranges, "a reservation leaked"


# ---- fork ------------------------------------------------------------------------


def fork_child_cannot_touch_parent(reps: int) -> None:
    """A child that writes through an inherited view dies (the range is
    inaccessible there) and the parent's cache is unchanged; a child that
    calls methods gets ForkedError from each and exits normally, mapper busy
    or not."""
    with faulty_host_backend() as faults:
        for rep in range(reps):
            faults.delay(2000 if rep % 2 else 0)
            kv = make(policy={"eager_tokens": L}, backend=FAULTY_HOST)
            r = kv.alloc_reqid()
            lens = [0] * B
            lens[r] = 100
            assert kv.step(lens)
            k, v = kv.layer(0)
            k[r, :100] = 1.0
            pid = os.fork()
            if pid == 0:  # child: write through the view
                signal.signal(signal.SIGSEGV, signal.SIG_DFL)
                k[r, :100] = 99.0
                os._exit(0)  # reached only if the write went through
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, f"child status {status}"
            assert torch.all(k[r, :100] == 1.0), "the child changed the parent's cache"

            pid = os.fork()
            if pid == 0:  # child: every call refuses; exit must not hang
                code = 0
                calls = [lambda: kv.step(lens), kv.alloc_reqid, lambda: kv.free_reqid(r), kv.stats, lambda: kv.layer(0),
                         kv.cleanup, lambda: kv.fork(r, 10), lambda: kv.retain_prefix(r, 10), kv.reclaim, kv.wait_idle]
                for call in calls:
                    try:
                        call()
                        code = 3
                    except vattn.ForkedError:
                        pass
                    except BaseException:  # noqa: BLE001
                        code = 4
                os._exit(code) if code else sys.exit(0)  # sys.exit runs atexit and destructors
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
            assert kv.step(lens) and torch.all(k[r, :100] == 1.0)
            del k, v
            kv.cleanup()
            faults.delay(0)


def module_level_in_forked_child(reps: int) -> None:
    """After vattn.init, a forked child's module-level calls each raise ForkedError (they had said "call
    vattn.init first", a ClosedError), vattn.cleanup() there changes nothing, and vattn.init() in the child
    makes the child a cache of its own; the parent's default manager goes on."""
    shape = dict(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=B,
                 max_context_len=L, page_size=PAGE)
    for _ in range(reps):
        kv = vattn.init(**shape)
        r = vattn.alloc_reqid()
        lens = [0] * B
        lens[r] = 40
        assert vattn.step(lens)
        pid = os.fork()
        if pid == 0:
            code = 0
            calls = [lambda: vattn.step(lens), vattn.alloc_reqid, lambda: vattn.free_reqid(r), vattn.stats,
                     lambda: vattn.layer(0), lambda: vattn.fork(r, 10), vattn.get_manager, vattn.cleanup,
                     vattn.get_manager]  # the refused cleanup left the default in place
            for i, call in enumerate(calls):
                try:
                    call()
                    code = code or 10 + i
                except vattn.ForkedError:
                    pass
                except BaseException:  # noqa: BLE001
                    code = code or 30 + i
            if not code:
                try:
                    child = vattn.init(**shape)
                    assert vattn.get_manager() is child is not kv
                    c = vattn.alloc_reqid()
                    child_lens = [0] * B
                    child_lens[c] = 20
                    assert vattn.step(child_lens)
                    vattn.cleanup()
                except BaseException:  # noqa: BLE001
                    code = 50
            os._exit(code) if code else sys.exit(0)  # sys.exit runs atexit and destructors
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
        assert vattn.get_manager() is kv and vattn.step(lens)
        vattn.cleanup()


# ---- resource limits ---------------------------------------------------------------


def rlimit_fsize(reps: int) -> None:
    """A pool larger than RLIMIT_FSIZE is refused with a DriverError naming the
    limit, instead of SIGXFSZ killing the process."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        make(physical_memory=4 << 20)
    except vattn.DriverError as e:
        assert "RLIMIT_FSIZE" in str(e), e
    else:
        raise AssertionError("a pool beyond RLIMIT_FSIZE was accepted")


def rlimit_as(reps: int) -> None:
    """A reservation beyond RLIMIT_AS is refused before the system call with
    the bytes and the argument to lower; one that fits the limit but not the
    address space left becomes a DriverError, never a crash."""
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    try:
        make(max_context_len=1 << 24, max_batch_size=64)
    except ValueError as e:
        assert "RLIMIT_AS" in str(e) and "max_batch_size" in str(e), e
    else:
        raise AssertionError("a reservation beyond RLIMIT_AS was accepted")
    # Fits the limit, not what is left of it: the mmap fails and says so.
    small_pool = 64 * 4 * PAGE
    hog = make(max_context_len=600 << 10, max_batch_size=1, policy={"background": False},
               physical_memory=small_pool)  # 600 MiB
    try:
        make(max_context_len=600 << 10, max_batch_size=1, policy={"background": False},
             physical_memory=small_pool)
    except vattn.DriverError as e:
        assert "mmap(reserve)" in str(e), e
    else:
        raise AssertionError("reserving past RLIMIT_AS did not fail")
    hog.cleanup()


def max_map_count(reps: int) -> None:
    """At vm.max_map_count: mapping more pages raises DriverError, an unmap
    that must split a mapping fails and leaves the pages as orphans, and the
    page table describes exactly what is mapped throughout; freeing mappings
    lets the orphans go; cleanup releases everything."""
    from conftest import assert_invariants, assert_table_is_real

    limit = int(open("/proc/sys/vm/max_map_count").read())
    slots, per_slot = 64, (limit + 4096) // 64 + 1  # more single-page mappings than the limit allows
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=1024, dtype=torch.float32,
                              max_batch_size=slots, max_context_len=per_slot, page_size=PAGE,
                              layout="all_layers", page_allocator="external",
                              physical_memory=2 * slots * per_slot * PAGE)
    rng = np.random.default_rng(0)
    ids = 16 + rng.permutation(kv.num_page_ids - 16)  # shuffled: no two neighbours merge
    reqids = [kv.alloc_reqid() for _ in range(slots)]
    # one slot first, with consecutive ids: a single merged mapping of 16 pages per buffer
    merged = reqids[0]
    kv.map_pages([merged], [0], list(range(16)), [16])
    cursor, pos, chunk = 0, 0, 256
    with_error = None
    while with_error is None:
        assert pos < per_slot, "never reached vm.max_map_count"
        for r in reqids[1:]:
            n = min(chunk, per_slot - pos)
            try:
                kv.map_pages([r], [pos], ids[cursor:cursor + n], [n])
            except vattn.DriverError as e:
                with_error = e
                break
            cursor += n
        pos += chunk
    assert "max_map_count" in str(with_error), with_error
    # At the limit (nothing that allocates memory until mappings are freed:
    # malloc itself cannot get a new mapping now). Unmapping the middle of the
    # merged mapping needs a split, which the kernel refuses at the limit when
    # it counts one more mapping: the pages then stay mapped, as orphans.
    try:
        kv.unmap_pages([merged], [8])
    except vattn.DriverError:
        pass
    kv.unmap_pages(reqids[1:9], [0] * 8)  # frees thousands of mappings
    assert_table_is_real(kv)
    assert_invariants(kv)
    kv.reclaim()  # retries any orphan
    assert kv.stats()["pages_orphaned"] == 0
    assert kv.page_ids(merged) == list(range(8))
    assert_table_is_real(kv)
    assert_invariants(kv)
    kv.cleanup()


SCENARIOS = {f.__name__: f for f in (disjoint_steps, cleanup_while_waiting, concurrent_cleanup_and_drop,
                                     fork_child_cannot_touch_parent, module_level_in_forked_child, rlimit_fsize,
                                     rlimit_as, max_map_count)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    print("held")
