"""The host kernel's decode against a plain read of the same K/V bytes, per ISA:
how much of the read bandwidth a decode reaches on this machine.

    python benchmarks/decode_bandwidth.py                        # every vector ISA this CPU runs
    python benchmarks/decode_bandwidth.py --isa avx512_bf16 --points 8:4096:bfloat16
    python benchmarks/decode_bandwidth.py --replot --isa avx2    # redraw that ISA's plot from its JSON

For every point (``batch:ctx:dtype``, one decode token per request over ``ctx``
cached ones, one layer of ``--model``, per_layer cache) and ISA, two calls read
the same vattn cache: the kernel of this checkout (``vattn._cpu_attn``, built
in place) on that ISA's path, and benchmarks/kv_read_probe.cpp, a loop that
loads every K and V byte of the batch once with that ISA's vector width (built
with setup.py's flags of the ISA's kernel unit) and adds them as integers.
Both run on one thread (VATTN_CPU_ATTN_THREADS=1, set here): the probe has no
thread pool, and on a shared 2-core machine a second thread measures the
neighbours. Rounds alternate the order; in each, a call runs once after
``--flush-mb`` MiB were written (``cold``: K/V from memory) and once straight
after (``warm``: from the caches). The default flush is 256 MiB, or eight times
the last-level cache where that is larger: on a 2-core Zen 4 (32 MiB of L3) a
64 MiB flush left part of a point's K/V in the L3, whose replacement keeps
lines that were read before against a stream of new ones; the plain read of
1-8 MiB ran 15-36 GB/s "cold" there against 9-17 GB/s after 256 MiB.
The read runs twice a round (``read-again``: the A/A pair). Two more reads load
the same bytes in the order a decode item of the kernel does (tiles of
``--tile-kib`` KiB of K; in each, every head's K rows head by head, then its V
rows): ``by-head`` with no requests (the hardware prefetchers alone) and
``by-head-requested`` asking for lines ahead as the kernel's decode loops do
(half a tile ahead for 16-bit caches, a whole tile for fp32; into L2 where the
kernel's info() says its requests go there): how much of the decode's gap to
the plain read the order of its loads explains. Reported per point:
median, min and max microseconds of each, the GB/s of the medians, and the
decode's share of the read bandwidth (read time / decode time; the goal is at
least 2/3), of the medians and within each round (median and 95% bootstrap
interval, harness.ratio_summary) beside the read's A/A ratio.
Writes benchmarks/results/decode_bandwidth_<isa>[_<tag>]_<machine>.json and a
plot for each ISA.
"""

from __future__ import annotations

import os

os.environ["VATTN_CPU_ATTN_THREADS"] = "1"  # read when the kernel's pool starts, at its first call

import argparse
import ctypes
import importlib.util
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from attention_ab import Case, model_shape
from harness import (RESULTS, describe_ratio, draw, git_revision, machine, machine_slug, point_label, pyplot,
                     ratio_summary, require_current_build, save_plot, write_json)
from torch.utils.dlpack import to_dlpack

from vattn import _cpu_attn

ROOT = Path(__file__).resolve().parents[1]
PROBE_SOURCE = Path(__file__).resolve().parent / "kv_read_probe.cpp"
CXX = "g++"
# the kernel unit whose setup.py flags build the probe for each x86 path, and the vector bytes it must load
PROBE_UNIT = {"avx2": ("kernel_avx2.cpp", 32), "avx512": ("kernel_avx512.cpp", 64),
              "avx512_bf16": ("kernel_avx512.cpp", 64), "amx": ("kernel_avx512.cpp", 64)}
GOAL_SHARE = 2 / 3


def setup_flags() -> dict[str, list[str]]:
    """setup.py's per-unit ISA flags on this machine."""
    spec = importlib.util.spec_from_file_location("vattn_setup", ROOT / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # its setup() runs only as __main__
    return setup.isa_flags(platform.machine())


def compile_probe(source: Path, unit: str, library: Path) -> ctypes.CDLL:
    """``source`` (a probe beside this file) built into ``library`` with setup.py's flags of the kernel
    unit ``unit``, and loaded."""
    built = subprocess.run([CXX, "-std=c++17", "-O3", "-shared", "-fPIC", *setup_flags().get(unit, []),
                            str(source), "-o", str(library)], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"{CXX} failed on {source}:\n{built.stderr[-3000:]}")
    return ctypes.CDLL(str(library))


def declare_probe(probe: ctypes.CDLL) -> ctypes.CDLL:
    """``probe`` (kv_read_probe.cpp loaded) with its functions' argument and result types set."""
    probe.kv_read.restype = ctypes.c_int64
    probe.kv_read.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    probe.kv_decode_tile_tokens.restype = ctypes.c_int64
    probe.kv_decode_tile_tokens.argtypes = [ctypes.c_int64, ctypes.c_int64]
    probe.kv_read_by_head.restype = ctypes.c_int64
    probe.kv_read_by_head.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_int64), *[ctypes.c_int64] * 6, ctypes.c_int, ctypes.c_int]
    return probe


