"""FlashAttention on the whole cache: one varlen call per layer for the whole batch.

FlashAttention's ``flash_attn_varlen_func`` takes a batch of requests of any
query lengths (``cu_seqlens_q``) over a paged K/V cache (``block_table``).
Over the vattn cache it needs no block table of vattn's own: each request's
slice is one page of the paged cache (the cache's ``[B_max, L, H, D]`` view
with its slice stride as the page stride), so the block table is the batch's
reqids as a column, and a request's keys are its first ``seq_len`` rows.
Prefill chunks and decodes of any lengths share the one call. The step's new
K/V are written first with one indexed store per tensor, at the rows the plan
names. Every index tensor is built by the plan, once per forward, in one copy
to the device.

For CUDA graphs a plan can instead be written into persistent buffers
(:class:`FlashAttentionBuffers`, :meth:`FlashAttentionKernel.plan_into`): a
captured forward reads its index tensors at the addresses it saw at capture,
so every later forward's plan goes to the same addresses, padded to the
captured batch's rows and tokens. Padded rows read no key; padded tokens
write their K/V into a padding slice that no request reads.

Two builds serve this call: the flash-attn package (FlashAttention-2, whose
paged pages must be multiples of 256 tokens, so a slice must be too), and
vLLM's bundled build (pages of 16-token multiples, and FlashAttention-3 on
Hopper; :mod:`vattn.integrations.vllm.flash_attn`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from .batch import AttentionBatch, token_rows
from .protocol import AttentionCase, Kernel, KernelPlan, Support, check_layer, load_module


class FlashAttentionPlan(KernelPlan):
    """The batch as one varlen call: its index tensors on the batch's device,
    and where each new token's K/V go."""

    __slots__ = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "max_seqlen_q", "max_seqlen_k",
                 "token_reqids", "token_positions", "num_tokens", "num_splits", "padding_reqid")

    def __init__(self, batch: AttentionBatch) -> None:
        super().__init__(batch)
        starts, key_starts, seq_lens, reqids = batch.tensors(("query_starts", "key_starts", "seq_lens", "reqids"))
        self.cu_seqlens_q = starts  # [n + 1] int32: request i's queries are rows starts[i]:starts[i + 1]
        self.cu_seqlens_k = key_starts  # [n + 1] int32: the same for its keys (builds that take lengths so)
        self.seqused_k = seq_lens  # [n] int32: keys of request i (rows 0 .. seq_len - 1 of its slice)
        self.block_table = reqids[:, None]  # [n, 1] int32: request i's one page is its slice
        self.max_seqlen_q = max(batch.query_lens)
        self.max_seqlen_k = max(batch.seq_lens)
        # [T] int64 each: new token t goes to row token_positions[t] of slice token_reqids[t]
        self.token_reqids, self.token_positions = token_rows(batch)
        self.num_tokens = batch.num_tokens  # T: rows of q, k, v and out
        self.num_splits = 0  # the build's own choice (vLLM's build takes an upper bound for CUDA graphs)
        self.padding_reqid: int | None = None  # the slice padded tokens write into (plan_into's plans)


