"""Attention adapters on the cache against a float64 reference on dense copies.

The manager maps exactly each request's length (no background mapper, no
lookahead) and several requests end exactly at a page end, so an adapter that
read one row past a request's length would fault instead of passing.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

import vattn
from vattn.attention import (
    AttentionBatch,
    FlashInferAttention,
    flash_attn_attention,
    flashinfer_single_prefill,
    sdpa_attention,
    write_kv,
)
from vattn.kernels import AttentionCase, select_kernel

NUM_LAYERS = 2
HEAD_DIM = 64

# Tolerances for relative error against float64 (bf16 has an 8-bit mantissa).
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    return None


def _module_reason(module: str, what: str) -> str | None:
    if _cuda_reason():
        return _cuda_reason()
    if importlib.util.find_spec(module) is None:
        return f"needs {what}: the python package {module!r} is not installed"
    return None


def make_manager(device: str, layout: str, dtype: torch.dtype, heads_kv: int, page_size: int | None,
                 max_context_len: int) -> vattn.KVCacheManager:
    return vattn.KVCacheManager(num_layers=NUM_LAYERS, num_kv_heads=heads_kv, head_dim=HEAD_DIM, dtype=dtype,
                                max_batch_size=6, max_context_len=max_context_len, page_size=page_size,
                                device=device, layout=layout,
                                policy={"background": False, "deferred_reclaim": False, "eager": False,
                                        "lookahead_tokens": 0})


def boundary_cases(tokens_per_page: int) -> tuple[list[int], list[int]]:
    """(cached_lens, query_lens) for 5 requests, placing page ends at and inside requests."""
    t = tokens_per_page
    cached = [0, t - 1, t, t - 5, 0]  # prefill to a page end; decode to a page end; decode
    query = [t, 1, 1, 10, 3]  # past one; chunked prefill across a page end; short prefill
    return cached, query


class Scenario:
    """A cache with history written for every request, plus the dense truth."""

    def __init__(self, device: str, layout: str, dtype: torch.dtype, heads_q: int, heads_kv: int,
                 page_size: int | None, decode_only: bool = False) -> None:
        torch.manual_seed(0)
        probe = make_manager(device, layout, dtype, heads_kv, page_size, 8)
        self.tokens_per_page = probe.page_size // probe.config.token_bytes_per_buffer
        probe.cleanup()
        cached, query = boundary_cases(self.tokens_per_page)
        if decode_only:
            cached, query = [c + q - 1 for c, q in zip(cached, query)], [1] * len(query)
        self.kv = make_manager(device, layout, dtype, heads_kv, page_size, 2 * self.tokens_per_page + 16)
        reqids = [self.kv.alloc_reqid() for _ in cached]
        reqids = reqids[1:] + reqids[:1]  # token order differs from reqid order
        self.batch = AttentionBatch(reqids, cached, query, device=device)
        lens = [0] * self.kv.config.max_batch_size
        for r, n in zip(reqids, self.batch.seq_lens):
            lens[r] = n
        assert self.kv.step(lens)
        for r, n in zip(reqids, self.batch.seq_lens):  # exact mapping, no slack
            assert self.kv.mapped_tokens(r) < n + self.tokens_per_page

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, dtype=torch.float32).to(dtype=dtype, device=device)

        self.history = {}  # (layer, reqid) -> dense K, V of cached tokens
        self.new = []  # per layer: q, k, v of this forward's tokens
        history_batch = [(r, c) for r, c in zip(reqids, cached) if c]
        for layer in range(NUM_LAYERS):
            k_cache, v_cache = self.kv.layer(layer)
            for r, c in history_batch:
                k_hist, v_hist = rand(c, heads_kv, HEAD_DIM), rand(c, heads_kv, HEAD_DIM)
                write_kv(k_cache, v_cache, AttentionBatch([r], [0], [c], device=device), k_hist, v_hist)
                self.history[layer, r] = (k_hist, v_hist)
            t = self.batch.num_tokens
            self.new.append((rand(t, heads_q, HEAD_DIM), rand(t, heads_kv, HEAD_DIM), rand(t, heads_kv, HEAD_DIM)))

    def reference(self, layer: int, scale: float | None = None) -> torch.Tensor:
        """float64 attention on dense copies of the same K/V."""
        q, k_new, v_new = (x.double().cpu() for x in self.new[layer])
        out = torch.empty_like(q)
        b = self.batch
        for i, (r, c, n) in enumerate(zip(b.reqids, b.cached_lens, b.seq_lens)):
            s, e = b.query_starts[i], b.query_starts[i + 1]
            k_hist, v_hist = (x.double().cpu() for x in self.history.get((layer, r), (k_new[:0], v_new[:0])))
            k = torch.cat([k_hist, k_new[s:e]])
            v = torch.cat([v_hist, v_new[s:e]])
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * (scale or 1 / math.sqrt(q.shape[-1]))
            visible = torch.arange(n)[None, :] <= (c + torch.arange(e - s))[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[s:e] = torch.einsum("hqk,khd->qhd", probs, v)
        return out

    def check_cache_rows(self, layer: int) -> None:
        """The new tokens landed in their rows of the cache."""
        k_cache, v_cache = self.kv.layer(layer)
        _, k_new, v_new = self.new[layer]
        b = self.batch
        for i, (r, c, n) in enumerate(zip(b.reqids, b.cached_lens, b.seq_lens)):
            s, e = b.query_starts[i], b.query_starts[i + 1]
            assert torch.equal(k_cache[r, c:n], k_new[s:e])
            assert torch.equal(v_cache[r, c:n], v_new[s:e])

    def close(self) -> None:
        self.kv.cleanup()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol)


HEADS = [pytest.param(8, 2, id="gqa"), pytest.param(4, 4, id="mha")]
LAYOUTS = ["per_layer", "all_layers"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_cpu_matches_reference(layout, heads_q, heads_kv, dtype):
    check_adapter(sdpa_attention, "cpu", layout, heads_q, heads_kv, dtype, page_size=16384)


def check_adapter(adapter, device: str, layout: str, heads_q: int, heads_kv: int, dtype: torch.dtype,
                  page_size: int | None) -> None:
    """Every layer: the adapter appends K/V and attends; rows and output are checked."""
    sc = Scenario(device, layout, dtype, heads_q, heads_kv, page_size=page_size)
    try:
        for layer in range(NUM_LAYERS):
            q, k, v = sc.new[layer]
            out = adapter(q, *sc.kv.layer(layer), sc.batch, k=k, v=v)
            assert out.shape == q.shape and out.dtype == dtype
            sc.check_cache_rows(layer)
            assert_matches(out, sc.reference(layer), dtype)
    finally:
        sc.close()


def test_sdpa_custom_scale_and_prewritten_kv():
    sc = Scenario("cpu", "per_layer", torch.float32, 8, 2, page_size=16384)
    try:
        q, k, v = sc.new[0]
        k_cache, v_cache = sc.kv.layer(0)
        write_kv(k_cache, v_cache, sc.batch, k, v)
        out = sdpa_attention(q, k_cache, v_cache, sc.batch, softmax_scale=0.3)
        assert_matches(out, sc.reference(0, scale=0.3), torch.float32)
    finally:
        sc.close()


def test_batch_validation():
    with pytest.raises(ValueError, match="equal lengths"):
        AttentionBatch([0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        AttentionBatch([1, 1], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="query_lens must be >= 1"):
        AttentionBatch([0], [3], [0])
    with pytest.raises(ValueError, match="cached_lens must be >= 0"):
        AttentionBatch([0], [-1], [1])
    with pytest.raises(TypeError, match="reqids must hold ints"):
        AttentionBatch([0.5], [0], [1])
    b = AttentionBatch(torch.tensor([2, 0]), [3, 0], [1, 4])
    assert b.seq_lens == [4, 4] and b.query_starts == [0, 1, 5] and not b.is_decode
    assert b.tensor("token_positions").tolist() == [3, 0, 1, 2, 3]
    assert b.tensor("token_reqids").tolist() == [2, 0, 0, 0, 0]


def test_adapter_input_errors():
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                              max_batch_size=2, max_context_len=64, page_size=4096) as kv:
        k_cache, v_cache = kv.layer(0)
        q = torch.zeros(3, 4, 16)
        with pytest.raises(ValueError, match=r"reqids must be in \[0, 1\]"):
            sdpa_attention(q, k_cache, v_cache, AttentionBatch([2], [0], [3]))
        with pytest.raises(ValueError, match="<= 64"):
            sdpa_attention(q, k_cache, v_cache, AttentionBatch([0], [62], [3]))
        with pytest.raises(ValueError, match="q must be"):
            sdpa_attention(q[:2], k_cache, v_cache, AttentionBatch([0], [0], [3]))
        with pytest.raises(ValueError, match="multiple"):
            sdpa_attention(torch.zeros(3, 3, 16), k_cache, v_cache, AttentionBatch([0], [0], [3]))
        with pytest.raises(ValueError, match="k must be"):
            sdpa_attention(q, k_cache, v_cache, AttentionBatch([0], [0], [3]), k=torch.zeros(3, 2, 8),
                           v=torch.zeros(3, 2, 16))
        # a dtype other than the cache's: TypeError naming the tensor (torch's RuntimeError came from deep inside)
        batch = AttentionBatch([0], [0], [3], cache=kv)
        assert kv.alloc_reqid() == 0 and kv.step([3, 0])
        new = torch.zeros(3, 2, 16)
        for dtype in (torch.float64, torch.bfloat16, torch.int64):
            with pytest.raises(TypeError, match=rf"q must have the cache's dtype \(float32\), got {str(dtype)[6:]}"):
                sdpa_attention(q.to(dtype), k_cache, v_cache, batch, k=new, v=new)
            with pytest.raises(TypeError, match=rf"k must have the cache's dtype \(float32\), got {str(dtype)[6:]}"):
                sdpa_attention(q, k_cache, v_cache, batch, k=new.to(dtype), v=new)
            with pytest.raises(TypeError, match=rf"v must have the cache's dtype \(float32\), got {str(dtype)[6:]}"):
                write_kv(k_cache, v_cache, batch, new, new.to(dtype))


def test_gpu_adapters_refuse_cpu_tensors():
    """On tensors that are not CUDA tensors the GPU adapters raise a clear error."""
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float16,
                              max_batch_size=2, max_context_len=64, page_size=4096) as kv:
        lens = [0, 0]
        lens[kv.alloc_reqid()] = 3
        assert kv.step(lens)
        batch = AttentionBatch([lens.index(3)], [0], [3])
        for adapter in (flash_attn_attention, flashinfer_single_prefill):
            with pytest.raises(vattn.BackendUnavailable, match="not installed|needs CUDA"):
                adapter(torch.zeros(3, 2, 16, dtype=torch.float16), *kv.layer(0), batch)
        with pytest.raises(vattn.BackendUnavailable, match="not installed|CUDA device"):
            FlashInferAttention(device="cpu")


# ---- GPU adapters ---------------------------------------------------------------

GPU_DTYPES = [torch.float16, torch.bfloat16]


FA_REASON = _module_reason("flash_attn", "FlashAttention-2")
FI_REASON = _module_reason("flashinfer", "FlashInfer")


def torch_flash_attention(q, k_cache, v_cache, batch, k=None, v=None):
    """torch's own FlashAttention-2 kernel as an adapter function."""
    from vattn.kernels import KERNELS

    kernel = KERNELS["torch_flash"]
    return kernel.run(batch.plan(kernel), q, k_cache, v_cache, k, v)


