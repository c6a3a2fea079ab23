"""KVCacheManager on the host backend: data, growth, attention, limits, errors."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vattn
from conftest import manager_state

KiB, MiB = 1024, 1024 * 1024
PAGE_SIZES = [4 * KiB, 64 * KiB, 256 * KiB, 2 * MiB]
LAYOUTS = ["per_layer", "all_layers"]


def make(**overrides) -> vattn.KVCacheManager:
    # The plain synchronous manager: exact page counts are asserted below.
    args = dict(num_layers=3, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4, max_context_len=512,
                policy={"background": False})
    args.update(overrides)
    return vattn.KVCacheManager(**args)


def lens_for(kv, by_reqid: dict[int, int]) -> list[int]:
    """seq_lens for the manager: by_reqid's lengths, 0 elsewhere."""
    lens = [0] * kv.config.max_batch_size
    for r, n in by_reqid.items():
        lens[r] = n
    return lens


def stamp(reqid: int, layer: int, kind: int, start: int, stop: int, shape) -> torch.Tensor:
    """Distinct values per (reqid, layer, K/V, token, head, dim)."""
    t = torch.arange(start, stop, dtype=torch.float64).view(-1, 1, 1)
    h = torch.arange(shape[0], dtype=torch.float64).view(1, -1, 1)
    d = torch.arange(shape[1], dtype=torch.float64).view(1, 1, -1)
    return t * 1000 + h * 100 + d + reqid * 1e6 + layer * 1e5 + kind * 0.5


@pytest.mark.parametrize("background", [False, True], ids=["sync", "mapper"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_data_reads_back_across_growth(layout, page_size, background):
    cfg = dict(layout=layout, page_size=page_size, max_context_len=2048 if page_size == 2 * MiB else 512,
               policy={"background": background})
    with make(**cfg) as kv:
        L = kv.config.max_context_len
        reqs = [kv.alloc_reqid() for _ in range(3)]
        lens = [0] * 4
        written = {r: 0 for r in reqs}
        targets = [1, 7, 130, L // 3, L - 5, L]
        for i, target in enumerate(targets):
            for j, r in enumerate(reqs):
                lens[r] = min(L, target + j)
            assert kv.step(lens)
            for r in reqs:
                for layer in range(kv.config.num_layers):
                    k, v = kv.layer(layer)
                    shape = k.shape[2:]
                    k[r, written[r] : lens[r]] = stamp(r, layer, 0, written[r], lens[r], shape).float()
                    v[r, written[r] : lens[r]] = stamp(r, layer, 1, written[r], lens[r], shape).float()
                written[r] = lens[r]
            # every row written so far, in every layer, still holds its value
            for r in reqs:
                for layer in range(kv.config.num_layers):
                    k, v = kv.layer(layer)
                    shape = k.shape[2:]
                    assert torch.equal(k[r, : written[r]], stamp(r, layer, 0, 0, written[r], shape).float())
                    assert torch.equal(v[r, : written[r]], stamp(r, layer, 1, 0, written[r], shape).float())
                assert kv.mapped_tokens(r) >= lens[r]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_maps_exactly_the_pages_needed(layout):
    with make(layout=layout, page_size=4 * KiB) as kv:
        cfg = kv.config
        r = kv.alloc_reqid()
        for n in [0, 1, 31, 32, 33, 100, 512]:
            assert kv.step(lens_for(kv, {r: n}))
            want = math.ceil(n * cfg.token_bytes_per_buffer / kv.page_size)
            assert cfg.pages_for(n, kv.page_size) == want
            assert kv._pages.mapped_pages(r) == want
            assert kv.stats()["pages_mapped"] == want * cfg.num_buffers
            assert kv.mapped_bytes(r) == kv.stats()["bytes_mapped"] == want * cfg.num_buffers * kv.page_size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_tensor_stacks_k_and_v_of_a_layer(layout):
    with make(layout=layout, page_size=4 * KiB) as kv:
        r = kv.alloc_reqid()
        assert kv.step(lens_for(kv, {r: 10}))
        for i in range(kv.config.num_layers):
            k, v = kv.layer(i)
            k[r, :10], v[r, :10] = i + 1, -(i + 1)
        for i in range(kv.config.num_layers):
            k, v = kv.layer(i)
            both = kv.kv_tensor(i)
            assert both.shape == (2, *k.shape) and both[0].stride() == k.stride()
            assert both[0].data_ptr() == k.data_ptr() and both[1].data_ptr() == v.data_ptr()
            assert torch.equal(both[0, r, :10], k[r, :10]) and torch.equal(both[1, r, :10], v[r, :10])
            both[1, r, 3] = 7.0  # writes land in the layer's V
            assert bool((v[r, 3] == 7.0).all())


def test_tensor_shapes_and_strides():
    with make(layout="per_layer") as kv:
        k, v = kv.layer(1)
        assert k.shape == v.shape == (4, 512, 2, 32)
        assert k.stride(-1) == 1 and k.stride(2) == 32 and k.stride(1) == 64
        assert k.stride(0) * 4 == kv.slice_bytes
        assert k.data_ptr() == kv.buffer_address(2) and v.data_ptr() == kv.buffer_address(3)
        with pytest.warns(DeprecationWarning, match="slot_bytes is deprecated; use KVCacheManager.slice_bytes"):
            assert kv.slot_bytes == kv.slice_bytes  # the old name of a reqid's slice, kept for callers
    with make(layout="all_layers") as kv:
        k, v = kv.layer(1)
        assert k.shape == (4, 512, 2, 32)
        assert k.stride(1) == 3 * 2 * 32  # a token row holds all layers
        K, V = kv.buffers()
        assert K.shape == (4, 512, 3, 2, 32)
        assert k.data_ptr() == K.data_ptr() + 2 * 32 * 4
        assert v.data_ptr() == kv.buffer_address(1) + 2 * 32 * 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 4)])
