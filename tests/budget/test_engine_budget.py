"""Two serving engines in two processes under one budget: the budget fits a
few requests of one engine, never both engines' peaks. Both finish every
request with the greedy fp32 tokens they produce alone, the budget's total
never passes its limit, and the contention shows as refused page creations
and preemptions (tests/budget/engine_budget_scenario.py is one engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from budget_helpers import budget_name  # noqa: F401 (fixture)

import vattn

pytest.importorskip("transformers", reason="needs transformers: pip install -e \".[transformers]\"")

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = Path(__file__).with_name("engine_budget_scenario.py")
ID_BYTES = 6 * 4096  # 3 layers x K, V pages of 4 KiB


def test_two_engines_in_two_processes_share_one_budget(budget_name):
    limit = 8 * ID_BYTES  # a lone request needs at most 3 page ids
    budget = vattn.Budget.create(budget_name, limit)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("VATTN_BUDGET", None)
    engines = [subprocess.Popen([sys.executable, str(SCENARIO), budget_name, str(seed)], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for seed in (1, 2)]
    try:
        for p in engines:
            assert p.stdout.readline().strip() == "ready"
        for p in engines:
            p.stdin.write("go\n")
            p.stdin.flush()
        peak = 0
        while any(p.poll() is None for p in engines):
            peak = max(peak, budget.held_bytes)
            time.sleep(0.002)
        results = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in engines]
        assert [p.returncode for p in engines] == [0, 0]
    finally:
        for p in engines:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(r["equal"] for r in results), results
    assert [r["label"] for r in results] == ["engine", "engine"]
    assert 0 < peak <= limit
    assert sum(r["refused"] for r in results) > 0 and sum(r["preemptions"] for r in results) > 0, results
    assert budget.usage().members == ()
