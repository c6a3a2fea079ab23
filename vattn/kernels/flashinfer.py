"""FlashInfer on the vattn cache as-is: its batched paged kernels
(:class:`FlashInferKernel`) and its single-request prefill
(:class:`FlashInferSinglePrefillKernel`).

The batched kernel sees the cache ``[B_max, L, H_kv, D]`` as a paged cache in
one of two presentations (:data:`PRESENTATIONS`):

- ``"pages"`` (the default): the cache cut into vattn-page-sized pages
  (:mod:`vattn.kernels.page_view`): reqid ``r``'s pages are ``r * P ..
  r * P + n - 1``, ranges computed once per batch, no table kept. FlashInfer
  splits a long request's keys across thread blocks in whole pages, so this
  lets small-batch long-context decode use the whole GPU.
- ``"request"``: one page per request, ``page_size = L``, page index =
  reqid, last page length = the request's length. FlashInfer cannot split a
  request's keys then (one page), and it keeps a page's stride in 32 bits
  (``paged_kv_t::stride_page``): a slice of 2^32 elements or more (Llama-3-8B
  in ``all_layers`` at 131072 tokens) would wrap and every request would
  read request 0's rows, so :meth:`FlashInferKernel.supports` refuses it.

Either way the kernel reads ``k_cache[r, :seq_len]`` and nothing else.
FlashInfer fixes the heads, dtypes and softmax scale when it plans, so this
kernel plans per case.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vattn.common.errors import BackendUnavailable
from .batch import AttentionBatch, token_rows, write_rows
from .page_view import PageGeometry, page_geometry, page_ranges, paged_view
from .protocol import AttentionCase, Kernel, KernelPlan, Support, check_layer, load_module

INSTALL_HINT = "FlashInfer (pip install flashinfer-python)"
PRESENTATIONS = ("pages", "request")
UINT32_LIMIT = 1 << 32  # paged_kv_t's strides (page, token, head) are uint32_t: elements
INT32_LIMIT = 1 << 31  # page indices are int32


class _FlashInfer(Kernel):
    """FlashInfer's limits, shared by its kernels."""

    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    q_takes_cache_dtype = False  # q_data_type and kv_data_type are FlashInfer's plan's own

    def module(self) -> Any:
        return load_module("flashinfer", INSTALL_HINT)

    def available(self) -> Support:
        try:
            self.module()
        except Exception as e:  # noqa: BLE001 - BackendUnavailable, or a broken build's own error
            return Support(False, str(e))
        return Support(True)


class FlashInferPlan(KernelPlan):
    """FlashInfer's plan of the batch for one case (its wrapper and the
    arguments it was planned with)."""

    __slots__ = ("case", "kind", "args", "kwargs", "geometry")

    def __init__(self, batch: AttentionBatch, case: AttentionCase, kind: str, args: tuple,
                 kwargs: dict[str, Any], geometry: PageGeometry | None) -> None:
        super().__init__(batch)
        self.case, self.kind, self.args, self.kwargs = case, kind, args, kwargs
        self.geometry = geometry  # the pages the cache is cut into; None: one page per request


