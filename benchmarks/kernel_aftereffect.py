"""What an attention kernel leaves behind for the ops after it: the rest of a
decoder layer (o_proj, norms, MLP, the next layer's qkv) timed right after
vattn's host kernel and right after vLLM-CPU's kernel, in one process.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/kernel_aftereffect.py
    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/kernel_aftereffect.py --points 8:3500:bfloat16 --threads 1

In vLLM serving (benchmarks/vllm_serving.py) the part of a forward outside the
attention layers ran shorter beside vattn than in stock vLLM on the long
traces, though both run the same model code there. One explanation would be
the kernel's wake: the caches it leaves cold or dirty, the OpenMP threads it
leaves spinning. This isolates it. Every round runs the three kernels of
benchmarks/kernel_vs_vllm.py (vattn's, vLLM's, vLLM's again on a second copy
of its cache: the A/A pair) in rotating order, each followed at once by the
same layer rest on ``B`` tokens (the shapes of the serving benchmark's long
model: hidden 512, intermediate 1024, 8 query / 2 KV heads of 64, bf16
weights), and times the rest alone. Reported per point: the rest's time after
vLLM's kernel over its time after vattn's, and after vLLM's over after vLLM's
again, each as the median of per-round ratios with its 95% interval
(harness.ratio_summary). Writes
benchmarks/results/kernel_aftereffect[_TAG]_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from attention_ab import Case, model_shape
from harness import (RESULTS, ROOT, describe_ratio, draw, git_revision, machine, machine_slug, point_label, pyplot,
                     ratio_summary, require_current_build, save_plot, write_json)
from host_kernel_ab import parse_point
from kernel_vs_vllm import KERNELS, beside_vllm, kernels

HIDDEN, INTERMEDIATE = 512, 1024  # benchmarks/vllm_serving.py's long model (vattn.cli.make_model: 2 x hidden)


def layer_rest(tokens: int, dtype: torch.dtype, heads: tuple[int, int, int]):
    """A decoder layer's work outside attention on ``tokens`` tokens, as a call."""
    heads_q, heads_kv, head_dim = heads
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * cols ** -0.5).to(dtype)

    w_o, w_gate_up = weight(HIDDEN, heads_q * head_dim), weight(2 * INTERMEDIATE, HIDDEN)
    w_down, w_qkv = weight(HIDDEN, INTERMEDIATE), weight((heads_q + 2 * heads_kv) * head_dim, HIDDEN)
    norm = torch.ones(HIDDEN, dtype=dtype)
    attn_out = torch.randn(tokens, heads_q * head_dim, generator=gen).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    linear, rms_norm = torch.nn.functional.linear, torch.nn.functional.rms_norm

    def rest() -> torch.Tensor:
        h = linear(attn_out, w_o) + residual
        gate_up = linear(rms_norm(h, (HIDDEN,), norm), w_gate_up)
        h = linear(torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:], w_down) + h
        return linear(rms_norm(h, (HIDDEN,), norm), w_qkv)
    return rest


