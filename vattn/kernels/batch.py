"""One forward's requests (:class:`AttentionBatch`) and the checks and K/V
writes every kernel shares.

Token-packed ("varlen") tensors: ``q`` is ``[T, H_q, D]`` and ``k``/``v`` (the
new tokens) ``[T, H_kv, D]`` where ``T = sum(query_lens)``, request ``i``'s
tokens at rows ``[query_starts[i], query_starts[i+1])``. The caches are one
layer's ``[B_max, L, H_kv, D]`` views (:meth:`vattn.KVCacheManager.layer`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vattn.core.manager import KVCacheManager
from vattn.core.mapped_check import ViewsCheck

if TYPE_CHECKING:
    from .protocol import AttentionCase, Kernel, KernelPlan


class AttentionBatch:
    """One forward's requests: which reqids, how long, how many new tokens.

    Built once per iteration (it validates and precomputes the index tensors)
    and passed to every layer's attention call. What a kernel prepares from
    it is that kernel's plan (:meth:`vattn.kernels.Kernel.plan`); the batch
    keeps the plans made for it (:meth:`plan`), so a caller that hands every
    layer the batch plans it once per kernel and lives as long as the batch.

    Args:
        reqids: cache rows (vattn reqids) of the requests in this forward, in
            the order their tokens appear in ``q``; distinct.
        cached_lens: tokens each request already has in the cache before this
            forward.
        query_lens: new tokens each request brings in this forward (>= 1).
        device: where the index tensors the kernels take should live
            (the cache's device).
        cache: the :class:`vattn.KVCacheManager` whose views the batch's
            kernels read, when the caller knows it: the plans then carry a
            mapping check built for it once (:meth:`KVCacheManager.mapped_check`).
            None: the first cache views handed in are looked up by address.
        first_reqid: the manager's reqid of the views' row 0, when the
            kernels read views sliced along the reqids (``reqids`` index
            those views); 0 for :meth:`KVCacheManager.layer`'s.

    ``seq_lens[i] = cached_lens[i] + query_lens[i]`` tokens are attended; the
    caller must have ``step``-ed every request to at least that length.
    """

    __slots__ = ("reqids", "cached_lens", "query_lens", "seq_lens", "query_starts", "device", "max_reqid",
                 "max_seq_len", "mapped", "_tensors", "_plans", "__weakref__")

    def __init__(
        self,
        reqids: Sequence[int],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        device: str | torch.device = "cpu",
        *,
        cache: KVCacheManager | None = None,
        first_reqid: int = 0,
    ) -> None:
        reqids, cached_lens, query_lens = (int_list(n, v) for n, v in
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
        seq_lens = [c + q for c, q in zip(cached_lens, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self._fill(reqids, cached_lens, query_lens, seq_lens, starts, device, cache, first_reqid)

    @classmethod
    def of_arrays(cls, reqids: np.ndarray, cached_lens: np.ndarray, query_lens: np.ndarray,
                  device: str | torch.device = "cpu", *, cache: KVCacheManager | None = None,
                  first_reqid: int = 0) -> AttentionBatch:
        """The batch of a framework's per-forward integer arrays (numpy,
        ``[n]`` each), checked by array operations rather than per request
        in Python: the integrations' path, once per forward. Same checks
        and errors as the constructor."""
        reqids = np.array(reqids, dtype=np.int64)  # a copy: an unbound check reads it at the first layer
        cached_lens, query_lens = np.asarray(cached_lens, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
        ids, cached, query = reqids.tolist(), cached_lens.tolist(), query_lens.tolist()
        n = len(ids)
        if not (0 < n == len(cached) == len(query) and min(ids) >= 0 and min(cached) >= 0 and min(query) >= 1
                and len(set(ids)) == n):
            return cls(ids, cached, query, device)  # raises, naming the argument
        batch = cls.__new__(cls)
        seq_lens = cached_lens + query_lens
        batch._fill(ids, cached, query, seq_lens.tolist(), [0, *itertools.accumulate(query)], device, cache,
                    first_reqid, (reqids, seq_lens))
        return batch

    def _fill(self, reqids: list[int], cached_lens: list[int], query_lens: list[int], seq_lens: list[int],
              query_starts: list[int], device: str | torch.device, cache: KVCacheManager | None,
              first_reqid: int, arrays: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """``arrays``: ``reqids`` and ``seq_lens`` as int64 arrays too, which the mapping check takes as they are."""
        self.reqids = reqids
        self.cached_lens = cached_lens
        self.query_lens = query_lens
        self.seq_lens = seq_lens
        self.query_starts = query_starts
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        if cache is not None and not isinstance(cache, KVCacheManager):
            raise TypeError(f"cache must be a vattn.KVCacheManager or None, got {type(cache).__name__}")
        self.max_reqid, self.max_seq_len = max(reqids), max(seq_lens)  # what every layer's shapes are checked against
        # the rows' mapping check, which every plan of the batch carries
        rows, lens = arrays if arrays is not None else (reqids, seq_lens)
        self.mapped: ViewsCheck = (ViewsCheck(rows, lens, "attention", cached_lens=cached_lens) if cache is None
                                   else cache.mapped_check(rows, lens, "attention", first_reqid, cached_lens))
        self._tensors: dict[str, torch.Tensor] = {}
        self._plans: dict[Any, Any] = {}  # per (kernel, case key): see plan

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
        ``query_starts`` and ``key_starts`` (length B+1: running sums of
        ``query_lens`` and of ``seq_lens``), ``token_reqids`` and
        ``token_positions`` (length T: each new token's reqid and position in
        its request).
        """
        return self.tensors((name,), dtype)[0]

    def tensors(self, names: Sequence[str], dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
        """Several of :meth:`tensor`'s tensors; those not built yet are built
        in one copy to the device (views of one tensor)."""
        keys = [f"{name}:{dtype}" for name in names]
        missing = [(key, self._values(name)) for key, name in zip(keys, names) if key not in self._tensors]
        if missing:
            packed = index_tensor([x for _, values in missing for x in values], dtype, self.device)
            at = 0
            for key, values in missing:
                self._tensors[key] = packed[at:at + len(values)]
                at += len(values)
        return [self._tensors[key] for key in keys]

    def _values(self, name: str) -> list[int]:
        if name == "token_reqids":
            return [r for r, q in zip(self.reqids, self.query_lens) for _ in range(q)]
        if name == "token_positions":
            return [p for c, s in zip(self.cached_lens, self.seq_lens) for p in range(c, s)]
        if name == "key_starts":
            starts = [0]
            for n in self.seq_lens:
                starts.append(starts[-1] + n)
            return starts
        if name in ("reqids", "cached_lens", "seq_lens", "query_starts"):
            return getattr(self, name)
        raise ValueError(f"unknown batch tensor {name!r}")

    def plan(self, kernel: Kernel, case: AttentionCase | None = None) -> KernelPlan:
        """``kernel.plan(self, case)``, made once per kernel (and per case,
        for kernels whose plan depends on it: ``plans_per_case``) and kept
        with the batch: callers that hand every layer the batch (the
        :mod:`vattn.attention` functions) plan it once."""
        key = (kernel, case) if kernel.plans_per_case else kernel
        plan = self._plans.get(key)
        if plan is None:  # two threads may both plan: each gets a valid plan, one is kept
            plan = kernel.plan(self, case)
            plan.batch = weakref.proxy(self)  # kept by the batch: the plan must not keep the batch alive
            self._plans[key] = plan
        return plan

    def check_mapped(self, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str,
                     sliding_window: int | None = None) -> None:
        """Raises ``ValueError`` (starting with ``what``) unless every request
        may be read: when a cache is a view of a :class:`vattn.KVCacheManager`'s
        memory, each reqid must be allocated there with at least ``seq_len``
        tokens mapped (rows past that are unmapped: a read would fault), and
        no hole (:meth:`vattn.KVCacheManager.unmap_pages_below`) among the rows
        read: all from row 0, or with ``sliding_window`` (tokens) those from
        ``cached_len - sliding_window + 1`` on. Other tensors are bounded by
        their shape, which the kernels check.

        Checked on every call, so a request freed between two layers is caught
        too; the core is asked again only when a slice lost pages or a reqid
        was freed since the last check passed (:attr:`mapped`, the check every
        plan of the batch carries).
        """
        self.mapped(k_cache, v_cache, what, sliding_window)

    def check_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Raises unless both caches are ``[B_max, L, H, D]`` and hold every
        request (shapes only; :meth:`check_mapped` checks the memory)."""
        check_cache_shapes(k_cache, v_cache)
        num_reqids, max_len = k_cache.shape[:2]
        if self.max_reqid >= num_reqids:
            raise ValueError(f"reqids must be in [0, {num_reqids - 1}] for this cache, got {self.max_reqid}")
        if self.max_seq_len > max_len:
            raise ValueError(f"cached_lens + query_lens must be <= {max_len} (max_context_len), "
                             f"got {self.max_seq_len}")

    def __repr__(self) -> str:
        return (f"AttentionBatch(reqids={self.reqids}, cached_lens={self.cached_lens}, "
                f"query_lens={self.query_lens})")


def index_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor of ``dtype`` on ``device``, without waiting
    for the device: off the CPU the values are written into page-locked host
    memory and copied by :func:`to_device` (a pageable source would make the
    copy wait for the work queued before it, once per forward)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return to_device(pinned_host(values, dtype), device)


def pinned_host(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``values`` in page-locked host memory (torch's caching host allocator:
    a block is reused only once the copies that read it have run)."""
    host = torch.empty(len(values), dtype=dtype, pin_memory=True)
    host.copy_(torch.tensor(values, dtype=dtype))
    return host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host-to-device copy of every per-forward index tensor the
    forward path builds: from page-locked ``host`` memory, queued on the
    current stream without blocking the host."""
    return host.to(device, non_blocking=True)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes the new tokens' K and V (``[T, H_kv, D]``) into their cache rows.

    One indexed store per tensor: row ``(reqid, cached_len + j)`` for every new
    token; nothing else of the cache is touched.
    """
    batch.check_cache(k_cache, v_cache)
    check_new_kv(k_cache, batch.num_tokens, k, v)
    batch.check_mapped(k_cache, v_cache, "write_kv", sliding_window=1)  # it writes rows [cached_len, seq_len) only
    write_rows(k_cache, v_cache, batch, k, v)


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """:func:`write_kv` after its checks."""
    rows = tuple(token_rows(batch))
    k_cache.index_put_(rows, k)
    v_cache.index_put_(rows, v)


def token_rows(batch: AttentionBatch) -> list[torch.Tensor]:
    """Each new token's (reqid, position) as two int64 tensors on the batch's
    device, built once per batch in one copy: where :func:`write_rows`
    stores. A kernel's plan asks for them, so that no layer builds them."""
    return batch.tensors(("token_reqids", "token_positions"), torch.long)


def check_cache_shapes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raises unless both caches are ``[B_max, L, H, D]`` of one shape."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name} must be [max_batch_size, max_context_len, heads, head_dim], "
                             f"got shape {tuple(cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")