def test_sdpa_on_cache_equals_dense_copy(layout, q_heads, kv_heads):
    torch.manual_seed(0)
    with make(layout=layout, num_kv_heads=kv_heads, head_dim=64, page_size=64 * KiB) as kv:
        lengths = {}
        lens = [0] * 4
        for n in (37, 300, 129):
            r = kv.alloc_reqid()
            lens[r] = lengths[r] = n
        assert kv.step(lens)
        dense = {}
        for r, n in lengths.items():
            for layer in range(kv.config.num_layers):
                k, v = kv.layer(layer)
                kd, vd = torch.randn(n, kv_heads, 64), torch.randn(n, kv_heads, 64)
                k[r, :n], v[r, :n] = kd, vd
                dense[r, layer] = (kd, vd)
        for r, n in lengths.items():
            for layer in range(kv.config.num_layers):
                k, v = kv.layer(layer)
                q = torch.randn(1, q_heads, 5, 64)
                out = F.scaled_dot_product_attention(
                    q, k[r, :n].transpose(0, 1)[None], v[r, :n].transpose(0, 1)[None], enable_gqa=True
                )
                kd, vd = dense[r, layer]
                ref = F.scaled_dot_product_attention(
                    q.double(), kd.transpose(0, 1)[None].double(), vd.transpose(0, 1)[None].double(), enable_gqa=True
                )
                torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_out_of_pages_returns_false_and_keeps_data():
    # 4 buffers (2 layers); pool of 12 pages of 4 KiB; a token takes 256 B per buffer
    with make(num_layers=2, head_dim=32, page_size=4 * KiB, physical_memory=12 * 4 * KiB) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        lens = lens_for(kv, {a: 16, b: 16})  # 1 page per buffer each: 8 pages
        assert kv.step(lens)
        k, _ = kv.layer(0)
        k[a, :16] = 1.0
        k[b, :16] = 2.0
        lens[b] = 48  # b needs 2 more pages per buffer = 8 more, only 4 left
        before = manager_state(kv)
        assert kv.step(lens) is False
        after = manager_state(kv)
        assert dict(after[0])["failed_steps"] == dict(before[0])["failed_steps"] + 1
        assert after[1:] == before[1:]  # nothing mapped or unmapped
        assert torch.all(k[a, :16] == 1.0) and torch.all(k[b, :16] == 2.0)
        # free a: its pages stay mapped (deferred), yet the same step now succeeds by reclaiming them
        kv.free_reqid(a)
        assert kv._pages.mapped_pages(a) == 1
        lens[a] = 0
        assert kv.step(lens)
        assert kv._pages.mapped_pages(a) == 0 and kv._pages.mapped_pages(b) == 3
        assert kv.stats()["reclaimed_pages"] == 4
        assert torch.all(k[b, :16] == 2.0)


