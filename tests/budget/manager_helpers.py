"""Helpers of the tests of KV cache managers in a budget: small host managers,
what the process really commits (the memfd pool's allocated blocks, resident
memory) and polling for what the keeper thread does on its own."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

import vattn

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
B = 4
# 1 layer, 1 head of 64 fp32: 256 bytes a token per buffer, 256 tokens a page;
# one page id = 2 buffers x 64 KiB = 128 KiB of the budget.
ID_BYTES = 2 * PAGE
TOKENS_PER_PAGE = PAGE // 256


def make_kv(**overrides: Any) -> vattn.KVCacheManager:
    args = dict(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=B,
                max_context_len=4096, page_size=PAGE, physical_memory=64 * ID_BYTES, budget=False)
    args.update(overrides)
    return vattn.KVCacheManager(**args)


def lens_of(**by_reqid: int) -> list[int]:
    lens = [0] * B
    for r, n in by_reqid.items():
        lens[int(r[1:])] = n
    return lens


def pages(r: int, tokens: int) -> list[int]:
    """seq_lens with reqid r at ``tokens`` tokens."""
    return lens_of(**{f"r{r}": tokens})


def pool_bytes_committed() -> int:
    """Bytes the host really holds for every vattn page pool of this process:
    the allocated blocks of each memfd (a punched hole gives them back)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:vattn-kv-pool"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            pass  # closed meanwhile
    return total


def rss_shmem_bytes() -> int:
    """Resident shared memory of this process (mapped memfd pages), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem line in /proc/self/status")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Polls until ``predicate()`` holds (the keeper acts within ~20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def held_matches_created(kv: vattn.KVCacheManager) -> bool:
    """The budget's charge is exactly the created pages (between mapper rounds)."""
    share = kv.budget_share()
    return share["held_bytes"] == kv.stats()["bytes_created"]
