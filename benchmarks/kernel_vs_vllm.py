"""vattn's host attention kernel against vLLM-CPU's own kernel on the same
shapes and the same K/V, in one process, with an A/A pair beside it.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/kernel_vs_vllm.py
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/kernel_vs_vllm.py --model llama-3-8b \\
        --points 1:2048:float32:prefill,8:2048:bfloat16 --rounds 30 --threads 2 --tag llama8b
    python benchmarks/kernel_vs_vllm.py --replot

For every point (``batch:ctx:dtype[:phase]``, one layer of ``--model``,
per_layer cache; phase ``prefill``: ``ctx`` fresh prompt tokens per request,
causal, or ``decode`` (default): one new token over ``ctx`` cached ones) the
K/V are written once into a vattn cache and copied into vLLM's paged cache of
``--vllm-block`` tokens per block, as benchmarks/attention_host.py does. Three
calls are timed: vattn's kernel on the cache in place (``host``), vLLM's
kernel as its CPU attention backend calls it (``vllm``), and vLLM's kernel
again on a second copy of its cache into a second output (``vllm_again``: the
A/A pair, the same kernel twice, shows how far noise alone moves a ratio).
The outputs must agree before anything is timed. Each round runs the three in
an order that rotates from round to round, each once after ``--flush-mb`` MiB
were written (cold: its K/V come from the last-level cache or DRAM, as for a
layer in a forward) and once straight after (warm). Per round: vllm / host
(above 1: vattn's kernel is faster) and vllm / vllm_again; reported as the
median over rounds with its 95% bootstrap interval and verdict
(docs/benchmarks.md, "Reading an A/B"). Both kernels run on ``--threads``
threads (vattn's: VATTN_CPU_ATTN_THREADS; vLLM's: torch's OpenMP pool).
Writes benchmarks/results/kernel_vs_vllm[_TAG]_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from attention_ab import MODELS, Case, model_shape
from attention_host import vllm_available, vllm_kernels
from harness import (RESULTS, ROOT, describe_ratio, draw, git_revision, machine, machine_slug, point_label, pyplot,
                     ratio_summary, require_current_build, save_plot, write_json)
from host_kernel_ab import parse_point

from vattn.attention import host_attention, host_attention_info

KERNELS = ("host", "vllm", "vllm_again")


def kernels(case: Case, block: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The three timed calls of one point, each into its own output."""
    out = torch.empty_like(case.q)
    return {"host": lambda: host_attention(case.q, case.k_cache, case.v_cache, case.batch, out=out),
            "vllm": vllm_kernels(case, [], block)["vllm"],
            "vllm_again": vllm_kernels(case, [], block)["vllm"]}


def beside_vllm(script: str, threads: int) -> None:
    """Refuses to go on without vLLM's CPU build (naming ``script``, the benchmark asking), and runs both
    kernels, vattn's and torch's (vLLM's) OpenMP threads, on ``threads`` threads."""
    why = vllm_available()
    if why:
        raise SystemExit(f"{script} needs vLLM's CPU build: {why} (run it with vLLM's interpreter, "
                         f"e.g. PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/{script}.py)")
    if threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {threads}")
    os.environ["VATTN_CPU_ATTN_THREADS"] = str(threads)  # read at the kernel's first call
    torch.set_num_threads(threads)