class FlashAttentionBuffers:
    """Index tensors at device addresses that never change, for plans a CUDA
    graph captures (:meth:`FlashAttentionKernel.plan_into`).

    One device buffer holds the block-table column (``[max_rows]`` int32),
    the keys' running sums (``[max_rows + 1]`` int32) and each new token's
    (reqid, position) (``[max_tokens, 2]`` int64); a host buffer of the same
    layout (pinned on CUDA, so that the copy is asynchronous) is filled each
    forward and copied over in one copy on the current stream, which orders
    it after the work queued before (an earlier replay still reading the
    buffer) and before the forward that reads it. The caller must not refill
    the host buffer before that copy has run (vLLM: its input-preparation
    event, or the synchronous step's wait for sampled tokens).
    """

    def __init__(self, max_rows: int, max_tokens: int, device: str | torch.device) -> None:
        if max_rows < 1 or max_tokens < 1:
            raise ValueError(f"max_rows and max_tokens must be >= 1, got {max_rows}, {max_tokens}")
        self.device = torch.device(device)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        int32_bytes = (2 * max_rows + 1) * 4
        self._rows_at = -(-int32_bytes // 8) * 8  # the int64 token rows start 8-byte aligned
        nbytes = self._rows_at + 16 * max_tokens
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._device = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        # block table, cu_seqlens_k, token rows: numpy views of the host buffer, tensors of the device one
        self._host_views = tuple(t.numpy() for t in self._views(self._host))
        self.block_table, self.cu_seqlens_k, self.token_rows = self._views(self._device)

    def _views(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ints = raw[:(2 * self.max_rows + 1) * 4].view(torch.int32)
        return ints[:self.max_rows], ints[self.max_rows:], raw[self._rows_at:].view(torch.int64).view(-1, 2)

    def fill(self, batch: AttentionBatch | None, num_rows: int, num_tokens: int, padding_reqid: int) -> None:
        """Writes ``batch`` (rows ``0 .. n-1``, tokens ``0 .. T-1``; None: no
        request) padded to ``num_rows`` rows and ``num_tokens`` tokens, and
        copies it to the device. A padded row's one page is ``padding_reqid``'s
        slice and it has no key; a padded token's K/V go to row 0 of that
        slice."""
        n = len(batch.reqids) if batch is not None else 0
        t = batch.num_tokens if batch is not None else 0
        if not n <= num_rows <= self.max_rows or not t <= num_tokens <= self.max_tokens:
            raise ValueError(f"a plan of {n} requests and {t} tokens padded to {num_rows} rows and {num_tokens} "
                             f"tokens does not fit buffers of {self.max_rows} rows and {self.max_tokens} tokens")
        table, key_starts, rows = self._host_views
        key_starts[0] = 0
        if batch is not None:
            reqids = np.asarray(batch.reqids, dtype=np.int64)
            query_lens = np.asarray(batch.query_lens, dtype=np.int64)
            table[:n] = reqids
            np.cumsum(batch.seq_lens, out=key_starts[1:n + 1])
            rows[:t, 0] = np.repeat(reqids, query_lens)
            # position of token j of request i: cached_lens[i] + j
            first = np.asarray(batch.cached_lens, dtype=np.int64) - np.asarray(batch.query_starts[:-1], dtype=np.int64)
            rows[:t, 1] = np.arange(t) + np.repeat(first, query_lens)
        table[n:num_rows] = padding_reqid
        key_starts[n + 1:num_rows + 1] = key_starts[n]
        rows[t:num_tokens] = (padding_reqid, 0)
        used = self._rows_at + 16 * num_tokens
        self._device[:used].copy_(self._host[:used], non_blocking=True)


class FlashAttentionKernel(Kernel):
    """FlashAttention (see the module docstring); by default the flash-attn
    package's FlashAttention-2. Without the head_dim multiple FlashAttention
    pads, i.e. copies, the whole cache."""

    name = "FlashAttention-2"
    key = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    head_dim_max = 256
    head_dim_multiple = 8
    batched = True
    graphs = True
    page_tokens_multiple: ClassVar[int] = 256  # the build's paged pages: multiples of this many tokens

    def __init__(self, module_name: str = "flash_attn",
                 install_hint: str = "FlashAttention-2 (pip install flash-attn)") -> None:
        """``module_name``: the module whose ``flash_attn_varlen_func`` runs;
        ``install_hint`` names it when it does not load."""
        self.module_name = module_name
        self.install_hint = install_hint

    def module(self) -> Any:
        """The module that provides ``flash_attn_varlen_func``."""
        return load_module(self.module_name, self.install_hint)

    def available(self) -> Support:
        try:
            self.module()
        except Exception as e:  # noqa: BLE001 - BackendUnavailable, or a broken build's own error
            return Support(False, str(e))
        return Support(True)

    def supports(self, case: AttentionCase) -> Support:
        support = super().supports(case)
        if support and case.slice_stride is not None and case.row_stride:
            try:
                self.slice_tokens(case.slice_stride, case.row_stride)
            except ValueError as e:
                return Support(False, str(e))
        return support

    def slice_tokens(self, slice_stride: int, row_stride: int) -> int:
        """Tokens from one slice's first row to the next slice's (elements
        ``slice_stride`` apart, rows ``row_stride``): the page of the paged
        view. ValueError unless a whole number of rows and of the build's
        page multiple."""
        if slice_stride % row_stride or (slice_stride // row_stride) % self.page_tokens_multiple:
            raise ValueError(f"{self.name} reads each slice as one page, which must be a multiple of "
                             f"{self.page_tokens_multiple} tokens; this cache's slices are "
                             f"{slice_stride / row_stride:g} tokens apart (choose a max_context_len, or vLLM "
                             f"block size, that makes them so)")
        return slice_stride // row_stride

    def plan(self, batch: AttentionBatch, case: AttentionCase | None = None) -> FlashAttentionPlan:
        return FlashAttentionPlan(batch)  # the new rows' indices too: no layer builds any

    def plan_into(self, buffers: FlashAttentionBuffers, batch: AttentionBatch | None, *, num_rows: int,
                  num_tokens: int, padding_reqid: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, num_splits: int = 0) -> FlashAttentionPlan:
        """A plan whose tensors lie at the same addresses every forward (CUDA graphs).

        Args:
            buffers: this plan's persistent buffers (the previous plan's
                tensors are overwritten).
            batch: the requests, rows ``0 .. n-1`` and tokens ``0 .. T-1``
                (their reqids mapped to their lengths); None: every row is
                padding (a graph-capture batch, which reads only the padding
                slice).
            num_rows, num_tokens: the batch padded to the captured size:
                rows ``n ..`` read no key and write nothing; tokens ``T ..``
                write their K/V into row 0 of ``padding_reqid``'s slice.
            padding_reqid: a slice no request reads, its first rows mapped.
            cu_seqlens_q: ``[num_rows + 1]`` int32 on the device, at a fixed
                address: the running sums of the rows' query lengths, padded
                rows' lengths 0 (vLLM's ``query_start_loc``).
            seqused_k: ``[num_rows]`` int32 on the device, at a fixed
                address: keys each row reads; 0 for padded rows, at most the
                padding slice's mapped rows for rows of a padding-only plan
                (vLLM's ``seq_lens``).
            max_seqlen_q, max_seqlen_k: upper bounds the build sizes its
                launch with; a graph keeps those of its capture, so they
                must hold for every replay (vLLM captures with 1 and
                ``max_model_len``).
            num_splits: the build's ``num_splits`` (0: its own heuristic).

        Writes the indices with one host-to-device copy and allocates nothing.
        """
        for name, t, n in (("cu_seqlens_q", cu_seqlens_q, num_rows + 1), ("seqused_k", seqused_k, num_rows)):
            if t.dtype != torch.int32 or tuple(t.shape) != (n,):
                raise ValueError(f"{name} must be [{n}] int32, got {tuple(t.shape)} {t.dtype}")
        buffers.fill(batch, num_rows, num_tokens, padding_reqid)
        plan = FlashAttentionPlan.__new__(FlashAttentionPlan)
        plan.batch = batch
        plan.check = None if batch is None else batch.mapped
        plan.cu_seqlens_q, plan.seqused_k = cu_seqlens_q, seqused_k
        plan.block_table = buffers.block_table[:num_rows, None]
        plan.cu_seqlens_k = buffers.cu_seqlens_k[:num_rows + 1]
        rows = buffers.token_rows[:num_tokens]
        plan.token_reqids, plan.token_positions = rows[:, 0], rows[:, 1]  # equal strides: indexed without a copy
        plan.max_seqlen_q, plan.max_seqlen_k = max_seqlen_q, max_seqlen_k
        plan.num_tokens, plan.num_splits, plan.padding_reqid = num_tokens, num_splits, padding_reqid
        return plan

    def run(self, plan: KernelPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
            softmax_scale: float | None = None, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> torch.Tensor:
        module = self.module()
        if not isinstance(plan, FlashAttentionPlan):
            raise TypeError(f"plan must be FlashAttentionKernel.plan's, got {type(plan).__name__}")
        check_layer(self, plan, q, k_cache, v_cache, k, v, out, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, num_tokens=plan.num_tokens)
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"{self.name} needs head_dim % {self.head_dim_multiple} == 0, got {k_cache.shape[-1]}")
        if plan.padding_reqid is not None and not 0 <= plan.padding_reqid < k_cache.shape[0]:
            raise ValueError(f"the plan's padding slice {plan.padding_reqid} is not in this cache's "
                             f"{k_cache.shape[0]} slices")
        tokens = self.slice_tokens(k_cache.stride(0), k_cache.stride(1))
        if k is not None:  # only plan tensors: a captured graph reads the next plan's rows at the same addresses
            rows = (plan.token_reqids, plan.token_positions)
            k_cache.index_put_(rows, k)
            v_cache.index_put_(rows, v)
        pages = [c.as_strided((c.shape[0], tokens, *c.shape[2:]), c.stride()) for c in (k_cache, v_cache)]
        result = self.varlen(module, plan, q, pages[0], pages[1], softmax_scale, out)
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def varlen(self, module: Any, plan: FlashAttentionPlan, q: torch.Tensor, k_pages: torch.Tensor,
               v_pages: torch.Tensor, softmax_scale: float | None, out: torch.Tensor | None) -> torch.Tensor:
        """The build's one call: the flash-attn package's signature (lengths of keys as ``cu_seqlens_k``)."""
        return module.flash_attn_varlen_func(
            q, k_pages, v_pages, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
            softmax_scale=softmax_scale, causal=True, block_table=plan.block_table)
