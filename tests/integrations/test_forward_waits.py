"""No forward waits for the device on vattn's account: the vLLM worker's
mapping (BlockPlacer) on the fake CUDA driver (tests/backends/fake_cuda),
with a stream that plays vLLM's forward stream and lags behind the host.

A request's slice follows it for its life, so finishes, preemptions and
reordered rows map only new blocks; a finished request's pages stay mapped
until its slice is reused, and only slices whose last readers the device
has finished are reused (asked with cuEventQuery, never waited for), by a
request that shares their first blocks where one does.
"""

from __future__ import annotations

import random

import numpy as np
import torch

import vattn
from backends.cuda_framework import Framework
from vattn.integrations.block_placer import BlockPlacer

MiB = 1 << 20
BLOCK = 2048  # 4 KV heads x 128 x fp16 = 1 KiB per token: one 2 MiB page per block and buffer
ROWS, SLICES, NUM_BLOCKS = 4, 8, 24


def device_waits(lib, stream: int) -> int:
    """Waits the driver saw: on the stream (cuStreamSynchronize, cuEventSynchronize) and on the device."""
    return lib.fake_cuda_stream_syncs(stream) + lib.fake_cuda_sync_calls()


def test_a_vllm_like_trace_never_waits_for_the_device_inside_a_forward(fake_cuda):
    fw = Framework(fake_cuda)
    fw.init()
    stream = fw.stream()
    rng = random.Random(3)
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16,
                              max_batch_size=SLICES, max_context_len=4 * BLOCK, device="cuda",
                              physical_memory=NUM_BLOCKS * 4 * 2 * MiB, page_allocator="external",
                              policy={"background": False, "deferred_reclaim": False, "eager": False},
                              sync_streams=[stream])
    try:
        placer = BlockPlacer(kv, BLOCK)
        free_blocks = list(range(1, NUM_BLOCKS))
        live: dict[str, tuple[list[int], int]] = {}
        waits_in_forwards = forwards = finished = preempted = 0
        cached: list[list[int]] = []
        for step in range(200):
            # the scheduler: arrivals, finishes and preemptions (their slices go back, still mapped)
            ended, gone = [], {}
            for key in list(live):
                blocks, tokens = live[key]
                if rng.random() < 0.1 or tokens >= 4 * BLOCK - 1:
                    free_blocks += blocks
                    gone[key] = blocks[:tokens // BLOCK]  # its full blocks stay in the prefix cache
                    del live[key]
                    ended.append(key)
                    finished += 1
                elif rng.random() < 0.05:
                    free_blocks += blocks
                    need = -(-tokens // BLOCK)
                    rng.shuffle(free_blocks)
                    live[key] = ([free_blocks.pop() for _ in range(need)], tokens)
                    ended.append(key)  # resumed with new blocks: a fresh slice
                    preempted += 1
                else:
                    grow = min(rng.choice([1, 1, 1, BLOCK // 2]), 4 * BLOCK - tokens)
                    need = -(-(tokens + grow) // BLOCK)
                    if need > len(blocks) and not free_blocks:
                        continue
                    live[key] = (blocks + [free_blocks.pop() for _ in range(need - len(blocks))], tokens + grow)
            placer.release(ended)
            cached += gone.values()
            while len(live) < ROWS and len(free_blocks) >= 2:
                tokens = rng.randint(1, 2 * BLOCK)
                # half the arrivals hit the prefix cache: a finished request's first blocks, while still free
                hit = (rng.choice(cached) if cached and rng.random() < 0.5 else [])[:(tokens - 1) // BLOCK]
                hit = hit[:next((i for i, b in enumerate(hit) if b not in free_blocks), len(hit))]
                for b in hit:
                    free_blocks.remove(b)
                fresh = [free_blocks.pop() for _ in range(-(-tokens // BLOCK) - len(hit))]
                live[f"r{step}-{len(live)}"] = (hit + fresh, tokens)
            order = list(live)
            rng.shuffle(order)  # rows move every forward
            # the forward's mapping, on the host, while the device still runs the previous forward
            before = device_waits(fake_cuda, stream)
            table = np.zeros((len(order), 4), dtype=np.int32)
            for i, key in enumerate(order):
                table[i, :len(live[key][0])] = live[key][0]
            num_blocks = np.array([len(live[k][0]) for k in order], dtype=np.int32)
            reqids = placer.reqids_of(order, table, num_blocks)
            placer.map(reqids, table, num_blocks, np.array([live[k][1] for k in order]))
            waits_in_forwards += device_waits(fake_cuda, stream) - before
            forwards += 1
            # the forward's kernels are queued; the device finishes the previous forward's meanwhile
            fake_cuda.fake_cuda_finish(stream)
            fake_cuda.fake_cuda_launch(stream)
            for key, reqid in zip(order, reqids.tolist()):
                blocks, tokens = live[key]
                assert kv.page_ids(reqid) == blocks[:-(-tokens // BLOCK)]
        assert finished > 20 and preempted > 5 and forwards == 200
        assert placer.positions_reused > 10  # prefix hits found their blocks mapped in a free slice
        assert waits_in_forwards == 0
        s = kv.stats()
        assert s["page_unmaps"] > 0  # finished requests' pages were unmapped, after their readers were done
        assert int(kv._vmm_backend().facts["fence_queries"]) > 0  # asked, never waited for
    finally:
        kv.cleanup()
        fw.close()
