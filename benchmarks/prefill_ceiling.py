"""The host kernel's fp32 prefill against this core's multiply-add ceiling, per
x86 path: how much of the FMA peak a compute-bound call reaches.

    python benchmarks/prefill_ceiling.py                          # every x86 path this CPU runs
    python benchmarks/prefill_ceiling.py --isa avx512 --points llama-3-8b:1:2048
    python benchmarks/prefill_ceiling.py --replot

For every point (``model:batch:prompt``: one layer of an attention_ab.py model
shape, ``batch`` fresh prompts of ``prompt`` tokens each, causal, fp32,
per_layer cache) and path, two calls alternate in each round on one thread
(VATTN_CPU_ATTN_THREADS=1, set here): benchmarks/fma_peak_probe.cpp, twelve
independent chains of vector multiply-adds built with setup.py's flags of
that path's kernel unit, and the kernel's prefill on that path. The prefill's
work is 4 heads_q head_dim multiply-add flops per (query, visible key) pair
(Q K^T and P V, two flops each; a prompt of n tokens has n (n + 1) / 2 such
pairs per head); the probe's is 2 flops per lane per multiply-add. Reported
per point: GFLOP/s of both (median, min and max over rounds) and the
prefill's share of the peak in each round (median, min, max). The softmax,
masking and loads are what keeps the share below 1. Writes
benchmarks/results/prefill_ceiling[_TAG]_<machine>.json and a plot.
"""

from __future__ import annotations

import os

os.environ["VATTN_CPU_ATTN_THREADS"] = "1"  # read when the kernel's pool starts, at its first call

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from attention_ab import Case, model_shape
from decode_bandwidth import CXX, compile_probe
from harness import (RESULTS, draw, git_revision, machine, machine_slug, pyplot, require_current_build, save_plot,
                     write_json)
from torch.utils.dlpack import to_dlpack

from vattn import _cpu_attn

ROOT = Path(__file__).resolve().parents[1]
PROBE_SOURCE = Path(__file__).resolve().parent / "fma_peak_probe.cpp"
# the kernel unit whose setup.py flags build the probe for each x86 path, and that path's floats per vector
PROBE_UNIT = {"avx2": ("kernel_avx2.cpp", 8), "avx512": ("kernel_avx512.cpp", 16)}
PROBE_SECONDS = 0.02  # per probe call: long beside the call's overhead, short beside a prefill


