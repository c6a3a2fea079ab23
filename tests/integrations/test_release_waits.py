"""A budget's release in the vLLM worker never waits for the device
(vattn/integrations/vllm/worker_budget.py ``release_blocks``), on the fake
CUDA driver (tests/backends/fake_cuda) with a stream that plays vLLM's
forward stream: blocks a finished request's slice still maps while the
device reads them (its read fence not passed) keep their pages and wait in
the cache's backlog, counted; the next release, once the device is done,
gives them back."""

from __future__ import annotations

import types

import numpy as np
import torch

import vattn
from backends.cuda_framework import Framework
from test_forward_waits import BLOCK, MiB, device_waits
from vattn.integrations.block_placer import BlockPlacer
from vattn.integrations.vllm.worker_budget import release_blocks


def test_a_release_defers_what_the_device_still_reads_instead_of_waiting(fake_cuda):
    fw = Framework(fake_cuda)
    fw.init()
    stream = fw.stream()
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16,
                              max_batch_size=4, max_context_len=4 * BLOCK, device="cuda",
                              physical_memory=16 * 4 * 2 * MiB, page_allocator="external",
                              policy=vattn.Policy(background=False, deferred_reclaim=False, eager=False),
                              sync_streams=[stream])
    try:
        placer = BlockPlacer(kv, BLOCK)
        cache = types.SimpleNamespace(manager=kv, groups=[types.SimpleNamespace(placer=placer, padding=None)],
                                      release_backlog=set(), releases_deferred=0)
        table = np.array([[3, 5, 0, 0], [7, 0, 0, 0]], dtype=np.int32)
        num_blocks = np.array([2, 1], dtype=np.int32)
        reqids = placer.reqids_of(["a", "b"], table, num_blocks)
        placer.map(reqids, table, num_blocks, np.array([2 * BLOCK - 5, 9]))
        fake_cuda.fake_cuda_launch(stream)  # the forward reading them is queued, not done
        placer.release(["a"])  # finished: its slice keeps blocks 3 and 5 mapped until the device is done
        created = kv.stats()["bytes_created"]
        before = device_waits(fake_cuda, stream)
        assert release_blocks(cache, [3, 5, 9]) == 1  # 9 was never created: mapped nowhere
        assert device_waits(fake_cuda, stream) == before  # nothing waited for the device
        assert cache.release_backlog == {3, 5} and cache.releases_deferred == 2
        assert kv.stats()["bytes_created"] == created  # their pages stay while the device reads them
        assert kv.page_ids(int(reqids[1])) == [7]  # the live request's blocks are untouched
        fake_cuda.fake_cuda_finish(stream)
        assert release_blocks(cache, []) == 2  # the next release: the device is done with them
        assert cache.release_backlog == set() and cache.releases_deferred == 2
        assert kv.stats()["bytes_created"] == created - 2 * kv.page_size * kv.config.num_buffers
        assert device_waits(fake_cuda, stream) == before
    finally:
        kv.cleanup()
        fw.close()