def check_query(q: torch.Tensor, k_cache: torch.Tensor, num_tokens: int, cache_dtype: bool = True) -> None:
    """Raises unless ``q`` is ``[num_tokens, H_q, D]`` with ``H_q`` a multiple of the cache's heads, and with
    ``cache_dtype`` of the cache's dtype (``TypeError``: the libraries such kernels call take one dtype)."""
    if cache_dtype:
        check_cache_dtype("q", q, k_cache)
    heads_kv, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[0] != num_tokens or q.shape[2] != head_dim:
        raise ValueError(f"q must be [{num_tokens}, num_qo_heads, {head_dim}] "
                         f"(tokens, heads, head_dim), got {tuple(q.shape)}")
    if q.shape[1] % heads_kv:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the cache's KV heads ({heads_kv})")


def check_new_kv(k_cache: torch.Tensor, num_tokens: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
    """Raises unless ``k`` and ``v`` are ``[num_tokens, H_kv, D]`` of the cache's dtype (``TypeError``)."""
    want = (num_tokens, *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        if t is None or tuple(t.shape) != want:
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"{name} must be {list(want)} (new tokens, kv heads, head_dim), got {got}")
        check_cache_dtype(name, t, k_cache)


def check_cache_dtype(name: str, t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """``TypeError`` naming ``name`` unless ``t`` has the cache's dtype."""
    if t.dtype != k_cache.dtype:
        want, got = (str(d).removeprefix("torch.") for d in (k_cache.dtype, t.dtype))
        raise TypeError(f"{name} must have the cache's dtype ({want}), got {got}")


def int_list(name: str, values: Sequence[int] | torch.Tensor) -> list[int]:
    """``values`` as a list of ints (``TypeError`` naming ``name`` otherwise)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = list(values)
    for x in out:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__}")
    return out
