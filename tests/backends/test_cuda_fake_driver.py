"""The cuda backend's C++ code against the test driver (tests/backends/fake_cuda): data,
context handling, injected driver failures, leaks. Device pointers of the fake
driver are host addresses, read and written here through its checked device
accesses (a fault fails the test)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import vattn
from backends.cuda_framework import device_read, device_write
from conftest import manager_state

MiB = 1024 * 1024
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_UNKNOWN = 999


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    # per token per buffer: 4 heads x 128 x fp16 = 1 KiB, so 2048 tokens = one 2 MiB page
    args = dict(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                max_context_len=8192, device="cuda", physical_memory=64 * MiB)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


def row_address(kv, buffer: int, reqid: int, token: int) -> int:
    return kv.buffer_address(buffer) + reqid * kv.slice_bytes + token * kv.config.token_bytes_per_buffer


def write_row(lib, kv, buffer: int, reqid: int, token: int, value: int) -> None:
    """A device write: the fake driver faults where nothing is mapped with access."""
    device_write(lib, row_address(kv, buffer, reqid, token), bytes([value]) * kv.config.token_bytes_per_buffer)


def read_row(lib, kv, buffer: int, reqid: int, token: int) -> bytes:
    return device_read(lib, row_address(kv, buffer, reqid, token), kv.config.token_bytes_per_buffer)


def assert_all_released(lib):
    assert lib.fake_cuda_live_mappings() == lib.baseline_mappings
    assert lib.fake_cuda_live_handles() == lib.baseline_handles
    assert lib.fake_cuda_live_reservations() == lib.baseline_reservations


def test_granularity_and_page_size_validation(fake_cuda):
    with pytest.raises(ValueError, match=r"multiple of the cuda backend's granularity \(2097152 bytes\)"):
        make(page_size=3 * MiB)
    with pytest.raises(vattn.BackendUnavailable, match=r"below the CUDA driver's granularity"):
        make(page_size=64 * 1024)  # never rounded up (tests/backends/test_cuda_uvm.py has the rest)
    with make() as kv:
        assert kv.page_size == 2 * MiB
        assert kv.backend.name == "cuda"
        assert kv.stats()["pages_total"] == 32


def test_data_written_through_mappings_reads_back(fake_cuda):
    with make() as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        for n in (1, 2048, 2049, 5000):
            assert kv.step([n if r in (a, b) else 0 for r in range(4)])
            for buf in range(kv.config.num_buffers):
                write_row(fake_cuda, kv, buf, a, n - 1, 0x11 + buf)
                write_row(fake_cuda, kv, buf, b, n - 1, 0x21 + buf)
        for n in (1, 2048, 2049, 5000):
            for buf in range(kv.config.num_buffers):
                assert read_row(fake_cuda, kv, buf, a, n - 1) == bytes([0x11 + buf]) * 1024
                assert read_row(fake_cuda, kv, buf, b, n - 1) == bytes([0x21 + buf]) * 1024
        assert fake_cuda.fake_cuda_live_mappings() - fake_cuda.baseline_mappings == 2 * 3 * 4  # 2 reqs x 3 pages x 4 buffers
    assert_all_released(fake_cuda)
    del kv  # the backend keeps the primary context until its last owner goes
    gc.collect()
    assert fake_cuda.fake_cuda_primary_refs() == 0


def test_step_from_a_thread_without_context(fake_cuda):
    # The fake driver refuses memory calls on a thread with no current context,
    # as the real one does: the backend must make the primary context current.
    with make() as kv:
        r = kv.alloc_reqid()
        results = []
        t = threading.Thread(target=lambda: results.append(kv.step([3000 if i == r else 0 for i in range(4)])))
        t.start()
        t.join()
        assert results == [True]
        write_row(fake_cuda, kv, 0, r, 2999, 7)
        assert read_row(fake_cuda, kv, 0, r, 2999) == bytes([7]) * 1024


def test_reclaim_synchronizes_before_unmap(fake_cuda):
    with make(physical_memory=8 * MiB) as kv:  # 4 pages: one per buffer
        a = kv.alloc_reqid()
        assert kv.step([10 if i == a else 0 for i in range(4)])
        kv.free_reqid(a)
        b = kv.alloc_reqid(prompt_len=0)  # the smallest mapping that covers 0 tokens: not a's
        assert b != a
        syncs = fake_cuda.fake_cuda_sync_calls()
        assert kv.step([10 if i == b else 0 for i in range(4)])
        assert fake_cuda.fake_cuda_sync_calls() > syncs  # device idle before a's pages were unmapped
        assert kv.stats()["reclaimed_pages"] == 4


@pytest.mark.parametrize(
    "call,skip,code,name",
    [
        ("cuMemCreate", 0, CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"),
        ("cuMemCreate", 5, CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
        ("cuMemMap", 0, CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"),
        ("cuMemMap", 3, CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
        ("cuMemSetAccess", 0, CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
        ("cuMemSetAccess", 1, CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"),
    ],
)
def test_injected_failure_surfaces_cleanly(fake_cuda, call, skip, code, name):
    kv = make()
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    assert kv.step([100 if r == a else 0 for r in range(4)])  # a holds 1 page per buffer
    write_row(fake_cuda, kv, 0, a, 99, 0x5A)
    before = manager_state(kv)
    mappings_before = fake_cuda.fake_cuda_live_mappings()
    fake_cuda.fake_cuda_fail(call.encode(), skip, 1, code)
    lens = [0] * 4
    lens[a], lens[b] = 6000, 6000  # a grows by 2 pages, b needs 3: 20 pages in all
    with pytest.raises(vattn.DriverError, match=f"{call} failed: {name}") as info:
        kv.step(lens)
    assert info.value.call == call and name in info.value.detail
    # nothing new stays mapped, nothing a held was touched
    assert fake_cuda.fake_cuda_live_mappings() == mappings_before
    after = manager_state(kv)
    assert after[1:] == before[1:]
    assert read_row(fake_cuda, kv, 0, a, 99) == bytes([0x5A]) * 1024
    # the same step succeeds once the driver recovers
    fake_cuda.fake_cuda_clear_failures()
    assert kv.step(lens)
    write_row(fake_cuda, kv, 3, b, 5999, 0x33)
    assert read_row(fake_cuda, kv, 3, b, 5999) == bytes([0x33]) * 1024
    kv.cleanup()
    assert_all_released(fake_cuda)


@pytest.mark.parametrize("skip", [0, 5])
def test_out_of_memory_at_creation_is_a_full_pool(fake_cuda, skip):
    # CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate (something else took the
    # memory) is no failure: step answers False as for a full pool, nothing
    # changed, and the same step succeeds once memory is back.
    kv = make()
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    assert kv.step([100 if r == a else 0 for r in range(4)])
    write_row(fake_cuda, kv, 0, a, 99, 0x5A)
    before, handles = manager_state(kv), fake_cuda.fake_cuda_live_handles()
    fake_cuda.fake_cuda_fail(b"cuMemCreate", skip, 1, CUDA_ERROR_OUT_OF_MEMORY)
    lens = [0] * 4
    lens[a], lens[b] = 6000, 6000
    assert kv.step(lens) is False
    assert manager_state(kv)[1:] == before[1:] and fake_cuda.fake_cuda_live_handles() == handles
    assert read_row(fake_cuda, kv, 0, a, 99) == bytes([0x5A]) * 1024
    assert kv.stats()["creations_refused"] == 1 and kv.stats()["failed_steps"] == 1
    fake_cuda.fake_cuda_clear_failures()
    assert kv.step(lens)
    kv.cleanup()
    assert_all_released(fake_cuda)


def test_unmap_failure_at_cleanup_still_releases_what_it_can(fake_cuda):
    kv = make()
    r = kv.alloc_reqid()
    assert kv.step([10 if i == r else 0 for i in range(4)])
    fake_cuda.fake_cuda_fail(b"cuMemUnmap", 0, 1, CUDA_ERROR_UNKNOWN)
    with pytest.raises(vattn.DriverError, match="cuMemUnmap"):
        kv.cleanup()
    assert kv.closed
    fake_cuda.fake_cuda_clear_failures()
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles  # released; a mapping stays behind


def test_no_driver_raises_backend_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("VATTN_CUDA_DRIVER_LIB", str(tmp_path / "libcuda-missing.so.1"))
    with pytest.raises(vattn.BackendUnavailable, match="cannot load the CUDA driver library"):
        make()
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64) as kv:  # the host is unaffected
        assert kv.step([0])


def test_missing_device(fake_cuda):
    with pytest.raises(vattn.BackendUnavailable, match="CUDA device 3 does not exist"):
        make(device="cuda:3")


def test_cuda_tensors_need_a_cuda_torch(fake_cuda):
    with make() as kv:
        if torch.cuda.is_available():
            pytest.skip("needs a torch without CUDA: the fake driver's addresses are not device memory")
        with pytest.raises(vattn.BackendUnavailable, match="no CUDA support"):
            kv.layer(0)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_fork_maps_one_allocation_at_several_addresses(fake_cuda, layout):
    """Shared pages: the same cuMemCreate handle behind both slices; the partial
    page is a fresh handle filled by a device-to-device copy."""
    page_size = 2 * MiB if layout == "per_layer" else 4 * MiB  # all_layers: 2 layers x 1 KiB per token
    with make(layout=layout, page_size=page_size) as kv:
        tokens, row = kv.page_tokens, kv.config.token_bytes_per_buffer
        src = kv.alloc_reqid()
        assert kv.step([2 * tokens + 10 if r == src else 0 for r in range(4)])
        for buf in range(kv.config.num_buffers):
            for t in (0, tokens, 2 * tokens + 9):
                write_row(fake_cuda, kv, buf, src, t, 0x30 + buf + t % 7)
        child = kv.fork(src, 2 * tokens + 10)
        for buf in range(kv.config.num_buffers):
            base = kv.buffer_address(buf)
            for pos in range(3):
                here = fake_cuda.fake_cuda_handle_at(base + child * kv.slice_bytes + pos * page_size)
                there = fake_cuda.fake_cuda_handle_at(base + src * kv.slice_bytes + pos * page_size)
                assert here != 0 and (here == there) == (pos < 2)
            for t in (0, tokens, 2 * tokens + 9):
                assert read_row(fake_cuda, kv, buf, child, t) == bytes([0x30 + buf + t % 7]) * row
        kv.free_reqid(src)
        kv.reclaim()
        for buf in range(kv.config.num_buffers):
            assert read_row(fake_cuda, kv, buf, child, 0) == bytes([0x30 + buf]) * row
    assert_all_released(fake_cuda)
