"""The protocol every attention kernel on the vattn cache follows.

A kernel says whether it serves a case (:meth:`Kernel.supports`, with the
reason when it does not), prepares a forward's batch once
(:meth:`Kernel.plan`) and runs one layer on that plan (:meth:`Kernel.run`)::

    case = AttentionCase.of(q, k_cache)
    kernel = select_kernel(case)              # vattn.kernels.select
    plan = kernel.plan(batch, case)           # once per forward
    for i in range(num_layers):
        out = kernel.run(plan, q[i], *kv.layer(i), k=k_new[i], v=v_new[i])

A kernel's limits (devices, dtypes, head dims, options) are its class
attributes, read by :meth:`Kernel.supports`; nothing else restates them.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, ClassVar, NamedTuple

import torch

from vattn.common.deprecation import warn_renamed
from vattn.common.errors import BackendUnavailable
from vattn.core.mapped_check import ViewsCheck
from .batch import AttentionBatch, check_cache_shapes, check_new_kv, check_query


class _CaseFields(NamedTuple):
    device_type: str  # "cpu" or "cuda"
    head_dim: int  # elements per head (D)
    dtype: torch.dtype | None = None  # of q (and out)
    kv_dtype: torch.dtype | None = None  # of the cache; None: dtype's
    num_q_heads: int | None = None  # H_q
    num_kv_heads: int | None = None  # H_kv
    max_context_len: int | None = None  # tokens per slice (L)
    softmax_scale: float | None = None  # None: 1/sqrt(D)
    sliding_window: int | None = None  # tokens a query sees, itself included
    logits_soft_cap: float | None = None  # scores become cap * tanh(score / cap)
    slice_stride: int | None = None  # elements from one reqid's row 0 to the next's (k_cache.stride(0))
    row_stride: int | None = None  # elements from one token's row to the next (k_cache.stride(1))
    page_tokens: int | None = None  # tokens per vattn page (KVCacheManager.page_tokens), when whole


class AttentionCase(_CaseFields):
    """What a kernel's support and plan depend on.

    Fields not known yet are None and not checked: a framework's start-up
    check knows the device, head dim and options before any tensor exists.
    ``sliding_window`` and ``logits_soft_cap``: None or 0 is off. The
    cache's geometry (``slice_stride``, ``row_stride``, ``page_tokens``)
    matters to kernels that present the cache as pages (FlashInfer).
    ``slot_stride`` is the deprecated name of ``slice_stride`` (it warns).
    """

    __slots__ = ()

    def __new__(cls, *args: Any, **fields: Any) -> AttentionCase:
        if "slot_stride" in fields:
            warn_renamed("AttentionCase(slot_stride=...)", "AttentionCase(slice_stride=...)")
            fields["slice_stride"] = fields.pop("slot_stride")
        return super().__new__(cls, *args, **fields)

    @property
    def slot_stride(self) -> int | None:
        """Deprecated name of :attr:`slice_stride`."""
        warn_renamed("AttentionCase.slot_stride", "AttentionCase.slice_stride")
        return self.slice_stride

    @classmethod
    def of(cls, q: torch.Tensor, k_cache: torch.Tensor, softmax_scale: float | None = None,
           sliding_window: int | None = None, logits_soft_cap: float | None = None,
           page_tokens: int | None = None) -> AttentionCase:
        """The case of one call: ``q`` ``[T, H_q, D]`` over ``k_cache``
        ``[B_max, L, H_kv, D]`` (shapes the kernel checks again: a wrong rank
        leaves a field None here). ``page_tokens`` is not read from the
        cache's manager (a lookup per call): give it where it matters."""
        # built on every attention() call, so from the cheapest accessors (tensor.device costs half a
        # microsecond) and straight into the tuple
        device = "cpu" if q.is_cpu else "cuda" if q.is_cuda else q.device.type
        q_shape, cache = q.shape, k_cache.shape
        four = len(cache) == 4
        strides = k_cache.stride() if four else (None, None)
        return tuple.__new__(cls, (device, q_shape[-1] if q_shape else 0, q.dtype, k_cache.dtype,
                                   q_shape[1] if len(q_shape) == 3 else None, cache[2] if four else None,
                                   cache[1] if four else None, softmax_scale, sliding_window, logits_soft_cap,
                                   strides[0], strides[1], page_tokens))


