"""The benchmarks' harness: machine facts, timing statistics, result files
and plots, shared by every script in benchmarks/ (``from harness import
...``: a script run as ``python benchmarks/x.py`` has benchmarks/ on its path;
tests load the scripts by path, tests/conftest.py ``load_benchmark``).

Importing it also puts the repository's root on ``sys.path``, so that a script
then imports what it shares with the tests, ``from workloads... import ...``
(workloads/__init__.py), from whatever directory it was started in.

Results go to benchmarks/results/, or to $VATTN_RESULTS_DIR when set (the GPU
suite, benchmarks/gpu_suite.sh, points it at its output folder). Under
$VATTN_GPU_SUITE_DRY_RUN every JSON says "dry_run": true.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # appended: benchmarks/ and site-packages keep their precedence
    sys.path.append(str(ROOT))

RESULTS = Path(os.environ.get("VATTN_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def dry_run() -> bool:
    """The GPU suite's CPU rehearsal (tiny grids, nothing to publish)."""
    return os.environ.get("VATTN_GPU_SUITE_DRY_RUN", "") not in ("", "0")


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "bf16")
"""The /proc/cpuinfo flags the host kernels choose their code paths by (a VM's
"model name" may not say which generation of a CPU it runs on)."""


CPUINFO = "/proc/cpuinfo"  # where machine() reads the CPU's description


