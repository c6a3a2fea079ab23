"""What vLLM's path does per layer and per forward, counted on a host
cache without a GPU: a layer of vLLM's FlashAttention build is its cache
write and its call, a layer of the host kernel is its one call, and the
forward's mapping check is built once, for the planner's own cache.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vattn
from integrations.test_vllm_cuda_path import (VllmInputs, fake_vllm_build, forward,  # noqa: F401 (a fixture)
                                              host_worker_cache, set_rows)
from kernels.mapping_checks import count_mapping_checks
from vattn.core import mapped_check
from vattn.integrations import vllm as plugin
from vattn.integrations.vllm import attention as vllm_attention
from vattn.kernels import KERNELS, sdpa_dense

VATTN_SOURCE = os.path.dirname(vattn.__file__)


def calls_made_by_vattn(fn) -> list[str]:
    """The Python and C functions vattn's own code calls while ``fn`` runs
    (a call from a test or from a kernel's library is not vattn's work;
    the call into the library is)."""
    calls = []

    def profile(frame, event, arg):
        caller = frame.f_back if event == "call" else frame if event == "c_call" else None
        if caller is not None and caller.f_code.co_filename.startswith(VATTN_SOURCE):
            calls.append(getattr(arg, "__qualname__", None) or frame.f_code.co_qualname if event == "c_call"
                         else frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


class AtenOps(TorchDispatchMode):
    """The aten ops run while the mode is on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


LAYER_CALLS = 12  # attend's own calls: the views' lookup, run_layer, two index_copy_, the build's call, and glue


@contextlib.contextmanager
def two_requests_planned(kernel) -> Iterator[tuple]:
    """``(cache, planner, reader)``: ``kernel``'s forward planner on a host worker cache whose requests
    a and b hold blocks 3, 4 and 5 (16 tokens each), closed after."""
    runner, cache = host_worker_cache(kernel)
    try:
        planner = vllm_attention.ForwardPlanner(cache, 0, torch.device("cpu"), 4, 32)
        set_rows(runner, {"a": [3, 4], "b": [5]})
        yield cache, planner, planner.reader(runner)
    finally:
        cache.manager.cleanup()


@contextlib.contextmanager
def one_prefill(kernel) -> Iterator[tuple]:
    """``(kv_caches, md, q, k, v, out)``: one forward of two requests (17 and 1 new tokens, 2 KV heads of 32)
    planned by ``kernel``'s planner on a host worker cache, closed after."""
    torch.manual_seed(0)
    with two_requests_planned(kernel) as (cache, planner, reader):
        md = planner.build(reader.read(VllmInputs(4, 64).common([17, 1], [17, 1])))
        q, k, v = torch.randn(18, 4, 32), torch.randn(18, 2, 32), torch.randn(18, 2, 32)
        yield cache.kv_caches(), md, q, k, v, torch.zeros(18, 4, 32)


def test_a_layer_of_vllms_build_is_its_cache_write_and_its_call(fake_vllm_build, monkeypatch):
    """vLLM's FlashAttention build, planned into the CUDA-graph buffers on a
    host cache: one layer's ``attend`` makes at most ``LAYER_CALLS`` calls of
    vattn's own (no check, view or index tensor: the planner made those once
    per forward) and runs exactly two aten ops of its own, ``index_copy_``
    of the new K and V into the cache's token rows, besides the build's
    call. The outputs stay exact (the build's reference then runs)."""
    kernel = plugin.loaded_kernel(KERNELS["flash_attn"], head_size=32)
    with one_prefill(kernel) as (kv_caches, md, q, k, v, out):
        with monkeypatch.context() as stubbed:  # the build's call costs nothing: what is left is vattn's
            stubbed.setattr(fake_vllm_build, "flash_attn_varlen_func", lambda *a, out, **kw: out)
            calls = calls_made_by_vattn(lambda: forward(md, kv_caches, q, k, v, out, "layer.1"))
            with AtenOps() as seen:
                forward(md, kv_caches, q, k, v, out, "layer.0")
        assert len(calls) <= LAYER_CALLS, " ".join(calls)
        assert calls.count("Tensor.index_copy_") == 2
        assert seen.ops == ["index_copy_.default", "index_copy_.default"]
        reqids = md.plan.block_table[:2, 0].tolist()
        k_cache, v_cache = kv_caches["layer.0"]
        assert torch.equal(k_cache[reqids[0], :17], k[:17]) and torch.equal(v_cache[reqids[1], 0], v[17])
        want = sdpa_dense(q[:17], k_cache[reqids[0], :17], v_cache[reqids[0], :17], 0.125)
        forward(md, kv_caches, q, k, v, out, "layer.1")  # real: the reference build
        torch.testing.assert_close(out[:17], want)


def test_a_forwards_mapping_check_is_bound_to_the_planners_cache(monkeypatch):
    """The planner builds each forward's mapping check for its own cache and
    views: the forward's check looks no view up by address and makes one
    check of the core's for both buffers; a request whose rows are not
    mapped still fails the forward, naming it."""
    made, lookups = count_mapping_checks(monkeypatch)
    with two_requests_planned(KERNELS["host"]) as (_, planner, reader):
        inputs = VllmInputs(4, 64)
        for query_lens, seq_lens in (([17, 1], [17, 1]), ([1, 1], [18, 2]), ([1, 1], [19, 3])):
            before = len(made)
            plan = planner.build(reader.read(inputs.common(query_lens, seq_lens))).plan
            checks = plan.check.mapped  # named apart: a failed assert's report shows no cache view (unmapped rows)
            assert len(made) - before == 1 and checks is made[-1] and not lookups
        # the same binding with rows past what the planner mapped (request a holds two 16-token blocks)
        check = mapped_check.ViewsCheck(np.array(plan.batch.reqids), np.array([40, 3]), "attention",
                                        plan.check.binding)
        with pytest.raises(ValueError, match="would read 40 tokens but has 32 mapped"):
            check(planner.first_views.k_cache, planner.first_views.v_cache, "attention")


def test_a_layer_of_the_host_kernel_is_its_one_call():
    """vattn's host kernel under vLLM's backend (the CPU path): one layer's
    ``attend`` is the extension's call, which writes the new K/V too, and
    the DLPack handles it takes, at most ``LAYER_CALLS`` calls of vattn's
    own; the result equals SDPA's on the cache."""
    with one_prefill(KERNELS["host"]) as (kv_caches, md, q, k, v, out):
        calls = calls_made_by_vattn(lambda: forward(md, kv_caches, q, k, v, out, "layer.0"))
        assert len(calls) <= LAYER_CALLS and sum(c.endswith(".attention") for c in calls) == 1, " ".join(calls)
        k_cache, v_cache = kv_caches["layer.0"]
        reqid = md.plan.batch.reqids[0]
        assert torch.equal(k_cache[reqid, :17], k[:17])
        torch.testing.assert_close(out[:17], sdpa_dense(q[:17], k_cache[reqid, :17], v_cache[reqid, :17], 0.125))
