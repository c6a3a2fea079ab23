"""Unmodified attention kernels on the vattn cache.

Every kernel here reads K/V straight from the cache tensors of
:meth:`vattn.KVCacheManager.layer` (``[B_max, L, H_kv, D]`` views, either
layout): no block table, no gather, no copy of the cache. Each request ``r``
is read only in rows ``[0, seq_len)``, which ``step`` has mapped; nothing reads
the rest of the slot (a read there would fault).

The per-iteration work is planned once and reused by every layer
(FlashInfer's plan/run split)::

    batch = AttentionBatch(reqids=[3, 0], cached_lens=[17, 0], query_lens=[1, 5])
    for i in range(num_layers):
        k_cache, v_cache = kv.layer(i)
        out = sdpa_attention(q, k_cache, v_cache, batch, k=k_new, v=v_new)

Token-packed ("varlen") tensors: ``q`` is ``[T, H_q, D]`` and ``k``/``v`` (the
new tokens) ``[T, H_kv, D]`` where ``T = sum(query_lens)``, request ``i``'s
tokens at rows ``[query_starts[i], query_starts[i+1])``. Attention is causal
with the queries aligned to the end of each request (a query at position
``cached_len + j`` sees keys ``0 .. cached_len + j``).

On the host, :func:`host_attention` is vattn's own kernel (the
``vattn._cpu_attn`` extension): one call per layer serves the whole mixed
batch, reads each request's rows in place for both layouts, and writes the
step's new K/V rows itself. :func:`attention` picks it for CPU tensors and
:func:`sdpa_attention` (also the reference) for CUDA ones.

FlashAttention and FlashInfer are imported on first use; without them, or
without a CUDA tensor, their adapters raise :class:`vattn.BackendUnavailable`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

from .errors import BackendUnavailable
from .manager import manager_of

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


class AttentionBatch:
    """One forward's requests: which reqids, how long, how many new tokens.

    Built once per iteration (it validates and precomputes the index tensors)
    and passed to every layer's attention call.

    Args:
        reqids: cache rows (vattn reqids) of the requests in this forward, in
            the order their tokens appear in ``q``; distinct.
        cached_lens: tokens each request already has in the cache before this
            forward.
        query_lens: new tokens each request brings in this forward (>= 1).
        device: where the index tensors the kernels take should live
            (the cache's device).

    ``seq_lens[i] = cached_lens[i] + query_lens[i]`` tokens are attended; the
    caller must have ``step``-ed every request to at least that length.
    """

    __slots__ = ("reqids", "cached_lens", "query_lens", "seq_lens", "query_starts", "device", "_tensors",
                 "_host_plan", "_mapped_checks")

    def __init__(
        self,
        reqids: Sequence[int],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> None:
        reqids, cached_lens, query_lens = (_int_list(n, v) for n, v in
                                            (("reqids", reqids), ("cached_lens", cached_lens),
                                             ("query_lens", query_lens)))
        if not len(reqids) == len(cached_lens) == len(query_lens):
            raise ValueError(
                f"reqids, cached_lens and query_lens must have equal lengths, got "
                f"{len(reqids)}, {len(cached_lens)}, {len(query_lens)}"
            )
        if not reqids:
            raise ValueError("reqids must name at least one request")
        if min(reqids) < 0 or len(set(reqids)) != len(reqids):
            raise ValueError(f"reqids must be distinct non-negative ints, got {reqids}")
        if min(cached_lens) < 0:
            raise ValueError(f"cached_lens must be >= 0, got {cached_lens}")
        if min(query_lens) < 1:
            raise ValueError(f"query_lens must be >= 1, got {query_lens}")
        self.reqids = reqids
        self.cached_lens = cached_lens
        self.query_lens = query_lens
        self.seq_lens = [c + q for c, q in zip(cached_lens, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.query_starts = starts
        self.device = torch.device(device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._host_plan: Any = None
        self._mapped_checks: dict[tuple, list[Any]] = {}  # per (k view, v view, caller): see check_mapped

    @property
    def num_tokens(self) -> int:
        """T: new tokens in this forward, all requests together."""
        return self.query_starts[-1]

    @property
    def is_decode(self) -> bool:
        """Every request brings exactly one token."""
        return self.num_tokens == len(self.reqids)

    def tensor(self, name: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """A per-batch index tensor on ``device``, built once per batch.

        ``name`` is one of ``reqids``, ``cached_lens``, ``seq_lens``,
        ``query_starts`` (length B+1), ``token_reqids`` and ``token_positions``
        (length T: each new token's reqid and position in its request).
        """
        key = f"{name}:{dtype}"
        if key not in self._tensors:
            if name == "token_reqids":
                values = [r for r, q in zip(self.reqids, self.query_lens) for _ in range(q)]
            elif name == "token_positions":
                values = [p for c, s in zip(self.cached_lens, self.seq_lens) for p in range(c, s)]
            elif name in ("reqids", "cached_lens", "seq_lens", "query_starts"):
                values = getattr(self, name)
            else:
                raise ValueError(f"unknown batch tensor {name!r}")
            self._tensors[key] = torch.tensor(values, dtype=dtype, device=self.device)
        return self._tensors[key]

    def host_plan(self) -> Any:
        """The batch as the host kernel's plan (``vattn._cpu_attn.Plan``),
        built on first use; its work split is computed by the first layer's
        call and reused by the others."""
        if self._host_plan is None:
            self._host_plan = _cpu_attn().Plan(self.reqids, self.cached_lens, self.query_lens)
        return self._host_plan

    def check_mapped(self, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> None:
        """Raises ``ValueError`` (starting with ``what``) unless every request
        may be read: when a cache is a view of a :class:`vattn.KVCacheManager`'s
        memory, each reqid must be allocated there with at least ``seq_len``
        tokens mapped (rows past that are unmapped: a read would fault). Other
        tensors are bounded by their shape, which the kernels check.

        Checked on every call (one call into the core for the whole batch,
        a few microseconds), so a request freed between two layers is caught
        too; which manager and rows a view maps to is worked out once per view.
        """
        key = (k_cache.data_ptr(), k_cache.stride(), v_cache.data_ptr(), v_cache.stride(), what)
        checks = self._mapped_checks.get(key)
        if checks is None:
            checks = self._mapped_checks[key] = self._plan_mapped_checks(k_cache, v_cache, what)
        for check in checks:
            check()

    def _plan_mapped_checks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> list[Any]:
        checks, origins = [], []
        for cache in (k_cache, v_cache):
            manager = manager_of(cache) if cache.dim() == 4 else None  # a bad rank: the kernel's check names it
            if manager is None:
                continue
            origin, check = manager.mapped_check(cache, self.reqids, self.seq_lens, what)
            if (manager, origin) not in origins:  # V at K's place in its own buffer: the same slots and tokens
                origins.append((manager, origin))
                checks.append(check)
        return checks

    def check_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Raises unless both caches are ``[B_max, L, H, D]`` and hold every
        request (shapes only; :meth:`check_mapped` checks the memory)."""
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4:
                raise ValueError(f"{name} must be [max_batch_size, max_context_len, heads, head_dim], "
                                 f"got shape {tuple(cache.shape)}")
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
        slots, max_len = k_cache.shape[:2]
        if max(self.reqids) >= slots:
            raise ValueError(f"reqids must be in [0, {slots - 1}] for this cache, got {max(self.reqids)}")
        if max(self.seq_lens) > max_len:
            raise ValueError(f"cached_lens + query_lens must be <= {max_len} (max_context_len), "
                             f"got {max(self.seq_lens)}")

    def __repr__(self) -> str:
        return (f"AttentionBatch(reqids={self.reqids}, cached_lens={self.cached_lens}, "
                f"query_lens={self.query_lens})")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes the new tokens' K and V (``[T, H_kv, D]``) into their cache rows.

    One indexed store per tensor: row ``(reqid, cached_len + j)`` for every new
    token; nothing else of the cache is touched.
    """
    batch.check_cache(k_cache, v_cache)
    _check_new_kv(k_cache, batch, k, v)
    batch.check_mapped(k_cache, v_cache, "write_kv")
    _write_rows(k_cache, v_cache, batch, k, v)


def _write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """write_kv after its checks."""
    rows = (batch.tensor("token_reqids", torch.long), batch.tensor("token_positions", torch.long))
    k_cache.index_put_(rows, k)
    v_cache.index_put_(rows, v)


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
    views ``K[:, :, i]`` alike: any token and slot stride), accumulated in
    fp32 without copying the cache. The work (request x kv heads x query
    block x key split) runs without the GIL on torch's OpenMP threads (the
    ones its own ops use, so the two never compete for cores), or on a pool
    of its own (``VATTN_CPU_ATTN_POOL=own``, or in a forked child).

    Args:
        q: ``[T, H_q, D]`` queries, float32 / bfloat16 / float16; ``H_q`` a
            multiple of ``H_kv`` (GQA, MQA); head_dim stride 1.
        k_cache, v_cache: ``[B_max, L, H_kv, D]`` cache views of one layer
            (:meth:`vattn.KVCacheManager.layer`), any of the three dtypes.
        batch: the forward's plan.
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
        isa: ``"scalar"``, ``"avx2"``, ``"avx512"``, ``"amx"`` (AVX-512
            with AMX-BF16 tiles for prefill blocks of a bf16 cache),
            ``"neon"`` or ``"sve256"`` (SVE at a 256-bit vector length) to
            force a path (falls back to a lower supported one); None: the
            fastest this CPU supports, or the one ``VATTN_CPU_ATTN_ISA``
            names.

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
    # once per layer per step: the common case costs one test, and the arguments go in by position
    # (keywords cost the binding a string match each, about a microsecond per call in all)
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and (k is None or k.is_cpu)
            and (v is None or v.is_cpu) and (out is None or out.is_cpu)):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("out", out)):
            if t is not None and not t.is_cpu:
                raise ValueError(f"host_attention needs CPU tensors, got {name} on {t.device}")
    if out is None:
        out = torch.empty_like(q)
    batch.check_mapped(k_cache, v_cache, "host_attention")
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if return_lse else None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _cpu_attn().attention(
        batch.host_plan(), to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out),
        None if k is None else to_dlpack(k), None if v is None else to_dlpack(v),
        None if lse is None else to_dlpack(lse), scale, logits_soft_cap or 0.0, sliding_window or 0, isa)
    return (out, lse) if return_lse else out


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
    """The attention an engine calls on the cache: :func:`host_attention` for
    CPU tensors, :func:`sdpa_attention` for CUDA ones (which has no sliding
    window or soft-cap). Shapes as :func:`host_attention`."""
    if q.device.type == "cpu":
        return host_attention(q, k_cache, v_cache, batch, k=k, v=v, softmax_scale=softmax_scale,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if sliding_window or logits_soft_cap:
        raise ValueError("sliding_window and logits_soft_cap need the host kernel (CPU tensors); "
                         f"got tensors on {q.device}")
    return sdpa_attention(q, k_cache, v_cache, batch, k=k, v=v, softmax_scale=softmax_scale)


def host_attention_info() -> dict[str, Any]:
    """The host kernel's build and CPU: ``isa`` (the path calls take),
    ``supported``, ``compiled``, ``threads`` (pool size), ``calls`` (calls
    completed in this process, per ISA) and ``note`` (why
    ``VATTN_CPU_ATTN_ISA`` was not honoured, if it was not)."""
    return dict(_cpu_attn().info())


def sdpa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """torch ``scaled_dot_product_attention`` on the cache, CPU or GPU.

    Args:
        q: ``[T, H_q, D]`` queries; ``H_q`` a multiple of ``H_kv`` (GQA).
        k_cache, v_cache: ``[B_max, L, H_kv, D]`` cache views of one layer.
        batch: the forward's plan.
        k, v: ``[T, H_kv, D]`` new tokens, written into the cache first; None
            when the caller has written them already.
        softmax_scale: defaults to ``1/sqrt(D)``.

    Returns:
        ``[T, H_q, D]`` in ``q``'s dtype.

    Each request is one SDPA call on ``k_cache[r, :seq_len]`` (a view), so no
    request is padded to the longest one.
    """
    _check_inputs(q, k_cache, v_cache, batch, k, v, "sdpa_attention")
    if k is not None or v is not None:
        _write_rows(k_cache, v_cache, batch, k, v)
    out = torch.empty_like(q)
    starts = batch.query_starts
    for i, (reqid, seq_len) in enumerate(zip(batch.reqids, batch.seq_lens)):
        # k_cache[reqid, :seq_len] is a view of the mapped rows: nothing is copied
        out[starts[i]:starts[i + 1]] = sdpa_dense(q[starts[i]:starts[i + 1]], k_cache[reqid, :seq_len],
                                                  v_cache[reqid, :seq_len], softmax_scale)
    return out


def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """SDPA of one request: ``q`` ``[q_len, H_q, D]`` over ``k``/``v``
    ``[seq_len, H_kv, D]`` (any strides), causal with the queries at the last
    ``q_len`` positions. Returns ``[q_len, H_q, D]``."""
    q_len, seq_len = q.shape[0], k.shape[0]
    mask = None
    if 1 < q_len < seq_len:  # causal, aligned to the end of the request
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
    # 4-D [1, H, tokens, D]: torch's CPU flash kernel takes only batched
    # inputs (3-D ones fall back to the math path, ~20x slower for decode).
    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    upcast = _cpu_half_is_slow(q)
    if upcast:  # copies only this request's rows
        heads_first = [t.float() for t in heads_first]
    out = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, is_causal=1 < q_len == seq_len,
                                         scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(q.dtype) if upcast else out[0].transpose(0, 1)


def _cpu_half_is_slow(q: torch.Tensor) -> bool:
    """torch's CPU SDPA in fp16 / bf16 ran 2-6x slower for decode than
    converting the request's rows to fp32 first (torch 2.13 on an AVX-512 CPU,
    AVX512-BF16 present); fp32 is what the half kernel accumulates in anyway."""
    return q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16)


def flash_attn_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """FlashAttention-2 ``flash_attn_with_kvcache`` on the whole cache.

    ``cache_batch_idx`` selects the reqids and ``cache_seqlens`` their lengths,
    so the kernel reads each request's rows in place; new ``k``/``v`` are
    appended in place by the kernel. Requests with equal ``query_lens`` share
    one call (a decode batch is one call). Shapes as :func:`sdpa_attention`;
    CUDA tensors, fp16/bf16, ``head_dim`` a multiple of 8 (otherwise
    FlashAttention pads, i.e. copies, the whole cache).
    """
    flash_attn = _import("flash_attn", "FlashAttention-2 (pip install flash-attn)")
    _require_cuda(q, k_cache, "flash_attn_attention")
    _check_inputs(q, k_cache, v_cache, batch, k, v, "flash_attn_attention")
    if k_cache.shape[-1] % 8:
        raise ValueError(f"flash_attn_attention needs head_dim % 8 == 0, got {k_cache.shape[-1]}")
    appending = k is not None
    lens = batch.tensor("cached_lens" if appending else "seq_lens")
    reqids = batch.tensor("reqids")
    out = torch.empty_like(q)
    for q_len, members in _group_by_query_len(batch).items():
        idx = torch.tensor(members, dtype=torch.long, device=q.device)
        rows = _token_rows(batch, members, q.device)

        def grouped(t: torch.Tensor | None) -> torch.Tensor | None:  # [G * q_len, ...] -> [G, q_len, ...]
            return None if t is None else t[rows].view(len(members), q_len, *t.shape[1:])

        o = flash_attn.flash_attn_with_kvcache(
            grouped(q), k_cache, v_cache, k=grouped(k), v=grouped(v),
            cache_seqlens=lens[idx], cache_batch_idx=reqids[idx],
            softmax_scale=softmax_scale, causal=True,
        )
        out[rows] = o.reshape(-1, *q.shape[1:])
    return out


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
    flashinfer = _import("flashinfer", "FlashInfer (pip install flashinfer-python)")
    _require_cuda(q, k_cache, "flashinfer_single_prefill")
    _check_inputs(q, k_cache, v_cache, batch, k, v, "flashinfer_single_prefill")
    if k is not None or v is not None:
        _write_rows(k_cache, v_cache, batch, k, v)
    out = torch.empty_like(q)
    starts = batch.query_starts
    for i, (reqid, seq_len) in enumerate(zip(batch.reqids, batch.seq_lens)):
        out[starts[i]:starts[i + 1]] = flashinfer.single_prefill_with_kv_cache(
            q[starts[i]:starts[i + 1]], k_cache[reqid, :seq_len], v_cache[reqid, :seq_len],
            causal=True, kv_layout="NHD", sm_scale=softmax_scale,
        )
    return out


class FlashInferAttention:
    """FlashInfer's batched paged kernels, run on the vattn cache as-is.

    The cache ``[B_max, L, H_kv, D]`` is presented as a paged cache with
    ``page_size = L``: one "page" per request, page index = reqid, last page
    length = the request's length. So the kernel reads ``k_cache[r, :seq_len]``
    and nothing else. :meth:`plan` once per forward, :meth:`run` per layer.

    Example::

        fi = FlashInferAttention(device="cuda")
        fi.plan(batch, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                max_context_len=L, q_dtype=torch.bfloat16)
        for i in range(num_layers):
            out = fi.run(q[i], *kv.layer(i), k=k_new[i], v=v_new[i])
    """

    def __init__(self, device: str | torch.device = "cuda", workspace_bytes: int = 128 << 20) -> None:
        self._flashinfer = _import("flashinfer", "FlashInfer (pip install flashinfer-python)")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise BackendUnavailable(f"FlashInferAttention needs a CUDA device, got {self.device}")
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[str, Any] = {}
        self._batch: AttentionBatch | None = None
        self._wrapper: Any = None

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
    ) -> None:
        """Plans the batched decode (every ``query_len`` 1) or prefill kernel."""
        if max(batch.seq_lens) > max_context_len:
            raise ValueError(f"seq_lens must be <= max_context_len ({max_context_len}), got {max(batch.seq_lens)}")
        n = len(batch.reqids)
        page_indptr = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        pages = (page_indptr, batch.tensor("reqids"), batch.tensor("seq_lens"))
        kind = "decode" if batch.is_decode else "prefill"
        wrapper = self._wrappers.get(kind)
        if wrapper is None:
            cls = (self._flashinfer.BatchDecodeWithPagedKVCacheWrapper if kind == "decode"
                   else self._flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            wrapper = self._wrappers[kind] = cls(self._workspace, "NHD")
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype or q_dtype, sm_scale=softmax_scale)
        if kind == "decode":
            wrapper.plan(*pages, num_qo_heads, num_kv_heads, head_dim, max_context_len, **common)
        else:
            wrapper.plan(batch.tensor("query_starts"), *pages, num_qo_heads, num_kv_heads, head_dim,
                         max_context_len, causal=True, **common)
        self._batch, self._wrapper = batch, wrapper

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` (``[T, H_q, D]``) over one layer's cache; writes
        ``k``/``v`` (``[T, H_kv, D]``) first when given. Returns ``[T, H_q, D]``."""
        if self._batch is None:
            raise RuntimeError("FlashInferAttention.run called before plan()")
        batch = self._batch
        _check_inputs(q, k_cache, v_cache, batch, k, v, "FlashInferAttention.run")
        if k is not None or v is not None:
            _write_rows(k_cache, v_cache, batch, k, v)
        return self._wrapper.run(q, (k_cache, v_cache))


# ---- helpers ---------------------------------------------------------------------


_cpu_attn_module: Any = None


def _cpu_attn() -> Any:
    """The host kernel extension, imported on first use."""
    global _cpu_attn_module
    if _cpu_attn_module is None:
        from . import _cpu_attn as module

        _cpu_attn_module = module
    return _cpu_attn_module


def _int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = list(values)
    for x in out:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__}")
    return out


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                  k: torch.Tensor | None, v: torch.Tensor | None, what: str) -> None:
    """Shapes of the caches, the queries and the new K/V (when either is
    given), then the mapping of every request's rows."""
    batch.check_cache(k_cache, v_cache)
    _check_query(q, k_cache, batch)
    if k is not None or v is not None:
        _check_new_kv(k_cache, batch, k, v)
    batch.check_mapped(k_cache, v_cache, what)