def machine() -> dict[str, Any]:
    """CPU model, its family and model numbers, its vector extensions
    (ISA_FLAGS), cores, memory and GPU (when torch sees one) of this machine.

    The numbers tell CPU generations apart where a VM's model name does not
    (on x86: AMD family 25 is Zen 3/Zen 4, 26 is Zen 5)."""
    fields: dict[str, str] = {}  # the first processor's /proc/cpuinfo lines
    try:
        with open(CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {"cpu": cpu, "cpu_family": _cpuinfo_int(fields, "cpu family"),
                            "cpu_model": _cpuinfo_int(fields, "model"),
                            "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
                            "memory_gib": round(mem_gib, 1), "gpu": None, "torch": None, "cuda": None,
                            "driver": None}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda  # the CUDA torch was built with; None on a CPU build
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    info["driver"] = cuda_driver()
    return info


def _cpuinfo_int(fields: dict[str, str], key: str) -> int | None:
    """A decimal /proc/cpuinfo field (x86's "cpu family", "model"); None
    where absent (AArch64 names them differently) or not a number."""
    try:
        return int(fields[key])
    except (KeyError, ValueError):
        return None


def cuda_driver() -> dict[str, Any] | None:
    """The CUDA driver vattn's cuda backend would load: library, driver API
    version, the device it reports and the kernel module version
    (nvidia-smi); None where no driver loads."""
    try:
        from vattn.backends import cuda_driver_path, cuda_info
        from vattn.common.errors import VAttnError
    except ImportError:  # the extension is not built yet (a fresh GPU machine, before the suite's build stage)
        return None

    path = cuda_driver_path()
    try:
        info = cuda_info(0, path)
    except VAttnError:
        return None
    version = info["driver_version"]
    out = {"library": path, "api_version": f"{version // 1000}.{version % 1000 // 10}",
           "device": info["name"], "granularity": info["granularity"], "nvidia_smi": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out["nvidia_smi"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                               capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def machine_slug(m: dict[str, Any]) -> str:
    if m["gpu"]:
        return m["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    return f"cpu-{m['cores']}core"


def summarize(seconds: list[float]) -> dict[str, float]:
    """Mean, median and p99 in microseconds."""
    us = sorted(s * 1e6 for s in seconds)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return {"mean_us": statistics.fmean(us), "p50_us": statistics.median(us), "p99_us": p99, "samples": len(us)}


def git_revision(checkout: Path) -> str:
    """``checkout``'s commit (short), marked when its tracked files but results (a run in progress
    writes them) differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!benchmarks/results"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    return (head.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def require_current_build(checkout: Path) -> None:
    """Exits, naming the files, where a C++ source or setup.py of ``checkout`` changed after its last
    build (the newest of ``vattn/*.so``; a build recompiles only the extensions whose sources changed):
    a benchmark would time an earlier build's code and record the current commit for it. Rebuild
    with ``python setup.py build_ext --inplace``."""
    built = list((checkout / "vattn").glob("*.so"))
    if not built:
        raise SystemExit(f"{checkout}: no built extension in vattn/ (python setup.py build_ext --inplace)")
    last_build = max(built, key=lambda p: p.stat().st_mtime)
    sources = [p for p in (checkout / "csrc").rglob("*") if p.is_file()] + [checkout / "setup.py"]
    newest = max(sources, key=lambda p: p.stat().st_mtime)
    if newest.stat().st_mtime > last_build.stat().st_mtime:
        raise SystemExit(f"{checkout}: {newest.relative_to(checkout)} changed after the last build "
                         f"({last_build.relative_to(checkout)}); rebuild (python setup.py build_ext --inplace) "
                         f"before timing it")


def round_order(engines: list[str], aa: str | None, round_index: int) -> list[str]:
    """The runs of one round of an A/B: every engine, then the A/A engine
    (``aa``) a second time as ``<aa>-again``; reversed every other round, so
    that a machine whose speed drifts favours no engine and the A/A pair
    stands as far apart in the order as any pair."""
    order = list(engines) + ([f"{aa}-again"] if aa else [])
    return order if round_index % 2 == 0 else order[::-1]


MIN_ROUNDS = 3  # fewer rounds make no interval worth judging by


def ratio_summary(per_round: list[float], resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """A ratio measured once per round (B / A of the same round): its
    median, minimum and maximum, and the 95% bootstrap interval of the
    median (percentile method, ``resamples`` resamplings of the rounds,
    seeded). ``verdict``: "ahead" where the interval lies above 1.0,
    "behind" where below, "within noise" where it holds 1.0 (an A/A pair's
    interval, measured beside, shows how wide noise alone makes it); with
    fewer than ``MIN_ROUNDS`` rounds there is no interval to judge by, and
    the verdict says so."""
    if not per_round:
        raise ValueError("ratio_summary needs at least one round")
    rng = random.Random(seed)
    n = len(per_round)
    medians = sorted(statistics.median(rng.choices(per_round, k=n)) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[min(resamples - 1, int(0.975 * resamples))]
    verdict = ("ahead" if low > 1.0 else "behind" if high < 1.0 else "within noise") if n >= MIN_ROUNDS else \
        f"no verdict: {n} round{'s' if n > 1 else ''}, fewer than {MIN_ROUNDS}"
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "interval_95": [low, high], "verdict": verdict, "per_round": [round(r, 4) for r in per_round]}


def point_label(row: dict[str, Any]) -> str:
    """A kernel point's x-axis label: dtype (short), "pre" for prefill, batch and context."""
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(row["dtype"], row["dtype"])
    return f"{dtype}{' pre' if row.get('phase') == 'prefill' else ''} B={row['batch']}\nctx={row['ctx']}"


def describe_ratio(name: str, q: dict[str, Any]) -> str:
    """One line for a ratio_summary: median, interval, range and verdict."""
    low, high = q["interval_95"]
    return (f"{name}: median {q['median']:.3f}x, 95% interval [{low:.3f}, {high:.3f}], rounds {q['min']:.3f}-"
            f"{q['max']:.3f} ({len(q['per_round'])}): {q['verdict']}")


def _compact_lists(text: str) -> str:
    """Puts every list of plain numbers on one line (per-iteration series stay readable)."""
    return re.sub(r"\[\s*([-0-9.eE+,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    if dry_run():
        payload = {**payload, "dry_run": True}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(_compact_lists(json.dumps(payload, indent=2)) + "\n")
    return path


def publish(name: str, payload: dict[str, Any], plot: Any, shown: Any = None) -> Path:
    """Writes results/<name>.json, prints ``shown`` (a summary, as JSON) and
    the path, and draws the figure: ``plot(payload, name)`` (where
    matplotlib is missing, says how to draw it later instead of failing)."""
    path = write_json(name, payload)
    if shown is not None:
        print(json.dumps(shown, indent=2))
    print(f"wrote {path}")
    draw(plot, payload, name, Path(sys.argv[0]).name)
    return path


def draw(plot: Any, payload: Any, name: str, script: str) -> None:
    """``plot(payload, name)``, or where matplotlib is missing, how to draw it
    later (``python benchmarks/<script> --replot``)."""
    try:
        plot(payload, name)
    except ImportError as e:
        print(f"no plot ({e}): redraw with `python benchmarks/{script} --replot` where matplotlib is installed")


def pyplot():
    """matplotlib.pyplot on a file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, name: str) -> Path:
    """Writes a figure as results/<name>.png and says where."""
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path
