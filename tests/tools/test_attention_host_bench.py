"""benchmarks/attention_host.py's cold mode: every timed call comes after a
write of the flush tensor, and the cold grid lands in its own JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
time_interleaved = load_benchmark("attention_ab").time_interleaved


def test_every_timed_call_follows_a_flush():
    flush = torch.zeros(1024)
    seen: dict[str, list[float]] = {"a": [], "b": []}

    def kernel(name: str):
        return lambda: seen[name].append(flush[0].item())

    time_interleaved({name: kernel(name) for name in seen}, torch.device("cpu"), 0.0, 3, flush)
    calls = sorted(seen["a"][1:] + seen["b"][1:])  # the first call of each is the untimed probe
    assert len(calls) >= 6
    # one write between any two timed calls: no two calls saw the same flush count
    assert len(set(calls)) == len(calls), calls


def test_cold_grid_writes_its_own_json(tmp_path):
    env = {**os.environ, "VATTN_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_host.py"), "--flush-mb", "1",
                           "--decode-ctx", "256", "--decode-batch", "1", "--prefill-tokens", "0", "--blocks", "0",
                           "--min-seconds", "0.02"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("attention_host_cold_*.json")
    payload = json.loads(result.read_text())
    assert payload["flush_mb"] == 1
    assert [(r["phase"], r["batch"], r["ctx"]) for r in payload["results"]] == [("decode", 1, 256)] * 2
    assert all(r["ms"]["host"] > 0 for r in payload["results"])