def _check_query(q: torch.Tensor, k_cache: torch.Tensor, batch: AttentionBatch) -> None:
    heads_kv, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[0] != batch.num_tokens or q.shape[2] != head_dim:
        raise ValueError(f"q must be [{batch.num_tokens}, num_qo_heads, {head_dim}] "
                         f"(tokens, heads, head_dim), got {tuple(q.shape)}")
    if q.shape[1] % heads_kv:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the cache's KV heads ({heads_kv})")


def _check_new_kv(k_cache: torch.Tensor, batch: AttentionBatch, k: torch.Tensor | None,
                  v: torch.Tensor | None) -> None:
    want = (batch.num_tokens, *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        if t is None or tuple(t.shape) != want:
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"{name} must be {list(want)} (new tokens, kv heads, head_dim), got {got}")


def _require_cuda(q: torch.Tensor, k_cache: torch.Tensor, what: str) -> None:
    if q.device.type != "cuda" or k_cache.device.type != "cuda":
        raise BackendUnavailable(f"{what} needs CUDA tensors, got q on {q.device} and the cache on {k_cache.device}")


def _import(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailable(f"{what} is not installed: {e}") from e


def _group_by_query_len(batch: AttentionBatch) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, q_len in enumerate(batch.query_lens):
        groups.setdefault(q_len, []).append(i)
    return groups


def _token_rows(batch: AttentionBatch, members: list[int], device: torch.device) -> torch.Tensor:
    """Rows of the packed token tensors that belong to requests ``members``."""
    starts = batch.query_starts
    rows = [t for i in members for t in range(starts[i], starts[i + 1])]
    return torch.tensor(rows, dtype=torch.long, device=device)
