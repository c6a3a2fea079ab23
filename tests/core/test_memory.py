"""Virtual reservations commit nothing; init/cleanup cycles leak nothing."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import resource
import struct

import pytest
import torch

import vattn
from vattn import _C

GiB = 1024**3


def proc_kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def mapping_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reserving_tens_of_gb_commits_only_the_pool():
    page = 2 * 1024 * 1024
    pool = 128 * page  # 256 MiB
    rss0 = proc_kib("/proc/self/status", "VmRSS")
    shmem0 = proc_kib("/proc/meminfo", "Shmem")
    # 32 layers x 2 x 64 slots x 32K tokens x 8 heads x 128 x fp16 = 256 GiB of virtual space
    kv = vattn.KVCacheManager(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                              max_batch_size=64, max_context_len=32768, page_size=page,
                              physical_memory=pool, policy={"background": False})
    try:
        s = kv.stats()
        assert s["bytes_reserved"] >= 256 * GiB
        assert s["bytes_total"] == pool
        assert proc_kib("/proc/self/status", "VmSize") * 1024 >= 256 * GiB  # really reserved
        r = kv.alloc_reqid()
        lens = [0] * 64
        lens[r] = 2000  # 2000 tokens x 2 KiB per buffer = 2 pages x 64 buffers = the whole pool
        assert kv.step(lens)
        for layer in range(32):
            k, v = kv.layer(layer)
            k[r, :2000] = 1.0  # touch every mapped byte
            v[r, :2000] = 1.0
        lens[r] = 3000  # 3 pages per buffer: beyond the pool
        assert kv.step(lens) is False
        rss = (proc_kib("/proc/self/status", "VmRSS") - rss0) * 1024
        shmem = (proc_kib("/proc/meminfo", "Shmem") - shmem0) * 1024
        assert pool - 8 * 1024 * 1024 <= rss < pool + 64 * 1024 * 1024  # interpreter noise allowance
        assert shmem <= pool + 32 * 1024 * 1024  # other processes' noise allowance
    finally:
        kv.cleanup()


def test_committed_memory_follows_mapped_pages():
    page = 2 * 1024 * 1024
    shmem0 = proc_kib("/proc/meminfo", "Shmem")
    with vattn.KVCacheManager(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                              max_batch_size=8, max_context_len=8192, page_size=page,
                              policy={"background": False}) as kv:
        r = kv.alloc_reqid()
        lens = [0] * 8
        lens[r] = 2048  # 2048 x 2 KiB = 4 MiB = 2 pages per buffer, 8 buffers -> 32 MiB
        assert kv.step(lens)
        grown = (proc_kib("/proc/meminfo", "Shmem") - shmem0) * 1024
        assert 16 * page - 8 * 1024 * 1024 <= grown <= 16 * page + 16 * 1024 * 1024
    released = (proc_kib("/proc/meminfo", "Shmem") - shmem0) * 1024
    assert released < 8 * 1024 * 1024


def present_os_pages(addr: int, nbytes: int) -> list[bool]:
    """Whether each OS page of [addr, addr + nbytes) has a page-table entry (bit 63 of /proc/self/pagemap,
    which an unprivileged process reads for itself)."""
    first, count = addr // mmap.PAGESIZE, -(-(addr + nbytes) // mmap.PAGESIZE) - addr // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"<{count}Q", f.read(count * 8))
    return [bool(e >> 63) for e in entries]


def os_pages_state(kv: vattn.KVCacheManager, reqid: int, nbytes: int) -> tuple[list[int], list[int]]:
    """For K and V of layer 1 of ``reqid``: OS pages of its first ``nbytes`` without a page-table entry,
    and OS pages of the next 64 KiB with one."""
    k, v = kv.layer(1)
    starts = [k[reqid].data_ptr(), v[reqid].data_ptr()]
    return ([present_os_pages(start, nbytes).count(False) for start in starts],
            [present_os_pages(start + nbytes, 64 * 1024).count(True) for start in starts])


def write_faults(kv: vattn.KVCacheManager, reqid: int, tokens: int) -> int:
    """Minor page faults taken writing ``tokens`` tokens of K and V of layer 1 of ``reqid``; checks they read back."""
    k, v = kv.layer(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    k[reqid, :tokens] = 1.0
    v[reqid, :tokens] = 2.0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    sums = (float(k[reqid, :tokens].sum()), float(v[reqid, :tokens].sum()))
    assert sums == (tokens * 2 * 64, 2 * tokens * 2 * 64)
    return faults


@pytest.mark.parametrize("page", [64 * 1024, 2 * 1024 * 1024])
def test_map_pages_populates_the_page_table_and_step_leaves_it_to_first_touch(page):
    # A framework writes the blocks it maps right away (a prefill's): map_pages makes their page-table entries
    # in one pass, and the forward's writes take no fault per OS page. step's pages, which a decode fills a
    # token at a time, fault in as written: populating them would put a whole page's entries on the step
    # that crosses into it. Plain numbers only in the asserts: pytest would print a tensor whose slice
    # reads unmapped rows.
    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("needs /proc/self/pagemap: Linux shows a page-table entry there")
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=4,
                 max_context_len=16384, page_size=page)
    tokens = 4096  # x 512 B = 2 MiB per buffer
    with vattn.KVCacheManager(**shape, page_allocator="external") as kv:
        r = kv.alloc_reqid()
        positions = tokens * 512 // page
        kv.map_pages([r], [0], [list(range(1, 1 + positions))])
        missing, beyond = os_pages_state(kv, r, tokens * 512)
        assert missing == [0, 0], "map_pages left mapped OS pages without a page-table entry (K, V)"
        assert beyond == [0, 0], "page-table entries past the mapping (K, V)"
        faults = write_faults(kv, r, tokens)
        assert faults < tokens * 512 // mmap.PAGESIZE // 8, f"{faults} page faults writing pages map_pages mapped"
    with vattn.KVCacheManager(**shape, policy={"background": False}) as kv:
        r = kv.alloc_reqid()
        lens = [0] * 4
        lens[r] = tokens
        assert kv.step(lens)
        missing, _ = os_pages_state(kv, r, tokens * 512)
        assert missing == [tokens * 512 // mmap.PAGESIZE] * 2, "step populated page-table entries"
        assert write_faults(kv, r, tokens) >= tokens * 512 // mmap.PAGESIZE


def test_created_pages_are_cleared_when_created():
    # fallocate commits a page but leaves its zeroing to the first use: a forward's fault (or map_pages'
    # populate) would pay it. The host clears the pages it creates, so their first use finds them ready:
    # mincore, which reports a shared memory page as resident once it is up to date, sees all of them.
    page, pages = 64 * 1024, 32
    backend = _C.make_backend("host", 0, page, pages, "")
    backend.create_pages(0, pages)
    base = backend.reserve(pages * page)
    try:
        backend.map([(base + i * page, i) for i in range(pages)])
        count = pages * page // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * count)()
        assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(base), ctypes.c_size_t(pages * page), vec) == 0
        assert sum(v & 1 for v in vec) == count, "created pages not yet cleared"
        view = (ctypes.c_ubyte * (pages * page)).from_address(base)
        assert bytes(view).count(0) == pages * page
        backend.unmap([base + i * page for i in range(pages)])
    finally:
        backend.free_reservation(base, pages * page)


def test_init_cleanup_cycles_leave_nothing_behind():
    def cycle(i: int) -> None:
        kv = vattn.init(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                        max_context_len=1024, page_size=64 * 1024, layout=("per_layer", "all_layers")[i % 2])
        r = vattn.alloc_reqid()
        lens = [0] * 4
        lens[r] = 300 + i
        assert vattn.step(lens)
        k, v = vattn.layer(1)
        k[r, : lens[r]] = 1.0
        del k, v
        vattn.free_reqid(r)
        vattn.cleanup()
        assert kv.closed

    cycle(0)  # warm-up: first-use allocations of torch and the extension
    gc.collect()
    maps0, fds0 = mapping_count(), fd_count()
    for i in range(300):
        cycle(i)
    gc.collect()
    assert fd_count() == fds0
    assert mapping_count() <= maps0 + 2  # glibc arenas may split one region; no per-cycle growth


def test_views_keep_memory_alive_after_cleanup_like_a_storage():
    gc.collect()
    fds0, maps0 = fd_count(), mapping_count()
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2, max_context_len=256,
                              page_size=4096, policy={"background": False})
    r = kv.alloc_reqid()
    assert kv.step([100, 0] if r == 0 else [0, 100])
    k = kv.layer(0)[0]
    k[r, :100] = 7.0
    assert fd_count() == fds0 + 1  # the memfd pool
    kv.cleanup()
    del kv
    gc.collect()
    # a view that outlives cleanup still reads what it read (never unmapped or reused memory)
    assert torch.all(k[r, :100] == 7.0)
    assert fd_count() == fds0 + 1
    del k
    gc.collect()
    # the last view gone: pool, mappings and reservation are released
    assert fd_count() == fds0
    assert mapping_count() <= maps0 + 2
