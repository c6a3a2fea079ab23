"""Unmodified attention kernels on the vattn cache, one function per kernel.

The kernels themselves, their limits and the rule that picks one live in
:mod:`vattn.kernels` (a module per kernel, one protocol); this module keeps
the function-per-kernel API on top of them: each function is one
:meth:`Kernel.run` on the plan the batch keeps for that kernel
(:meth:`AttentionBatch.plan`, made by the first layer), so a forward hands
each layer the same :class:`AttentionBatch`::

    batch = AttentionBatch(reqids=[3, 0], cached_lens=[17, 0], query_lens=[1, 5])
    for i in range(num_layers):
        k_cache, v_cache = kv.layer(i)
        out = attention(q, k_cache, v_cache, batch, k=k_new, v=v_new)

Token-packed ("varlen") tensors: ``q`` is ``[T, H_q, D]`` and ``k``/``v`` (the
new tokens) ``[T, H_kv, D]`` where ``T = sum(query_lens)``, request ``i``'s
tokens at rows ``[query_starts[i], query_starts[i+1])``. Attention is causal
with the queries aligned to the end of each request (a query at position
``cached_len + j`` sees keys ``0 .. cached_len + j``).

:func:`attention` runs the kernel :func:`vattn.kernels.select_kernel` picks:
on the host vattn's own kernel (:func:`host_attention`: one call per layer for
the whole mixed batch, K/V read in place for both layouts, the step's new K/V
rows written by the same call), on CUDA FlashAttention-2 where it is installed
and serves the case, else torch SDPA (:func:`sdpa_attention`, also the
reference).

FlashAttention and FlashInfer are imported on first use; without them, or
without a CUDA tensor, their functions raise :class:`vattn.BackendUnavailable`.
"""

from __future__ import annotations

from typing import Any

import torch

from vattn.common.errors import BackendUnavailable
from . import host as _host
from .batch import AttentionBatch, write_kv
from .flashinfer import FlashInferKernel, FlashInferPlan
from .protocol import AttentionCase
from .sdpa import sdpa_dense
from .select import FLASH_ATTN, FLASHINFER_SINGLE, HOST, SDPA, select_kernel

