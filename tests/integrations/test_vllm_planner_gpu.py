"""vLLM's forward planner on a CUDA GPU, with no vLLM installed.

The metadata builder's work apart from vLLM's classes (:class:`ForwardPlanner`
fed hand-built :class:`ForwardInputs`, the typed value every forward is read
into) on the worker's cache as vLLM's CUDA worker builds it, with torch's
FlashAttention-2 op (``TorchFlashKernel``, what runs where no FlashAttention
package is installed) in place of vLLM's build: eager prefills through
``attend``, then a padded decode batch captured in a CUDA graph and replayed
after builds that map new pages (a block crossed, a request joined): the
manager's rule, step (here: build) before replay. Every output of a real row
is checked against SDPA on dense copies of the cache's rows, and the new K/V
against the rows they were written to. The same steps run on the CPU with
a reference of the op's varlen contract, "replaying" by running the
captured plan again (what a replay reads: the same tensors, refilled by the
builds): the indexing without the GPU.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from vattn.integrations.vllm import attention as vllm_attention
from vattn.integrations.vllm import worker as vllm_worker
from vattn.integrations.vllm.forward_inputs import ForwardInputs, PaddedBatch
from vattn.kernels import KERNELS, AttentionCase, sdpa_dense

from test_vllm_cuda_path import fake_runner, one_group_config

from kernels.kernel_references import install_torch_flash

H_Q, H_KV, D = 16, 8, 128
BLOCK = 1024  # tokens: 8 KV heads x 128 x fp16 = 2 KiB a token, so one 2 MiB page per block and buffer
MAX_MODEL_LEN, MAX_NUM_REQS, MAX_NUM_TOKENS = 4 * BLOCK, 4, 2048
CAPTURED_ROWS = 4  # the decode graph's batch: rows and tokens
SCALE = D ** -0.5
LAYERS = ("layer.0", "layer.1")


class Persistent:
    """vLLM's persistent device tensors a graph reads (``query_start_loc``,
    ``seq_lens``), filled per forward as vLLM's input preparation fills them:
    rows past the requests have query length 0 and ``seq_lens`` 0."""

    def __init__(self, device: torch.device) -> None:
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)

    def padded(self, query_lens: list[int], seq_lens: list[int], num_rows: int, num_tokens: int,
               max_seq_len: int) -> PaddedBatch:
        n = len(query_lens)
        starts = np.zeros(num_rows + 1, dtype=np.int32)
        starts[1:n + 1] = np.cumsum(query_lens)
        starts[n + 1:] = starts[n]
        used = np.zeros(num_rows, dtype=np.int32)
        used[:n] = seq_lens
        self.query_start_loc[:num_rows + 1].copy_(torch.from_numpy(starts))
        self.seq_lens[:num_rows].copy_(torch.from_numpy(used))
        return PaddedBatch(num_rows, num_tokens, self.query_start_loc[:num_rows + 1], self.seq_lens[:num_rows],
                           max(query_lens, default=1), max_seq_len)


def forward_inputs(persistent: Persistent, rows: dict[str, tuple[list[int], int, int]], num_rows: int | None = None,
                   num_tokens: int | None = None) -> ForwardInputs:
    """One forward of ``rows`` (request -> (its block ids, tokens after the
    forward, new tokens)), padded to ``num_rows`` rows and ``num_tokens``
    tokens (default: none)."""
    keys = list(rows)
    table = np.zeros((MAX_NUM_REQS, MAX_MODEL_LEN // BLOCK), dtype=np.int32)
    num_blocks = np.zeros(MAX_NUM_REQS, dtype=np.int32)
    for i, (blocks, _, _) in enumerate(rows.values()):
        table[i, :len(blocks)] = blocks
        num_blocks[i] = len(blocks)
    seq_lens = [s for _, s, _ in rows.values()]
    query_lens = [q for _, _, q in rows.values()]
    padded = persistent.padded(query_lens, seq_lens, num_rows or len(keys), num_tokens or sum(query_lens),
                               max(seq_lens))
    return ForwardInputs(keys, False, keys, np.array(seq_lens, dtype=np.int64), np.array(query_lens, dtype=np.int32),
                         table, num_blocks, padded)


def check_rows(md, kv_caches: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               layer: str, rows: dict[str, tuple[list[int], int, int]]) -> None:
    """The real rows of one layer's forward: new K/V at their rows, output equal to SDPA on dense copies."""
    k_cache, v_cache = kv_caches[layer].unbind(0)
    reqids = md.plan.reqids[:len(rows)].tolist()
    at = 0
    for reqid, (_, seq_len, new) in zip(reqids, rows.values()):
        tokens = slice(at, at + new)
        assert torch.equal(k_cache[reqid, seq_len - new:seq_len], k[tokens]), f"{layer}: K of reqid {reqid}"
        assert torch.equal(v_cache[reqid, seq_len - new:seq_len], v[tokens]), f"{layer}: V of reqid {reqid}"
        want = sdpa_dense(q[tokens], k_cache[reqid, :seq_len].clone(), v_cache[reqid, :seq_len].clone(), SCALE)
        torch.testing.assert_close(out[tokens], want, atol=1e-2, rtol=1e-2)
        at += new


