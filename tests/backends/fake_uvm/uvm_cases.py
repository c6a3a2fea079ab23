"""The cuda_uvm backend against the patched module's stand-in (fake_uvm.c).

Run by tests/backends/test_cuda_uvm.py in a process started with the stand-in in
LD_PRELOAD and FAKE_UVM_DEVICE / VATTN_UVM_DEVICE / FAKE_CUDA_UVM_DEVICE naming
one stand-in device file; the fake CUDA driver (tests/backends/fake_cuda) plays libcuda,
opening that file as its nvidia-uvm descriptor. Device pointers are host
addresses, read and written here with ctypes.

Every test checks the page table against what the stand-in really has mapped
(`assert_table_exact`): after success, after each error code, after batches
that fail part-way.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import importlib.util
import os
import threading
from pathlib import Path

import pytest
import torch

import vattn
import vattn.cli.info
from vattn import _C

ROOT = Path(__file__).resolve().parents[3]

KiB, MiB = 1024, 1024 * 1024
PAGE_SIZES = [64 * KiB, 128 * KiB, 256 * KiB, 2 * MiB]
# NV_STATUS values of csrc/backends/vattn_uvm_ioctl.h, by the names the backend reports
STATUS = {
    "NV_ERR_ILLEGAL_ACTION": 0x16,
    "NV_ERR_INVALID_ADDRESS": 0x1E,
    "NV_ERR_INVALID_ARGUMENT": 0x1F,
    "NV_ERR_INVALID_DEVICE": 0x26,
    "NV_ERR_INVALID_OBJECT_HANDLE": 0x33,
    "NV_ERR_NO_MEMORY": 0x51,
    "NV_ERR_NOT_SUPPORTED": 0x56,
    "NV_ERR_OUT_OF_RANGE": 0x5B,
    "NV_ERR_UVM_ADDRESS_IN_USE": 0x68,
}
CREATE_EXTERNAL_RANGE_CALLS = 5  # fake_uvm_calls index


@pytest.fixture
def uvm(monkeypatch):
    """The stand-in (already loaded through LD_PRELOAD) with its baselines."""
    lib = ctypes.CDLL(os.environ["FAKE_UVM_LIB"])
    lib.fake_uvm_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_long, ctypes.c_uint, ctypes.c_int]
    lib.fake_uvm_handle_at.restype = ctypes.c_ulonglong
    lib.fake_uvm_handle_at.argtypes = [ctypes.c_ulonglong]
    lib.fake_uvm_bytes_in_use.restype = ctypes.c_ulonglong
    lib.fake_uvm_mapped_vas.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_long]
    lib.fake_uvm_clear_failures()
    gc.collect()  # managers of earlier tests let go of their nvidia-uvm descriptors
    for name in ("FAKE_UVM_STOCK", "FAKE_UVM_ABI", "FAKE_UVM_PAGE_SIZES", "FAKE_UVM_TOTAL_MEM", "FAKE_UVM_VA_LIMIT",
                 "FAKE_UVM_FRESH_MAPS", "FAKE_CUDA_UVM_EXTERNAL", "FAKE_CUDA_UVM_REGISTER", "VATTN_UVM_FD"):
        monkeypatch.delenv(name, raising=False)
    lib.baseline = (lib.fake_uvm_live_allocs(), lib.fake_uvm_live_mappings(), lib.fake_uvm_live_ranges())
    yield lib
    lib.fake_uvm_clear_failures()


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    # per token per buffer: 4 heads x 128 x fp16 = 1 KiB; 64 KiB pages hold 64 tokens
    args = dict(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                max_context_len=4096, device="cuda", page_size=64 * KiB, physical_memory=16 * MiB)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


def lens_of(kv, **by_reqid) -> list[int]:
    out = [0] * kv.config.max_batch_size
    for r, n in by_reqid.items():
        out[int(r[1:])] = n
    return out


def row_address(kv, buffer: int, reqid: int, token: int) -> int:
    # per_layer: one layer's K or V row per token; all_layers: every layer's, side by side
    return kv.buffer_address(buffer) + reqid * kv.slice_bytes + token * kv.config.token_bytes_per_buffer


def write_row(kv, buffer, reqid, token, value) -> None:
    ctypes.memset(row_address(kv, buffer, reqid, token), value, 512)


def read_row(kv, buffer, reqid, token) -> bytes:
    return ctypes.string_at(row_address(kv, buffer, reqid, token), 512)


def mapped_vas(uvm) -> set[int]:
    n = uvm.fake_uvm_mapped_vas(None, 0)
    out = (ctypes.c_ulonglong * max(n, 1))()
    uvm.fake_uvm_mapped_vas(out, n)
    return set(out[:n])


def assert_table_exact(kv, uvm) -> None:
    """The page table names exactly the addresses the module has mapped inside
    this cache, and one physical page is one allocation wherever it is mapped."""
    table = kv._pages.table()
    base, size = kv.buffer_address(0), kv.config.num_buffers * kv._pages.buffer_bytes
    here = {va for va in mapped_vas(uvm) if base <= va < base + size}
    assert {addr for addr, _ in table} == here
    handle_of: dict[int, int] = {}
    for addr, page in table:
        handle_of.setdefault(page, uvm.fake_uvm_handle_at(addr))
        assert uvm.fake_uvm_handle_at(addr) == handle_of[page] != 0
    assert len(set(handle_of.values())) == len(handle_of)  # distinct pages, distinct allocations


def assert_all_released(uvm) -> None:
    assert (uvm.fake_uvm_live_allocs(), uvm.fake_uvm_live_mappings(), uvm.fake_uvm_live_ranges()) == uvm.baseline


# ---- success ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_write_read_back_across_map_unmap_remap(uvm, fake_cuda, page_size, layout):
    token_bytes = 1 * KiB if layout == "per_layer" else 2 * KiB  # per buffer
    tokens = page_size // token_bytes  # per page
    # two requests of 3 pages in every buffer
    with make(page_size=page_size, layout=layout, backend="cuda_uvm", max_context_len=max(4096, 3 * tokens),
              physical_memory=24 * page_size) as kv:
        assert kv.backend.name == "cuda_uvm" and kv.page_size == page_size
        assert kv.config.token_bytes_per_buffer == token_bytes
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lengths = [1, tokens, tokens + 1, 3 * tokens]
        for n in lengths:  # fresh maps
            assert kv.step(lens_of(kv, **{f"r{a}": n, f"r{b}": n}))
            for buf in range(kv.config.num_buffers):
                write_row(kv, buf, a, n - 1, 0x10 + buf)
                write_row(kv, buf, b, n - 1, 0x20 + buf)
        assert_table_exact(kv, uvm)
        for n in lengths:
            for buf in range(kv.config.num_buffers):
                assert read_row(kv, buf, a, n - 1) == bytes([0x10 + buf]) * 512
                assert read_row(kv, buf, b, n - 1) == bytes([0x20 + buf]) * 512
        kv.unmap_pages([a], [1])  # unmap all but a's first page
        assert_table_exact(kv, uvm)
        assert read_row(kv, 0, a, 0) == bytes([0x10]) * 512  # the page that stayed kept its data
        assert kv.step(lens_of(kv, **{f"r{a}": 3 * tokens, f"r{b}": 3 * tokens}))  # remap
        assert_table_exact(kv, uvm)
        for buf in range(kv.config.num_buffers):
            write_row(kv, buf, a, 3 * tokens - 1, 0x30 + buf)
            assert read_row(kv, buf, a, 3 * tokens - 1) == bytes([0x30 + buf]) * 512
            assert read_row(kv, buf, b, 3 * tokens - 1) == bytes([0x20 + buf]) * 512
    assert_all_released(uvm)
    assert fake_cuda.fake_cuda_live_reservations() == fake_cuda.baseline_reservations


def test_shared_pages_are_one_allocation_at_two_addresses(uvm, fake_cuda):
    with make() as kv:
        a = kv.alloc_reqid()
        assert kv.step(lens_of(kv, **{f"r{a}": 150}))  # 3 pages of 64 tokens
        for t in range(150):
            write_row(kv, 0, a, t, t % 251)
        b = kv.fork(a, 150)  # 2 whole pages shared, the partial third copied
        assert_table_exact(kv, uvm)
        shared = row_address(kv, 0, b, 0)
        assert uvm.fake_uvm_handle_at(shared) == uvm.fake_uvm_handle_at(row_address(kv, 0, a, 0))
        assert uvm.fake_uvm_handle_at(row_address(kv, 0, b, 140)) != uvm.fake_uvm_handle_at(row_address(kv, 0, a, 140))
        assert [read_row(kv, 0, b, t)[0] for t in range(150)] == [t % 251 for t in range(150)]
    assert_all_released(uvm)


def test_background_mapper_thread_maps_through_the_module(uvm, fake_cuda):
    with make(policy={"background": True}) as kv:
        r = kv.alloc_reqid()
        for n in range(1, 400, 7):
            assert kv.step(lens_of(kv, **{f"r{r}": n}))
            write_row(kv, 1, r, n - 1, 0x42)
        kv.wait_idle()
        assert_table_exact(kv, uvm)
        assert all(read_row(kv, 1, r, n - 1) == bytes([0x42]) * 512 for n in range(1, 400, 7))
    assert_all_released(uvm)


def test_driver_made_the_reservation_an_external_range(uvm, fake_cuda, monkeypatch):
    # A driver that registers its reservations with UVM itself: the backend's
    # own UVM_CREATE_EXTERNAL_RANGE is refused (address in use) and it uses
    # the driver's range, which the driver frees with the reservation.
    monkeypatch.setenv("FAKE_CUDA_UVM_EXTERNAL", "1")
    before = uvm.fake_uvm_calls(CREATE_EXTERNAL_RANGE_CALLS)
    with make() as kv:
        r = kv.alloc_reqid()
        assert kv.step(lens_of(kv, **{f"r{r}": 100}))
        write_row(kv, 2, r, 99, 0x77)
        assert read_row(kv, 2, r, 99) == bytes([0x77]) * 512
        assert uvm.fake_uvm_live_ranges() == uvm.baseline[2] + 1  # the driver's range only
        assert uvm.fake_uvm_calls(CREATE_EXTERNAL_RANGE_CALLS) == before + 2  # the driver's, then ours refused
    assert_all_released(uvm)


def test_automatic_selection(uvm, fake_cuda):
    with make(page_size=128 * KiB) as kv:  # below the driver's 2 MiB, patched module loaded
        assert kv.backend.name == "cuda_uvm"
    with make(page_size=None) as kv:  # the driver's granularity: the stock path
        assert kv.backend.name == "cuda" and kv.page_size == 2 * MiB
    with make(page_size=None, backend="cuda_uvm") as kv:
        assert kv.backend.name == "cuda_uvm" and kv.page_size == 64 * KiB
    with pytest.raises(ValueError, match=r"page_size 65536 needs backend='cuda_uvm'"):
        make(backend="cuda")
    with pytest.raises(ValueError, match=r"one of \(65536, 131072, 262144, 2097152\) bytes for the cuda_uvm"):
        make(backend="cuda_uvm", page_size=4 * MiB)
    assert_all_released(uvm)


def test_info_reports_the_patched_module(fake_cuda):
    info = vattn.cli.info.collect()
    uvm_info = info["backends"]["cuda_uvm"]
    assert uvm_info["patched_module"] and uvm_info["available"]
    assert uvm_info["abi_version"] == _C.backend_probe("cuda_uvm", "abi")["abi_version"]
    assert uvm_info["page_sizes"] == PAGE_SIZES
    text = vattn.cli.info.render(info)
    assert "backend cuda_uvm: available (patched nvidia-uvm loaded (ABI 1" in text
    assert "page sizes: 64 KiB, 128 KiB, 256 KiB, 2 MiB (default 64 KiB)" in text


def load_verify_script():
    spec = importlib.util.spec_from_file_location("uvm_verify", ROOT / "driver_patch" / "verify.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_slice(kv, buffer: int, reqid: int) -> torch.Tensor:
    """The slice through host memory (the stand-in's device pointers are host addresses)."""
    addr = kv.buffer_address(buffer) + reqid * kv.slice_bytes
    return torch.frombuffer((ctypes.c_uint8 * kv.slice_bytes).from_address(addr), dtype=torch.uint8)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_verify_script_passes_on_a_module_that_keeps_data(uvm, fake_cuda, page_size):
    verify = load_verify_script()
    assert verify.check_page_size(page_size, "cuda", host_slice) == []
    assert_all_released(uvm)


def test_verify_script_catches_a_module_that_maps_the_wrong_memory(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_UVM_FRESH_MAPS", "1")
    verify = load_verify_script()
    problems = verify.check_page_size(64 * KiB, "cuda", host_slice)
    assert problems and all(p.startswith("65536: ") for p in problems)
    assert any("shared page differs between its two addresses" in p for p in problems)


# ---- streams and CUDA graphs: what the cuda backend does, the same way ----------------


def test_graph_capture_refuses_every_driver_reaching_call_on_every_thread(uvm, fake_cuda):
    with make(policy={"background": True, "eager": False, "lookahead_tokens": 64}) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens_of(kv, **{f"r{a}": 64, f"r{b}": 64}))
        kv.wait_idle()
        tables, calls = kv._pages.table(), [uvm.fake_uvm_calls(i) for i in range(8)]
        syncs = fake_cuda.fake_cuda_sync_calls()
        outcome = []

        def grow_b():
            try:
                outcome.append(kv.step(lens_of(kv, **{f"r{b}": 300})))
            except vattn.DriverError as e:
                outcome.append(e)

        with kv.graph_capture():
            assert kv.step(lens_of(kv, **{f"r{a}": 64, f"r{b}": 64}))  # mapped already: needs no driver call
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.step(lens_of(kv, **{f"r{a}": 200}))  # needs new pages
            t = threading.Thread(target=grow_b)
            t.start()
            t.join(timeout=10)
            assert not t.is_alive(), "another thread's call blocked during the capture"
            assert isinstance(outcome[0], vattn.DriverError) and "another thread" in str(outcome[0])
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.fork(a, 64)  # waits for the device, then copies
            kv.free_reqid(b)  # deferred reclaim: no unmap, no fence recorded
            with pytest.raises(vattn.DriverError, match="graph_capture"):
                kv.reclaim()  # waits for b's readers, then unmaps
            assert kv._pages.table() == tables
            assert [uvm.fake_uvm_calls(i) for i in range(8)] == calls, "an ioctl during the capture"
            assert fake_cuda.fake_cuda_sync_calls() == syncs
        assert kv.reclaim() == 8  # b's 2 pages in each of 4 buffers (64 tokens stepped, 64 mapped ahead)
        assert kv.step(lens_of(kv, **{f"r{a}": 200}))  # after the capture it maps
        kv.wait_idle()
        assert kv.stats()["mapper_errors"] == 0
        assert_table_exact(kv, uvm)
        with pytest.raises(RuntimeError, match="already"):
            with kv.graph_capture():
                with kv.graph_capture():
                    pass
        assert kv.step(lens_of(kv, **{f"r{a}": 300}))  # the failed reentry left nothing paused or closed
    assert_all_released(uvm)


def test_reclaim_waits_for_the_named_stream_not_the_device(uvm, fake_cuda):
    # 0: the legacy default stream, the one handle a test can name without a
    # framework; its counters are the process's, so the test works with deltas
    with make(sync_streams=0) as kv:
        facts = dict(kv._pages.memory.backend.facts)
        assert facts["sync"] == "events on 1 stream(s)"
        syncs = fake_cuda.fake_cuda_sync_calls()
        a = kv.alloc_reqid()
        assert kv.step(lens_of(kv, **{f"r{a}": 100}))
        fake_cuda.fake_cuda_launch(0)
        fake_cuda.fake_cuda_launch(0)
        read_before_free = fake_cuda.fake_cuda_launch(0)  # the kernels that read a
        kv.free_reqid(a)  # its read fence: an event on the stream
        fake_cuda.fake_cuda_launch(0)  # later iterations of other requests
        assert kv.reclaim() == 8  # 2 pages x 4 buffers
        assert fake_cuda.fake_cuda_stream_completed(0) == read_before_free  # a's readers, not the later kernel
        assert fake_cuda.fake_cuda_sync_calls() == syncs  # nor the device
        assert int(kv._pages.memory.backend.facts["event_waits"]) >= 1
        kv.set_sync_streams(None)  # back to the device: waits for the stream's work first
        assert fake_cuda.fake_cuda_stream_completed(0) == read_before_free + 1
        assert dict(kv._pages.memory.backend.facts)["sync"] == "cuCtxSynchronize"
    assert_all_released(uvm)


# ---- the module refuses: each error code ------------------------------------------


@pytest.mark.parametrize("status", sorted(STATUS))
@pytest.mark.parametrize("skip", [0, 5])  # the first entry of a batch, or part-way through it
def test_map_error_part_way_leaves_the_table_exact(uvm, fake_cuda, status, skip):
    kv = make()
    a, b = kv.alloc_reqid(), kv.alloc_reqid()
    assert kv.step(lens_of(kv, **{f"r{a}": 64}))  # one page in each of the 4 buffers
    write_row(kv, 3, a, 63, 0x5A)
    uvm.fake_uvm_fail(b"VATTN_UVM_MAP", skip, 1, STATUS[status], 0)
    grow = lens_of(kv, **{f"r{a}": 200, f"r{b}": 200})  # 3 + 4 pages per buffer: 28 entries
    with pytest.raises(vattn.DriverError, match=f"VATTN_UVM_MAP failed: {status} \\(0x{STATUS[status]:x}\\)") as info:
        kv.step(grow)
    assert info.value.call == "VATTN_UVM_MAP"
    assert_table_exact(kv, uvm)
    assert (kv.mapped_tokens(a), kv.mapped_tokens(b)) == (64, 0)  # neither request's batch completed
    assert read_row(kv, 3, a, 63) == bytes([0x5A]) * 512
    uvm.fake_uvm_clear_failures()
    assert kv.step(grow)  # the module recovered: the same step succeeds
    assert_table_exact(kv, uvm)
    write_row(kv, 0, b, 199, 0x11)
    assert read_row(kv, 0, b, 199) == bytes([0x11]) * 512
    kv.cleanup()
    assert_all_released(uvm)


@pytest.mark.parametrize("status", sorted(STATUS))
def test_unmap_error_part_way_leaves_the_table_exact(uvm, fake_cuda, status):
    kv = make()
    a = kv.alloc_reqid()
    assert kv.step(lens_of(kv, **{f"r{a}": 256}))  # 4 pages per buffer
    write_row(kv, 0, a, 0, 0x3C)
    uvm.fake_uvm_fail(b"VATTN_UVM_UNMAP", 3, 1, STATUS[status], 0)  # the 4th of 12 entries fails
    with pytest.raises(vattn.DriverError, match=f"VATTN_UVM_UNMAP failed: {status}"):
        kv.unmap_pages([a], [1])
    assert_table_exact(kv, uvm)
    assert read_row(kv, 0, a, 0) == bytes([0x3C]) * 512
    uvm.fake_uvm_clear_failures()
    kv.unmap_pages([a], [1])
    assert_table_exact(kv, uvm)
    assert kv.mapped_tokens(a) == 64
    kv.cleanup()
    assert_all_released(uvm)


@pytest.mark.parametrize("status", ["NV_ERR_NOT_SUPPORTED", "NV_ERR_INVALID_DEVICE", "NV_ERR_INVALID_ARGUMENT",
                                    "NV_ERR_ILLEGAL_ACTION"])
def test_create_error_releases_what_the_call_created(uvm, fake_cuda, status):
    kv = make()
    r = kv.alloc_reqid()
    allocs = uvm.fake_uvm_live_allocs()
    uvm.fake_uvm_fail(b"VATTN_UVM_CREATE", 2, 1, STATUS[status], 0)
    with pytest.raises(vattn.DriverError, match=f"VATTN_UVM_CREATE failed: {status}"):
        kv.step(lens_of(kv, **{f"r{r}": 64}))
    assert uvm.fake_uvm_live_allocs() == allocs  # the two it created went back
    assert_table_exact(kv, uvm)
    assert kv.mapped_tokens(r) == 0
    uvm.fake_uvm_clear_failures()
    assert kv.step(lens_of(kv, **{f"r{r}": 64}))
    kv.cleanup()
    assert_all_released(uvm)


def test_module_out_of_memory_for_real(uvm, fake_cuda, monkeypatch):
    # Out of memory at creation is a full pool (step answers False), not a
    # driver failure: what the call created went back.
    monkeypatch.setenv("FAKE_UVM_TOTAL_MEM", str(uvm.fake_uvm_bytes_in_use() + 6 * 64 * KiB))
    kv = make()
    r = kv.alloc_reqid()
    allocs = uvm.fake_uvm_live_allocs()
    assert kv.step(lens_of(kv, **{f"r{r}": 128})) is False  # 8 pages, room for 6
    assert uvm.fake_uvm_live_allocs() == allocs
    assert kv.stats()["creations_refused"] == 1
    assert_table_exact(kv, uvm)
    assert kv.mapped_tokens(r) == 0
    monkeypatch.delenv("FAKE_UVM_TOTAL_MEM")
    assert kv.step(lens_of(kv, **{f"r{r}": 128}))
    kv.cleanup()
    assert_all_released(uvm)


def test_address_beyond_the_gpu_for_real(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_UVM_VA_LIMIT", "4096")  # every host address is out of this GPU's reach
    kv = make()
    r = kv.alloc_reqid()
    with pytest.raises(vattn.DriverError, match=r"VATTN_UVM_MAP failed: NV_ERR_OUT_OF_RANGE \(0x5b\)"):
        kv.step(lens_of(kv, **{f"r{r}": 10}))
    assert_table_exact(kv, uvm)
    kv.cleanup()
    assert_all_released(uvm)


@pytest.mark.parametrize("call", [b"VATTN_UVM_MAP", b"VATTN_UVM_UNMAP"])
def test_failed_ioctl_call_is_an_errno_error(uvm, fake_cuda, call):
    kv = make()
    r = kv.alloc_reqid()
    if call == b"VATTN_UVM_UNMAP":
        assert kv.step(lens_of(kv, **{f"r{r}": 200}))
    uvm.fake_uvm_fail(call, 0, 1, 0, errno.EIO)
    with pytest.raises(vattn.DriverError, match=rf"ioctl\({call.decode()}\) failed: errno 5 \(Input/output error\)"):
        if call == b"VATTN_UVM_MAP":
            kv.step(lens_of(kv, **{f"r{r}": 200}))
        else:
            kv.unmap_pages([r], [0])
    assert_table_exact(kv, uvm)
    uvm.fake_uvm_clear_failures()
    kv.cleanup()
    assert_all_released(uvm)


def test_release_failure_at_cleanup_does_not_raise(uvm, fake_cuda):
    kv = make()
    r = kv.alloc_reqid()
    assert kv.step(lens_of(kv, **{f"r{r}": 64}))
    uvm.fake_uvm_fail(b"VATTN_UVM_RELEASE", 0, -1, STATUS["NV_ERR_INVALID_OBJECT_HANDLE"], 0)
    kv.cleanup()  # releases are best effort, as cuMemRelease's are
    assert kv.closed
    assert uvm.fake_uvm_live_mappings() == uvm.baseline[1]


# ---- the module is not the one we need: BackendUnavailable ------------------------


def test_stock_module_with_backend_cuda_uvm(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_UVM_STOCK", "1")
    refs = fake_cuda.fake_cuda_primary_refs()
    with pytest.raises(vattn.BackendUnavailable, match=r"stock module, without driver_patch/.*driver_patch/README.md"):
        make(backend="cuda_uvm")
    with pytest.raises(vattn.BackendUnavailable, match=r"granularity of 2097152 bytes.*patched nvidia-uvm"):
        make()  # automatic: 64 KiB below the driver's granularity, no patched module
    assert_all_released(uvm)
    assert fake_cuda.fake_cuda_primary_refs() == refs


def test_abi_mismatch(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_UVM_ABI", "2")
    with pytest.raises(vattn.BackendUnavailable, match=r"speaks ABI 2, this vattn build ABI 1"):
        make(backend="cuda_uvm")


def test_page_size_the_gpu_does_not_serve(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_UVM_PAGE_SIZES", str(2 * MiB))
    refs = fake_cuda.fake_cuda_primary_refs()
    with pytest.raises(vattn.BackendUnavailable, match=r"serves page sizes 2048 KiB on CUDA device 0, not 65536"):
        make()
    assert fake_cuda.fake_cuda_primary_refs() == refs  # the failed backend released its context


@pytest.mark.parametrize(
    "register,why",
    [("gpu", "the GPU is registered without a GPU VA space"), ("none", "the GPU is not registered in its VA space")],
)
def test_descriptor_without_the_gpu_page_tables(uvm, fake_cuda, monkeypatch, register, why):
    # (the fake_cuda fixture makes the driver open and register its descriptor anew, under this environment)
    monkeypatch.setenv("FAKE_CUDA_UVM_REGISTER", register)
    refs = fake_cuda.fake_cuda_primary_refs()
    with pytest.raises(vattn.BackendUnavailable, match=f"no .* descriptor holds this GPU's page tables; fd \\d+: {why}"):
        make()
    assert fake_cuda.fake_cuda_primary_refs() == refs


def test_no_descriptor_open(uvm, fake_cuda, monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_UVM_DEVICE")
    with pytest.raises(vattn.BackendUnavailable, match=r"the CUDA driver has no .* descriptor open in this process"):
        make()


def test_descriptor_named_by_vattn_uvm_fd(uvm, fake_cuda, monkeypatch):
    monkeypatch.setenv("VATTN_UVM_FD", "not-a-number")
    with pytest.raises(vattn.BackendUnavailable, match=r"VATTN_UVM_FD must be a file descriptor number"):
        make()
    fd = os.open(os.environ["FAKE_UVM_DEVICE"], os.O_RDWR)  # never initialised: not a VA space
    try:
        monkeypatch.setenv("VATTN_UVM_FD", str(fd))
        with pytest.raises(vattn.BackendUnavailable, match=f"fd {fd}: not an initialised VA space descriptor"):
            make()
    finally:
        os.close(fd)


# ---- processes ------------------------------------------------------------------


def test_forked_child_cannot_touch_the_parents_pages(uvm, fake_cuda):
    with make() as kv:
        r = kv.alloc_reqid()
        assert kv.step(lens_of(kv, **{f"r{r}": 100}))
        write_row(kv, 0, r, 99, 0x66)
        calls = [uvm.fake_uvm_calls(i) for i in range(8)]
        pid = os.fork()
        if pid == 0:  # child: every call raises, no ioctl is made
            code = 0
            try:
                kv.step(lens_of(kv, **{f"r{r}": 300}))
                code = 1
            except vattn.ForkedError:
                code = 0 if [uvm.fake_uvm_calls(i) for i in range(8)] == calls else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert read_row(kv, 0, r, 99) == bytes([0x66]) * 512
        assert kv.step(lens_of(kv, **{f"r{r}": 300}))
        assert_table_exact(kv, uvm)
    assert_all_released(uvm)
