"""FlashInfer's two presentations of the cache, on the CPU: the page view
(vattn/kernels/page_view.py) against a reference, what FlashInferKernel
refuses (FlashInfer's 32-bit strides), and its plans run through a stand-in
of FlashInfer's paged wrappers (tests/kernels/kernel_references.py) against
SDPA on the same cache."""

from __future__ import annotations

import random

import pytest
import torch

import vattn
from kernels.kernel_references import install_flashinfer
from vattn.attention import AttentionBatch, FlashInferAttention, sdpa_attention
from vattn.kernels import AttentionCase, FlashInferKernel
from vattn.kernels.page_view import PageGeometry, page_geometry, page_ranges, paged_view


def reference_ranges(reqids, seq_lens, page_tokens, pages_per_slice):
    """Request by request, page by page."""
    indptr, indices, last = [0], [], []
    for r, n in zip(reqids, seq_lens):
        count = -(-n // page_tokens)
        indices += [r * pages_per_slice + j for j in range(count)]
        indptr.append(indptr[-1] + count)
        last.append(n - (count - 1) * page_tokens)
    return indptr, indices, last


def test_page_ranges_match_the_reference():
    rng = random.Random(0)
    for _ in range(200):
        t, p = rng.choice([1, 16, 32, 1024]), rng.randint(1, 9)
        slots = rng.randint(1, 12)
        reqids = rng.sample(range(slots), rng.randint(1, slots))
        lens = [rng.randint(1, t * p) for _ in reqids]
        got = page_ranges(reqids, lens, PageGeometry(t, p, t * 7))
        assert all(x.dtype == torch.int32 and x.device.type == "cpu" for x in got)
        assert [x.tolist() for x in got] == list(reference_ranges(reqids, lens, t, p))


def test_page_geometry_cuts_slots_into_whole_pages():
    assert page_geometry(3072 * 1024, 1024, 1024) == PageGeometry(1024, 3, 1024 * 1024)  # 2 MiB pages, fp16
    assert page_geometry(3072 * 1024, 1024) == PageGeometry(256, 12, 256 * 1024)  # vattn page unknown
    assert page_geometry(48 * 8, 8) == PageGeometry(16, 3, 128)
    with pytest.raises(ValueError, match=r"a slice \(100 elements\) is not a whole number of token rows"):
        page_geometry(100, 8)
    with pytest.raises(ValueError, match=r"page_tokens must divide the slice's 48 rows, got 32"):
        page_geometry(48 * 8, 8, 32)


@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
def test_the_paged_view_is_the_cache(layout):
    """Pool page r * P + j, row i is the cache's row (r, j * page_tokens + i), for both layouts."""
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, max_batch_size=3,
                              max_context_len=100, page_size=4096, layout=layout, policy={"background": False}) as kv:
        lens = [100, 37, 64]
        for _ in lens:
            kv.alloc_reqid()
        assert kv.step(lens)
        k, _ = kv.layer(1)
        for r, n in enumerate(lens):
            k[r, :n] = torch.arange(n * 16, dtype=torch.float32).view(n, 2, 8) + 1000 * r
        g = page_geometry(k.stride(0), k.stride(1), kv.page_tokens)
        assert g.page_tokens == kv.page_tokens and g.pages_per_slice * kv.page_size == kv.slice_bytes
        pool = paged_view(k, g)
        for r, n in enumerate(lens):
            for t in range(n):
                assert torch.equal(pool[r * g.pages_per_slice + t // g.page_tokens, t % g.page_tokens], k[r, t])


# ---- what FlashInfer refuses -----------------------------------------------------------------

PAGES, REQUEST = FlashInferKernel(presentation="pages"), FlashInferKernel(presentation="request")


def llama3_8b_case(layout: str, context: int, page_tokens: int | None = None) -> AttentionCase:
    """Llama-3-8B's cache on a GPU (32 layers x 8 KV heads x 128, bf16, 2 MiB pages)."""
    row = 8 * 128 * (32 if layout == "all_layers" else 1)
    slice_bytes = -(-context * row * 2 // (2 << 20)) * (2 << 20)
    return AttentionCase("cuda", 128, torch.bfloat16, torch.bfloat16, 32, 8, context, slice_stride=slice_bytes // 2,
                         row_stride=row, page_tokens=page_tokens)


def test_one_page_per_request_is_refused_where_flashinfers_page_stride_wraps():
    """A slot of 2^32 elements (Llama-3-8B, all_layers, 131072 tokens) would
    wrap paged_kv_t::stride_page: every request would read request 0's rows."""
    fits, wraps = llama3_8b_case("all_layers", 131072 - 64), llama3_8b_case("all_layers", 131072)
    assert wraps.slice_stride == 1 << 32
    assert REQUEST.supports(fits) and REQUEST.supports(llama3_8b_case("per_layer", 131072))
    ok, reason = REQUEST.supports(wraps)
    assert not ok and reason == (
        "FlashInfer (one page per request) keeps a page's stride in 32 bits (paged_kv_t::stride_page): a slice of "
        "4294967296 elements (2^32 or more) would wrap and every request would read request 0's rows; use the "
        "'pages' presentation")
    assert PAGES.supports(wraps) and PAGES.supports(llama3_8b_case("all_layers", 131072, page_tokens=32))
    with pytest.raises(ValueError, match=r"stride_page\): a slice of 4294967296 elements"):
        REQUEST.plan(AttentionBatch([0], [0], [1], device="cuda"), wraps)
    assert not PAGES.supports(llama3_8b_case("per_layer", 1000, page_tokens=48))  # 48 does not divide 1024 rows


def test_a_slot_of_partial_rows_cannot_be_pages():
    case = AttentionCase("cuda", 128, torch.float16, torch.float16, 8, 8, 100, slice_stride=100 * 1024 + 512,
                         row_stride=1024)
    ok, reason = PAGES.supports(case)
    assert not ok and reason.startswith("FlashInfer cannot cut this cache into pages: a slice (102912 elements)")
    assert REQUEST.supports(case)


# ---- plans on the stand-in -------------------------------------------------------------------


@pytest.fixture
def flashinfer_log(monkeypatch):
    return install_flashinfer(monkeypatch)


@pytest.mark.parametrize("presentation", ["pages", "request"])
@pytest.mark.parametrize("layout", ["per_layer", "all_layers"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_both_presentations_attend_over_each_requests_rows(flashinfer_log, presentation, layout, decode):
    """Lengths that end on, before and just past a page end; the stand-in
    reads through the plan's page arrays (a wrong page reads other rows, or
    faults on an unmapped one) and must give SDPA's result."""
    with vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, max_batch_size=5,
                              max_context_len=200, page_size=4096, layout=layout,
                              policy={"background": False, "deferred_reclaim": False, "eager": False,
                                      "lookahead_tokens": 0}) as kv:
        t = kv.page_tokens
        reqids = [kv.alloc_reqid() for _ in range(4)][::-1]
        seq = [t, 3 * t - 1, t + 1, 1]
        query = [1] * 4 if decode else [1, 5, t + 1, 1]
        batch = AttentionBatch(reqids, [s - q for s, q in zip(seq, query)], query)
        lens = [0] * 5
        for r, n in zip(reqids, seq):
            lens[r] = n
        assert kv.step(lens)
        torch.manual_seed(1)
        fi = FlashInferAttention(device="cpu", workspace_bytes=1 << 16, presentation=presentation)
        fi.plan(batch, 4, 2, 16, 200, q_dtype=torch.float16, k_cache=kv.layer(0)[0], page_tokens=t)
        plans = [e for e in flashinfer_log if e[0] == "plan"]
        assert len(plans) == 1 and plans[0][1] == ("decode" if decode else "prefill")
        planned = plans[0][2]
        if presentation == "pages":
            g = page_geometry(kv.layer(0)[0].stride(0), kv.layer(0)[0].stride(1), t)
            assert planned["page_size"] == t
            assert [planned[k].tolist() for k in ("indptr", "indices", "last_page_len")] == \
                list(reference_ranges(reqids, seq, t, g.pages_per_slice))
        else:
            assert planned["page_size"] == 200 and planned["indices"].tolist() == reqids
        for layer in range(2):
            k_cache, v_cache = kv.layer(layer)
            for r, c in zip(reqids, batch.cached_lens):
                k_cache[r, :c] = torch.randn(c, 2, 16, dtype=torch.float16)
                v_cache[r, :c] = torch.randn(c, 2, 16, dtype=torch.float16)
            q = torch.randn(batch.num_tokens, 4, 16, dtype=torch.float16)
            k, v = torch.randn(batch.num_tokens, 2, 16).half(), torch.randn(batch.num_tokens, 2, 16).half()
            out = fi.run(q, k_cache, v_cache, k=k, v=v)
            torch.testing.assert_close(out, sdpa_attention(q, k_cache, v_cache, batch), rtol=2e-3, atol=2e-3)
        assert len([e for e in flashinfer_log if e[0] == "plan"]) == 1  # planned once for every layer


def test_a_plan_is_for_the_strides_it_was_made_with(flashinfer_log):
    kernel = FlashInferKernel(workspace_bytes=1 << 16)
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float16, max_batch_size=2,
                              max_context_len=64, page_size=4096, policy={"background": False}) as kv:
        r = kv.alloc_reqid()
        assert kv.step([5 if i == r else 0 for i in range(2)])
        k_cache, v_cache = kv.layer(0)
        batch = AttentionBatch([r], [4], [1])
        case = AttentionCase.of(torch.zeros(1, 2, 16, dtype=torch.float16), k_cache)
        assert (case.slice_stride, case.row_stride) == k_cache.stride()[:2]
        plan = kernel.plan(batch, case._replace(slice_stride=case.slice_stride * 2))
        with pytest.raises(ValueError, match=r"planned pages of a cache with slice and row strides"):
            kernel.run(plan, torch.zeros(1, 2, 16, dtype=torch.float16), k_cache, v_cache)
    with pytest.raises(ValueError, match="FlashInfer plans with the case's slice_stride, row_stride"):
        kernel.plan(batch, case._replace(slice_stride=None, row_stride=None))