def test_failed_step_reclaims_nothing_when_it_cannot_succeed():
    with make(num_layers=2, page_size=4 * KiB, physical_memory=12 * 4 * KiB) as kv:
        a, b = kv.alloc_reqid(), kv.alloc_reqid()
        assert kv.step(lens_for(kv, {a: 16, b: 16}))
        kv.free_reqid(a)
        before = manager_state(kv)
        lens = lens_for(kv, {b: 512})  # far beyond the pool
        assert not kv.step(lens)
        assert manager_state(kv)[1:] == before[1:]  # a's pages were not thrown away for nothing


def test_deferred_free_and_reuse_prefers_mapped_slot():
    with make(page_size=4 * KiB) as kv:
        r0, r1 = kv.alloc_reqid(), kv.alloc_reqid()
        assert (r0, r1) == (0, 1)
        assert kv.step([10, 200, 0, 0])
        kv.free_reqid(r1)
        kv.free_reqid(r0)
        assert kv._pages.mapped_pages(1) > kv._pages.mapped_pages(0) > 0
        assert kv.alloc_reqid() == 1  # most pages mapped
        assert kv.alloc_reqid(prompt_len=5) == 0  # smallest mapping that covers 5 tokens
        assert kv.alloc_reqid(prompt_len=100) == 2  # nothing free is mapped: lowest id
        assert kv.alloc_reqid() == 3
        with pytest.raises(vattn.OutOfReqids):
            kv.alloc_reqid()


def test_alloc_a_chosen_reqid():
    with make(page_size=4 * KiB) as kv:
        assert kv.alloc_reqid(reqid=2) == 2
        assert kv.alloc_reqid(prompt_len=7, reqid=0) == 0
        assert [kv.is_allocated(r) for r in range(4)] == [True, False, True, False]
        before = manager_state(kv)
        with pytest.raises(ValueError, match="already allocated"):
            kv.alloc_reqid(reqid=2)
        with pytest.raises(ValueError, match=r"reqid must be in \[0, 3\]"):
            kv.alloc_reqid(reqid=4)
        assert manager_state(kv) == before
        assert kv.alloc_reqid() == 1  # the free reqids are still handed out as before
        assert kv.step([0, 0, 100, 0])
        kv.free_reqid(2)  # deferred: its pages stay mapped
        assert kv._pages.mapped_pages(2) == 7
        assert kv.alloc_reqid(prompt_len=33, reqid=2) == 2  # keeps the 3 pages 33 tokens need
        assert kv._pages.mapped_pages(2) == 3 and kv.stats()["pages_mapped"] == 3 * kv.config.num_buffers
        kv.free_reqid(2)
        assert kv.alloc_reqid(reqid=2) == 2 and kv._pages.mapped_pages(2) == 0