__all__ = [
    "AttentionBatch",
    "write_kv",
    "attention",
    "host_attention",
    "host_attention_info",
    "sdpa_attention",
    "sdpa_dense",
    "flash_attn_attention",
    "flashinfer_single_prefill",
    "FlashInferAttention",
]


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """The attention an engine calls on the cache: the kernel
    :func:`vattn.kernels.select_kernel` picks for these tensors and options
    (raises ``ValueError`` naming each candidate's limit when none serves
    them). Shapes as :func:`host_attention`."""
    case = AttentionCase.of(q, k_cache, softmax_scale, sliding_window, logits_soft_cap)
    kernel = select_kernel(case)  # cached per case
    return kernel.run(batch.plan(kernel, case), q, k_cache, v_cache, k, v, softmax_scale=softmax_scale,
                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


def host_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vattn's host attention kernel: one call serves a whole mixed batch.

    Prefill chunks (causal, after the request's cached tokens) and decodes
    are served together; every request's K/V are read in place from
    ``k_cache[reqid, :seq_len]`` (``per_layer`` views and ``all_layers``
    views ``K[:, :, i]`` alike: any token and slice stride), accumulated in
    fp32 without copying the cache. The work (request x kv heads x query
    block x key split) runs without the GIL on torch's OpenMP threads (the
    ones its own ops use, so the two never compete for cores), or on a pool
    of its own (``VATTN_CPU_ATTN_POOL=own``, or in a forked child).

    Args:
        q: ``[T, H_q, D]`` queries, float32 / bfloat16 / float16; ``H_q`` a
            multiple of ``H_kv`` (GQA, MQA); head_dim stride 1.
        k_cache, v_cache: ``[B_max, L, H_kv, D]`` cache views of one layer
            (:meth:`vattn.KVCacheManager.layer`), any of the three dtypes.
        batch: the forward's requests.
        k, v: ``[T, H_kv, D]`` new tokens in the cache's dtype, written into
            rows ``(reqid, cached_len + j)`` before attending; None when the
            caller has written them already.
        softmax_scale: defaults to ``1/sqrt(D)``.
        sliding_window: a query at position ``p`` sees keys
            ``p - sliding_window + 1 .. p`` (vLLM's and Hugging Face's
            ``sliding_window``; FlashAttention's ``window_size=(W - 1, 0)``);
            None or 0: the whole causal prefix.
        logits_soft_cap: scores become ``cap * tanh(score / cap)`` before the
            softmax (Gemma-2); None or 0: off.
        return_lse: also return the log-sum-exp of the (scaled, capped)
            scores, ``[T, H_q]`` float32, natural log.
        out: ``[T, H_q, D]`` in ``q``'s dtype to write into; allocated when None.
        isa: ``"scalar"``, ``"avx2"``, ``"avx512"``, ``"avx512_bf16"``
            (AVX-512 with Q K^T of bf16 queries over a bf16 cache by
            VDPBF16PS), ``"amx"`` (that, plus AMX-BF16 tiles for prefill
            blocks of a bf16 cache), ``"neon"`` or ``"sve256"`` (SVE at a
            256-bit vector length) to force a path (falls back to a lower
            supported one); None: the fastest this CPU supports, or the one
            ``VATTN_CPU_ATTN_ISA`` names.

    Returns:
        ``out`` ``[T, H_q, D]`` in ``q``'s dtype, or ``(out, lse)``.

    The kernel reads rows ``[0, seq_len)`` of each request and nothing else.
    Before anything is read, shapes, strides, dtypes, reqids and lengths are
    checked against the tensors and, for views of a vattn cache, each reqid
    is checked to be allocated with ``seq_len`` tokens mapped
    (:meth:`AttentionBatch.check_mapped`): a bad argument raises
    ``ValueError`` / ``TypeError`` naming it.

    NaN, on every ISA path: a NaN in a query, or in K of a key the query
    sees, makes that query's output row and its LSE NaN; a NaN in V of a
    key it sees makes that column of the row NaN (as torch's SDPA does).
    Rows that do not read it are unaffected, except that a NaN in V may also
    reach queries of the same request that share its key tile (at most 64
    keys) without seeing the key (their weight for it is exactly 0, and
    0 x NaN is NaN).

    Example::

        batch = AttentionBatch(reqids=[3, 0], cached_lens=[17, 0], query_lens=[1, 5])
        out = host_attention(q, *kv.layer(i), batch, k=k_new, v=v_new)
    """
    return HOST.run(batch.plan(HOST), q, k_cache, v_cache, k, v, out, softmax_scale, sliding_window,
                    logits_soft_cap, return_lse, isa)


def host_attention_info() -> dict[str, Any]:
    """The host kernel's build and CPU (:func:`vattn.kernels.host.info`):
    ``isa`` (the path calls take), ``supported``, ``compiled``, ``threads``
    (pool size), ``calls`` (calls completed in this process, per ISA),
    ``packed_value_bytes`` (bytes of values the calls packed once for their
    prompts' query blocks, in this process: docs/kernels.md),
    ``decode_prefetch`` (``"l2"`` or ``"l1"``: the cache level decode items
    from memory request their next key tile's lines into, ``"l2"`` on cores
    whose L1 data cache is under 48 KiB) and ``note`` (why
    ``VATTN_CPU_ATTN_ISA`` was not honoured, if it was not)."""
    return _host.info()


def sdpa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """torch ``scaled_dot_product_attention`` on the cache, CPU or GPU
    (:class:`vattn.kernels.SdpaKernel`).

    Args:
        q: ``[T, H_q, D]`` queries; ``H_q`` a multiple of ``H_kv`` (GQA).
        k_cache, v_cache: ``[B_max, L, H_kv, D]`` cache views of one layer.
        batch: the forward's requests.
        k, v: ``[T, H_kv, D]`` new tokens, written into the cache first; None
            when the caller has written them already.
        softmax_scale: defaults to ``1/sqrt(D)``.

    Returns:
        ``[T, H_q, D]`` in ``q``'s dtype.

    Each request is one SDPA call on ``k_cache[r, :seq_len]`` (a view), so no
    request is padded to the longest one.
    """
    return SDPA.run(batch.plan(SDPA), q, k_cache, v_cache, k, v, softmax_scale=softmax_scale)


def flash_attn_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """FlashAttention-2 on the whole cache, one ``flash_attn_varlen_func``
    call for the batch (:class:`vattn.kernels.FlashAttentionKernel`).

    Each request's slice is one page of a paged view (the block table is the
    reqids as a column), ``seq_lens`` its keys, so the kernel reads each
    request's rows in place, whatever its query length; new ``k``/``v`` are
    written first by one indexed store each. The index tensors are built
    once per batch. Shapes as :func:`sdpa_attention`; CUDA tensors,
    fp16/bf16, ``head_dim`` a multiple of 8 (otherwise FlashAttention pads,
    i.e. copies, the whole cache), slices a multiple of 256 tokens apart.
    """
    FLASH_ATTN.module()  # not installed: BackendUnavailable before the plan is built on the device
    FLASH_ATTN.require_device("flash_attn_attention", q=q, k_cache=k_cache)
    return FLASH_ATTN.run(batch.plan(FLASH_ATTN), q, k_cache, v_cache, k, v, softmax_scale=softmax_scale)


def flashinfer_single_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """FlashInfer ``single_prefill_with_kv_cache`` per request on
    ``k_cache[r, :seq_len]`` (NHD views). Shapes as :func:`sdpa_attention`."""
    return FLASHINFER_SINGLE.run(batch.plan(FLASHINFER_SINGLE), q, k_cache, v_cache, k, v,
                                 softmax_scale=softmax_scale)


class FlashInferAttention:
    """FlashInfer's batched paged kernels, run on the vattn cache as-is
    (:class:`vattn.kernels.FlashInferKernel` with a workspace of its own).

    ``presentation`` says how the cache ``[B_max, L, H_kv, D]`` is shown to
    FlashInfer as a paged cache: ``"pages"`` (default) cuts every slice into
    pages of ``page_tokens`` rows (the vattn page; page ``j`` of reqid ``r``
    is ``r * P + j``), so FlashInfer can split a long request's keys across
    thread blocks; ``"request"`` makes each slice one page (``page_size =
    L``, page index = reqid), which FlashInfer refuses past 2^32 elements
    per slice. Either way the kernel reads ``k_cache[r, :seq_len]`` and
    nothing else. :meth:`plan` once per forward, :meth:`run` per layer.

    Example::

        fi = FlashInferAttention(device="cuda")
        fi.plan(batch, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                max_context_len=L, q_dtype=torch.bfloat16, k_cache=kv.layer(0)[0],
                page_tokens=kv.page_tokens)
        for i in range(num_layers):
            out = fi.run(q[i], *kv.layer(i), k=k_new[i], v=v_new[i])
    """

    def __init__(self, device: str | torch.device = "cuda", workspace_bytes: int = 128 << 20,
                 presentation: str = "pages") -> None:
        self._kernel = FlashInferKernel(workspace_bytes, presentation)
        self._kernel.module()
        self.device = torch.device(device)
        if self.device.type not in self._kernel.devices:
            raise BackendUnavailable(f"FlashInferAttention needs a CUDA device, got {self.device}")
        self._batch: AttentionBatch | None = None
        self._case: AttentionCase | None = None
        self._plan: FlashInferPlan | None = None

    def plan(
        self,
        batch: AttentionBatch,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_context_len: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        softmax_scale: float | None = None,
        k_cache: torch.Tensor | None = None,
        page_tokens: int | None = None,
    ) -> None:
        """Plans the batched decode (every ``query_len`` 1) or prefill kernel.

        ``k_cache``: a layer's cache view, for its slice and row strides
        (every layer's are the same); None: the plan is made at the first
        :meth:`run`, from its cache. ``page_tokens``: the vattn page in tokens
        (``KVCacheManager.page_tokens``) for the ``"pages"`` presentation;
        None: the largest power of two up to 256 that divides a slice.
        """
        self._batch = batch
        self._case = AttentionCase(self.device.type, head_dim, q_dtype, kv_dtype or q_dtype, num_qo_heads,
                                   num_kv_heads, max_context_len, softmax_scale, page_tokens=page_tokens)
        self._plan = None
        if k_cache is not None:
            self._plan_for(k_cache)

    def _plan_for(self, k_cache: torch.Tensor) -> FlashInferPlan:
        assert self._batch is not None and self._case is not None
        case = self._case._replace(slice_stride=k_cache.stride(0), row_stride=k_cache.stride(1))
        if self._plan is None or self._plan.case != case:
            self._plan = self._kernel.plan(self._batch, case)
        return self._plan

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` (``[T, H_q, D]``) over one layer's cache; writes
        ``k``/``v`` (``[T, H_kv, D]``) first when given. Returns ``[T, H_q, D]``."""
        if self._batch is None:
            raise RuntimeError("FlashInferAttention.run called before plan()")
        if k_cache.dim() != 4:
            raise ValueError(f"k_cache must be [max_batch_size, max_context_len, heads, head_dim], "
                             f"got shape {tuple(k_cache.shape)}")
        return self._kernel.run(self._plan_for(k_cache), q, k_cache, v_cache, k, v)
