"""Several models on one machine: static KV partitions (stock vLLM) against
one elastic budget (vLLM + vattn), on the same bursty trace in one run.

    python benchmarks/multi_model.py [--models 2|3] [--rounds 2] [--aa] [--budget-mib N]
                                     [--dtype auto|bfloat16|float32] [--serve [--tp2]] [--tag T] [--replot]

Each model is a random-weight Llama-style checkpoint of its own width (4
layers, 2 KV heads of 64, so the same KV bytes per token), served by its own
vLLM-CPU engine in its own process, all engines at once, in ``--dtype``:
``auto`` (the default) is bfloat16 where the CPU has AVX-512 BF16 or AMX
(vLLM-CPU's bf16 matmuls need them to be fast; the committed results ran so)
and float32 elsewhere. The trace sends bursts of requests (prompts of 256-1024
tokens, 128-256 output tokens, arriving within half a second) to one model
after the other, every ``--period-s`` seconds; between its bursts a model is
idle.

The total KV memory B fits one burst's peak (every request of the largest
burst at full length), unless ``--budget-mib`` says otherwise. Three
configurations serve the same trace:

- ``stock static``: stock vLLM, each engine given B / k (``kv_cache_memory_bytes``),
  what a user does today to put k models on one machine;
- ``vattn static``: vLLM + vattn with the same B / k each (how much of the
  difference is vattn's kernel rather than elasticity);
- ``vattn elastic``: vLLM + vattn, every engine in one budget of B
  (``VATTN_BUDGET``; vLLM's pools are virtual, 1 GiB each). An engine gives its
  free blocks' pages back after ``--idle-release-s`` without a request, or at
  once when another engine waits for pages.

Each round runs the three in alternating order (fresh processes, the round's
own prompts). Reported per model and configuration: time to first token
(mean and p99 over all its requests; measured from the request's arrival, so
queueing for KV memory counts) and throughput (generated tokens over the
seconds from a burst's first arrival to its last answer, mean over bursts).
The ratios of stock static to vattn elastic come pooled over the rounds and
per round, as a median with its 95% bootstrap interval (three rounds or more
give one); ``--aa`` runs stock static a second time in every round, and the
same ratios of stock static to itself show how far noise alone moves them.
KV memory over time: the budget's account (bytes of pages that exist, by
engine; never above B), blocks in use in each engine's scheduler, and the
engines' resident memory (VmRSS, and RssShmem: vattn's pages are shared
memory, counted there while a request's row maps them; free pages kept for
reuse are in no page table, so only the budget's account shows them). Writes
benchmarks/results/multi_model_<k>models[_fp32]_<machine>.json and .png.

The comparison holds only while the CPU keeps up with the trace: each burst
served before the next one starts, so that a model is idle between its
bursts. Where even ``vattn elastic`` (all of B for the busy model) answers a
burst's last request after the next burst has begun, the engines queue for
the CPU and the times to first token measure that queue, not KV memory: the
script then says so, prints no comparison, writes the run to
``..._overloaded.json`` (not over a result) and exits with status 1; a longer
``--period-s``, fewer ``--burst-requests`` or float32 may fit the CPU.

``--serve``: the engines are OpenAI-compatible API servers
(``python -m vllm.entrypoints.openai.api_server``) in vLLM's default process
layout (API server, engine-core process, worker process per rank), and the
trace arrives over HTTP: each request a streamed completion of its prompt's
token ids, time to first token measured at the client from the request's
arrival to its first streamed token; preemptions from the servers'
``/metrics``; memory as the servers' process groups' resident memory and,
under the budget, each engine core's account. ``--tp2``: the first model's
server runs tensor parallel 2 (a worker process per rank, one CPU each).
Writes ``..._serve[_tp2]_<machine>.json`` and .png (``--tag T``: ``..._T_<machine>``).

SIGTERM or SIGINT (Ctrl-C) stops the engines and removes the budget's
segment before the script exits (status 128 + the signal's number).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import (RESULTS, ROOT, describe_ratio, machine, machine_slug, publish, pyplot, ratio_summary, round_order,
                     save_plot, write_json)
from multi_model_runs import (BLOCK, MAX_MODEL_LEN, SAMPLE_S, MiB, burst_throughput, late_bursts, percentile,
                              read_rss, run_outcome)
from multi_model_serve import run_config_serve
from workloads.vllm_launch import SCENARIO

VOCAB = (3, 256)
MODELS = [  # name, layers, hidden, query heads (KV heads: 2 of hidden / query heads = 64)
    ("llama-4x512", 4, 512, 8),
    ("llama-4x768", 4, 768, 12),
    ("llama-4x384", 4, 384, 6),
]
"""Models of different widths, with the same KV bytes per token (4 layers, 2 KV heads of 64), so one B / k
share is as tight for each."""
CONFIGS = ("stock static", "vattn static", "vattn elastic")
STOCK, ELASTIC = "stock static", "vattn elastic"
AGAIN = f"{STOCK}-again"  # --aa: stock static a second time in every round, the A/A pair's other half
PROMPT_TOKENS = (256, 1024)  # per request, uniform
OUTPUT_TOKENS = (128, 256)  # chat-like answers: a request holds its blocks for a few seconds
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
DTYPE_TAGS = {"bfloat16": "", "float32": "_fp32"}  # in result file names: bf16 keeps the committed names


def kv_bytes_per_token(layers: int, dtype: str = "bfloat16") -> int:
    return 2 * layers * 2 * 64 * DTYPE_BYTES[dtype]  # K and V, 2 KV heads of 64


def auto_dtype(isa: list[str]) -> str:
    """bfloat16 where the CPU (harness.machine()'s ``isa``) has AVX-512 BF16
    or AMX, whose instructions vLLM-CPU's bf16 matmuls use; float32 elsewhere."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(isa) else "float32"


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: unwinds through every ``finally`` (engines killed, budget removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise :class:`Stopped` once; a second signal during the clean-up is ignored."""

    def handler(signum: int, frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def make_trace(k: int, bursts: int, burst_requests: int, period_s: float, seed: int) -> list[list[dict]]:
    """Per model, its requests: burst j goes to model j % k at j * period_s."""
    rng = random.Random(seed)
    trace: list[list[dict]] = [[] for _ in range(k)]
    for j in range(bursts):
        t = 1.0 + j * period_s
        for _ in range(burst_requests):
            trace[j % k].append(dict(arrival_s=round(t + rng.uniform(0, 0.5), 4), burst=j,
                                     prompt=[rng.randrange(*VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))],
                                     max_tokens=rng.randint(*OUTPUT_TOKENS)))
    return trace


def burst_peak_bytes(requests: list[dict], layers: int, dtype: str = "bfloat16") -> int:
    """KV bytes of one burst with every request at full length, in whole blocks."""
    blocks = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // BLOCK) for r in requests)
    return blocks * BLOCK * kv_bytes_per_token(layers, dtype)


class Sampler(threading.Thread):
    """Every SAMPLE_S: the engines' resident memory and, for a budget, its account."""

    def __init__(self, procs: list[subprocess.Popen], budget_name: str | None) -> None:
        super().__init__(daemon=True)
        self.procs, self.budget, self.stop = procs, None, threading.Event()
        if budget_name:
            import vattn

            self.budget = vattn.Budget.attach(budget_name)
        self.samples: list[dict] = []

    def run(self) -> None:
        while not self.stop.is_set():
            sample = {"unix": time.time(), "rss": [read_rss(p.pid) for p in self.procs]}
            if self.budget is not None:
                usage = self.budget.usage()
                held = {p.pid: p.held_bytes for p in usage.processes}
                sample["budget_held"] = [held.get(p.pid, 0) for p in self.procs]
            self.samples.append(sample)
            time.sleep(SAMPLE_S)


def run_config(config: str, args: argparse.Namespace, models: list[tuple], trace: list[list[dict]],
               budget_bytes: int, tmp: Path, label: str) -> dict:
    """Starts one engine per model, all at once, replays the trace, and returns their results."""
    import vattn

    print(f"[{time.strftime('%H:%M:%S')}] {label}: {len(models)} engines ...", flush=True)
    k = len(models)
    start_dir = tmp / f"start-{label.replace(' ', '-')}"
    start_dir.mkdir()
    budget = None
    # (VLLM_CPU_KVCACHE_SPACE would override the engines' kv_cache_memory_bytes)
    environ = {n: v for n, v in os.environ.items()
               if not n.startswith(("VATTN_VLLM", "VATTN_BUDGET")) and n != "VLLM_CPU_KVCACHE_SPACE"}
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = dict(dtype=args.dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=args.burst_requests,
                  enable_prefix_caching=True, block_size=BLOCK)
    if config == "vattn elastic":
        budget = vattn.Budget.create(f"multi-model-{os.getpid()}", budget_bytes)
        environ.update(VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S=str(args.idle_release_s),
                       VLLM_CPU_KVCACHE_SPACE="1")
    else:
        engine["kv_cache_memory_bytes"] = budget_bytes // k
    if config.startswith("vattn"):
        environ["VATTN_VLLM"] = "1"
    procs, outs, logs = [], [], []
    try:
        for (name, *_), requests in zip(models, trace):
            spec = tmp / f"{label}-{name}.spec.json".replace(" ", "-")
            spec.write_text(json.dumps(dict(engine=engine, requests=requests,
                                            warmup=[[7] * 256, [9] * 300],
                                            start=dict(dir=str(start_dir), parties=k))))
            outs.append(spec.with_suffix("").with_suffix(".out.json"))
            logs.append(open(spec.with_suffix("").with_suffix(".log"), "w"))
            procs.append(subprocess.Popen([args.python, str(SCENARIO), "serve", str(tmp / name), str(spec),
                                           str(outs[-1])], stdout=logs[-1], stderr=subprocess.STDOUT,
                                          env=environ, cwd=tmp))
        sampler = Sampler(procs, budget.name if budget else None)
        sampler.start()
        last = time.monotonic()
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
            if time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"  ... {sum(p.poll() is None for p in procs)} engines still serving", flush=True)
        sampler.stop.set()
        sampler.join()
        for p, (name, *_), log in zip(procs, models, logs):
            log.close()
            if p.returncode:
                sys.exit(f"{label}: the engine of {name} failed:\n{Path(log.name).read_text()[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if budget is not None:
            budget.remove(force=True)  # the engines were ended: whatever is left goes
    results = [json.loads(o.read_text()) for o in outs]
    for result, requests, (name, layers, *_) in zip(results, trace, models):
        for served, asked in zip(result["requests"], requests):
            served["burst"] = asked["burst"]
        pool_bytes = result["num_blocks"] * BLOCK * kv_bytes_per_token(layers, args.dtype)
        if "kv_cache_memory_bytes" in engine and pool_bytes > engine["kv_cache_memory_bytes"]:
            sys.exit(f"{label}: the engine of {name} has {pool_bytes} bytes of KV blocks, more than its share "
                     f"{engine['kv_cache_memory_bytes']}")
        result["pool_bytes"] = pool_bytes
    start = min(r["start_unix"] for r in results)
    return run_outcome(models, results, sampler.samples, start, budget is not None, budget_bytes, args.period_s)


# ---- --serve: API servers in vLLM's default layout, the trace over HTTP ----------------------------------------


def blocks_in_use(engines: list[dict]) -> dict[str, list]:
    """The engines' schedulers' blocks in use, added up, in bytes, at every step of any engine."""
    events = sorted((t, j, blocks * e["usage_block_bytes"]) for j, e in enumerate(engines)
                    for t, blocks in e["usage_series"])
    in_use = [0] * len(engines)
    t_s, total = [], []
    for t, j, nbytes in events:
        in_use[j] = nbytes
        t_s.append(t)
        total.append(sum(in_use))
    return {"blocks_in_use_t_s": t_s, "blocks_in_use_bytes": total}


def summarize(models: list[tuple], runs: dict[str, list[dict]]) -> dict:
    """Per model and configuration, the time to first token over every round's requests and the
    throughput; then the ratios of stock static to vattn elastic, pooled over the rounds and, per round
    (each round its own trace, the same for every configuration), as a median with its interval
    (harness.ratio_summary); with the A/A pair (``AGAIN`` in ``runs``), the same ratios of stock static
    to itself."""
    out: dict = {}
    for i, (name, *_) in enumerate(models):
        row: dict = {}
        for config in runs:
            requests = [q for run in runs[config] for q in run["engines"][i]["requests"]]
            ttft = [q["ttft_s"] for q in requests]
            row[config] = {
                "ttft_mean_s": statistics.fmean(ttft),
                "ttft_p99_s": percentile(ttft, 99),
                "ttft_mean_s_rounds": [round(statistics.fmean(q["ttft_s"] for q in run["engines"][i]["requests"]), 3)
                                       for run in runs[config]],
                "tokens_per_s_per_burst": statistics.fmean(burst_throughput(run["engines"][i]["requests"])
                                                           for run in runs[config]),
                "tokens_per_s_rounds": [round(burst_throughput(run["engines"][i]["requests"]), 3)
                                        for run in runs[config]],
                "preemptions": sum(run["engines"][i]["preemptions"] for run in runs[config]),
            }
        stock, elastic = row[STOCK], row[ELASTIC]
        row["ttft_mean_ratio_stock_static_over_vattn_elastic"] = stock["ttft_mean_s"] / elastic["ttft_mean_s"]
        row["ttft_p99_ratio_stock_static_over_vattn_elastic"] = stock["ttft_p99_s"] / elastic["ttft_p99_s"]
        row["throughput_ratio_vattn_elastic_over_stock_static"] = (elastic["tokens_per_s_per_burst"]
                                                                   / stock["tokens_per_s_per_burst"])
        pairs = [("ttft", STOCK, ELASTIC, "ttft_mean_s_rounds"), ("throughput", ELASTIC, STOCK, "tokens_per_s_rounds")]
        for what, top, bottom, key in pairs:  # > 1: vattn elastic ahead
            row[f"{what}_rounds"] = ratio_summary([t / b for t, b in zip(row[top][key], row[bottom][key])])
            if AGAIN in runs:
                row[f"{what}_rounds_aa"] = ratio_summary([t / b for t, b in zip(row[STOCK][key], row[AGAIN][key])])
        out[name] = row
    return out


def plot(payload: dict, name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    budget = payload["budget_bytes"] / MiB
    ax = axes[0]
    mem = payload["memory_first_round"]
    e = mem["vattn elastic"]
    ax.plot(e["t_s"], [b / MiB for b in e["budget_held_bytes"]], label="elastic: budget held")
    for i, model in enumerate(payload["models"]):
        ax.plot(e["t_s"], [b / MiB for b in e["budget_held_bytes_per_model"][i]], lw=0.8, ls=":",
                label=f"elastic: held by {model['name']}")
    ax.plot(e["t_s"], [b / MiB for b in e["rss_shmem_bytes"]], lw=0.8,
            label="elastic: RssShmem (pages mapped)")
    s = mem["stock static"]
    if "blocks_in_use_t_s" in s:  # the in-process engines' schedulers (not known over HTTP: --serve)
        ax.step(s["blocks_in_use_t_s"], [b / MiB for b in s["blocks_in_use_bytes"]], where="post", lw=0.8,
                label="stock static: blocks in use")
    ax.axhline(budget, color="k", ls="--", lw=1, label=f"B = {budget:.0f} MiB")
    ax.set_xlim(left=-1)
    ax.set_ylim(0, budget * 1.8)  # room for the legend above the curves
    ax.set_xlabel("seconds since the trace started (round 1)")
    ax.set_ylabel("KV MiB")
    ax.set_title("KV memory over time")
    ax.legend(fontsize=7, loc="upper left", ncol=2, columnspacing=0.8, handlelength=1.5)
    summary = payload["summary"]
    names = list(summary)
    width = 0.8 / len(CONFIGS)
    for ax, key, ylabel, title in ((axes[1], "ttft_mean_s", "seconds", "time to first token, mean (p99 dotted)"),
                                   (axes[2], "tokens_per_s_per_burst", "generated tokens/s",
                                    "throughput per burst")):
        for c, config in enumerate(CONFIGS):
            xs = [x + (c - 1) * width for x in range(len(names))]
            ax.bar(xs, [summary[n][config][key] for n in names], width, label=config)
            if key == "ttft_mean_s":
                ax.scatter(xs, [summary[n][config]["ttft_p99_s"] for n in names], marker="_", s=200, color="k")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    served = ", API servers over HTTP" + (" (first with tensor parallel 2)" if payload.get("tp2") else "") \
        if payload.get("serve") else ""
    fig.suptitle(f"{len(names)} models on one {payload['machine']['cores']}-core machine, total KV B = "
                 f"{budget:.0f} MiB, vLLM-CPU {payload['vllm']}{served}")
    save_plot(fig, name)


def result_name(models: int, dtype: str, serve: bool, tp2: bool, slug: str, tag: str = "") -> str:
    """``multi_model_<k>models[_fp32][_serve[_tp2]][_TAG]_<machine>``: ``tag`` (``--tag``) tells apart runs on
    machines of one size (their CPUs, say)."""
    served = ("_serve" + ("_tp2" if tp2 else "")) if serve else ""
    return f"multi_model_{models}models{DTYPE_TAGS[dtype]}{served}{'_' + tag if tag else ''}_{slug}"


def main() -> None:
    stop_on_signals()
    try:
        run(sys.argv[1:])
    except Stopped as e:
        name = signal.Signals(e.signum).name
        print(f"multi_model: stopped by {name}: the engines were stopped and the budget removed", file=sys.stderr)
        sys.exit(128 + e.signum)


def overload(models: list[tuple], runs: dict[str, list[dict]], period_s: float) -> dict[str, dict[str, list]]:
    """Per model, the late bursts of ``vattn elastic`` in each round (:func:`late_bursts`), for the models
    that had any: even with all of B for the busy model, the CPU did not keep up with the trace."""
    late = {}
    for i, (name, *_) in enumerate(models):
        rounds = [late_bursts(run["engines"][i]["requests"], period_s) for run in runs["vattn elastic"]]
        if any(rounds):
            late[name] = rounds
    return late


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=os.environ.get("VATTN_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
                   help="interpreter of the vLLM environment")
    p.add_argument("--models", type=int, default=2, choices=(2, 3), help="engines (one model each)")
    p.add_argument("--bursts", type=int, default=8, help="bursts in the trace, alternating between the models")
    p.add_argument("--burst-requests", type=int, default=16, help="requests per burst (also max_num_seqs)")
    p.add_argument("--period-s", type=float, default=6.0, help="seconds between the starts of two bursts")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="total KV memory B, MiB (default: the largest burst's peak)")
    p.add_argument("--idle-release-s", type=float, default=2.0,
                   help="vattn elastic: seconds without a request after which an engine gives its free pages back")
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration, in alternating order "
                   "(3 or more give the per-round ratios an interval)")
    p.add_argument("--aa", action="store_true",
                   help="run stock static twice in every round: the A/A pair, the noise floor beside the ratios")
    p.add_argument("--dtype", choices=("auto", *DTYPE_BYTES), default="auto",
                   help="the engines' dtype; auto: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32")
    p.add_argument("--serve", action="store_true",
                   help="API servers in vLLM's default layout, the trace over HTTP, TTFT from the first streamed token")
    p.add_argument("--tp2", action="store_true", help="--serve: the first model's server with tensor parallel 2")
    p.add_argument("--tag", default="", help="a label in the result's name, before the machine (e.g. the CPU: avx512)")
    p.add_argument("--replot", action="store_true", help="redraw the figure from the JSON of an earlier run")
    args = p.parse_args(argv)
    for what, value, low in (("--bursts", args.bursts, args.models), ("--burst-requests", args.burst_requests, 1),
                             ("--rounds", args.rounds, 1)):
        if value < low:
            p.error(f"{what} must be >= {low}, got {value}")
    if args.period_s <= 0 or args.idle_release_s < 0:
        p.error("--period-s must be > 0 and --idle-release-s >= 0")
    m = machine()
    if args.dtype == "auto":
        args.dtype = auto_dtype(m["isa"])
    if args.tp2 and not args.serve:
        p.error("--tp2 needs --serve")
    if args.tag and not args.tag.replace("-", "").isalnum():
        p.error(f"--tag must be letters, digits and '-', got {args.tag!r}")
    name = result_name(args.models, args.dtype, args.serve, args.tp2, machine_slug(m), args.tag)
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    models = MODELS[:args.models]
    traces = [make_trace(args.models, args.bursts, args.burst_requests, args.period_s, seed=i)
              for i in range(args.rounds)]
    peak = max(burst_peak_bytes([r for r in reqs if r["burst"] == j], layers, args.dtype)
               for trace in traces for (_, layers, *_), reqs in zip(models, trace)
               for j in {r["burst"] for r in reqs})
    budget_bytes = int(args.budget_mib * MiB) if args.budget_mib else peak
    print(f"{args.dtype}; budget B = {budget_bytes / MiB:.1f} MiB (largest burst at full length: {peak / MiB:.1f} "
          f"MiB); static partitions: {budget_bytes / args.models / MiB:.1f} MiB each", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS + ((AGAIN,) if args.aa else ())}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model_name, layers, hidden, heads in models:
            if args.serve:  # with a tokenizer: the API server needs one
                subprocess.run([args.python, "-m", "vattn", "make-model", str(tmp / model_name), "--layers",
                                str(layers), "--hidden", str(hidden), "--query-heads", str(heads), "--max-positions",
                                str(MAX_MODEL_LEN)], check=True, capture_output=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
            else:
                subprocess.run([args.python, str(SCENARIO), "make-model", str(tmp / model_name), str(layers),
                                str(hidden), str(heads), str(MAX_MODEL_LEN)], check=True, capture_output=True)
        for i in range(args.rounds):
            for config in round_order(list(CONFIGS), STOCK if args.aa else None, i):
                runner = run_config_serve if args.serve else run_config
                runs[config].append(runner(config.removesuffix("-again"), args, models, traces[i], budget_bytes,
                                           tmp, f"{config} (round {i + 1})"))
    for config in runs:
        for run in runs[config]:
            if not args.serve:
                run["memory"].update(blocks_in_use(run["engines"]))
    summary = summarize(models, runs)
    first = {c: runs[c][0]["memory"] for c in CONFIGS}
    payload = {
        "benchmark": "multi_model", "machine": m, "vllm": "0.32.0 (vllm-cpu)",
        "models": [dict(name=n, layers=layers, hidden=hidden, query_heads=heads, kv_heads=2, head_dim=64,
                        dtype=args.dtype, kv_bytes_per_token=kv_bytes_per_token(layers, args.dtype))
                   for n, layers, hidden, heads in models],
        "trace": dict(bursts=args.bursts, burst_requests=args.burst_requests, period_s=args.period_s,
                      prompt_tokens=PROMPT_TOKENS, max_tokens=OUTPUT_TOKENS, arrival_spread_s=0.5,
                      order="burst j to model j % k"),
        "budget_bytes": budget_bytes, "largest_burst_peak_bytes": peak,
        "engine": dict(dtype=args.dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=args.burst_requests,
                       block_size=BLOCK, enable_prefix_caching=True, enforce_eager=True,
                       engine_core=("own process: vLLM's default layout (API server, engine core, worker per "
                                    "rank)" if args.serve else "in-process")),
        "serve": args.serve, "tp2": args.tp2,
        "ttft": ("client side: from the request's arrival to its first streamed token (HTTP)" if args.serve
                 else "from the request's arrival to its first token, in the engine's process"),
        "configs": {"stock static": f"stock vLLM, kv_cache_memory_bytes = B / {args.models} each",
                    "vattn static": f"vLLM + vattn, kv_cache_memory_bytes = B / {args.models} each",
                    "vattn elastic": f"vLLM + vattn, one budget of B (VATTN_BUDGET), virtual pools of 1 GiB, "
                                     f"VATTN_VLLM_IDLE_RELEASE_S={args.idle_release_s}"},
        "rounds": args.rounds, "aa": f"{STOCK} twice per round" if args.aa else None,
        "order": "round 1: stock static, vattn static, vattn elastic (then stock static again with --aa); every "
                 "other round reversed; fresh processes; each round its own prompts, the same for every "
                 "configuration",
        "summary": summary,
        "budget_held_peak_bytes": max(max(r["memory"]["budget_held_bytes"], default=0)
                                      for r in runs["vattn elastic"]),
        "memory_first_round": first,
    }
    late = overload(models, runs, args.period_s)
    if late:
        payload["overloaded"] = {"late_bursts_vattn_elastic": late, "period_s": args.period_s}
        path = write_json(f"{name}_overloaded", payload)
        sys.exit(f"the trace overloads this CPU: with all of B for the busy model (vattn elastic), bursts were "
                 f"still being served when the next one began ({late}, per model and round, bursts every "
                 f"{args.period_s} s), so the engines queued for the CPU and the times to first token measure "
                 f"that queue, not KV memory; no comparison is reported. Try a longer --period-s, fewer "
                 f"--burst-requests, or --dtype float32 where the CPU lacks AVX-512 BF16 (this run: {args.dtype}). "
                 f"The run's data: {path}")
    for model, row in summary.items():
        for what, label in (("ttft", "mean TTFT, stock static / vattn elastic"),
                            ("throughput", "throughput, vattn elastic / stock static")):
            print(describe_ratio(f"{model} {label}", row[f"{what}_rounds"]))
            if f"{what}_rounds_aa" in row:
                print(describe_ratio(f"{model} {what} A/A, stock static / stock static", row[f"{what}_rounds_aa"]))
    publish(name, payload, plot, summary)


if __name__ == "__main__":
    main()