def plan_addresses(md) -> tuple[int, ...]:
    plan = md.plan
    return tuple(t.data_ptr() for t in (plan.cu_seqlens_q, plan.seqused_k, plan.reqids, plan.flat_rows,
                                        plan._key_starts[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_a_captured_decode_replays_after_builds_that_map_new_pages(monkeypatch):
    ok, reason = KERNELS["torch_flash"].available()
    if not ok:
        pytest.skip(reason)
    torch_utils = types.ModuleType("vllm.utils.torch_utils")  # the stream the worker's manager fences on
    torch_utils.current_stream = torch.cuda.current_stream
    monkeypatch.setitem(sys.modules, "vllm.utils.torch_utils", torch_utils)
    decode_replays_after_builds(torch.device("cuda", torch.cuda.current_device()), graphs=True)


def test_the_same_steps_on_the_cpu_with_a_reference_op(monkeypatch):
    calls = install_torch_flash(monkeypatch)
    decode_replays_after_builds(torch.device("cpu"), graphs=False)
    assert calls


def decode_replays_after_builds(device: torch.device, graphs: bool) -> None:
    """Two prefills, a decode batch captured (``graphs``: in a CUDA graph;
    else its plan kept), then five decodes replayed after their builds: the
    third after a new request's prefill, one crossing a block."""
    kernel = KERNELS["torch_flash"]
    spec = types.SimpleNamespace(num_kv_heads=H_KV, head_size=D, dtype=torch.float16, block_size=BLOCK)
    runner = fake_runner(device, MAX_NUM_REQS, MAX_MODEL_LEN, MAX_MODEL_LEN // BLOCK,
                         full_graph_sizes=(CAPTURED_ROWS,), max_num_tokens=MAX_NUM_TOKENS)
    case = AttentionCase("cuda", D, torch.float16, torch.float16, num_kv_heads=H_KV, max_context_len=MAX_MODEL_LEN)
    cache = vllm_worker.build_cache(runner, one_group_config(spec, 24), spec, kernel, case)
    graph = None
    try:
        torch.manual_seed(0)
        kv_caches = cache.kv_caches()
        planner = vllm_attention.ForwardPlanner(cache, 0, device, MAX_NUM_REQS, MAX_NUM_TOKENS)
        assert planner.graphs
        persistent = Persistent(device)

        def run_eager(rows):
            md = planner.build(forward_inputs(persistent, rows))
            t = md.num_tokens
            for layer in LAYERS:
                q = torch.randn(t, H_Q, D, dtype=torch.float16, device=device)
                k, v = (torch.randn(t, H_KV, D, dtype=torch.float16, device=device) for _ in range(2))
                out = torch.empty_like(q)
                vllm_attention.attend(md, q, k, v, kv_caches[layer], out, SCALE)
                check_rows(md, kv_caches, q, k, v, out, layer, rows)

        blocks = {"a": [1], "b": [2]}
        lens = {"a": 1022, "b": 300}
        run_eager({key: (blocks[key], lens[key], lens[key]) for key in blocks})  # two prefills

        # the captured decode batch: every row and token at the padding slice, nothing mapped
        static_q = torch.zeros(CAPTURED_ROWS, H_Q, D, dtype=torch.float16, device=device)
        static_k, static_v = (torch.zeros(CAPTURED_ROWS, H_KV, D, dtype=torch.float16, device=device)
                              for _ in range(2))
        static_out = {layer: torch.zeros_like(static_q) for layer in LAYERS}
        capture = persistent.padded([1] * CAPTURED_ROWS, [1] * CAPTURED_ROWS, CAPTURED_ROWS, CAPTURED_ROWS,
                                    MAX_MODEL_LEN)
        captured = planner.build_for_capture(capture, 1)

        def layers(md):
            for layer in LAYERS:
                vllm_attention.attend(md, static_q, static_k, static_v, kv_caches[layer], static_out[layer], SCALE)

        if graphs:  # warm-up off the capturing stream, as torch.cuda.graph asks
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layers(captured)
            torch.cuda.current_stream().wait_stream(side)
        if graphs:
            graph = torch.cuda.CUDAGraph()
            with cache.manager.graph_capture(), torch.cuda.graph(graph):
                layers(captured)

        joined = False
        for iteration in range(5):
            if iteration == 2:  # a new request's prefill, eager; it decodes from the next iteration on
                blocks["c"], lens["c"] = [5], 200
                run_eager({"c": (blocks["c"], 200, 200)})
                joined = True
            for key in blocks:
                lens[key] += 1
                if lens[key] > BLOCK * len(blocks[key]):  # a block crossed: the build maps it
                    blocks[key] = blocks[key] + [10 + len(blocks[key])]
            rows = {key: (blocks[key], lens[key], 1) for key in blocks}
            md = planner.build(forward_inputs(persistent, rows, CAPTURED_ROWS, CAPTURED_ROWS))
            assert plan_addresses(md) == plan_addresses(captured), "a replay would read another plan's tensors"
            static_q.normal_()
            static_k.normal_()
            static_v.normal_()
            if graphs:
                graph.replay()
                torch.cuda.synchronize()
            else:  # what a replay reads: the captured plan's tensors, which the build refilled
                layers(captured)
            for layer in LAYERS:
                check_rows(md, kv_caches, static_q, static_k, static_v, static_out[layer], layer, rows)
        assert joined and len(blocks["a"]) == 2, "the decodes crossed no block"
        assert cache.manager.page_ids(md.plan.reqids[0].item())[:2] == blocks["a"]
    finally:
        if graphs:
            del graph
            torch.cuda.synchronize()
        cache.manager.cleanup()
