"""Time of the `step` that admits a new request of 1K-16K tokens: synchronous
allocation against deferred reclamation + eager allocation (vAttention paper,
Fig. 11).

    python benchmarks/prefill.py [--device cuda] [--prompts 1024,4096] [--reps 5]

Llama-3-8B KV shapes (32 layers, 8 KV heads x 128, fp16), host backend with
page sizes 64 KiB and 2 MiB, or ``--device cuda`` with the driver's
granularity (the mapping work on a GPU's critical path: cuMemCreate,
cuMemMap, cuMemSetAccess). For each prompt length, one earlier request of the same
length has finished just before (the steady state of a server), then
alloc_reqid(prompt_len) + step([prompt_len]) is timed:
  sync     background, deferred_reclaim and eager off: free_reqid unmapped the
           finished request, so the step maps every page of the prompt
  policies the defaults: the finished request's pages stay mapped and
           alloc_reqid hands out that slot; the mapper keeps the next slot
           pre-mapped for eager_tokens (1024)
A cold case (the first request ever, pages never created) is timed too.
Writes benchmarks/results/prefill_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from harness import machine, machine_slug, pyplot, save_plot, write_json

import vattn

KiB, MiB = 1024, 1024 * 1024
PROMPTS = [1024, 2048, 4096, 8192, 16384]
REPS = 5
MODES = {
    "sync": {"background": False, "deferred_reclaim": False, "eager": False},
    "policies": {"background": True, "deferred_reclaim": True, "eager": True},
}


def admit_us(kv: vattn.KVCacheManager, prompt: int) -> float:
    t = time.perf_counter()
    r = kv.alloc_reqid(prompt)
    lens = [0] * kv.config.max_batch_size
    lens[r] = prompt
    assert kv.step(lens)
    elapsed = (time.perf_counter() - t) * 1e6
    kv.free_reqid(r)
    return elapsed


def measure(device: str, page_size: int | None, mode: str, prompt: int, reps: int) -> dict:
    with vattn.KVCacheManager(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                              max_batch_size=2, max_context_len=max(PROMPTS + [prompt]), page_size=page_size,
                              device=device, policy=MODES[mode]) as kv:
        kv.wait_idle()
        cold = admit_us(kv, prompt)
        warm = []
        for _ in range(reps):
            kv.wait_idle()  # the server's other work between arrivals
            warm.append(admit_us(kv, prompt))
        s = kv.stats()
    return {"device": device, "page_size": kv.page_size, "mode": mode, "prompt": prompt, "cold_us": cold,
            "steady_us": statistics.median(warm), "sync_page_maps": s["sync_page_maps"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (host backend) or cuda")
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="comma list of prompt lengths (tokens)")
    p.add_argument("--reps", type=int, default=REPS)
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    sizes: list[int | None] = [64 * KiB, 2 * MiB] if args.device == "cpu" else [None]
    cases = [(ps, p, mode) for ps in sizes for p in prompts for mode in MODES]
    rows = []
    for i, (ps, prompt, mode) in enumerate(cases, 1):
        r = measure(args.device, ps, mode, prompt, args.reps)
        rows.append(r)
        print(f"[{i}/{len(cases)}] {r['page_size'] // KiB:4d} KiB, {prompt:5d} tokens, {mode:8s}: steady {r['steady_us']:9.1f} us, "
              f"cold {r['cold_us']:9.1f} us", flush=True)
    for r in rows:
        if r["mode"] == "policies":
            base = next(x for x in rows if x["mode"] == "sync" and x["page_size"] == r["page_size"]
                        and x["prompt"] == r["prompt"])
            r["speedup_steady"] = base["steady_us"] / r["steady_us"]
    m = machine()
    slug = machine_slug(m)
    path = write_json(f"prefill_{slug}", {"benchmark": "prefill", "machine": m, "results": rows})
    print(f"wrote {path}")
    plt = pyplot()
    shown = sorted({r["page_size"] for r in rows})
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), sharey=True, squeeze=False)
    for ax, ps in zip(axes[0], shown):
        for mode, style in (("sync", "o-"), ("policies", "s-")):
            sel = [r for r in rows if r["mode"] == mode and r["page_size"] == ps]
            ax.plot([r["prompt"] for r in sel], [r["steady_us"] for r in sel], style, label=f"{mode} (steady)")
            ax.plot([r["prompt"] for r in sel], [r["cold_us"] for r in sel], style, alpha=0.35, label=f"{mode} (cold)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{ps // KiB} KiB pages", fontsize=9)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("alloc_reqid + step, µs")
    fig.suptitle(f"Admitting a prefill, 32 layers, {args.device} — {m['gpu'] or m['cpu']}", fontsize=9)
    save_plot(fig, f"prefill_{slug}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