def measure(case: Case, rounds: int) -> dict[str, Any]:
    """Per kernel: median us of the kernel and of the layer rest after it; the rest's ratios per round."""
    calls = kernels(case, 128)
    rest = layer_rest(case.q.shape[0], case.q.dtype, (case.heads_q, case.heads_kv, case.head_dim))
    for call in calls.values():
        call()
    rest()
    kernel_us: dict[str, list[float]] = {k: [] for k in KERNELS}
    rest_us: dict[str, list[float]] = {k: [] for k in KERNELS}  # the layer rest, after each kernel
    for r in range(rounds):
        for name in KERNELS[r % 3:] + KERNELS[:r % 3]:
            start = time.perf_counter()
            calls[name]()
            between = time.perf_counter()
            rest()
            kernel_us[name].append((between - start) * 1e6)
            rest_us[name].append((time.perf_counter() - between) * 1e6)
    return {"rounds": rounds,
            "kernel_us": {k: round(statistics.median(v), 2) for k, v in kernel_us.items()},
            "rest_us": {k: round(statistics.median(v), 2) for k, v in rest_us.items()},
            "rest_after_vllm_over_after_host": ratio_summary([v / h for v, h in zip(rest_us["vllm"], rest_us["host"])]),
            "aa_rest_after_vllm_over_after_vllm_again": ratio_summary(
                [a / b for a, b in zip(rest_us["vllm"], rest_us["vllm_again"])])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="8:3500:bfloat16,8:1024:bfloat16,1:4096:bfloat16:prefill",
                   help="batch:ctx:dtype[:phase] points of the small-8q2kv heads, comma-separated")
    p.add_argument("--rounds", type=int, default=300, help="rounds per point (fewer for kernels above 2 ms)")
    p.add_argument("--threads", type=int, default=2, help="threads of both kernels and of the rest's ops")
    p.add_argument("--tag", default="", help="names the result files kernel_aftereffect_<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    name = f"kernel_aftereffect{'_' + args.tag if args.tag else ''}_{machine_slug(machine())}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    require_current_build(ROOT)
    beside_vllm("kernel_aftereffect", args.threads)
    shape = model_shape("small-8q2kv")
    rows, started = [], time.perf_counter()
    points = [parse_point(spec) for spec in args.points.split(",")]
    for n, (batch, ctx, dtype, phase) in enumerate(points, 1):
        case = Case(phase, "per_layer", batch, ctx, 1, "cpu", getattr(torch, dtype), [], shape)
        try:
            vllm_kernel = kernels(case, 128)["vllm"]
            vllm_kernel()  # (its first call is not a measure of the next)
            probe = time.perf_counter()
            vllm_kernel()
            rounds = min(args.rounds, max(40, int(args.rounds * 4e-3 / (time.perf_counter() - probe))))
            row = {"batch": batch, "ctx": ctx, "dtype": dtype, "phase": phase, **measure(case, rounds)}
        finally:
            case.close()
        rows.append(row)
        label = point_label(row).replace("\n", " ")
        print(f"[{n}/{len(points)} {time.perf_counter() - started:5.0f}s] {label}: kernels "
              f"{row['kernel_us']} us, the rest after each {row['rest_us']} us", flush=True)
        print(f"    {describe_ratio('rest after vllm / after vattn', row['rest_after_vllm_over_after_host'])}")
        aa = row["aa_rest_after_vllm_over_after_vllm_again"]
        print(f"    {describe_ratio('A/A: after vllm / after vllm again', aa)}", flush=True)
    payload = {"benchmark": "kernel_aftereffect", "machine": machine(),
               "commit": git_revision(ROOT), "vllm": __import__("vllm").__version__,
               "model": "small-8q2kv", "rest": {"hidden": HIDDEN, "intermediate": INTERMEDIATE},
               "threads": args.threads,
               "unit": "median us per call; rest_after_vllm_over_after_host above 1: the layer rest runs slower "
                       "after vLLM's kernel than after vattn's; aa_*: after vLLM's kernel against after itself",
               "results": rows}
    print(f"wrote {write_json(name, payload)}")
    draw(plot, payload, name, "kernel_aftereffect.py")


def plot(payload: dict, name: str) -> None:
    """The rest's ratio per point with its interval, the A/A beside."""
    plt = pyplot()
    rows = payload["results"]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 3.5))
    for offset, key, label in ((-0.15, "rest_after_vllm_over_after_host", "after vLLM's kernel / after vattn's"),
                               (0.15, "aa_rest_after_vllm_over_after_vllm_again", "A/A")):
        medians = [r[key]["median"] for r in rows]
        low = [m - r[key]["interval_95"][0] for m, r in zip(medians, rows)]
        high = [r[key]["interval_95"][1] - m for m, r in zip(medians, rows)]
        ax.bar([x + offset for x in range(len(rows))], medians, 0.3, yerr=[low, high], capsize=3, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(range(len(rows))), [point_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("layer rest's time, ratio")
    ax.set_title(f"A decoder layer's rest after each attention kernel ({payload['threads']} thread(s))", fontsize=9)
    ax.legend(fontsize=7)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
