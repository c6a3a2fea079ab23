"""Two builds of the host attention kernel (csrc/cpu_attn) timed against each
other in one process: the way to decide whether a kernel change is faster on
a machine whose speed drifts by more than the change (two processes timed one
after the other disagree by 10-40% on a shared VM; an A/A pair of builds here
agrees within a few percent).

    python benchmarks/host_kernel_ab.py HEAD~1               # HEAD~1 against the working tree
    python benchmarks/host_kernel_ab.py main my-branch --points 1:128:float32,16:2048:bfloat16
    python benchmarks/host_kernel_ab.py main . --model small-8q2kv --points 4:512:bfloat16,1:2048:bfloat16:prefill
    python benchmarks/host_kernel_ab.py HEAD HEAD            # A/A: how far apart equal builds read
    python benchmarks/host_kernel_ab.py HEAD~1 --tag mychange   # results as host_kernel_ab_mychange_<machine>.*
    python benchmarks/host_kernel_ab.py --replot             # redraw the plot from the JSON (with --tag: that one)

Each side (a git revision, or ``.`` for the working tree) is compiled from its
own csrc/cpu_attn with its own setup.py's per-unit ISA flags into a module of
its own name and C++ namespace (``-Dvattn=...``, ``-D_cpu_attn=...``), so both
load side by side. For every point (``batch:ctx:dtype[:phase]``, one layer of
``--model``, per_layer cache; phase ``decode`` (default: one new token over
``ctx`` cached ones) or ``prefill`` (``ctx`` new tokens per request, causal))
both modules attend over the same vattn cache into their own outputs (at the
same offset within a page, twin_outputs), on the
path ``--isa`` names (default: each build's own choice); the outputs must
agree before anything is timed.
Rounds alternate the order (base first, then test first); in each, a side's
call runs once after ``--flush-mb`` MiB were written (``cold``: the K/V come
from the last-level cache or DRAM, as for a layer whose cache other layers
evicted) and once straight after (``warm``). Reported: median microseconds
per call and base / test (above 1: the test build is faster), both of the
medians and within each round: the per-round ratio's median with its 95%
bootstrap interval and verdict (harness.ratio_summary). Run ``HEAD HEAD`` for
the A/A pair beside an A/B. Writes
benchmarks/results/host_kernel_ab_<machine>.json (``--tag T``:
host_kernel_ab_T_<machine>.json) and a plot.
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import importlib.util
import json
import platform
import statistics
import subprocess
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from attention_ab import MODELS, Case, model_shape
from harness import (RESULTS, describe_ratio, draw, machine, machine_slug, point_label, pyplot, ratio_summary, save_plot,
                     write_json)
from torch.utils.dlpack import to_dlpack

ROOT = Path(__file__).resolve().parents[1]
CXX = "g++"


def source_tree(rev: str, into: Path) -> tuple[Path, str]:
    """(directory holding csrc/ and setup.py of ``rev``, its commit or "working tree")."""
    if rev == ".":
        return ROOT, "working tree"
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"{rev!r} is not a commit of this checkout (give a git revision, or . for the working tree)")
    commit = found.stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "csrc", "setup.py"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into, commit


@functools.lru_cache(maxsize=None)
def accepts(flag: str) -> bool:
    return subprocess.run([CXX, flag, "-x", "c++", "-c", "-o", "/dev/null", "-"], input="int x;\n",
                          capture_output=True, text=True).returncode == 0


def build(tree: Path, name: str, out: Path) -> Path:
    """vattn._cpu_attn of ``tree`` as module ``name`` (C++ namespace renamed alike), in ``out``."""
    import pybind11  # only to build: the interpreters that import parse_point need not have it
    spec = importlib.util.spec_from_file_location(f"setup_of_{name}", tree / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # its setup() runs only as __main__
    flags = setup.isa_flags(platform.machine())
    kernel_flags = getattr(setup, "KERNEL_FLAGS", [])  # (trees before it had none)
    # as setup.py builds it: Python's CFLAGS first (-fwrapv among them), then the extension's, then the unit's
    python_flags = (sysconfig.get_config_var("CFLAGS") or "").split()
    common = [*python_flags, "-std=c++17", "-O3", *kernel_flags, "-fPIC", "-fvisibility=hidden",
              f"-Dvattn={name}_ns", f"-D_cpu_attn={name}",
              f"-I{tree / 'csrc' / 'cpu_attn'}", f"-I{tree / 'csrc'}", f"-I{tree / 'csrc' / 'cuda_vmm'}", f"-I{pybind11.get_include()}",
              f"-I{sysconfig.get_paths()['include']}"]
    sources = [tree / s for s in setup.CPU_ATTN_SOURCES]

    def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
        obj = out / f"{name}_{src.stem}.o"
        extra = setup.usable_flags(flags.get(src.name, []), accepts)
        return obj, subprocess.run([CXX, *common, *extra, "-c", str(src), "-o", str(obj)], capture_output=True,
                                   text=True)

    with ThreadPoolExecutor() as pool:
        built = list(pool.map(compile_one, sources))
    for src, (_, proc) in zip(sources, built):
        if proc.returncode != 0:
            raise SystemExit(f"{CXX} failed on {src}:\n{proc.stderr[-3000:]}")
    library = out / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([CXX, "-shared", "-pthread", *(str(o) for o, _ in built), "-o", str(library)], check=True)
    return library


def load(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def twin_outputs(like: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` disjoint tensors shaped like ``like`` whose addresses agree modulo 4 KiB, 2 KiB away from
    ``like``'s: each side's output relates alike to the query and the cache it reads. Outputs taken one
    after the other from the allocator sit at different page offsets, and for calls of a few microseconds
    with the K/V warm that alone read 1.00-1.13x between two equal builds (the side with the later
    allocation faster)."""
    page, size = 4096, like.numel() * like.element_size()
    stride = -(-size // page) * page  # bytes from one output to the next: whole pages
    flat = torch.empty((n * stride + 2 * page) // like.element_size(), dtype=like.dtype)
    target = (like.data_ptr() + page // 2) % page
    offset = (target - flat.data_ptr()) % page  # bytes to the first output
    elements = [(offset + i * stride) // like.element_size() for i in range(n)]
    return [flat[e:e + like.numel()].view(like.shape) for e in elements]


def measure(modules: list[ModuleType], batch: int, ctx: int, dtype: torch.dtype, shape: tuple[int, int, int],
            flush: torch.Tensor, rounds: int, phase: str = "decode", isa: str | None = None) -> dict[str, Any]:
    """Median us per call, cold and warm, of each module on one point (``phase``
    decode or prefill) on the path ``isa`` (None: each module's default); the
    base's time over the test's within each round, as a ratio_summary (median,
    95% interval, verdict); and the rounds run: ``rounds``, or fewer where a
    call takes over 8 ms."""
    case = Case(phase, "per_layer", batch, ctx, 1, "cpu", dtype, [], shape)
    try:
        b = case.batch
        scale = shape[2] ** -0.5
        calls, outs = [], []
        for m, out in zip(modules, twin_outputs(case.q, len(modules))):
            plan = m.Plan(list(b.reqids), list(b.cached_lens), list(b.query_lens))
            args = (plan, to_dlpack(case.q), to_dlpack(case.k_cache), to_dlpack(case.v_cache), to_dlpack(out),
                    None, None, None, scale, 0.0, 0, isa)
            calls.append(functools.partial(m.attention, *args))
            outs.append(out)
        for call in calls:
            call()
        torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=1e-2, atol=1e-2)
        t = time.perf_counter()
        calls[0]()
        rounds = min(rounds, max(6, int(rounds * 8e-3 / (time.perf_counter() - t))))  # calls over 8 ms: fewer rounds
        cold: list[list[float]] = [[] for _ in modules]
        warm: list[list[float]] = [[] for _ in modules]
        for r in range(rounds):
            for i in (range(len(modules)) if r % 2 == 0 else reversed(range(len(modules)))):
                flush.add_(1.0)
                t = time.perf_counter()
                calls[i]()
                cold[i].append(time.perf_counter() - t)
                t = time.perf_counter()
                calls[i]()
                warm[i].append(time.perf_counter() - t)
        return {"rounds": rounds, "cold_us": [round(statistics.median(c) * 1e6, 2) for c in cold],
                "warm_us": [round(statistics.median(w) * 1e6, 2) for w in warm],
                "base_over_test_per_round": {state: ratio_summary([b / t for b, t in zip(times[0], times[1])])
                                             for state, times in (("cold", cold), ("warm", warm))}}
    finally:
        case.close()


def parse_point(spec: str) -> tuple[int, int, str, str]:
    """``batch:ctx:dtype[:phase]`` -> (batch, ctx, dtype, phase)."""
    parts = spec.split(":")
    phase = parts[3] if len(parts) == 4 else "decode"
    if len(parts) not in (3, 4) or phase not in ("decode", "prefill") or not hasattr(torch, parts[2]):
        raise SystemExit(f"--points: {spec!r} is not batch:ctx:dtype[:phase] (phase decode or prefill)")
    return int(parts[0]), int(parts[1]), parts[2], phase


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", nargs="?", help="git revision of the base build, or . for the working tree")
    p.add_argument("test", nargs="?", default=".", help="git revision of the test build (default: the working tree)")
    p.add_argument("--points", default="1:128:float32,4:512:float32,16:2048:float32,1:8192:float32,"
                                        "1:128:bfloat16,4:512:bfloat16,16:2048:bfloat16,1:8192:bfloat16",
                   help="points, batch:ctx:dtype[:phase] (phase decode, the default, or prefill), comma-separated")
    p.add_argument("--model", default="llama-3-8b", help=f"one of {sorted(MODELS)} or name:heads_q:heads_kv:head_dim")
    p.add_argument("--isa", default=None, help="the path both builds run (e.g. avx2; default: each build's choice)")
    p.add_argument("--flush-mb", type=int, default=4, help="MiB written before each cold call")
    p.add_argument("--rounds", type=int, default=60, help="rounds per point (fewer for points above 8 ms)")
    p.add_argument("--tag", default="", help="names the result files host_kernel_ab_<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from this machine's JSON")
    args = p.parse_args()
    name = f"host_kernel_ab_{args.tag + '_' if args.tag else ''}{machine_slug(machine())}"
    if args.replot:
        plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    if args.base is None:
        p.error("give the base revision (or --replot)")
    shape = model_shape(args.model)
    with tempfile.TemporaryDirectory(prefix="vattn-ab-") as tmp:
        sides = []
        for label, rev in (("base", args.base), ("test", args.test)):
            tree, commit = source_tree(rev, Path(tmp) / label)
            print(f"building {label} ({rev}: {commit}) ...", flush=True)
            sides.append((label, rev, commit, load(f"_cpu_attn_ab_{label}", build(tree, f"_cpu_attn_ab_{label}",
                                                                                   Path(tmp)))))
    modules = [m for *_, m in sides]
    flush = torch.zeros(args.flush_mb << 18)
    rows = []
    started = time.perf_counter()
    points = [parse_point(spec) for spec in args.points.split(",")]
    for n, (batch, ctx, dtype, phase) in enumerate(points, 1):
        times = measure(modules, batch, ctx, getattr(torch, dtype), shape, flush, args.rounds, phase, args.isa)
        row = dict(batch=batch, ctx=ctx, dtype=dtype, phase=phase, **times,
                   base_over_test={k: round(times[f"{k}_us"][0] / times[f"{k}_us"][1], 3) for k in ("cold", "warm")})
        rows.append(row)
        print(f"[{n}/{len(points)} {time.perf_counter() - started:5.0f}s] {dtype:8s} {phase:7s} B={batch:<3d} "
              f"ctx={ctx:<6d} "
              f"cold {times['cold_us'][0]:9.1f} -> {times['cold_us'][1]:9.1f} us ({row['base_over_test']['cold']:.2f}x)  "
              f"warm {times['warm_us'][0]:9.1f} -> {times['warm_us'][1]:9.1f} us ({row['base_over_test']['warm']:.2f}x)",
              flush=True)
        for state, q in times["base_over_test_per_round"].items():
            print(f"    {describe_ratio(f'{state} base/test per round', q)}", flush=True)
    payload = {
        "benchmark": "host_kernel_ab",
        "machine": machine(),
        "model": args.model,
        "base": {"rev": sides[0][1], "commit": sides[0][2]},
        "test": {"rev": sides[1][1], "commit": sides[1][2]},
        "threads": modules[0].info()["threads"],
        "isa": args.isa or modules[0].info()["isa"],
        "flush_mb": args.flush_mb,
        "unit": "median us per call (one layer, per_layer cache); base_over_test (of the medians) above 1: the test "
                "build is faster; base_over_test_per_round: the ratio within each round, its median, 95% interval "
                "and verdict",
        "results": rows,
    }
    print(f"wrote {write_json(name, payload)}")
    draw(plot, payload, name, "host_kernel_ab.py")


def plot(payload: dict, name: str) -> None:
    """base / test per point, cold and warm bars, 1 marked."""
    plt = pyplot()
    rows = payload["results"]
    labels = [point_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["base_over_test"]["cold"] for r in rows], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [r["base_over_test"]["warm"] for r in rows], 0.4, label="warm")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("base time / test time")
    ax.set_title(f"host kernel A/B: {payload['base']['rev']} vs {payload['test']['rev']} ({payload['model']}, "
                 f"{payload['threads']} threads, {payload['isa']})", fontsize=9)
    ax.legend()
    save_plot(fig, name)


if __name__ == "__main__":
    main()
