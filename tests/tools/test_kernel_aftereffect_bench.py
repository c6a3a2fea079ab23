"""benchmarks/kernel_aftereffect.py and what it shares with kernel_vs_vllm.py:
the decoder layer's rest it times is the long serving model's (its output is
the next layer's qkv, the same every call), and a run refuses to start
without vLLM or with fewer than one thread, and otherwise gives both kernels
the threads asked for."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import load_benchmark

aftereffect = load_benchmark("kernel_aftereffect")
kernel_vs_vllm = load_benchmark("kernel_vs_vllm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_rest_yields_the_next_layers_qkv_the_same_every_call(dtype):
    heads = (8, 2, 64)
    rest = aftereffect.layer_rest(5, dtype, heads)
    out = rest()
    assert out.shape == (5, (8 + 2 * 2) * 64) and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(rest(), out, rtol=0, atol=0)


def test_a_run_without_vllm_or_threads_is_refused_and_otherwise_gets_its_threads(monkeypatch):
    monkeypatch.setattr(kernel_vs_vllm, "vllm_available", lambda: "vllm is not installed")
    with pytest.raises(SystemExit, match="kernel_aftereffect needs vLLM's CPU build: vllm is not installed"):
        kernel_vs_vllm.beside_vllm("kernel_aftereffect", 1)
    monkeypatch.setattr(kernel_vs_vllm, "vllm_available", lambda: None)
    with pytest.raises(SystemExit, match="--threads must be at least 1, got 0"):
        kernel_vs_vllm.beside_vllm("kernel_aftereffect", 0)
    before = torch.get_num_threads()
    monkeypatch.setenv("VATTN_CPU_ATTN_THREADS", "")
    try:
        kernel_vs_vllm.beside_vllm("kernel_aftereffect", 1)
        assert os.environ["VATTN_CPU_ATTN_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
