"""The budget keeper's idle release waits while a framework captures a CUDA
graph (torch.cuda.CUDAGraph, here a stand-in: torch has no CUDA) and goes on
after it, on the fake CUDA driver."""

from __future__ import annotations

import time

import torch
from budget_helpers import budget_name  # noqa: F401 (fixture)
from manager_helpers import wait_until

import vattn

MiB = 1024 * 1024


class StandInGraph:
    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass


def test_idle_release_waits_for_the_capture(budget_name, fake_cuda, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    budget = vattn.Budget.create(budget_name, 64 * MiB, device="cuda:0")
    kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=8192, device="cuda", physical_memory=32 * MiB, budget=budget_name,
                              idle_release_s=0.3, policy={"background": False, "eager": False})
    try:
        a = kv.alloc_reqid()
        lens = [0, 0]
        lens[a] = 2 * 2048  # two ids, 8 MiB
        assert kv.step(lens)
        kv.free_reqid(a)
        g = StandInGraph()
        g.capture_begin()
        try:
            calls = fake_cuda.fake_cuda_calls()
            time.sleep(0.8)  # well past idle_release_s
            assert fake_cuda.fake_cuda_calls() == calls, "the keeper called the driver during the capture"
            assert budget.held_bytes == 8 * MiB
        finally:
            g.capture_end()
        wait_until(lambda: budget.held_bytes == 0, what="the idle release after the capture")
    finally:
        kv.cleanup()
