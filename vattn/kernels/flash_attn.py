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
to the device. A caller that runs many layers of one cache (vLLM's backend)
makes the cache's views once (:meth:`FlashAttentionKernel.layer_views`: the
pages, and the token rows the new K/V go to by one flat index per token) and
runs each layer as :meth:`FlashAttentionKernel.run_layer`: two
``index_copy_`` and the varlen call, nothing else.

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
from .protocol import AttentionCase, Kernel, KernelPlan, LayerViews, Support, check_layer, check_views, load_module


def cache_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``[B, L, H, D]`` cache view (a layer of either layout) as the token
    rows of every slice, ``[B * S, H, D]``, and ``S``: request ``r``'s rows
    start at row ``r * S``. ``S`` (slice stride over token stride) is at least
    ``L`` and in general not ``L``, so ``view(-1, H, D)`` would not do.
    Raises ``ValueError`` where a slice is not a whole number of token rows
    (an all_layers page that ends inside a token's row of all layers): no
    varlen kernel reads such a cache."""
    slice_elements, row = cache.stride(0), cache.stride(1)
    if slice_elements % row:
        raise ValueError(f"a slice of {slice_elements} elements is not a whole number of {row}-element token rows, so the "
                         "cache has no [rows, H, D] view for varlen kernels")
    rows_per_slice = slice_elements // row
    flat = cache.as_strided((cache.shape[0] * rows_per_slice, *cache.shape[2:]), (row, *cache.stride()[2:]))
    return flat, rows_per_slice


class FlashAttentionPlan(KernelPlan):
    """The batch as one varlen call: its index tensors on the batch's device,
    and where each new token's K/V go."""

    __slots__ = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "max_seqlen_q", "max_seqlen_k",
                 "token_reqids", "token_positions", "num_tokens", "num_splits", "padding_reqid", "flat_rows",
                 "rows_per_slice")

    def __init__(self, batch: AttentionBatch, case: AttentionCase | None = None) -> None:
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
        self.rows_per_slice, self.flat_rows = flat_token_rows(self.token_reqids, self.token_positions, case)


def rows_per_slice_of(case: AttentionCase | None) -> int:
    """S, the token rows from one slice's row 0 to the next's, of ``case``'s
    cache geometry; 0 where the case does not give it or it is not whole."""
    if case is None or not case.slice_stride or not case.row_stride or case.slice_stride % case.row_stride:
        return 0
    return case.slice_stride // case.row_stride


def flat_token_rows(token_reqids: torch.Tensor, token_positions: torch.Tensor,
                    case: AttentionCase | None) -> tuple[int, torch.Tensor | None]:
    """``(S, rows)``: each new token's row in the cache's ``[B_max * S, H, D]``
    token rows (``reqid * S + position``, ``[T]`` int64, one device op once
    per forward), where ``case`` gives the geometry; ``(0, None)`` otherwise."""
    per_slice = rows_per_slice_of(case)
    if not per_slice:
        return 0, None
    return per_slice, torch.add(token_positions, token_reqids, alpha=per_slice)


TOKEN_ROW_BYTES = 24  # a new token's (reqid, position, token row) in FlashAttentionBuffers, int64 each