def test_bad_inputs_raise_and_change_nothing():
    with make(max_batch_size=3, max_context_len=64, page_size=4 * KiB) as kv:
        r = kv.alloc_reqid()
        assert kv.step([10, 0, 0])
        before = manager_state(kv)
        bad_calls = [
            (ValueError, lambda: kv.step([10, 0])),  # wrong length
            (ValueError, lambda: kv.step([10, 0, 0, 0])),
            (ValueError, lambda: kv.step([-1, 0, 0])),  # negative
            (ValueError, lambda: kv.step([65, 0, 0])),  # above max_context_len
            (ValueError, lambda: kv.step([10, 5, 0])),  # reqid 1 not allocated
            (TypeError, lambda: kv.step([10, 0, 1.5])),  # not an integer
            (TypeError, lambda: kv.step(["x", 0, 0])),
            (TypeError, lambda: kv.step([[1], 0, 0])),
            (TypeError, lambda: kv.step(np.zeros((3, 1), dtype=np.int64))),  # 2-D
            (TypeError, lambda: kv.step(np.zeros(3, dtype=np.float32))),  # not integers
            (ValueError, lambda: kv.free_reqid(1)),  # never allocated
            (ValueError, lambda: kv.free_reqid(3)),  # out of range
            (ValueError, lambda: kv.free_reqid(-1)),
            (TypeError, lambda: kv.free_reqid("0")),
            (ValueError, lambda: kv.alloc_reqid(prompt_len=65)),
            (ValueError, lambda: kv.alloc_reqid(prompt_len=-2)),
            (TypeError, lambda: kv.alloc_reqid(prompt_len=2.0)),
            (ValueError, lambda: kv.layer(3)),
            (TypeError, lambda: kv.layer(1.0)),
            (ValueError, lambda: kv.reclaim(-1)),
        ]
        for exc, call in bad_calls:
            with pytest.raises(exc):
                call()
            assert manager_state(kv) == before
        k, _ = kv.layer(0)
        k[r, :10] = 3.0
        kv.free_reqid(r)
        with pytest.raises(ValueError, match="not allocated"):
            kv.free_reqid(r)  # twice
        assert torch.all(k[r, :10] == 3.0)  # deferred: still mapped


def test_error_messages_name_argument_and_range():
    with make(max_batch_size=3, max_context_len=64) as kv:
        with pytest.raises(ValueError, match=r"seq_lens must have max_batch_size = 3 entries, got 2"):
            kv.step([0, 0])
        with pytest.raises(ValueError, match=r"seq_lens\[0\] must be in \[0, 64\].*got 99"):
            kv.step([99, 0, 0])
        with pytest.raises(ValueError, match=r"reqid must be in \[0, 2\], got 7"):
            kv.free_reqid(7)


@pytest.mark.parametrize(
    "overrides,exc,match",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(num_kv_heads=-1), ValueError, "num_kv_heads"),
        (dict(head_dim=0), ValueError, "head_dim"),
        (dict(max_batch_size=0), ValueError, "max_batch_size"),
        (dict(max_context_len=0), ValueError, "max_context_len"),
        (dict(num_layers=2.5), TypeError, "num_layers"),
        (dict(dtype=torch.complex64), ValueError, "dtype"),
        (dict(layout="paged"), ValueError, "layout"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(page_size=1000), ValueError, "page_size"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(page_size=4096.0), TypeError, "page_size"),
        (dict(physical_memory=100), ValueError, "physical_memory"),
    ],
)
def test_bad_config_raises(overrides, exc, match):
    with pytest.raises(exc, match=match):
        make(**overrides)


def test_supported_dtypes_roundtrip():
    for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        with make(dtype=dtype, page_size=4 * KiB) as kv:
            r = kv.alloc_reqid()
            lens = [0] * 4
            lens[r] = 100
            assert kv.step(lens)
            k, _ = kv.layer(2)
            assert k.dtype == dtype
            src = torch.randn(100, 2, 32).to(dtype)
            k[r, :100] = src
            assert torch.equal(k[r, :100].view(torch.uint8), src.view(torch.uint8))