def measure(case: Case, block: int, rounds: int, flush: torch.Tensor) -> dict[str, Any]:
    """Per-round times (us) of the three calls, cold and warm, and the ratios'
    summaries; ``rounds`` fewer where one call takes over 20 ms."""
    calls = kernels(case, block)
    outs = {name: call() for name, call in calls.items()}
    for name in ("vllm", "vllm_again"):  # the same attention, or no timing
        torch.testing.assert_close(outs[name].float(), outs["host"].float(), rtol=2e-2, atol=2e-2)
    t = time.perf_counter()
    calls["host"]()
    rounds = min(rounds, max(8, int(rounds * 20e-3 / (time.perf_counter() - t))))
    times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in KERNELS} for s in ("cold", "warm")}
    for r in range(rounds):
        for name in KERNELS[r % 3:] + KERNELS[:r % 3]:  # each kernel first, second and third in turn
            flush.add_(1.0)
            t = time.perf_counter()
            calls[name]()
            times["cold"][name].append((time.perf_counter() - t) * 1e6)
            t = time.perf_counter()
            calls[name]()
            times["warm"][name].append((time.perf_counter() - t) * 1e6)
    row: dict[str, Any] = {"rounds": rounds}
    for state, by_kernel in times.items():
        row[state] = {
            "us": {k: round(statistics.median(v), 2) for k, v in by_kernel.items()},
            "vllm_over_host": ratio_summary([v / h for v, h in zip(by_kernel["vllm"], by_kernel["host"])]),
            "aa_vllm_over_vllm": ratio_summary([a / b for a, b in zip(by_kernel["vllm"], by_kernel["vllm_again"])]),
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small-8q2kv", help=f"one of {sorted(MODELS)} or name:heads_q:heads_kv:head_dim")
    p.add_argument("--points", default="1:512:float32:prefill,1:2048:float32:prefill,4:512:float32:prefill,"
                                        "1:512:bfloat16:prefill,1:2048:bfloat16:prefill,4:512:bfloat16:prefill,"
                                        "8:2048:float32,8:2048:bfloat16,16:1024:bfloat16",
                   help="batch:ctx:dtype[:phase] points, comma-separated")
    p.add_argument("--rounds", type=int, default=30, help="rounds per point (fewer for calls above 20 ms)")
    p.add_argument("--threads", type=int, default=1, help="threads of both kernels")
    p.add_argument("--vllm-block", type=int, default=128, help="tokens per block of vLLM's paged cache")
    p.add_argument("--flush-mb", type=int, default=4, help="MiB written before each cold call")
    p.add_argument("--tag", default="", help="names the result files kernel_vs_vllm_<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    name = f"kernel_vs_vllm{'_' + args.tag if args.tag else ''}_{machine_slug(machine())}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    require_current_build(ROOT)
    beside_vllm("kernel_vs_vllm", args.threads)
    shape = model_shape(args.model)
    points = [parse_point(spec) for spec in args.points.split(",")]
    flush = torch.zeros(args.flush_mb << 18)
    rows, started = [], time.perf_counter()
    for n, (batch, ctx, dtype, phase) in enumerate(points, 1):
        case = Case(phase, "per_layer", batch, ctx, 1, "cpu", getattr(torch, dtype), [], shape)
        try:
            row = {"batch": batch, "ctx": ctx, "dtype": dtype, "phase": phase,
                   **measure(case, args.vllm_block, args.rounds, flush)}
        finally:
            case.close()
        rows.append(row)
        print(f"[{n}/{len(points)} {time.perf_counter() - started:5.0f}s] {dtype} {phase} B={batch} ctx={ctx}, "
              f"{row['rounds']} rounds", flush=True)
        for state in ("cold", "warm"):
            us = row[state]["us"]
            print(f"    {state}: host {us['host']:.1f} us, vllm {us['vllm']:.1f} us; "
                  f"{describe_ratio('vllm/host', row[state]['vllm_over_host'])}; "
                  f"A/A {row[state]['aa_vllm_over_vllm']['median']:.3f}x "
                  f"{[round(x, 3) for x in row[state]['aa_vllm_over_vllm']['interval_95']]}", flush=True)
    info = host_attention_info()
    payload = {
        "benchmark": "kernel_vs_vllm",
        "machine": machine(),
        "commit": git_revision(ROOT),
        "vllm": __import__("vllm").__version__,
        "model": args.model,
        "heads": list(shape),
        "threads": args.threads,
        "isa": info.get("isa"),
        "vllm_block": args.vllm_block,
        "flush_mb": args.flush_mb,
        "argv": sys.argv[1:],
        "unit": "median us per call (one layer); vllm_over_host above 1: vattn's kernel is faster; "
                "aa_vllm_over_vllm: vLLM's kernel against itself",
        "results": rows,
    }
    print(f"wrote {write_json(name, payload)}")
    draw(plot, payload, name, "kernel_vs_vllm.py")


def plot(payload: dict, name: str) -> None:
    """vllm / host per point with its interval, cold and warm, the A/A beside."""
    plt = pyplot()
    rows = payload["results"]
    labels = [point_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    for offset, (state, key, label) in zip((-0.3, -0.1, 0.1, 0.3), (
            ("cold", "vllm_over_host", "vllm / host, cold"), ("warm", "vllm_over_host", "vllm / host, warm"),
            ("cold", "aa_vllm_over_vllm", "A/A, cold"), ("warm", "aa_vllm_over_vllm", "A/A, warm"))):
        medians = [r[state][key]["median"] for r in rows]
        low = [m - r[state][key]["interval_95"][0] for m, r in zip(medians, rows)]
        high = [r[state][key]["interval_95"][1] - m for m, r in zip(medians, rows)]
        ax.bar([x + offset for x in range(len(rows))], medians, 0.2, yerr=[low, high], capsize=2, label=label,
               alpha=0.5 if key.startswith("aa") else 1.0)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(range(len(rows))), labels, fontsize=7)
    ax.set_ylabel("vLLM kernel time / vattn kernel time")
    ax.set_title(f"vattn's host kernel against vLLM-CPU's ({payload['model']}, {payload['threads']} thread(s), "
                 f"{payload['isa']})", fontsize=9)
    ax.legend(fontsize=7)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