GPU_ADAPTERS = [
    pytest.param(sdpa_attention, id="sdpa", marks=pytest.mark.skipif(_cuda_reason() is not None,
                                                                      reason=str(_cuda_reason()))),
    pytest.param(torch_flash_attention, id="torch_flash",
                 marks=pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))),
    pytest.param(flash_attn_attention, id="flash_attn",
                 marks=pytest.mark.skipif(FA_REASON is not None, reason=str(FA_REASON))),
    pytest.param(flashinfer_single_prefill, id="flashinfer_single",
                 marks=pytest.mark.skipif(FI_REASON is not None, reason=str(FI_REASON))),
]


@pytest.mark.parametrize("adapter", GPU_ADAPTERS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_adapter_matches_reference(layout, heads_q, heads_kv, dtype, adapter):
    check_adapter(adapter, "cuda", layout, heads_q, heads_kv, dtype, page_size=None)


@pytest.mark.skipif(FI_REASON is not None, reason=str(FI_REASON))
@pytest.mark.parametrize("presentation", ["pages", "request"])
@pytest.mark.parametrize("decode_only", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flashinfer_batched_matches_reference(layout, heads_q, heads_kv, decode_only, presentation):
    dtype = torch.float16
    sc = Scenario("cuda", layout, dtype, heads_q, heads_kv, page_size=None, decode_only=decode_only)
    try:
        fi = FlashInferAttention(device="cuda", presentation=presentation)
        cfg = sc.kv.config
        fi.plan(sc.batch, heads_q, heads_kv, HEAD_DIM, cfg.max_context_len, q_dtype=dtype,
                page_tokens=sc.kv.page_tokens)
        for layer in range(NUM_LAYERS):
            q, k, v = sc.new[layer]
            out = fi.run(q, *sc.kv.layer(layer), k=k, v=v)
            sc.check_cache_rows(layer)
            assert_matches(out, sc.reference(layer), dtype)
    finally:
        sc.close()


def run_every_layer(sc: Scenario, kernel, plan, calls: list, query_of) -> list:
    """Runs ``kernel`` with ``plan`` on every layer of ``sc``, the new K/V
    given: the rows land, the output matches the reference, and each layer is
    one call of the stand-in library (``calls``, its record; ``query_of`` a
    record's q, which must be the layer's q as it is). Returns each layer's record."""
    seen = []
    for layer in range(NUM_LAYERS):
        q, k, v = sc.new[layer]
        del calls[:]
        out = kernel.run(plan, q, *sc.kv.layer(layer), k, v)
        sc.check_cache_rows(layer)
        assert_matches(out, sc.reference(layer), torch.float32)
        assert len(calls) == 1 and query_of(calls[0]) is q
        seen.append(calls[0])
    return seen


# ---- FlashAttention's plan and calls, against a reference flash_attn_varlen_func on the CPU -----------

FA_PAGE = 262144  # 256 KiB pages: slices of whole 256-token multiples in both layouts, as FlashAttention-2 pages


@pytest.fixture
def reference_flash_attn(monkeypatch):
    """``flash_attn`` replaced by a float reference of ``flash_attn_varlen_func``
    over a paged cache (tests/kernels/kernel_references.py), and the
    FlashAttention kernel let onto CPU tensors: what the kernel hands the
    library is checked here, the library itself on a GPU. Records the q of
    every call."""
    from kernels.kernel_references import install_flash_attn

    return install_flash_attn(monkeypatch)


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attn_is_one_call_per_layer_with_index_tensors_built_once_per_batch(reference_flash_attn, monkeypatch,
                                                                                   layout, decode_only):
    """A batch of mixed query lengths (prefill chunks and decodes) is one
    varlen call per layer, on q as it is; the plan builds every index tensor
    (one copy to the device for the lengths, one for the new rows); the
    layers build none."""
    from vattn.kernels import KERNELS

    kernel = KERNELS["flash_attn"]
    sc = Scenario("cpu", layout, torch.float32, 8, 2, page_size=FA_PAGE, decode_only=decode_only)
    assert len(set(sc.batch.query_lens)) == (1 if decode_only else 4)
    built = []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: built.append(a) or tensor(*a, **kw))
    try:
        plan = kernel.plan(sc.batch)
        assert len(built) == 2
        built.clear()
        run_every_layer(sc, kernel, plan, reference_flash_attn, query_of=lambda call: call)
        assert built == [], "a layer built index tensors"
    finally:
        sc.close()


def test_flash_attn_needs_slices_of_whole_pages_and_says_so(reference_flash_attn):
    """The flash-attn package pages K/V in multiples of 256 tokens: a cache
    whose slices are not is refused with the reason, and attention() runs
    the next kernel on it, torch's own FlashAttention-2."""
    from vattn.kernels import KERNELS

    kernel = KERNELS["flash_attn"]
    with vattn.KVCacheManager(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float16, max_batch_size=2,
                              max_context_len=64, page_size=4096, policy={"background": False}) as kv:
        k_cache = kv.layer(0)[0]
        case = AttentionCase.of(torch.zeros(1, 2, 16, dtype=torch.float16), k_cache)
        support = kernel.supports(case._replace(device_type="cuda"))
        assert not support and "reads each slice as one page, which must be a multiple of 256 tokens; this " \
                               "cache's slices are 64 tokens apart" in support.reason
        assert select_kernel(case._replace(device_type="cuda"), installed=False) is KERNELS["torch_flash"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attn_adapter_on_the_reference(reference_flash_attn, layout):
    """flash_attn_attention (the function API) over every layer, K/V appended
    by the library, and attending over K/V written before."""
    check_adapter(flash_attn_attention, "cpu", layout, 8, 2, torch.float32, page_size=FA_PAGE)
    sc = Scenario("cpu", layout, torch.float32, 8, 2, page_size=FA_PAGE)
    try:
        q, k, v = sc.new[0]
        write_kv(*sc.kv.layer(0), sc.batch, k, v)
        out = flash_attn_attention(q, *sc.kv.layer(0), sc.batch, softmax_scale=0.3)
        assert_matches(out, sc.reference(0, scale=0.3), torch.float32)
    finally:
        sc.close()



# ---- torch's own FlashAttention-2, against a reference of its op on the CPU ---------------------------


@pytest.fixture
def reference_torch_flash(monkeypatch):
    """torch's ``_flash_attention_forward`` replaced by a float reference
    of its varlen contract (tests/kernels/kernel_references.py), and the
    kernel let onto CPU tensors. Records (q, key starts) of every call."""
    from kernels.kernel_references import install_torch_flash

    return install_torch_flash(monkeypatch)


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_flash_is_one_call_per_layer_on_the_caches_rows(reference_torch_flash, layout, heads_q, heads_kv,
                                                              decode_only):
    """A batch of mixed query lengths, its rows not in reqid order, is one
    varlen call per layer on the cache's token rows (request r's keys from
    row r * S); the key starts are made by the first layer and reused."""
    from vattn.kernels import KERNELS

    kernel = KERNELS["torch_flash"]
    sc = Scenario("cpu", layout, torch.float32, heads_q, heads_kv, page_size=16384, decode_only=decode_only)
    assert list(sc.batch.reqids) != sorted(sc.batch.reqids)
    try:
        plan = kernel.plan(sc.batch)
        calls = run_every_layer(sc, kernel, plan, reference_torch_flash, query_of=lambda call: call[0])
        starts_seen = [starts for _, starts in calls]
        k_cache = sc.kv.layer(0)[0]
        rows_per_slice = k_cache.stride(0) // k_cache.stride(1)
        assert starts_seen[0][:-1].tolist() == [r * rows_per_slice for r in sc.batch.reqids]
        assert all(s is starts_seen[0] for s in starts_seen), "a layer rebuilt the key starts"
    finally:
        sc.close()


def test_torch_flash_key_starts_copy_nothing_from_the_host(reference_torch_flash):
    """The key starts are made inside the engine's captured decode forward,
    and CUDA graph capture refuses a copy from pageable host memory (an
    element assignment, ``starts[n] = rows``, is one: it failed the engine's
    first capture on an H200). They are made by kernels alone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vattn.kernels import KERNELS

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    sc = Scenario("cpu", "per_layer", torch.float32, 8, 2, page_size=16384)
    try:
        plan = KERNELS["torch_flash"].plan(sc.batch)  # no case: the first layer makes the starts
        with Ops() as ops:
            starts = plan.key_starts(64, (max(sc.batch.reqids) + 1) * 64)
        assert starts.tolist() == [r * 64 for r in sc.batch.reqids] + [(max(sc.batch.reqids) + 1) * 64]
        host_copies = [name for name in ops.names if name.split(".")[1] in ("lift_fresh", "copy_", "_to_copy")]
        assert not host_copies, f"the key starts copied from the host: {host_copies}"
    finally:
        sc.close()


def test_torch_flash_writes_into_out_and_takes_a_scale(reference_torch_flash):
    from vattn.kernels import KERNELS

    kernel = KERNELS["torch_flash"]
    sc = Scenario("cpu", "per_layer", torch.float32, 8, 2, page_size=16384)
    try:
        q, k, v = sc.new[0]
        write_kv(*sc.kv.layer(0), sc.batch, k, v)
        out = torch.full_like(q, float("nan"))
        result = kernel.run(kernel.plan(sc.batch), q, *sc.kv.layer(0), out=out, softmax_scale=0.3)
        assert result is out
        assert_matches(out, sc.reference(0, scale=0.3), torch.float32)
    finally:
        sc.close()


def test_cuda_picks_torch_flash_without_the_flash_attn_package(monkeypatch):
    """On CUDA without the flash-attn package select_kernel picks torch's own
    FlashAttention-2 (one call per layer) rather than SDPA's loop over
    requests; a torch whose op has no seqused_k, or a cache whose slices are
    not whole token rows, gets SDPA, and the reason names the kernel."""
    from vattn.kernels import KERNELS, NoKernel
    from vattn.kernels import select as select_module

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    select_module._select.cache_clear()
    case = AttentionCase("cuda", 64, torch.bfloat16, torch.bfloat16, 8, 2, 4096, slice_stride=4096 * 128,
                         row_stride=128)
    try:
        assert select_kernel(case) is KERNELS["torch_flash"]
        assert select_kernel(case, batched=True) is KERNELS["torch_flash"]
        uneven = case._replace(slice_stride=4096 * 128 + 64)
        ok, reason = KERNELS["torch_flash"].supports(uneven)
        assert not ok and "FlashAttention-2 (torch)" in reason and "not a whole number" in reason
        assert select_kernel(uneven) is KERNELS["sdpa"]
        with pytest.raises(NoKernel):
            select_kernel(uneven, batched=True)

        class OldOp:
            class default:
                class _schema:
                    arguments = []

        monkeypatch.setattr(type(KERNELS["torch_flash"]), "op", lambda self: OldOp)
        select_module._select.cache_clear()
        ok, reason = KERNELS["torch_flash"].available()
        assert not ok and "no seqused_k" in reason
        assert select_kernel(case) is KERNELS["sdpa"]
    finally:
        select_module._select.cache_clear()


def test_torch_flash_refuses_cpu_tensors_and_caches_beyond_int32_rows(reference_torch_flash, monkeypatch):
    from vattn.kernels import KERNELS, TorchFlashKernel

    kernel = KERNELS["torch_flash"]
    sc = Scenario("cpu", "per_layer", torch.float32, 8, 2, page_size=16384)
    try:
        q, k, v = sc.new[0]
        plan = kernel.plan(sc.batch)
        monkeypatch.setattr(TorchFlashKernel, "max_rows", sc.kv.layer(0)[0].shape[0])
        k_cache = sc.kv.layer(0)[0]
        b = sc.batch
        before = [k_cache[r, c:n].clone() for r, c, n in zip(b.reqids, b.cached_lens, b.seq_lens)]  # mapped rows
        with pytest.raises(ValueError, match="addresses at most"):
            kernel.run(plan, q, *sc.kv.layer(0), k, v)
        after = [k_cache[r, c:n] for r, c, n in zip(b.reqids, b.cached_lens, b.seq_lens)]
        assert all(torch.equal(x, y) for x, y in zip(before, after)), "a refused call wrote the cache"
        monkeypatch.setattr(TorchFlashKernel, "devices", ("cuda",))
        with pytest.raises(vattn.BackendUnavailable, match="needs CUDA tensors"):
            kernel.run(plan, q, *sc.kv.layer(0), k, v)
    finally:
        sc.close()