def test_step_accepts_tensors_and_tuples():
    with make(page_size=4 * KiB) as kv:
        r = kv.alloc_reqid()
        assert kv.step(torch.tensor([5, 0, 0, 0], dtype=torch.int32))
        assert kv.step((6, 0, 0, 0))
        assert kv.step(torch.tensor([7, 0, 0, 0]))
        assert kv.stats()["tokens_active"] == 7
        assert kv.step(np.array([8, 0, 0, 0], dtype=np.int64))
        assert kv.step(np.array([9, 0, 0, 0], dtype=np.int32))
        assert kv.stats()["tokens_active"] == 9
        kv.free_reqid(r)


def test_use_after_cleanup_raises():
    kv = make()
    r = kv.alloc_reqid()
    kv.cleanup()
    assert kv.closed
    for call in (kv.alloc_reqid, lambda: kv.step([0] * 4), lambda: kv.free_reqid(r), lambda: kv.layer(0),
                 lambda: kv.reclaim(), lambda: kv.mapped_tokens(0), kv.stats, kv.wait_idle,
                 lambda: kv.wait_for_budget(0), lambda: kv.page_ids(0), lambda: kv.is_allocated(0)):
        with pytest.raises(vattn.ClosedError):
            call()
    kv.cleanup()  # idempotent on the object


def test_two_managers_are_independent():
    with make(page_size=4 * KiB) as a, make(page_size=8 * KiB, layout="all_layers") as b:
        ra, rb = a.alloc_reqid(), b.alloc_reqid()
        assert a.step([50, 0, 0, 0]) and b.step([70, 0, 0, 0])
        a.layer(0)[0][ra, :50] = 1.0
        b.layer(0)[0][rb, :70] = 2.0
        a.cleanup()
        assert torch.all(b.layer(0)[0][rb, :70] == 2.0)
        assert b.stats()["pages_mapped"] > 0


def test_module_level_api():
    kv = vattn.init(num_layers=2, num_kv_heads=1, head_dim=16, max_batch_size=2, max_context_len=128,
                    dtype=torch.float32, policy={"background": False})
    try:
        with pytest.raises(vattn.VAttnError, match="already"):
            vattn.init(num_layers=1, num_kv_heads=1, head_dim=16)
        r = vattn.alloc_reqid()
        lens = [0, 0]
        lens[r] = 20
        assert vattn.step(lens)
        k, v = vattn.layer(1)
        k[r, :20] = 4.0
        assert vattn.stats()["tokens_active"] == 20
        assert vattn.get_manager() is kv
        vattn.free_reqid(r)
    finally:
        vattn.cleanup()
    with pytest.raises(vattn.ClosedError):
        vattn.step([0, 0])
    with pytest.raises(vattn.ClosedError):
        vattn.cleanup()
    vattn.init(num_layers=1, num_kv_heads=1, head_dim=16)  # init again after cleanup works
    vattn.cleanup()


def test_init_takes_exactly_the_managers_parameters():
    """vattn.init forwards to KVCacheManager: one parameter list (names,
    order, defaults, annotations), so a new manager parameter reaches init."""
    assert list(inspect.signature(vattn.init).parameters.values()) == \
        list(inspect.signature(vattn.KVCacheManager).parameters.values())
    kv = vattn.init(1, 1, 16, max_context_len=64, policy={"background": False},
                    sync_streams=None)  # sync_streams: once missing from init
    assert vattn.get_manager() is kv and kv.config.max_context_len == 64
    vattn.cleanup()
    with pytest.raises(TypeError, match="page_sise"):
        vattn.init(num_layers=1, num_kv_heads=1, head_dim=16, page_sise=4096)
    with pytest.raises(vattn.ClosedError):  # the refused call left no default manager
        vattn.get_manager()


def test_views_keep_reservation_alive_after_manager_is_gone():
    kv = make(page_size=4 * KiB)
    k, _ = kv.layer(0)
    base = kv.buffer_address(0)
    del kv  # never cleaned up explicitly: the destructor unmaps and releases
    import gc

    gc.collect()
    # the range stays reserved (PROT_NONE) while k exists
    maps = open("/proc/self/maps").read()
    assert any(_contains(line, base) for line in maps.splitlines())
    del k


def _contains(line: str, addr: int) -> bool:
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    return lo <= addr < hi