def prefill_flops(batch: int, prompt: int, heads_q: int, head_dim: int) -> int:
    """Multiply-add flops of a causal prefill of ``batch`` fresh prompts of ``prompt`` tokens: for each
    query head and (query, visible key) pair, head_dim multiply-adds in Q K^T and head_dim in P V."""
    return 4 * heads_q * head_dim * batch * (prompt * (prompt + 1) // 2)


def build_probe(isa: str, out: Path) -> ctypes.CDLL:
    """fma_peak_probe.cpp built with the flags of ``isa``'s kernel unit; refuses a build of another width."""
    unit, floats = PROBE_UNIT[isa]
    probe = compile_probe(PROBE_SOURCE, unit, out / f"fma_peak_probe_{isa}.so")
    probe.fma_run.restype = ctypes.c_double
    probe.fma_run.argtypes = [ctypes.c_int64]
    if probe.fma_vector_floats() != floats:
        raise SystemExit(f"the {isa} probe runs {probe.fma_vector_floats()}-float vectors, not {floats}")
    return probe


def probe_call(probe: ctypes.CDLL) -> tuple[Any, int]:
    """A call of the probe of about PROBE_SECONDS and its flops."""
    per_iteration = 2 * probe.fma_chains() * probe.fma_vector_floats()
    iterations = 100_000
    while True:
        t = time.perf_counter()
        probe.fma_run(iterations)
        if time.perf_counter() - t >= PROBE_SECONDS / 2:
            break
        iterations *= 2
    return (lambda: probe.fma_run(iterations)), iterations * per_iteration


def spread(values: list[float], digits: int) -> dict[str, float]:
    return {k: round(f(values), digits) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def measure(probe: ctypes.CDLL, isa: str, model: str, batch: int, prompt: int, rounds: int) -> dict[str, Any]:
    """One point: the probe and the kernel's prefill on ``isa``, alternated over ``rounds``."""
    heads = model_shape(model)
    case = Case("prefill", "per_layer", batch, prompt, 1, "cpu", torch.float32, [], heads)
    try:
        b = case.batch
        plan = _cpu_attn.Plan(list(b.reqids), list(b.cached_lens), list(b.query_lens))
        out = torch.empty_like(case.q)
        args = (plan, to_dlpack(case.q), to_dlpack(case.k_cache), to_dlpack(case.v_cache), to_dlpack(out), None,
                None, None, heads[2] ** -0.5, 0.0, 0, isa)

        def prefill() -> None:
            if _cpu_attn.attention(*args) != isa:
                raise SystemExit(f"the kernel did not run the {isa} path")

        peak_call, peak_flops = probe_call(probe)
        kernel_flops = prefill_flops(batch, prompt, heads[0], heads[2])
        sides = {"peak": (peak_call, peak_flops), "prefill": (prefill, kernel_flops)}
        for call, _ in sides.values():
            call()
        rates: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(rounds):
            for side in (sides if r % 2 == 0 else reversed(list(sides))):
                call, flops = sides[side]
                t = time.perf_counter()
                call()
                rates[side].append(flops / (time.perf_counter() - t) / 1e9)
        shares = [k / p for k, p in zip(rates["prefill"], rates["peak"])]
        return {"model": model, "heads": list(heads), "batch": batch, "prompt": prompt, "dtype": "float32",
                "rounds": rounds, "prefill_flops": kernel_flops,
                "gflop_per_s": {s: spread(v, 1) for s, v in rates.items()}, "share_of_peak": spread(shares, 3)}
    finally:
        case.close()


def parse_point(spec: str) -> tuple[str, int, int]:
    """``model:batch:prompt`` -> (model, batch, prompt)."""
    model, _, rest = spec.partition(":")
    batch, _, prompt = rest.partition(":")
    if not model or not batch.isdigit() or not prompt.isdigit() or int(batch) < 1 or int(prompt) < 1:
        raise SystemExit(f"--points: {spec!r} is not model:batch:prompt (e.g. llama-3-8b:1:2048)")
    model_shape(model)  # refuses an unknown model with the known names
    return model, int(batch), int(prompt)


def result_name(tag: str) -> str:
    return f"prefill_ceiling{'_' + tag if tag else ''}_{machine_slug(machine())}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="llama-3-8b:1:2048,llama-3-8b:4:512,small-8q2kv:1:2048",
                   help="fp32 prefill points, model:batch:prompt, comma-separated")
    p.add_argument("--isa", default=None,
                   help=f"comma-separated paths of {sorted(PROBE_UNIT)} (default: each one this CPU runs)")
    p.add_argument("--rounds", type=int, default=15, help="rounds per point")
    p.add_argument("--tag", default="", help="names the result files prefill_ceiling_<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    name = result_name(args.tag)
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    require_current_build(ROOT)
    supported = _cpu_attn.info()["supported"]
    isas = args.isa.split(",") if args.isa else [i for i in PROBE_UNIT if i in supported]
    for isa in isas:
        if isa not in PROBE_UNIT:
            raise SystemExit(f"--isa: {isa!r} is not one of {sorted(PROBE_UNIT)}")
        if isa not in supported:
            raise SystemExit(f"--isa: this CPU does not run {isa!r} (it runs {supported})")
    if not isas:
        raise SystemExit(f"this CPU runs none of {sorted(PROBE_UNIT)} (it runs {supported})")
    points = [parse_point(s) for s in args.points.split(",")]
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vattn-probe-") as tmp:
        for isa in isas:
            probe = build_probe(isa, Path(tmp))
            for model, batch, prompt in points:
                row = {"isa": isa, **measure(probe, isa, model, batch, prompt, args.rounds)}
                rows.append(row)
                g, s = row["gflop_per_s"], row["share_of_peak"]
                print(f"[{time.perf_counter() - started:5.0f}s] {isa:7s} {model} B={batch} prompt={prompt}: prefill "
                      f"{g['prefill']['median']:.1f} GFLOP/s, peak {g['peak']['median']:.1f}, share "
                      f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]", flush=True)
    payload = {
        "benchmark": "prefill_ceiling",
        "machine": machine(),
        "commit": git_revision(ROOT),
        "threads": 1,
        "unit": "GFLOP/s per call (median, min, max over rounds); share_of_peak: the prefill's GFLOP/s over the "
                "probe's in the same round (1: every cycle a full-width multiply-add on each FMA pipe)",
        "results": rows,
    }
    print(f"wrote {write_json(name, payload)}")
    draw(plot, payload, name, "prefill_ceiling.py")


def plot(payload: dict, name: str) -> None:
    """The prefill's share of the FMA peak per point and path, with its range over rounds."""
    plt = pyplot()
    rows = payload["results"]
    labels = [f"{r['isa']}\n{r['model']}\nB={r['batch']} n={r['prompt']}" for r in rows]
    med = [r["share_of_peak"]["median"] for r in rows]
    err = [[m - r["share_of_peak"]["min"] for m, r in zip(med, rows)],
           [r["share_of_peak"]["max"] - m for m, r in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(rows)), 4))
    ax.bar(range(len(rows)), med, yerr=err, capsize=3)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("prefill GFLOP/s / FMA peak GFLOP/s")
    ax.set_ylim(0, 1.1)
    fig.suptitle(f"fp32 prefill against the FMA peak, one thread ({payload['commit']})", fontsize=9)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
