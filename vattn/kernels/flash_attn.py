"""FlashAttention-2's ``flash_attn_with_kvcache`` on the whole cache.

``cache_batch_idx`` selects the reqids and ``cache_seqlens`` their lengths,
so the kernel reads each request's rows in place; new ``k``/``v`` are
appended in place by the kernel. Requests with equal ``query_lens`` share one
call (a decode batch is one call). The index tensors of every call are built
by the plan, once per forward and in one copy to the device (two when some
group's token rows must be gathered). A group whose requests are adjacent in
the batch (a batch of one query length, every decode batch, or a mixed batch
ordered by query length) takes its token rows as a slice of ``q``, ``k`` and
``v``, with no gather.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .batch import AttentionBatch, check_inputs
from .protocol import AttentionCase, Kernel, KernelPlan, Support, load_module


class _Group(NamedTuple):
    """Requests of one query length: one kernel call."""

    count: int  # requests
    query_len: int  # tokens each
    rows: slice | torch.Tensor  # their token rows: a slice when adjacent, else an int64 index (a gather)
    reqids: torch.Tensor  # int32, cache_batch_idx
    cached_lens: torch.Tensor  # int32, cache_seqlens when the kernel appends k / v
    seq_lens: torch.Tensor  # int32, cache_seqlens when k / v are in the cache already


class FlashAttentionPlan(KernelPlan):
    """The batch's calls: requests grouped by query length, each group's
    index tensors on the batch's device."""

    __slots__ = ("groups",)

    def __init__(self, batch: AttentionBatch) -> None:
        super().__init__(batch)
        members: dict[int, list[int]] = {}
        for i, q_len in enumerate(batch.query_lens):
            members.setdefault(q_len, []).append(i)
        ints: list[int] = []  # per group: reqids, cached_lens, seq_lens
        rows: list[int] = []  # token rows of the groups whose requests are not adjacent
        starts = batch.query_starts
        adjacent = {q_len: idx[-1] - idx[0] == len(idx) - 1 for q_len, idx in members.items()}
        for q_len, idx in members.items():
            for values in (batch.reqids, batch.cached_lens, batch.seq_lens):
                ints.extend(values[i] for i in idx)
            if not adjacent[q_len]:
                rows.extend(t for i in idx for t in range(starts[i], starts[i + 1]))
        packed = torch.tensor(ints, dtype=torch.int32, device=batch.device)
        packed_rows = torch.tensor(rows, dtype=torch.long, device=batch.device) if rows else None
        self.groups: list[_Group] = []
        at = row_at = 0
        for q_len, idx in members.items():
            n = len(idx)
            if adjacent[q_len]:
                group_rows: slice | torch.Tensor = slice(starts[idx[0]], starts[idx[-1] + 1])
            else:
                assert packed_rows is not None
                group_rows = packed_rows[row_at:row_at + n * q_len]
                row_at += n * q_len
            self.groups.append(_Group(n, q_len, group_rows, packed[at:at + n], packed[at + n:at + 2 * n],
                                      packed[at + 2 * n:at + 3 * n]))
            at += 3 * n


class FlashAttentionKernel(Kernel):
    """FlashAttention-2 (see the module docstring). Without the head_dim
    multiple FlashAttention pads, i.e. copies, the whole cache."""

    name = "FlashAttention-2"
    key = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_dim_max = 256
    head_dim_multiple = 8
    batched = True

    def __init__(self, module_name: str = "flash_attn",
                 install_hint: str = "FlashAttention-2 (pip install flash-attn)") -> None:
        """``module_name``: the module whose ``flash_attn_with_kvcache`` runs
        (the flash-attn package, or a module with that function's signature
        over another build, such as vLLM's); ``install_hint`` names it when
        it does not load."""
        super().__init__()
        self.module_name = module_name
        self.install_hint = install_hint

    def module(self) -> Any:
        """The module that provides ``flash_attn_with_kvcache``."""
        return load_module(self.module_name, self.install_hint)

    def available(self) -> Support:
        try:
            self.module()
        except Exception as e:  # noqa: BLE001 - BackendUnavailable, or a broken build's own error
            return Support(False, str(e))
        return Support(True)

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> FlashAttentionPlan:
        return FlashAttentionPlan(batch)

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        flash_attn = self.module()
        self.require_device("flash_attn_attention", q=q, k_cache=k_cache)
        self.check_options(sliding_window, logits_soft_cap)
        if not isinstance(plan, FlashAttentionPlan):
            raise TypeError(f"plan must be FlashAttentionKernel.plan's, got {type(plan).__name__}")
        check_inputs(q, k_cache, v_cache, plan.batch, k, v, "flash_attn_attention")
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"flash_attn_attention needs head_dim % {self.head_dim_multiple} == 0, "
                             f"got {k_cache.shape[-1]}")
        appending = k is not None
        if out is None:
            out = torch.empty_like(q)
        for g in plan.groups:

            def grouped(t: torch.Tensor | None) -> torch.Tensor | None:  # [G * q_len, ...] -> [G, q_len, ...]
                if t is None:
                    return None
                return t[g.rows].reshape(g.count, g.query_len, *t.shape[1:])

            o = flash_attn.flash_attn_with_kvcache(
                grouped(q), k_cache, v_cache, k=grouped(k), v=grouped(v),
                cache_seqlens=g.cached_lens if appending else g.seq_lens, cache_batch_idx=g.reqids,
                softmax_scale=softmax_scale, causal=True,
            )
            out[g.rows] = o.reshape(-1, *q.shape[1:])
        return out
