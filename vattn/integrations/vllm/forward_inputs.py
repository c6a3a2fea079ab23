"""The one place that reads vLLM's forward: the attention metadata vLLM hands
a builder and the model runner's persistent batch (request ids, CPU block
tables) become one typed value, :class:`ForwardInputs`, of numpy arrays and
vLLM's persistent tensors. The worker's cache, the block placer and the
planner take that value and never a vLLM object.

Per forward and KV cache group it costs what reading vLLM's objects cost
before: the arrays are views of vLLM's (the block table, the row counts, the
query starts), the request ids one list slice."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

WARM_UP = "vattn:warm-up-row"  # the key of a row vLLM's warm-up forwards fill without a request


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """What a CUDA graph's plan reads of a forward: vLLM's persistent device
    tensors, at the addresses a captured graph saw, and the padded sizes.
    Rows past the requests' are padding (query length 0, ``seq_lens`` 0)."""

    num_rows: int  # rows of the batch, padding included
    num_tokens: int  # tokens of q, k, v and the output, padding included
    query_start_loc: torch.Tensor  # [num_rows + 1] int32, on the model's device: cumulative query lengths
    seq_lens: torch.Tensor  # [num_rows] int32, on the model's device: tokens each row attends over
    max_query_len: int  # tokens, the longest row's query
    max_seq_len: int  # tokens, the longest row's keys (at capture: the model's longest context)


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
    """One KV cache group's view of one forward: the ``n`` rows with queries
    (rows past them are a CUDA graph's padding), in the order vLLM runs them.

    Arrays are vLLM's own where vLLM has them (views, not copies), valid
    until vLLM's next forward: a consumer reads them now and keeps nothing.
    """

    request_keys: list[Hashable]  # [n] the request of each row; a row without one gets (WARM_UP, row)
    warm_up_rows: bool  # some row has no request (vLLM's warm-up and profiling forwards)
    batch_request_keys: Sequence[Hashable | None]  # every row of vLLM's persistent batch (its list, None: empty)
    seq_lens: np.ndarray  # [n] int64, tokens each row attends over after this forward (cached + new)
    query_lens: np.ndarray  # [n] int32 (vLLM's), new tokens of each row in this forward, each >= 1
    block_table: np.ndarray  # [>= n, max_blocks] int32, the group's CPU block table (vLLM's array)
    num_blocks: np.ndarray  # [>= n] int32, blocks vLLM allocated to each row of the group's table
    padded: PaddedBatch | None  # the same forward as a CUDA graph reads it; None: the kernel runs no graphs


class ForwardReader:
    """Reads one KV cache group's forwards out of vLLM: ``runner``, the model
    runner (its persistent batch, read at each forward: vLLM may rebuild
    it), and the ``CommonAttentionMetadata`` its builder is handed.
    ``graphs``: the kernel runs in CUDA graphs, whose plans read
    :class:`PaddedBatch` (made only then: views cost a forward time)."""

    def __init__(self, runner: Any, group: int, graphs: bool = False) -> None:
        self.runner = runner
        self.group = group  # the KV cache group: which of the runner's block tables
        self.graphs = graphs

    def read(self, m: Any) -> ForwardInputs:
        """The forward of ``m`` (vLLM's ``CommonAttentionMetadata``). Rows
        past the last with queries are padding (vLLM's padded graph batches)."""
        starts = m.query_start_loc_cpu.numpy()[: m.num_reqs + 1]
        query_lens = starts[1:] - starts[:-1]
        n = int(np.count_nonzero(query_lens))
        seq_lens = self.cpu_seq_lens(m)[:n].astype(np.int64)  # exact: no speculative decoding
        batch = self.runner.input_batch
        req_ids = batch.req_ids
        keys = req_ids[:n]
        warm_up = len(keys) < n or None in keys
        if warm_up:
            keys = [(WARM_UP, row) if key is None else key for row, key in
                    enumerate(keys + [None] * (n - len(keys)))]
        table = batch.block_table[self.group]
        return ForwardInputs(keys, warm_up, req_ids, seq_lens, query_lens[:n], table.block_table.np,
                             table.num_blocks_per_row, self.padded(m) if self.graphs else None)

    @staticmethod
    def padded(m: Any) -> PaddedBatch:
        """The forward of ``m`` as a CUDA graph reads it."""
        return PaddedBatch(m.num_reqs, m.num_actual_tokens, m.query_start_loc[: m.num_reqs + 1],
                           m.seq_lens[: m.num_reqs], m.max_query_len, m.max_seq_len)

    def cpu_seq_lens(self, m: Any) -> np.ndarray:
        """Tokens each row of ``m`` attends over, from host memory
        (``[>= m.num_reqs]`` int32, a view): vLLM's
        ``seq_lens_cpu_upper_bound``, or where a metadata object has none
        (vLLM declares it optional) the runner's ``optimistic_seq_lens_cpu``,
        the array vLLM 0.32 slices it from (for forwards and dummy runs
        alike); never ``m.seq_lens``, which lives on the model's device."""
        bound = m.seq_lens_cpu_upper_bound
        return (bound if bound is not None else self.runner.optimistic_seq_lens_cpu).numpy()

    def longest_seq_len(self, m: Any) -> int:
        """Tokens the longest row of ``m`` attends over (0 without rows): what a capture batch reads."""
        return int(self.cpu_seq_lens(m)[: m.num_reqs].max()) if m.num_reqs else 0
