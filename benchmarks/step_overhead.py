"""`step` on the fast path (no new page) against building a vLLM-style padded
block table for the same batch (vAttention paper, section 3.3.2).

    python benchmarks/step_overhead.py

For B = 1 ... 256 requests with 512 ... 4096-token contexts and 32 layers
(64 K/V buffers), host backend, times in one run:
  step        vattn.step(seq_lens) with every page already mapped: the per-iteration cost
  block_table the per-iteration metadata of a paged cache: each request's block-id list
              (block 16) padded to the longest and made an int32 tensor, as vLLM's
              make_tensor_with_pad does
The fast path walks B lengths and touches no page, so its cost depends on B,
not on head sizes; heads are shrunk to 1 x 8 (fp16) with 64 KiB pages so that
B = 256 fits in a small machine's memory. The block table is built on the CPU
only (no copy to a device), which favours it.
Writes benchmarks/results/step_overhead_<machine>.json and a plot.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
from harness import machine, machine_slug, pyplot, save_plot, write_json

import vattn

BATCHES = [1, 4, 16, 64, 128, 256]
LAYERS, KV_HEADS, HEAD_DIM = 32, 1, 8
PAGE = 64 * 1024
BLOCK = 16
REPS = 2000


def median_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def padded_block_table(block_ids: list[list[int]]) -> torch.Tensor:
    width = max(len(b) for b in block_ids)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)


def measure(batch: int, background: bool, rng: random.Random) -> dict:
    lens_list = [rng.randint(512, 4096) for _ in range(batch)]
    with vattn.KVCacheManager(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                              max_batch_size=batch, max_context_len=4096, page_size=PAGE,
                              policy={"background": background, "eager": False}) as kv:
        for _ in range(batch):
            kv.alloc_reqid()
        assert kv.step(lens_list)
        kv.wait_idle()
        step_us = median_us(lambda: kv.step(lens_list), REPS)
        assert kv.stats()["sync_page_maps"] == kv.stats()["pages_mapped"] - kv.stats()["background_page_maps"]
    next_block = iter(range(10**9))
    block_ids = [[next(next_block) for _ in range(-(-n // BLOCK))] for n in lens_list]
    table_us = median_us(lambda: padded_block_table(block_ids), max(50, REPS // 10))
    return {"batch": batch, "background": background, "step_us": step_us, "block_table_us": table_us,
            "block_table_over_step": table_us / step_us}


def main() -> int:
    rng = random.Random(0)
    rows = []
    for i, b in enumerate(BATCHES, 1):
        for background in (False, True):
            r = measure(b, background, rng)
            rows.append(r)
            print(f"[{i}/{len(BATCHES)}] B={b:3d} mapper {'on ' if background else 'off'}: step {r['step_us']:.2f} us, "
                  f"block table {r['block_table_us']:.1f} us ({r['block_table_over_step']:.0f}x)", flush=True)
    m = machine()
    slug = machine_slug(m)
    path = write_json(f"step_overhead_{slug}", {"benchmark": "step_overhead", "machine": m, "layers": LAYERS,
                                                "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE,
                                                "block_size": BLOCK, "results": rows})
    print(f"wrote {path}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for background, style in ((False, "o-"), (True, "s-")):
        sel = [r for r in rows if r["background"] is background]
        ax.plot([r["batch"] for r in sel], [r["step_us"] for r in sel], style,
                label=f"vattn step (mapper {'on' if background else 'off'})")
    sel = [r for r in rows if r["background"]]
    ax.plot([r["batch"] for r in sel], [r["block_table_us"] for r in sel], "^-", label="padded block table (block 16)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("µs per iteration (median)")
    ax.set_title(f"Per-iteration KV metadata cost, {LAYERS} layers — {m['gpu'] or m['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    save_plot(fig, f"step_overhead_{slug}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