def build_probe(isa: str, out: Path) -> ctypes.CDLL:
    """kv_read_probe.cpp built with the flags of ``isa``'s kernel unit; refuses a build that loads
    another vector width than that ISA's."""
    unit, vector_bytes = PROBE_UNIT[isa]
    probe = declare_probe(compile_probe(PROBE_SOURCE, unit, out / f"kv_read_probe_{isa}.so"))
    if probe.kv_read_vector_bytes() != vector_bytes:
        raise SystemExit(f"the {isa} probe loads {probe.kv_read_vector_bytes()}-byte vectors, not {vector_bytes}")
    return probe


def spread(seconds: list[float]) -> dict[str, float]:
    """Median, min and max of ``seconds`` in microseconds."""
    return {k: round(f(seconds) * 1e6, 2) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def default_tile_kib(isa: str) -> int:
    """KiB of K per tile of a narrow decode item (a token's K rows of at most 2 KiB) on ``isa``'s path:
    16 on 8-float vectors, 64 on 16-float ones (run_item_typed, csrc/cpu_attn/kernel_impl.h)."""
    return 16 if PROBE_UNIT[isa][1] == 32 else 64


def measure(probe: ctypes.CDLL, isa: str, batch: int, ctx: int, dtype: torch.dtype, shape: tuple[int, int, int],
            flush: torch.Tensor, rounds: int, tile_kib: int) -> dict[str, Any]:
    """One point: the probe's reads and the kernel's decode on ``isa``, cold and warm, alternated."""
    case = Case("decode", "per_layer", batch, ctx, 1, "cpu", dtype, [], shape)
    try:
        b, k, v = case.batch, case.k_cache, case.v_cache
        if k.stride(3) != 1 or k.stride(2) != k.shape[3] or k.stride() != v.stride():
            raise SystemExit(f"the probe reads whole token rows; K/V strides {k.stride()} / {v.stride()} are not")
        row_bytes = k.shape[2] * k.shape[3] * k.element_size()
        seq_lens = [c + q for c, q in zip(b.cached_lens, b.query_lens)]
        k_rows = (ctypes.c_void_p * batch)(*[k[r].data_ptr() for r in b.reqids])
        v_rows = (ctypes.c_void_p * batch)(*[v[r].data_ptr() for r in b.reqids])
        tokens = (ctypes.c_int64 * batch)(*seq_lens)
        token_stride = k.stride(1) * k.element_size()
        heads, head_bytes, head_stride = k.shape[2], k.shape[3] * k.element_size(), k.stride(2) * k.element_size()
        tile = probe.kv_decode_tile_tokens(row_bytes, tile_kib << 10)  # the kernel's key_tile
        ahead = 1 if k.element_size() < 4 else 2  # the kernel's decode: half a tile ahead for 16-bit K/V
        to_l2 = int(_cpu_attn.info()["decode_prefetch"] == "l2")
        plan = _cpu_attn.Plan(list(b.reqids), list(b.cached_lens), list(b.query_lens))
        out = torch.empty_like(case.q)
        args = (plan, to_dlpack(case.q), to_dlpack(k), to_dlpack(v), to_dlpack(out), None, None, None,
                shape[2] ** -0.5, 0.0, 0, isa)

        def decode() -> None:
            if _cpu_attn.attention(*args) != isa:
                raise SystemExit(f"the kernel did not run the {isa} path")

        def read() -> None:
            probe.kv_read(k_rows, v_rows, tokens, batch, token_stride, row_bytes)

        def by_head(requests_ahead: int) -> Callable[[], None]:
            return lambda: probe.kv_read_by_head(k_rows, v_rows, tokens, batch, token_stride, heads, head_stride,
                                                 head_bytes, tile, requests_ahead, to_l2)

        # the read twice: the A/A pair
        sides = {"read": read, "by-head": by_head(0), "by-head-requested": by_head(ahead), "decode": decode,
                 "read-again": read}
        for call in sides.values():
            call()
        cold: dict[str, list[float]] = {s: [] for s in sides}
        warm: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(rounds):
            for side in (sides if r % 2 == 0 else reversed(list(sides))):
                flush.add_(1.0)
                t = time.perf_counter()
                sides[side]()
                cold[side].append(time.perf_counter() - t)
                t = time.perf_counter()
                sides[side]()
                warm[side].append(time.perf_counter() - t)
        kv_bytes = 2 * sum(seq_lens) * row_bytes
        row: dict[str, Any] = {"batch": batch, "ctx": ctx, "dtype": str(dtype).removeprefix("torch."),
                               "kv_bytes": kv_bytes, "rounds": rounds, "tile_tokens": tile,
                               "requests_ahead": ["none", "half a tile", "a whole tile"][ahead],
                               "requests_to": "l2" if to_l2 else "l1"}
        for temp, times in (("cold", cold), ("warm", warm)):
            us = {s: spread(times[s]) for s in sides}
            row[temp] = {"us": us, "gb_per_s": {s: round(kv_bytes / us[s]["median"] / 1e3, 2) for s in sides},
                         "decode_share": round(us["read"]["median"] / us["decode"]["median"], 3),
                         # within each round: read time / decode time, and the A/A pair read / read-again
                         "decode_share_per_round": ratio_summary([r / d for r, d in zip(times["read"], times["decode"])]),
                         # the decode's order against the address order, within each round: read / by-head
                         "by_head_share_per_round": {
                             s: ratio_summary([r / b for r, b in zip(times["read"], times[s])])
                             for s in ("by-head", "by-head-requested")},
                         "read_aa_per_round": ratio_summary([r / a for r, a in zip(times["read"], times["read-again"])])}
        return row
    finally:
        case.close()


def default_flush_mb() -> int:
    """MiB to write before a cold call so that none of its K/V stay cached: 256, or eight times the
    last-level cache (sysconf's L3, else L2) where that is larger."""
    cache = 0
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            cache = os.sysconf(name)
        except (ValueError, OSError):
            cache = 0
        if cache > 0:
            break
    return max(256, 8 * (cache >> 20))


def parse_point(spec: str) -> tuple[int, int, str]:
    """``batch:ctx:dtype`` -> (batch, ctx, dtype)."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not hasattr(torch, parts[2]):
        raise SystemExit(f"--points: {spec!r} is not batch:ctx:dtype (e.g. 8:2048:bfloat16)")
    return int(parts[0]), int(parts[1]), parts[2]


def result_name(isa: str, tag: str) -> str:
    return f"decode_bandwidth_{isa}{'_' + tag if tag else ''}_{machine_slug(machine())}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="1:2048:bfloat16,4:512:bfloat16,8:2048:bfloat16,8:4096:bfloat16,"
                                        "16:1024:bfloat16,8:2048:float32,8:4096:float32",
                   help="decode points, batch:ctx:dtype, comma-separated")
    p.add_argument("--model", default="small-8q2kv", help="a model name of attention_ab.py or name:heads_q:heads_kv:head_dim")
    p.add_argument("--isa", default=None,
                   help=f"comma-separated paths of {sorted(PROBE_UNIT)} (default: each one this CPU runs)")
    p.add_argument("--flush-mb", type=int, default=default_flush_mb(),
                   help="MiB written before each cold call (default: 256, or 8 x the last-level cache if larger)")
    p.add_argument("--rounds", type=int, default=100, help="rounds per point")
    p.add_argument("--tile-kib", type=int, default=None,
                   help="KiB of K per tile of the by-head reads (default: a narrow decode item's on each path, "
                        "16 on AVX2, 64 on AVX-512)")
    p.add_argument("--tag", default="", help="names the result files decode_bandwidth_<isa>_<tag>_<machine>.*")
    p.add_argument("--replot", action="store_true", help="only redraw the plots from this machine's JSON")
    args = p.parse_args()
    supported = _cpu_attn.info()["supported"]
    isas = args.isa.split(",") if args.isa else [i for i in PROBE_UNIT if i in supported]
    for isa in isas:
        if isa not in PROBE_UNIT:
            raise SystemExit(f"--isa: {isa!r} is not one of {sorted(PROBE_UNIT)}")
        if not args.replot and isa not in supported:
            raise SystemExit(f"--isa: this CPU does not run {isa!r} (it runs {supported})")
    if args.replot:
        for isa in isas:
            name = result_name(isa, args.tag)
            plot(json.loads((RESULTS / f"{name}.json").read_text()), name)
        return
    shape = model_shape(args.model)
    points = [parse_point(s) for s in args.points.split(",")]
    flush = torch.zeros(args.flush_mb << 18)
    require_current_build(ROOT)
    commit = git_revision(ROOT)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vattn-probe-") as tmp:
        for isa in isas:
            probe = build_probe(isa, Path(tmp))
            rows = []
            for batch, ctx, dtype in points:
                row = measure(probe, isa, batch, ctx, getattr(torch, dtype), shape, flush, args.rounds,
                              args.tile_kib or default_tile_kib(isa))
                rows.append(row)
                print(f"[{time.perf_counter() - started:5.0f}s] {isa:11s} {dtype:8s} B={batch:<3d} ctx={ctx:<6d} "
                      + "  ".join(f"{t} read {row[t]['gb_per_s']['read']:6.1f} decode {row[t]['gb_per_s']['decode']:6.1f}"
                                  f" GB/s ({row[t]['decode_share']:.2f})" for t in ("cold", "warm")), flush=True)
                for t in ("cold", "warm"):
                    print("    " + describe_ratio(f"{t} share per round", row[t]["decode_share_per_round"])
                          + "; " + describe_ratio("A/A read / read-again", row[t]["read_aa_per_round"]), flush=True)
                    print(f"    {t} by head {row[t]['gb_per_s']['by-head']:.1f} GB/s, requested "
                          f"{row[t]['gb_per_s']['by-head-requested']:.1f} GB/s ({row['tile_tokens']}-token tiles)",
                          flush=True)
            payload = {
                "benchmark": "decode_bandwidth",
                "machine": machine(),
                "model": args.model,
                "isa": isa,
                "probe_vector_bytes": PROBE_UNIT[isa][1],
                "commit": commit,
                "threads": 1,
                "flush_mb": args.flush_mb,
                "unit": "us per call (median, min, max over rounds); GB/s of the medians; decode_share: read time / "
                        "decode time of the medians (1: the decode reads as fast as a plain read); "
                        "decode_share_per_round: the same within each round, median and 95% bootstrap interval; "
                        "read_aa_per_round: the read against itself (read / read-again), the A/A pair; "
                        "by-head, by-head-requested: the same bytes read in a decode item's order (tile_tokens), "
                        "without and with requests ahead (requests_ahead, into requests_to); "
                        "by_head_share_per_round: read time / that read's time within each round",
                "results": rows,
            }
            name = result_name(isa, args.tag)
            print(f"wrote {write_json(name, payload)}")
            draw(plot, payload, name, "decode_bandwidth.py")


def plot(payload: dict, name: str) -> None:
    """GB/s of the read and the decode per point (cold, warm), and the decode's share with the 2/3 goal."""
    plt = pyplot()
    rows = payload["results"]
    labels = [point_label(r) for r in rows]
    xs = range(len(rows))
    fig, (bw, share) = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(rows)), 4))
    # the reads in the decode's order where the file has them (runs before they were added do not)
    bars = [("cold", "read"), *[("cold", s) for s in ("by-head", "by-head-requested") if s in rows[0]["cold"]["gb_per_s"]],
            ("cold", "decode"), ("warm", "read"), ("warm", "decode")]
    width = 0.8 / len(bars)
    for i, (temp, side) in enumerate(bars):
        bw.bar([x - 0.4 + width * (i + 0.5) for x in xs], [r[temp]["gb_per_s"][side] for r in rows], width,
               label=f"{side} ({temp})")
    bw.set_xticks(list(xs), labels, fontsize=7)
    bw.set_ylabel("GB/s of K/V (medians)")
    bw.legend(fontsize=7)
    share.bar([x - 0.2 for x in xs], [r["cold"]["decode_share"] for r in rows], 0.4, label="cold")
    share.bar([x + 0.2 for x in xs], [r["warm"]["decode_share"] for r in rows], 0.4, label="warm")
    share.axhline(GOAL_SHARE, color="black", linewidth=0.8, linestyle="--", label="2/3")
    share.set_xticks(list(xs), labels, fontsize=7)
    share.set_ylabel("decode's share of the read bandwidth")
    share.legend(fontsize=7)
    fig.suptitle(f"decode against a plain read of its K/V: {payload['isa']} ({payload['model']}, one thread, "
                 f"{payload['commit']})", fontsize=9)
    save_plot(fig, name)


if __name__ == "__main__":
    main()