class FlashInferKernel(_FlashInfer):
    """FlashInfer's batched decode (every ``query_len`` 1) or prefill kernel
    on the cache in ``presentation`` (see the module docstring). One
    instance keeps one workspace (``workspace_bytes`` of device memory,
    allocated at the first plan) and one FlashInfer wrapper per device and
    kind; a wrapper holds one plan at a time, so running an older plan plans
    it again."""

    batched = True
    plans_per_case = True
    required: ClassVar[tuple[str, ...]] = ("num_q_heads", "num_kv_heads", "max_context_len", "dtype")

    def __init__(self, workspace_bytes: int = 128 << 20, presentation: str = "pages") -> None:
        super().__init__()
        if presentation not in PRESENTATIONS:
            raise ValueError(f"presentation must be one of {PRESENTATIONS}, got {presentation!r}")
        self.presentation = presentation
        self.name = "FlashInfer" if presentation == "pages" else "FlashInfer (one page per request)"
        self.key = "flashinfer" if presentation == "pages" else "flashinfer_request"
        self.workspace_bytes = workspace_bytes
        self._wrappers: dict[tuple[torch.device, str], Any] = {}
        self._planned: dict[tuple[torch.device, str], FlashInferPlan] = {}  # what each wrapper holds now

    def supports(self, case: AttentionCase) -> Support:
        ok = super().supports(case)
        if not ok or case.slice_stride is None or case.row_stride is None:
            return ok  # the cache's geometry is checked once known
        return self._supports_geometry(case.slice_stride, case.row_stride, case.page_tokens)

    def _supports_geometry(self, slice_stride: int, row_stride: int, page_tokens: int | None) -> Support:
        if row_stride >= UINT32_LIMIT:
            return Support(False, f"{self.name} keeps the token stride in 32 bits (paged_kv_t::stride_n): "
                                  f"{row_stride} elements per token row do not fit")
        if self.presentation == "request":
            if slice_stride >= UINT32_LIMIT:
                return Support(False, f"{self.name} keeps a page's stride in 32 bits (paged_kv_t::stride_page): "
                                      f"a slice of {slice_stride} elements (2^32 or more) would wrap and every "
                                      "request would read request 0's rows; use the 'pages' presentation")
            return Support(True)
        try:
            geometry = page_geometry(slice_stride, row_stride, page_tokens)
        except ValueError as e:
            return Support(False, f"{self.name} cannot cut this cache into pages: {e}")
        if geometry.page_stride >= UINT32_LIMIT:
            return Support(False, f"{self.name} keeps a page's stride in 32 bits (paged_kv_t::stride_page): "
                                  f"pages of {geometry.page_tokens} tokens are {geometry.page_stride} elements")
        return Support(True)

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> FlashInferPlan:
        required = self.required + (("slice_stride", "row_stride") if self.presentation == "pages" else ())
        missing = [f for f in required if case is None or getattr(case, f) is None]
        if missing:
            raise ValueError(f"{self.name} plans with the case's {', '.join(missing)}: give an AttentionCase with them")
        assert case is not None
        if batch.device.type not in self.devices:
            raise BackendUnavailable(f"{self.name} plans on a CUDA device, got a batch on {batch.device}")
        self.check_options(case.sliding_window, case.logits_soft_cap)
        if max(batch.seq_lens) > case.max_context_len:
            raise ValueError(f"seq_lens must be <= max_context_len ({case.max_context_len}), got {max(batch.seq_lens)}")
        if case.slice_stride is not None and case.row_stride is not None:
            ok, reason = self._supports_geometry(case.slice_stride, case.row_stride, case.page_tokens)
            if not ok:
                raise ValueError(reason)
        # the page arrays go in on the host: FlashInfer's plan reads them there and copies them to the device
        if self.presentation == "pages":
            geometry = page_geometry(case.slice_stride, case.row_stride, case.page_tokens)  # type: ignore[arg-type]
            if (max(batch.reqids) + 1) * geometry.pages_per_slice > INT32_LIMIT:
                raise ValueError(f"{self.name} indexes pages with int32: reqid {max(batch.reqids)} has pages past "
                                 f"2^31 ({geometry.pages_per_slice} pages per slice)")
            pages = tuple(page_ranges(batch.reqids, batch.seq_lens, geometry))
            page_size = geometry.page_tokens
        else:
            geometry = None
            n = len(batch.reqids)
            pages = (torch.arange(n + 1, dtype=torch.int32), torch.tensor(batch.reqids, dtype=torch.int32),
                     torch.tensor(batch.seq_lens, dtype=torch.int32))
            page_size = case.max_context_len
        kind = "decode" if batch.is_decode else "prefill"
        common = dict(q_data_type=case.dtype, kv_data_type=case.kv_dtype or case.dtype, sm_scale=case.softmax_scale)
        shape = (case.num_q_heads, case.num_kv_heads, case.head_dim, page_size)
        if kind == "decode":
            args, kwargs = (*pages, *shape), common
        else:
            starts = torch.tensor(batch.query_starts, dtype=torch.int32)
            args, kwargs = (starts, *pages, *shape), dict(common, causal=True)
        plan = FlashInferPlan(batch, case, kind, args, kwargs, geometry)
        self._plan_wrapper(plan)
        token_rows(batch)  # where run() writes the new K/V
        return plan

    def _plan_wrapper(self, plan: FlashInferPlan) -> Any:
        wrapper_key = (plan.batch.device, plan.kind)
        wrapper = self._wrappers.get(wrapper_key)
        if wrapper is None:
            flashinfer = self.module()
            cls = (flashinfer.BatchDecodeWithPagedKVCacheWrapper if plan.kind == "decode"
                   else flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=plan.batch.device)
            wrapper = self._wrappers[wrapper_key] = cls(workspace, "NHD")
        wrapper.plan(*plan.args, **plan.kwargs)
        self._planned[wrapper_key] = plan
        return wrapper

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`Kernel.run`; ``softmax_scale`` is the one planned (the
        case's), None or equal to it."""
        if not isinstance(plan, FlashInferPlan):
            raise TypeError(f"plan must be FlashInferKernel.plan's, got {type(plan).__name__}")
        if softmax_scale is not None and softmax_scale != plan.case.softmax_scale:
            raise ValueError(f"{self.name} fixes softmax_scale when it plans: planned {plan.case.softmax_scale}, "
                             f"run with {softmax_scale}")
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap)
        batch = plan.batch
        paged = self._paged_caches(plan, k_cache, v_cache)
        if k is not None or v is not None:
            write_rows(k_cache, v_cache, batch, k, v)
        wrapper_key = (batch.device, plan.kind)
        wrapper = self._wrappers[wrapper_key] if self._planned.get(wrapper_key) is plan else self._plan_wrapper(plan)
        result = wrapper.run(q, paged)
        if out is None:
            return result
        out.copy_(result)
        return out


    def _paged_caches(self, plan: FlashInferPlan, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as the paged pool the plan indexes; ``ValueError``
        unless their strides are the ones planned for and fit FlashInfer's
        32-bit fields."""
        slice_stride, row_stride = k_cache.stride(0), k_cache.stride(1)
        ok, reason = self._supports_geometry(slice_stride, row_stride, plan.case.page_tokens)
        if not ok:
            raise ValueError(reason)
        if v_cache.stride()[:2] != (slice_stride, row_stride):
            raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
        if plan.geometry is None:
            return k_cache, v_cache
        if (slice_stride, row_stride) != (plan.case.slice_stride, plan.case.row_stride):
            raise ValueError(f"{self.name} planned pages of a cache with slice and row strides "
                             f"({plan.case.slice_stride}, {plan.case.row_stride}); this cache has "
                             f"({slice_stride}, {row_stride})")
        return paged_view(k_cache, plan.geometry), paged_view(v_cache, plan.geometry)


class FlashInferSinglePrefillKernel(_FlashInfer):
    """FlashInfer ``single_prefill_with_kv_cache`` per request on
    ``k_cache[r, :seq_len]`` (NHD views)."""

    name = "FlashInfer single prefill"
    key = "flashinfer_single"

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> KernelPlan:
        return KernelPlan(batch)

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        flashinfer = self.module()
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap)
        batch = plan.batch
        if k is not None or v is not None:
            write_rows(k_cache, v_cache, batch, k, v)
        if out is None:
            out = torch.empty_like(q)
        starts = batch.query_starts
        for i, (reqid, seq_len) in enumerate(zip(batch.reqids, batch.seq_lens)):
            out[starts[i]:starts[i + 1]] = flashinfer.single_prefill_with_kv_cache(
                q[starts[i]:starts[i + 1]], k_cache[reqid, :seq_len], v_cache[reqid, :seq_len],
                causal=True, kv_layout="NHD", sm_scale=softmax_scale,
            )
        return out
