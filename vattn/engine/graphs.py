"""Decode iterations replayed from CUDA graphs.

An iteration in which every request brings one token launches the same
kernels for a given batch size every time; only the values in its index
tensors and inputs change. :class:`DecodeGraphs` captures the model's
forward once per batch size in ``sizes`` (largest first, one memory pool)
with every tensor it reads at a fixed address: the token ids and positions,
the keys each row reads (``seqused_k``) and the kernel's plan
(:meth:`vattn.kernels.FlashAttentionKernel.plan_into`, the kernels whose
``graphs`` is True). Each decode iteration of ``n`` requests takes the
smallest captured size ``B >= n``, writes its inputs padded to ``B`` into
page-locked host buffers, copies them over (one copy for the inputs, one for
the plan, on the current stream) and replays; larger batches, prefills and
mixed iterations run eagerly.

Padding. Rows ``n .. B-1`` are decodes of token 0 at position 0 in the
padding slice (a reqid the engine holds for this alone, its first page
mapped): each writes its K/V into that slice's row 0 and reads that one row,
so padded rows compute finite values that no request reads.

The vattn rules (docs/gpu.md, "CUDA graphs"): captures run inside
``kv.graph_capture()``, after the padding slice was stepped, and read only
that slice; every replay comes after the scheduler's ``step`` for its
lengths. A replay runs no Python, so the plan's mapping check runs once per
iteration before it. The host buffers are refilled only after the previous
iteration's token ids came back, which waits for its copies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vattn.core import KVCacheManager
from vattn.kernels import AttentionBatch, Kernel, KernelPlan
from vattn.kernels.flash_attn import FlashAttentionBuffers

__all__ = ["CudaGraph", "DecodeGraphs", "GRAPH_DEVICES", "capture_sizes"]

GRAPH_DEVICES: tuple[str, ...] = ("cuda",)
"""Device types whose forwards the engine captures (tests on the CPU widen it, with a stand-in graph)."""

Forward = Callable[[KernelPlan, torch.Tensor, torch.Tensor], torch.Tensor]
"""(plan, input_ids ``[1, B]``, position_ids ``[1, B]``) -> logits ``[B, vocab]``: the model run with the plan."""


def capture_sizes(max_batch_size: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes to capture, ascending: ``sizes`` checked (ints in
    ``[1, max_batch_size]``, ``ValueError`` naming them otherwise), or by
    default 1, 2, 4, 8, then every multiple of 8, and ``max_batch_size``."""
    if sizes is None:
        default = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size, 8))
        return tuple(sorted(set(default) | {max_batch_size}))
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"graph_batch_sizes must be a non-empty sequence of ints in [1, {max_batch_size}] "
                         f"(max_batch_size), got {sizes!r}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= max_batch_size:
            raise ValueError(f"graph_batch_sizes must hold ints in [1, {max_batch_size}] (max_batch_size), "
                             f"got {s!r}")
    return tuple(sorted(set(sizes)))


