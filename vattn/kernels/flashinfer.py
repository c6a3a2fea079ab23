"""FlashInfer on the vattn cache as-is: its batched paged kernels
(:class:`FlashInferKernel`) and its single-request prefill
(:class:`FlashInferSinglePrefillKernel`).

The batched kernel sees the cache ``[B_max, L, H_kv, D]`` as a paged cache
with ``page_size = L``: one "page" per request, page index = reqid, last page
length = the request's length. So it reads ``k_cache[r, :seq_len]`` and
nothing else. FlashInfer fixes the heads, dtypes and softmax scale when it
plans, so this kernel plans per case.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import BackendUnavailable
from .batch import AttentionBatch, check_inputs, write_rows
from .protocol import AttentionCase, Kernel, KernelPlan, Support, load_module

INSTALL_HINT = "FlashInfer (pip install flashinfer-python)"


class _FlashInfer(Kernel):
    """FlashInfer's limits, shared by its kernels."""

    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)

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

    __slots__ = ("case", "kind", "args", "kwargs")

    def __init__(self, batch: AttentionBatch, case: AttentionCase, kind: str, args: tuple,
                 kwargs: dict[str, Any]) -> None:
        super().__init__(batch)
        self.case, self.kind, self.args, self.kwargs = case, kind, args, kwargs


class FlashInferKernel(_FlashInfer):
    """FlashInfer's batched decode (every ``query_len`` 1) or prefill kernel
    (see the module docstring). One instance keeps one workspace
    (``workspace_bytes`` of device memory, allocated at the first plan) and
    one FlashInfer wrapper per device and kind; a wrapper holds one plan at a
    time, so running an older plan plans it again."""

    name = "FlashInfer"
    key = "flashinfer"
    batched = True
    plans_per_case = True
    required: ClassVar[tuple[str, ...]] = ("num_q_heads", "num_kv_heads", "max_context_len", "dtype")

    def __init__(self, workspace_bytes: int = 128 << 20) -> None:
        super().__init__()
        self.workspace_bytes = workspace_bytes
        self._wrappers: dict[tuple[torch.device, str], Any] = {}
        self._planned: dict[tuple[torch.device, str], FlashInferPlan] = {}  # what each wrapper holds now

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> FlashInferPlan:
        missing = [f for f in self.required if case is None or getattr(case, f) is None]
        if missing:
            raise ValueError(f"{self.name} plans with the case's {', '.join(missing)}: give an AttentionCase with them")
        assert case is not None
        if batch.device.type not in self.devices:
            raise BackendUnavailable(f"{self.name} plans on a CUDA device, got a batch on {batch.device}")
        self.check_options(case.sliding_window, case.logits_soft_cap)
        if max(batch.seq_lens) > case.max_context_len:
            raise ValueError(f"seq_lens must be <= max_context_len ({case.max_context_len}), got {max(batch.seq_lens)}")
        n = len(batch.reqids)
        page_indptr = torch.arange(n + 1, dtype=torch.int32, device=batch.device)
        pages = (page_indptr, batch.tensor("reqids"), batch.tensor("seq_lens"))
        kind = "decode" if batch.is_decode else "prefill"
        common = dict(q_data_type=case.dtype, kv_data_type=case.kv_dtype or case.dtype, sm_scale=case.softmax_scale)
        shape = (case.num_q_heads, case.num_kv_heads, case.head_dim, case.max_context_len)
        if kind == "decode":
            args, kwargs = (*pages, *shape), common
        else:
            args, kwargs = (batch.tensor("query_starts"), *pages, *shape), dict(common, causal=True)
        plan = FlashInferPlan(batch, case, kind, args, kwargs)
        self._plan_wrapper(plan)
        return plan

    def _plan_wrapper(self, plan: FlashInferPlan) -> Any:
        slot = (plan.batch.device, plan.kind)
        wrapper = self._wrappers.get(slot)
        if wrapper is None:
            flashinfer = self.module()
            cls = (flashinfer.BatchDecodeWithPagedKVCacheWrapper if plan.kind == "decode"
                   else flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=plan.batch.device)
            wrapper = self._wrappers[slot] = cls(workspace, "NHD")
        wrapper.plan(*plan.args, **plan.kwargs)
        self._planned[slot] = plan
        return wrapper

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`Kernel.run`; ``softmax_scale`` is the one planned (the
        case's), None or equal to it."""
        if not isinstance(plan, FlashInferPlan):
            raise TypeError(f"plan must be FlashInferKernel.plan's, got {type(plan).__name__}")
        self.require_device("FlashInferAttention.run", q=q, k_cache=k_cache)
        self.check_options(sliding_window, logits_soft_cap)
        if softmax_scale is not None and softmax_scale != plan.case.softmax_scale:
            raise ValueError(f"{self.name} fixes softmax_scale when it plans: planned {plan.case.softmax_scale}, "
                             f"run with {softmax_scale}")
        batch = plan.batch
        check_inputs(q, k_cache, v_cache, batch, k, v, "FlashInferAttention.run")
        if k is not None or v is not None:
            write_rows(k_cache, v_cache, batch, k, v)
        slot = (batch.device, plan.kind)
        wrapper = self._wrappers[slot] if self._planned.get(slot) is plan else self._plan_wrapper(plan)
        result = wrapper.run(q, (k_cache, v_cache))
        if out is None:
            return result
        out.copy_(result)
        return out


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
        self.require_device("flashinfer_single_prefill", q=q, k_cache=k_cache)
        self.check_options(sliding_window, logits_soft_cap)
        batch = plan.batch
        check_inputs(q, k_cache, v_cache, batch, k, v, "flashinfer_single_prefill")
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