def test_stats_memory_figures():
    with make(page_size=4 * KiB) as kv:
        r = kv.alloc_reqid()
        lens = [0] * 4
        lens[r] = 100
        assert kv.step(lens)
        s = kv.stats()
        cfg = kv.config
        assert s["bytes_used"] == 100 * cfg.token_bytes
        assert s["bytes_mapped"] == s["pages_mapped"] * 4 * KiB >= s["bytes_used"]
        assert s["bytes_static"] == 4 * 512 * cfg.token_bytes
        assert s["bytes_reserved"] == cfg.num_buffers * 4 * kv.slice_bytes
        assert s["pages_free"] == s["pages_total"] - s["pages_mapped"]


def test_fits_alone_is_the_pool_not_the_free_pages():
    """One request fits alone when its pages fit the whole pool, however many are in use now."""
    with make(page_size=4 * KiB, physical_memory=6 * 3 * 2 * 4 * KiB) as kv:  # 6 ids; 16 tokens an id
        assert kv.num_page_ids == 6 and kv.page_tokens == 16
        assert kv.fits_alone(6 * 16) and not kv.fits_alone(6 * 16 + 1)
        r = kv.alloc_reqid()
        assert kv.step(lens_for(kv, {r: 6 * 16}))  # every id in use: still fits alone
        assert kv.fits_alone(6 * 16) and kv.fits_alone(0)


def test_the_default_pool_never_exceeds_its_share_of_free_memory(monkeypatch):
    """physical_memory=None takes half of MemAvailable; when one page per buffer needs more, the constructor
    says so (it had silently made the pool one page per buffer, over the share: 16 GiB of 1 GiB pages where
    half of MemAvailable was 12 GB), and a pool within the share is that share."""
    import vattn.backends.host as host

    monkeypatch.setattr(host, "host_meminfo", lambda: {"MemAvailable": 2 * 64 * KiB})  # a share of 64 KiB
    with pytest.raises(ValueError, match=r"physical_memory=None .* 65536 bytes here, less than one page per "
                                         r"buffer = 6 x 16384 = 98304 bytes; pass physical_memory"):
        make(page_size=16 * KiB)
    with make(page_size=4 * KiB) as kv:  # 16 page ids of 4 KiB in 6 buffers fit the share: 2 ids
        assert kv.num_page_ids * 6 * 4 * KiB <= 64 * KiB and kv.num_page_ids == 2
    with make(page_size=16 * KiB, physical_memory=96 * KiB) as kv:  # said explicitly: one page per buffer
        assert kv.num_page_ids == 1


def test_fits_alone_checks_its_argument_and_the_context_length():
    """A length step() refuses (above max_context_len) never fits, however large the pool; a negative or
    non-integer length is an error naming ``tokens`` (they had answered True, or raised from inside)."""
    with make(page_size=4 * KiB, max_context_len=64) as kv:  # a pool far larger than one request
        assert kv.fits_alone(64) and not kv.fits_alone(65) and not kv.fits_alone(2**40)
        with pytest.raises(ValueError, match="tokens must be at least 0, got -100"):
            kv.fits_alone(-100)
        for bad in (1.5, "3", True):
            with pytest.raises(TypeError, match="tokens must be an int"):
                kv.fits_alone(bad)


def test_release_pages_is_a_method_for_external_ids_only():
    with make(page_allocator="external", page_size=4 * KiB, physical_memory=8 * 3 * 2 * 4 * KiB) as kv:
        r = kv.alloc_reqid()
        kv.map_pages([r], [0], [[4, 6]])
        kv.unmap_pages([r], [1])  # id 6 created and mapped nowhere; id 4 still mapped; id 2 never created
        assert kv.release_pages([6, 4, 2, 6]) == [6]
        with pytest.raises(ValueError, match="page_ids"):
            kv.release_pages([8])
    with make() as kv, pytest.raises(ValueError, match="release_free_memory"):
        kv.release_pages([0])
