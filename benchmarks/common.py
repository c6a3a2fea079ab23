"""Shared helpers for benchmarks: machine description, stats, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """CPU model, cores, memory and GPU (when torch sees one) of this machine."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "gpu": None}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def machine_slug(m: dict[str, Any]) -> str:
    if m["gpu"]:
        return m["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    return f"cpu-{m['cores']}core"


def summarize(seconds: list[float]) -> dict[str, float]:
    """Mean, median and p99 in microseconds."""
    us = sorted(s * 1e6 for s in seconds)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    return {"mean_us": statistics.fmean(us), "p50_us": statistics.median(us), "p99_us": p99, "samples": len(us)}


def _compact_lists(text: str) -> str:
    """Puts every list of plain numbers on one line (per-iteration series stay readable)."""
    return re.sub(r"\[\s*([-0-9.eE+,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(_compact_lists(json.dumps(payload, indent=2)) + "\n")
    return path


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