class CudaGraph:
    """One captured forward: :meth:`capture` records it (after a warm-up run
    on a side stream, as torch asks), :meth:`replay` launches it again on the
    current stream, writing the output captured."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, run: Callable[[], torch.Tensor], kv: KVCacheManager) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # libraries set up their handles and workspaces outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with kv.graph_capture(), torch.cuda.graph(self.graph, pool=self.pool):
            return run()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """The decode forwards of one engine, captured per batch size (see the module docstring).

    Args:
        forward: runs the model with a plan (the engine's).
        kernel: the engine's attention kernel; ``graphs`` must be True.
        kv: the engine's cache.
        padding_reqid: a reqid held for padding alone, its first token row mapped.
        sizes: batch sizes to capture (:func:`capture_sizes`).
        max_context_len: tokens per request at most (every graph's bound on keys).
        graph_type: what records and replays a forward, called with the
            shared memory pool; None: :data:`GRAPH_TYPE` (:class:`CudaGraph`).
    """

    def __init__(self, forward: Forward, kernel: Kernel, kv: KVCacheManager, padding_reqid: int,
                 sizes: Sequence[int], max_context_len: int, graph_type: Callable[[Any], Any] | None = None) -> None:
        if not kernel.graphs:
            raise ValueError(f"{kernel.name} cannot run in CUDA graphs (it plans into no persistent buffers)")
        self.forward, self.kernel, self.kv = forward, kernel, kv
        self.padding_reqid = padding_reqid
        self.sizes = tuple(sorted(sizes))
        self.max_context_len = max_context_len
        self.replays = 0  # decode iterations served by a replay
        device = kv.device
        largest = self.sizes[-1]
        self.buffers = FlashAttentionBuffers(largest, largest, device)  # the plan's reqids and K/V rows
        # input ids and positions (int64), then the keys each row reads (int32), in one buffer: one copy
        nbytes = 20 * largest
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._host_ids, self._host_positions, self._host_used = (t.numpy() for t in self._views(self._host))
        self.input_ids, self.position_ids, self.seqused_k = self._views(self._device)
        # every row of a decode is one query token: the query starts are 0, 1, ..., B for every B
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        make_graph = graph_type or GRAPH_TYPE
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool's memory
            self._capture(size, make_graph(pool))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the captures' copies have run: the host buffers may be refilled

    def _views(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        largest = self.sizes[-1]
        longs = raw[:16 * largest].view(torch.int64)
        return longs[:largest], longs[largest:], raw[16 * largest:].view(torch.int32)

    def size_for(self, num_requests: int) -> int | None:
        """The captured size a decode of ``num_requests`` replays (the smallest
        that holds it); None when none does (it runs eagerly)."""
        for size in self.sizes:
            if size >= num_requests:
                return size
        return None

    def _fill(self, batch: AttentionBatch | None, tokens: Sequence[int], positions: Sequence[int],
              size: int) -> KernelPlan:
        """Writes a decode of ``batch`` (None: padding only) padded to ``size``
        rows into the persistent buffers, copies them to the device, and
        returns the kernel's plan of it (its tensors are the buffers)."""
        n = len(tokens)
        self._host_ids[:n] = tokens
        self._host_ids[n:size] = 0
        self._host_positions[:n] = positions
        self._host_positions[n:size] = 0
        if batch is not None:
            self._host_used[:n] = batch.seq_lens
        self._host_used[n:size] = 1  # a padded row reads the one row it wrote
        plan = self.kernel.plan_into(  # type: ignore[attr-defined]
            self.buffers, batch, num_rows=size, num_tokens=size, padding_reqid=self.padding_reqid,
            cu_seqlens_q=self.cu_seqlens_q[:size + 1], seqused_k=self.seqused_k[:size], max_seqlen_q=1,
            max_seqlen_k=self.max_context_len)
        self._device.copy_(self._host, non_blocking=True)
        return plan

    def _capture(self, size: int, graph: Any) -> None:
        plan = self._fill(None, [], [], size)
        ids, positions = self.input_ids[:size][None], self.position_ids[:size][None]
        # a copy per run: what a plan derives in its first layer (torch's key starts) is derived inside the capture
        self._outputs[size] = graph.capture(lambda: self.forward(copy.copy(plan), ids, positions), self.kv)
        self._graphs[size] = graph

    def run(self, batch: AttentionBatch, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor | None:
        """The logits ``[n, vocab]`` of a decode of ``n`` requests (``batch``,
        their new tokens and positions) by a replay; None when no captured
        size holds it. The caller has stepped every request to its length."""
        size = self.size_for(len(tokens))
        if size is None:
            return None
        # the replay checks nothing itself: the rows it reads must be mapped (checked before any copy is queued)
        batch.mapped(*self.kv.layer(0), self.kernel.name)
        self._fill(batch, tokens, positions, size)
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size][:len(tokens)]


GRAPH_TYPE: Callable[[Any], Any] = CudaGraph
"""What :class:`DecodeGraphs` records forwards with by default (tests on the CPU put a stand-in here)."""