class FlashAttentionBuffers:
    """Index tensors at device addresses that never change, for plans a CUDA
    graph captures (:meth:`FlashAttentionKernel.plan_into`).

    One device buffer holds the block-table column (``[max_rows]`` int32),
    the keys' running sums (``[max_rows + 1]`` int32), each row's first key
    row in the cache's token rows (``[max_rows + 1]`` int32, ``reqid * S``:
    torch's FlashAttention reads keys so) and each new token's (reqid,
    position, token row ``reqid * S + position``) (``[max_tokens, 3]``
    int64); the last two are written when the plan is given ``S``
    (``rows_per_slice``). A host buffer of the same
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
        int32_bytes = (3 * max_rows + 2) * 4
        self._rows_at = -(-int32_bytes // 8) * 8  # the int64 token rows start 8-byte aligned
        nbytes = self._rows_at + TOKEN_ROW_BYTES * max_tokens
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._device = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        # block table, cu_seqlens_k, key starts, token rows: numpy views of the host buffer, tensors of the device one
        self._host_views = tuple(t.numpy() for t in self._views(self._host))
        self.block_table, self.cu_seqlens_k, self.key_starts, self.token_rows = self._views(self._device)

    def _views(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.max_rows
        ints = raw[:(3 * rows + 2) * 4].view(torch.int32)
        tokens = raw[self._rows_at:].view(torch.int64).view(-1, 3)
        return ints[:rows], ints[rows:2 * rows + 1], ints[2 * rows + 1:], tokens

    def fill_checked(self, batch: AttentionBatch | None, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                     num_rows: int, num_tokens: int, padding_reqid: int, rows_per_slice: int = 0) -> None:
        """:meth:`fill`, after checking the framework's own persistent index
        tensors a plan into these buffers reads (``[num_rows + 1]`` and
        ``[num_rows]`` int32): ``ValueError`` naming the one that is not."""
        for name, t, n in (("cu_seqlens_q", cu_seqlens_q, num_rows + 1), ("seqused_k", seqused_k, num_rows)):
            if t.dtype != torch.int32 or tuple(t.shape) != (n,):
                raise ValueError(f"{name} must be [{n}] int32, got {tuple(t.shape)} {t.dtype}")
        self.fill(batch, num_rows, num_tokens, padding_reqid, rows_per_slice)

    def fill(self, batch: AttentionBatch | None, num_rows: int, num_tokens: int, padding_reqid: int,
             rows_per_slice: int = 0) -> None:
        """Writes ``batch`` (rows ``0 .. n-1``, tokens ``0 .. T-1``; None: no
        request) padded to ``num_rows`` rows and ``num_tokens`` tokens, and
        copies it to the device. A padded row's one page is ``padding_reqid``'s
        slice and it has no key; a padded token's K/V go to row 0 of that
        slice. ``rows_per_slice``: S, for the key starts and token rows in the
        cache's token rows (0: not written)."""
        n = len(batch.reqids) if batch is not None else 0
        t = batch.num_tokens if batch is not None else 0
        if not n <= num_rows <= self.max_rows or not t <= num_tokens <= self.max_tokens:
            raise ValueError(f"a plan of {n} requests and {t} tokens padded to {num_rows} rows and {num_tokens} "
                             f"tokens does not fit buffers of {self.max_rows} rows and {self.max_tokens} tokens")
        table, key_starts, first_keys, rows = self._host_views
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
        rows[t:num_tokens, :2] = (padding_reqid, 0)
        if rows_per_slice:
            np.multiply(table[:num_rows], rows_per_slice, out=first_keys[:num_rows])
            # read by no row with seqused_k given: the end of the last slice the rows start in
            first_keys[num_rows] = first_keys[:num_rows].max() + rows_per_slice
            rows[:num_tokens, 2] = rows[:num_tokens, 0] * rows_per_slice + rows[:num_tokens, 1]
        used = self._rows_at + TOKEN_ROW_BYTES * num_tokens
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
        """The batch's index tensors, the new rows' too (no layer builds
        any); with ``case`` giving the cache's strides, also each new
        token's row in the cache's token rows, for :meth:`run_layer`."""
        return FlashAttentionPlan(batch, case)

    def plan_into(self, buffers: FlashAttentionBuffers, batch: AttentionBatch | None, *, num_rows: int,
                  num_tokens: int, padding_reqid: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, num_splits: int = 0,
                  rows_per_slice: int = 0) -> FlashAttentionPlan:
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
            rows_per_slice: S of the cache the plan is run on
                (:meth:`layer_views`), so that each new token's token row is
                written too, for :meth:`run_layer`; 0: not written.

        Writes the indices with one host-to-device copy and allocates nothing.
        """
        buffers.fill_checked(batch, cu_seqlens_q, seqused_k, num_rows, num_tokens, padding_reqid, rows_per_slice)
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
        plan.rows_per_slice, plan.flat_rows = rows_per_slice, rows[:, 2] if rows_per_slice else None
        return plan

    def layer_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> LayerViews:
        """The cache as the build reads it, each slice one page
        (``[B_max, S, H_kv, D]``), and as token rows for the new K/V
        (:func:`cache_rows`), made once per cache.
        Raises ``ValueError`` where a slice is not a whole number of the
        build's pages or the head dim not a multiple of its own."""
        if k_cache.shape[-1] % self.head_dim_multiple:
            raise ValueError(f"{self.name} needs head_dim % {self.head_dim_multiple} == 0, got {k_cache.shape[-1]}")
        super().layer_views(k_cache, v_cache)  # shapes
        tokens = self.slice_tokens(k_cache.stride(0), k_cache.stride(1))
        pages = [c.as_strided((c.shape[0], tokens, *c.shape[2:]), c.stride()) for c in (k_cache, v_cache)]
        (k_rows, _), (v_rows, _) = cache_rows(k_cache), cache_rows(v_cache)
        return LayerViews(k_cache, v_cache, pages[0], pages[1], k_rows, v_rows, tokens, self.module())

    def check_forward(self, plan: KernelPlan, views: LayerViews, sliding_window: int | None = None) -> None:
        """:meth:`Kernel.check_forward`, and that a plan's padding slice is
        one of the cache's."""
        check_views(self, plan, views.k_cache, views.v_cache, sliding_window)
        padding = getattr(plan, "padding_reqid", None)
        if padding is not None and not 0 <= padding < views.k_cache.shape[0]:
            raise ValueError(f"the plan's padding slice {padding} is not in this cache's "
                             f"{views.k_cache.shape[0]} slices")

    def run_layer(self, plan: KernelPlan, views: LayerViews, q: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, out: torch.Tensor, softmax_scale: float | None,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """:meth:`Kernel.run_layer`: the new K/V written with one
        ``index_copy_`` each into the token rows, then the build's one call
        on the pages; a plan made without this cache's geometry runs
        :meth:`run`, checks included."""
        if plan.rows_per_slice != views.rows_per_slice:
            return self.run(plan, q, views.k_cache, views.v_cache, k, v, out=out, softmax_scale=softmax_scale,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if k is not None:  # only plan tensors: a captured graph reads the next plan's rows at the same addresses
            views.k_rows.index_copy_(0, plan.flat_rows, k)
            views.v_rows.index_copy_(0, plan.flat_rows, v)
        result = self.varlen(views.library, plan, q, views.k_read, views.v_read, softmax_scale, out)
        if result is not out:
            out.copy_(result)
        return out

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
