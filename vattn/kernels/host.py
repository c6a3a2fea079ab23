"""vattn's host attention kernel (the ``vattn._cpu_attn`` extension, built
from ``csrc/cpu_attn``): one call per layer serves a whole mixed batch.

Its limits (head dims, dtypes) are defined in ``csrc/cpu_attn/attention.h``
and read from the extension here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.utils.dlpack import to_dlpack

from .batch import AttentionBatch
from .protocol import AttentionCase, Kernel, KernelPlan, LayerViews, Support, check_layer

_native_module: Any = None


def native() -> Any:
    """The host kernel extension (``vattn._cpu_attn``), imported on first use."""
    global _native_module
    if _native_module is None:
        from vattn import _cpu_attn as module

        _native_module = module
    return _native_module


class HostPlan(KernelPlan):
    """The batch as the extension's plan (``vattn._cpu_attn.Plan``): the
    requests validated once; its work split is computed by the first layer's
    call (per heads and window) and reused by the others."""

    __slots__ = ("native",)

    def __init__(self, batch: AttentionBatch) -> None:
        super().__init__(batch)
        self.native = native().Plan(batch.reqids, batch.cached_lens, batch.query_lens)


class HostKernel(Kernel):
    """vattn's host kernel: prefill chunks (causal, after the request's cached
    tokens) and decodes of one batch in one call per layer, K/V read in place
    for both layouts (any token and slice stride), accumulated in fp32, the
    step's new K/V rows written by the same call. The work (request x kv
    heads x query block x key split) runs without the GIL on torch's OpenMP
    threads, or on a pool of its own (``VATTN_CPU_ATTN_POOL=own``, or in a
    forked child). See :func:`vattn.attention.host_attention` for the
    arguments and the NaN contract."""

    name = "vattn's host kernel"
    key = "host"
    devices = ("cpu",)
    has_sliding_window = True
    has_logits_soft_cap = True
    batched = True

    @functools.cached_property
    def dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        return tuple(getattr(torch, name) for name in native().DTYPES)

    @functools.cached_property
    def head_dim_max(self) -> int:  # type: ignore[override]
        return int(native().MAX_HEAD_DIM)

    def available(self) -> Support:
        try:
            native()
        except ImportError as e:
            return Support(False, f"{self.name} is not built (vattn._cpu_attn: {e})")
        return Support(True)

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> HostPlan:
        return HostPlan(batch)

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None, return_lse: bool = False,
            isa: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Kernel.run`, plus ``return_lse`` (also return the
        log-sum-exp of the scaled, capped scores, ``[T, H_q]`` float32) and
        ``isa`` (force a path, see :func:`vattn.attention.host_attention`).
        Every argument may also go in by position (host_attention's way:
        cheaper than keywords, once per layer per step)."""
        # once per layer per step: the arguments go in by position (keywords cost the binding a string
        # match each, about a microsecond per call in all); the extension checks the shapes
        if not isinstance(plan, HostPlan):
            raise TypeError(f"plan must be the host kernel's plan (HostKernel.plan), got {type(plan).__name__}")
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window, shapes=False)
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if return_lse else None
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        native().attention(
            plan.native, to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out),
            None if k is None else to_dlpack(k), None if v is None else to_dlpack(v),
            None if lse is None else to_dlpack(lse), scale, logits_soft_cap or 0.0, sliding_window or 0, isa)
        return (out, lse) if return_lse else out


    def run_layer(self, plan: KernelPlan, views: LayerViews, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, out: torch.Tensor, softmax_scale: float | None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`Kernel.run_layer`: the extension's one call (it writes the
        new K/V and checks the shapes itself), with no check of vattn's."""
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        _native_module.attention(
            plan.native, to_dlpack(q), to_dlpack(views.k_cache), to_dlpack(views.v_cache), to_dlpack(out),
            None if k is None else to_dlpack(k), None if v is None else to_dlpack(v), None, scale,
            logits_soft_cap or 0.0, sliding_window or 0, None)
        return out


def info() -> dict[str, Any]:
    """The host kernel's build and CPU: ``isa`` (the path calls take),
    ``best_isa``, ``supported``, ``compiled``, ``threads`` (pool size),
    ``pool``, ``calls`` (calls completed in this process, per ISA) and
    ``note`` (why ``VATTN_CPU_ATTN_ISA`` was not honoured, if it was not)."""
    return dict(native().info())
