"""Memory mapped vs memory used, per page size and layout (why small pages and
all_layers matter; see driver_patch/README.md).

    python benchmarks/fragmentation.py [--requests N] [--seed S]

Requests draw a prompt and an output length from lognormal distributions with
the means the vLLM paper reports for ShareGPT conversations (161 prompt and
338 output tokens, sigma 1), contexts capped at 4096 tokens, and are observed
at a uniformly drawn point of their decode: context = prompt + k, k in
[1, output]. For the per-token KV sizes of Yi-6B (32 layers, 4 KV heads x 128),
Llama-3-8B (32 x 8 x 128) and Yi-34B (60 x 8 x 128), fp16, page sizes 64 KiB,
128 KiB, 256 KiB and 2 MiB and both layouts, the requests are stepped in
batches through a host-backend manager and its page table gives the bytes
mapped and used (`stats()`), the same page arithmetic as on a GPU; the JSON
sums them over all requests.

per_layer keeps 2N buffers that each hold the same pages for a request, so
one layer's K and V buffers are mapped and the figures multiplied by N (the
host would otherwise commit N times the memory for the same answer);
all_layers maps its two full-width buffers as they are.

Writes benchmarks/results/fragmentation_<machine>.json and a PNG.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch
from harness import machine, machine_slug, pyplot, save_plot, write_json

import vattn

KiB, MiB, GiB = 1024, 1024 * 1024, 1024**3
MODELS = {  # layers, KV heads, head dim (fp16)
    "Yi-6B": (32, 4, 128),
    "Llama-3-8B": (32, 8, 128),
    "Yi-34B": (60, 8, 128),
}
PAGE_SIZES = [64 * KiB, 128 * KiB, 256 * KiB, 2 * MiB]
LAYOUTS = ["per_layer", "all_layers"]
PROMPT_MEAN, OUTPUT_MEAN, SIGMA, MAX_CONTEXT = 161, 338, 1.0, 4096
BATCH = 4  # requests mapped at once: bounds the memory the host commits
FLOOR_PERCENT = 0.01  # plot floor for the log axis


def lognormal(rng: random.Random, mean: float) -> int:
    mu = math.log(mean) - SIGMA**2 / 2  # so that the mean is `mean`
    return max(1, round(rng.lognormvariate(mu, SIGMA)))


def context_lengths(n: int, seed: int) -> list[int]:
    """Tokens each request holds when observed (prompt + part of its output)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, output = lognormal(rng, PROMPT_MEAN), lognormal(rng, OUTPUT_MEAN)
        out.append(min(MAX_CONTEXT, prompt + rng.randint(1, output)))
    return out


def measure(model: str, layout: str, page_size: int, lengths: list[int]) -> dict:
    layers, heads, head_dim = MODELS[model]
    measured_layers = 1 if layout == "per_layer" else layers
    scale = layers // measured_layers  # per_layer: N identical K/V buffer pairs
    kv = vattn.KVCacheManager(num_layers=measured_layers, num_kv_heads=heads, head_dim=head_dim,
                              dtype=torch.float16, max_batch_size=BATCH, max_context_len=MAX_CONTEXT,
                              page_size=page_size, layout=layout, physical_memory=4 * GiB,
                              policy={"background": False, "eager": False})
    mapped = used = 0
    waste_per_request = []  # bytes mapped but unused, all layers
    with kv:
        token_bytes = kv.config.token_bytes * scale  # K and V of every layer
        for start in range(0, len(lengths), BATCH):
            batch = lengths[start:start + BATCH]
            reqids = [kv.alloc_reqid() for _ in batch]
            lens = [0] * BATCH
            for r, n in zip(reqids, batch):
                lens[r] = n
            if not kv.step(lens):
                raise RuntimeError(f"{model} {layout} {page_size}: the 4 GiB pool cannot hold {batch} tokens")
            s = kv.stats()
            mapped += s["bytes_mapped"] * scale
            used += s["bytes_used"] * scale
            for r, n in zip(reqids, batch):
                waste_per_request.append(kv.mapped_bytes(r) * scale - n * token_bytes)
                kv.free_reqid(r)
            kv.reclaim()  # unmap the finished batch before the next
    return {
        "model": model,
        "layout": layout,
        "page_size": page_size,
        "bytes_mapped": mapped,  # summed over every request, each observed once
        "bytes_used": used,  # likewise
        "overhead": mapped / used - 1,  # mapped but unused, as a fraction of used
        "waste_per_request_mib": {
            "mean": statistics.fmean(waste_per_request) / MiB,
            "p99": sorted(waste_per_request)[int(0.99 * (len(waste_per_request) - 1))] / MiB,
            "max_possible": (2 * layers if layout == "per_layer" else 2) * page_size / MiB,
        },
        "per_layer_scaled_from_one_layer": layout == "per_layer",
    }


