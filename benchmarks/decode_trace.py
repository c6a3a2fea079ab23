"""Per-iteration `step` latency in a decode loop, background mapper on vs off
(vAttention paper, Fig. 10).

    python benchmarks/decode_trace.py [--iterations N] [--compute-ms MS]

Four requests (Llama-3-8B KV shapes: 32 layers, 8 KV heads x 128, fp16) start
from 1000-token prompts and decode one token per iteration; between steps the
loop sleeps `--compute-ms` to stand for the model's forward pass (on a GPU the
CPU is free then, and so is it here). For page sizes 64 KiB, 256 KiB, 2 MiB
and both layouts, it records every step's latency and marks the iterations
where some request crossed into a new page. Targets: with the mapper on,
`sync_page_maps` stays 0 after the prefill, and page-crossing iterations cost
at most 1.2x the others. Writes benchmarks/results/decode_trace_<machine>.json
and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine, machine_slug, pyplot, save_plot, write_json  # noqa: E402

import vattn  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
LAYERS, KV_HEADS, HEAD_DIM, BATCH, PROMPT = 32, 8, 128, 4, 1000


def run(page_size: int, layout: str, background: bool, iterations: int, compute_s: float) -> dict:
    kv = vattn.KVCacheManager(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                              max_batch_size=BATCH, max_context_len=PROMPT + iterations + 16, page_size=page_size,
                              layout=layout, background=background, eager=False)
    with kv:
        for _ in range(BATCH):
            kv.alloc_reqid()
        tokens_per_page = page_size // kv.config.token_bytes_per_buffer
        lens = [PROMPT] * BATCH
        assert kv.step(lens)  # prefill
        prefill_sync = kv.stats()["sync_page_maps"]
        latencies, crossing = [], []  # crossing: iterations whose step needs a new page
        for i in range(iterations):
            time.sleep(compute_s)
            lens = [n + 1 for n in lens]
            t = time.perf_counter()
            assert kv.step(lens)
            latencies.append(round((time.perf_counter() - t) * 1e6, 2))
            if tokens_per_page <= 1 or (lens[0] - 1) % tokens_per_page == 0:  # the last page was full
                crossing.append(i)
        s = kv.stats()
    marked = set(crossing)
    cross = [x for i, x in enumerate(latencies) if i in marked]
    other = [x for i, x in enumerate(latencies) if i not in marked]
    summary = {
        "page_size": page_size, "layout": layout, "background": background,
        "tokens_per_page": tokens_per_page,
        "sync_page_maps_after_prefill": s["sync_page_maps"] - prefill_sync,
        "background_page_maps": s["background_page_maps"],
        "step_wait_us": s["step_wait_us"],
        "median_us": statistics.median(latencies),
        "crossing_median_us": statistics.median(cross) if cross else None,
        "other_median_us": statistics.median(other) if other else None,
        "crossing_iterations": len(cross),
        "latencies_us": latencies,
        "crossing_iteration_indices": crossing,
    }
    if cross and other:
        summary["crossing_over_other"] = summary["crossing_median_us"] / summary["other_median_us"]
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=1100)
    p.add_argument("--compute-ms", type=float, default=1.0)
    args = p.parse_args()
    cases = [(ps, layout, bg) for ps in (64 * KiB, 256 * KiB, 2 * MiB) for layout in ("per_layer", "all_layers")
             for bg in (False, True)]
    results = []
    for i, (ps, layout, bg) in enumerate(cases, 1):
        r = run(ps, layout, bg, args.iterations, args.compute_ms / 1e3)
        results.append(r)
        ratio = r.get("crossing_over_other")
        print(f"[{i}/{len(cases)}] {ps // KiB:4d} KiB {layout:10s} mapper {'on ' if bg else 'off'}: "
              f"median {r['median_us']:.1f} us, crossing {r['crossing_median_us'] or 0:.1f} us "
              f"({r['crossing_iterations']} its), others {r['other_median_us'] or 0:.1f} us"
              + (f", ratio {ratio:.2f}" if ratio else "")
              + f", sync maps after prefill {r['sync_page_maps_after_prefill']}", flush=True)
    m = machine()
    slug = machine_slug(m)
    path = write_json(f"decode_trace_{slug}", {"benchmark": "decode_trace", "machine": m,
                                               "compute_ms": args.compute_ms, "batch": BATCH, "prompt": PROMPT,
                                               "layers": LAYERS, "results": results})
    print(f"wrote {path}")
    plt = pyplot()
    shown = [(ps, layout) for ps in (64 * KiB, 2 * MiB) for layout in ("per_layer", "all_layers")]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.4 * len(shown)), sharex=True)
    for ax, (ps, layout) in zip(axes, shown):
        for r in results:
            if r["page_size"] == ps and r["layout"] == layout:
                ax.plot(r["latencies_us"], lw=0.7, label=f"mapper {'on' if r['background'] else 'off'}")
        ax.set_yscale("log")
        ax.set_ylabel("step µs")
        ax.set_title(f"{ps // KiB} KiB pages, {layout}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("decode iteration")
    fig.suptitle(f"step latency per decode iteration, batch {BATCH}, {LAYERS} layers — {m['gpu'] or m['cpu']}",
                 fontsize=9)
    save_plot(fig, f"decode_trace_{slug}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
