"""`step` on the fast path, this checkout against another build, in one run.

    python benchmarks/step_overhead_ab.py BASE_CHECKOUT [--rounds 6]

BASE_CHECKOUT is another checkout of vattn with its extension built in place
(e.g. ``git worktree add ../base <commit>`` and ``python setup.py build_ext
--inplace`` there). Each round runs benchmarks/step_overhead.py of both
checkouts, each in a fresh process importing its own vattn, in the order
base, test, test, base (so drift in the machine's speed falls on both
alike). Per batch size and mapper setting it reports the median over rounds
of each side's `step` time (and their ratio, test / base: below 1 is
faster), and within each round the speed ratio (base time / test time: above
1 is faster) and the A/A pair (the base's first run's time over its second's),
each as the median over rounds with its 95% interval and verdict
(docs/benchmarks.md, "Reading an A/B").
Writes benchmarks/results/step_overhead_ab_<machine>.json and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (describe_ratio, git_revision, machine, machine_slug, pyplot, ratio_summary, require_current_build,
                     save_plot, write_json)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_side(checkout: Path, out: Path) -> list[dict]:
    """One run of ``checkout``'s step_overhead.py importing ``checkout``'s vattn; its rows."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_")}
    env.update(PYTHONPATH=str(checkout), VATTN_RESULTS_DIR=str(out))
    proc = subprocess.run([sys.executable, str(checkout / "benchmarks" / "step_overhead.py")], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"step_overhead.py in {checkout} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    (result,) = out.glob("step_overhead_*.json")
    rows = json.loads(result.read_text())["results"]
    result.unlink()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path, help="another checkout of vattn, its extension built in place")
    p.add_argument("--rounds", type=int, default=6, help="rounds of base, test, test, base (default 6)")
    args = p.parse_args()
    base = args.base.resolve()
    if not (base / "benchmarks" / "step_overhead.py").is_file() or not list((base / "vattn").glob("_C*.so")):
        p.error(f"base: {base} is not a checkout of vattn with its extension built in place")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    for checkout in (base, ROOT):
        require_current_build(checkout)
    # per (B, mapper): each run's step time in microseconds, in run order, per round
    samples: dict[tuple[int, bool], list[list[tuple[str, float]]]] = {}
    order = ["base", "test", "test", "base"]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, side in enumerate(order):
                print(f"[round {r + 1}/{args.rounds}, run {i + 1}/4] {side}", flush=True)
                for row in run_side(base if side == "base" else ROOT, Path(tmp) / f"{r}-{i}"):
                    runs = samples.setdefault((row["batch"], row["background"]), [])
                    if len(runs) <= r:
                        runs.append([])
                    runs[r].append((side, row["step_us"]))
    rows = []
    for key in sorted(samples):
        rounds = samples[key]
        side_us = {side: [us for one in rounds for s, us in one if s == side] for side in ("base", "test")}
        b_us, t_us = statistics.median(side_us["base"]), statistics.median(side_us["test"])
        # within each round, as speeds (above 1: faster, so that the verdict reads as for throughput):
        # base time / test time (means of its two runs each), and the A/A pair, the base's first run's
        # time over its second's (the runs furthest apart in the round)
        speed = ratio_summary([statistics.fmean(us for s, us in one if s == "base") /
                               statistics.fmean(us for s, us in one if s == "test") for one in rounds])
        aa = ratio_summary([[us for s, us in one if s == "base"][0] / [us for s, us in one if s == "base"][1]
                            for one in rounds])
        rows.append({"batch": key[0], "background": key[1], "base_step_us": b_us, "test_step_us": t_us,
                     "test_over_base": t_us / b_us, "test_speed_over_base": speed, "base_again_speed_over_base": aa,
                     "base_samples_us": side_us["base"], "test_samples_us": side_us["test"]})
        print(f"B={key[0]:3d} mapper {'on ' if key[1] else 'off'}: base {b_us:.2f} us, test {t_us:.2f} us; "
              f"{describe_ratio('speed test/base', speed)}; A/A {aa['median']:.3f}x [{aa['interval_95'][0]:.3f}, "
              f"{aa['interval_95'][1]:.3f}]")
    m = machine()
    slug = machine_slug(m)
    path = write_json(f"step_overhead_ab_{slug}", {
        "benchmark": "step_overhead_ab", "machine": m, "base": git_revision(base), "test": git_revision(ROOT),
        "rounds": args.rounds, "order": order, "results": rows})
    print(f"wrote {path}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for background, style in ((False, "o-"), (True, "s-")):
        sel = [r for r in rows if r["background"] is background]
        ax.plot([r["batch"] for r in sel], [r["test_over_base"] for r in sel], style,
                label=f"mapper {'on' if background else 'off'}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("step time, test / base (median of rounds)")
    ax.set_title(f"step fast path: {git_revision(ROOT)} vs {git_revision(base)} — {m['cpu']}", fontsize=8)
    ax.legend(fontsize=8)
    save_plot(fig, f"step_overhead_ab_{slug}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