def plot(results: list[dict], name: str, requests: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    width = 0.8 / len(MODELS)
    for ax, layout in zip(axes, LAYOUTS):
        for m, model in enumerate(MODELS):
            rows = [next(r for r in results if r["model"] == model and r["layout"] == layout
                         and r["page_size"] == p) for p in PAGE_SIZES]
            xs = [i + (m - (len(MODELS) - 1) / 2) * width for i in range(len(PAGE_SIZES))]
            # a floor keeps a zero overhead visible on the log axis; its label says 0.0
            bars = ax.bar(xs, [max(100 * r["overhead"], FLOOR_PERCENT) for r in rows], width, label=model)
            for bar, r in zip(bars, rows):
                ax.annotate(f"{r['waste_per_request_mib']['mean']:.1f}", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(PAGE_SIZES)), ["64 KiB", "128 KiB", "256 KiB", "2 MiB"])
        ax.set_xlabel("page size")
        ax.set_yscale("log")
        ax.set_title(f"{layout}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("memory mapped but unused, % of used (log)")
    axes[0].legend()
    fig.suptitle(f"KV memory mapped vs used, {requests} ShareGPT-like requests mid-decode "
                 "(labels: mean MiB wasted per request)", fontsize=10)
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512, help="requests per configuration (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.requests < BATCH:
        parser.error(f"--requests must be at least {BATCH}, got {args.requests}")
    lengths = context_lengths(args.requests, args.seed)
    print(f"{len(lengths)} requests: mean context {statistics.fmean(lengths):.0f} tokens, "
          f"median {statistics.median(lengths):.0f}, max {max(lengths)}")
    results = []
    configs = [(m, lay, p) for m in MODELS for lay in LAYOUTS for p in PAGE_SIZES]
    t0 = time.perf_counter()
    for i, (model, layout, page_size) in enumerate(configs, 1):
        r = measure(model, layout, page_size, lengths)
        results.append(r)
        print(f"[{i:2d}/{len(configs)}] {model:10s} {layout:10s} {page_size // KiB:5d} KiB: "
              f"sum over requests: mapped {r['bytes_mapped'] / GiB:7.2f} GiB, used {r['bytes_used'] / GiB:6.2f} GiB, "
              f"overhead {100 * r['overhead']:7.1f}%, {r['waste_per_request_mib']['mean']:6.1f} MiB/request wasted "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    m = machine()
    name = f"fragmentation_{machine_slug(m)}"
    path = write_json(name, {
        "machine": m,
        "requests": args.requests,
        "seed": args.seed,
        "distribution": {"prompt_mean": PROMPT_MEAN, "output_mean": OUTPUT_MEAN, "sigma": SIGMA,
                         "max_context": MAX_CONTEXT, "context_mean": statistics.fmean(lengths),
                         "context_median": statistics.median(lengths), "context_max": max(lengths)},
        "models": {k: {"layers": v[0], "kv_heads": v[1], "head_dim": v[2], "dtype": "float16"}
                   for k, v in MODELS.items()},
        "results": results,
    })
    print(f"wrote {path}")
    plot(results, name, args.requests)


if __name__ == "__main__":
    main()