class Support(NamedTuple):
    """Whether a kernel serves a case; ``reason`` says why not (a sentence
    naming the kernel). True / False as a condition."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class ReadFootprint(NamedTuple):
    """Rows of a slice a kernel may read besides the rows a request attends
    over: a kernel's read footprint is part of its contract, because a row
    it reads must be mapped (an unmapped one faults, on the host as on a
    GPU). A kernel that loads keys in whole tiles without a length mask
    (FlashAttention-3's TMA path) reads up to a tile less one row past a
    request's last row and below its first visible row (a sliding window's
    start); a kernel that masks its loads reads neither. Both are upper
    bounds, in token rows; a read past the slice's last row reads nothing
    (it is outside the kernel's page). False when both are 0."""

    past_end: int = 0  # rows read after row seq_len - 1
    below_start: int = 0  # rows read before the first row a query sees

    def __bool__(self) -> bool:
        return self.past_end > 0 or self.below_start > 0


NO_FOOTPRINT = ReadFootprint()


class LayerViews(NamedTuple):
    """One layer's cache as a kernel reads and writes it, made once per
    cache (:meth:`Kernel.layer_views`), not per forward or per layer call:
    what :meth:`Kernel.run_layer` takes in place of the cache views. Valid
    as long as the cache's memory (a :class:`vattn.KVCacheManager` keeps
    its address range for its life)."""

    k_cache: torch.Tensor  # [B_max, L, H_kv, D]: the layer's K view the views were made of
    v_cache: torch.Tensor  # [B_max, L, H_kv, D]: its V view
    k_read: torch.Tensor  # what the kernel reads K from (FlashAttention: pages; torch's: token rows; else k_cache)
    v_read: torch.Tensor  # the same for V
    k_rows: torch.Tensor | None = None  # [B_max * S, H_kv, D] token rows new K is written into; None: not written so
    v_rows: torch.Tensor | None = None  # the same for V
    rows_per_slice: int = 0  # S, token rows from one slice's row 0 to the next's; 0: not a whole number
    library: Any = None  # the kernel's loaded library (FlashAttention's module), looked up once


class KernelPlan:
    """A forward's batch as one kernel prepared it: made by
    :meth:`Kernel.plan` once per forward, read by every layer's
    :meth:`Kernel.run`. Kernels with more to prepare subclass it.

    ``check`` is the batch's mapping check (:attr:`AttentionBatch.mapped`),
    carried so that a layer runs it without looking anything up; None for a
    plan of padding only, which reads what its maker mapped for it."""

    __slots__ = ("batch", "check")

    def __init__(self, batch: AttentionBatch) -> None:
        self.batch = batch
        self.check: ViewsCheck | None = batch.mapped


class Kernel(abc.ABC):
    """An attention kernel on the vattn cache: its limits, plan and run.

    Subclasses state their limits as class attributes (or properties, where
    the limit lives in compiled code) and implement :meth:`plan` and
    :meth:`run`. Kernels hold no per-forward state: one instance serves
    every batch, from any thread; a forward's plan is held by whoever runs
    the forward (vLLM's metadata, the engine) or by the batch itself
    (:meth:`AttentionBatch.plan`, for the function API). Errors a kernel
    raises name the kernel (``name``), whoever called it.
    """

    name: ClassVar[str]  # for people: messages, logs, stats
    key: ClassVar[str]  # for code: vattn.kernels.KERNELS[key], select_kernel(prefer=key)
    devices: ClassVar[tuple[str, ...]]  # torch device types it runs on
    dtypes: tuple[torch.dtype, ...] = ()  # of q and the cache
    head_dim_max: int | None = None  # None: no upper bound
    head_dim_multiple: int = 1
    has_sliding_window: ClassVar[bool] = False
    q_takes_cache_dtype: ClassVar[bool] = True  # q of the cache's dtype only (False: the library takes both)
    has_logits_soft_cap: ClassVar[bool] = False
    # Serves the whole batch in a few calls per layer, with no loop over requests in Python.
    batched: ClassVar[bool] = False
    # The plan depends on the case (shapes, dtypes, options), not on the batch alone.
    plans_per_case: ClassVar[bool] = False
    # The kernel can plan into persistent buffers (``plan_into``) and its run reads only the plan's
    # tensors, waits for nothing on the host and allocates only through torch: a forward can be
    # captured in a CUDA graph and replayed after the next plan is written into the same buffers.
    graphs: ClassVar[bool] = False

    # ---- limits ------------------------------------------------------------------------

    def available(self) -> Support:
        """Whether the kernel can be loaded here (its package installed, its
        extension built); the reason names what is missing."""
        return Support(True)

    def supports(self, case: AttentionCase) -> Support:
        """Whether the kernel serves ``case`` (installed or not: see
        :meth:`available`); the reason is a sentence naming the kernel and the
        limit."""
        if case.device_type not in self.devices:
            return Support(False, f"{self.name} runs on {' or '.join(d.upper() for d in self.devices)} tensors, "
                                  f"not {case.device_type.upper()} ones")
        for dtype in (case.dtype, case.kv_dtype):
            if dtype is not None and dtype not in self.dtypes:
                names = ", ".join(str(t).removeprefix("torch.") for t in self.dtypes)
                return Support(False, f"{self.name} takes {names} tensors, not {str(dtype).removeprefix('torch.')}")
        d, top, step = case.head_dim, self.head_dim_max, self.head_dim_multiple
        if d < 1 or (top is not None and d > top) or d % step:
            if step > 1:
                rule = f"a multiple of {step} in [{step}, {top}]" if top else f"a positive multiple of {step}"
            else:
                rule = f"in [1, {top}]" if top else ">= 1"
            return Support(False, f"head_dim={d} is not supported by {self.name} (head_dim must be {rule})")
        return self.supports_options(case.sliding_window, case.logits_soft_cap)

    def supports_options(self, sliding_window: int | None, logits_soft_cap: float | None) -> Support:
        """Whether :meth:`run` takes these options (None or 0: off)."""
        window = bool(sliding_window) and not self.has_sliding_window
        if window or (logits_soft_cap and not self.has_logits_soft_cap):
            what = "sliding windows" if window else "logit soft-capping"
            return Support(False, f"{self.name} has no {what} (sliding_window={sliding_window}, "
                                  f"logits_soft_cap={logits_soft_cap})")
        return Support(True)

    def check_options(self, sliding_window: int | None, logits_soft_cap: float | None) -> None:
        """Raises ``ValueError`` unless :meth:`run` takes these options."""
        ok, reason = self.supports_options(sliding_window, logits_soft_cap)
        if not ok:
            raise ValueError(reason)

    def require_device(self, what: str, **tensors: torch.Tensor) -> None:
        """Raises :class:`WrongDevice` (a :class:`vattn.BackendUnavailable`,
        starting with ``what``, naming each tensor's device) unless every
        tensor is on one of the kernel's devices."""
        if any(t.device.type not in self.devices for t in tensors.values()):
            on = " and ".join(f"{name} on {t.device}" for name, t in tensors.items())
            raise WrongDevice(f"{what} needs {' or '.join(d.upper() for d in self.devices)} tensors, "
                                     f"got {on}")

    def layer_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> LayerViews:
        """``k_cache`` and ``v_cache`` (one layer's ``[B_max, L, H_kv, D]``
        views) as :meth:`run_layer` reads and writes them, made once per
        cache. Raises ``ValueError`` where the kernel cannot read this
        cache's geometry. By default the views themselves."""
        check_cache_shapes(k_cache, v_cache)
        return LayerViews(k_cache, v_cache, k_cache, v_cache)

    def check_forward(self, plan: KernelPlan, views: LayerViews, sliding_window: int | None = None) -> None:
        """What :meth:`run` checks per layer and depends on the forward and
        the cache alone, once per forward for every layer whose views share
        ``views``' geometry and mapping (the layers of one cache): the caches'
        shapes against the plan's batch and the plan's mapping check
        (:func:`check_views`; of the rows the layers' ``sliding_window``
        reads, where they have one). Raises as :meth:`run` would."""
        check_views(self, plan, views.k_cache, views.v_cache, sliding_window)

    def run_layer(self, plan: KernelPlan, views: LayerViews, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, out: torch.Tensor, softmax_scale: float | None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`run` for a caller that checked the forward once
        (:meth:`check_forward` on ``views``, the options and tensors' devices
        and shapes at start-up): one layer with no check of vattn's, the
        kernel's own call and the one cache write it needs, into ``out``
        (``[T, H_q, D]``). Tensors the kernel's library takes are still
        checked by it. By default :meth:`run`, checks included (kernels that
        have nothing to save per layer)."""
        return self.run(plan, q, views.k_cache, views.v_cache, k, v, out=out, softmax_scale=softmax_scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def read_footprint(self, case: AttentionCase) -> ReadFootprint:
        """The rows :meth:`run` may read beyond each request's visible rows
        for ``case`` (:class:`ReadFootprint`); whoever maps the cache for
        the kernel maps them too. None by default: the kernel masks its
        loads."""
        return NO_FOOTPRINT

    # ---- plan and run ----------------------------------------------------------------------

    @abc.abstractmethod
    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> KernelPlan:
        """Prepares ``batch`` once for every layer of the forward (index
        tensors, work splits, a library's own plan). ``case`` gives the
        shapes and options; kernels whose plan needs them
        (``plans_per_case``) raise ``ValueError`` without it."""

    @abc.abstractmethod
    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        """Attention of one layer over the cache.

        Args:
            plan: this forward's plan (:meth:`plan` of this kernel).
            q: ``[T, H_q, D]`` queries, token-packed; ``H_q`` a multiple of ``H_kv``.
            k_cache, v_cache: ``[B_max, L, H_kv, D]`` cache views of one layer.
            k, v: ``[T, H_kv, D]`` new tokens, written into rows
                ``(reqid, cached_len + j)`` before attending; None when the
                caller has written them already.
            out: ``[T, H_q, D]`` to write into; allocated when None.
            softmax_scale: None: ``1/sqrt(D)``.
            sliding_window, logits_soft_cap: None or 0: off; kernels without
                them raise ``ValueError`` when asked.

        Returns ``out``. Each request's rows ``[0, seq_len)`` are read,
        nothing else; for views of a vattn cache every reqid is checked to
        be allocated with that many tokens mapped before anything is read.
        """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class WrongDevice(BackendUnavailable, ValueError):
    """A tensor handed to a kernel is on a device the kernel does not run on:
    a bad argument, and a backend this kernel does not have."""


def check_layer(kernel: Kernel, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k: torch.Tensor | None = None, v: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
                sliding_window: int | None = None, logits_soft_cap: float | None = None, shapes: bool = True,
                num_tokens: int | None = None) -> None:
    """What every :meth:`Kernel.run` checks per layer, before anything is
    read: the options (:meth:`Kernel.check_options`), that each tensor is on
    one of the kernel's devices (:class:`WrongDevice`, naming them), with
    ``shapes`` the shapes of the caches, ``q`` and the new ``k``/``v``
    against the plan's batch (kernels whose library checks shapes pass
    False), then the plan's mapping check. ``num_tokens``: the rows of ``q``,
    ``k`` and ``v`` when the plan pads them past the batch's tokens (default:
    the batch's). What depends on the batch alone was checked when it was
    built and planned."""
    if sliding_window or logits_soft_cap:
        kernel.check_options(sliding_window, logits_soft_cap)
    devices = kernel.devices
    tensors = (q, k_cache, v_cache, k, v, out)
    if not all(t is None or (t.is_cpu and "cpu" in devices) or (t.is_cuda and "cuda" in devices) for t in tensors):
        wrong = [f"{name} on {t.device}" for name, t in zip(("q", "k_cache", "v_cache", "k", "v", "out"), tensors)
                 if t is not None and t.device.type not in devices]
        raise WrongDevice(f"{kernel.name} needs {' or '.join(d.upper() for d in devices)} tensors, "
                          f"got {' and '.join(wrong)}")
    batch = plan.batch
    if shapes:
        if batch is not None:
            batch.check_cache(k_cache, v_cache)
        else:
            check_cache_shapes(k_cache, v_cache)
        tokens = batch.num_tokens if num_tokens is None else num_tokens
        check_query(q, k_cache, tokens, kernel.q_takes_cache_dtype)
        if k is not None or v is not None:
            check_new_kv(k_cache, tokens, k, v)
    if plan.check is not None:
        plan.check(k_cache, v_cache, kernel.name, sliding_window)


def check_views(kernel: Kernel, plan: KernelPlan, k_cache: torch.Tensor, v_cache: torch.Tensor,
                sliding_window: int | None = None) -> None:
    """The part of :func:`check_layer` that depends on the caches and the
    plan alone: the caches' shapes against the plan's batch (any batch when
    the plan is padding only), then the plan's mapping check (of the rows a
    ``sliding_window`` reads, where one is given). What
    :meth:`Kernel.check_forward` runs once per forward."""
    if plan.batch is not None:
        plan.batch.check_cache(k_cache, v_cache)
    else:
        check_cache_shapes(k_cache, v_cache)
    if plan.check is not None:
        plan.check(k_cache, v_cache, kernel.name, sliding_window)


def load_module(module: str, what: str) -> Any:
    """Imports a kernel's package on first use; :class:`vattn.BackendUnavailable`
    naming ``what`` (the kernel and how to install it) when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailable(f"{what} is not installed: {e}") from e
