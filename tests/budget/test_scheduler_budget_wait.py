"""vattn's engine scheduler under a budget whose limit moves: a request whose
pages alone exceed the current limit never holds up the requests behind it,
waits at most ``budget_wait_s`` for the limit to rise, and then fails with
``OutOfPages``; every request that fits the limit runs.

The property test drives :class:`vattn.engine.scheduler.Scheduler` over a
real KV cache manager in a budget (no model: a request's prompt is computed
in the iteration it runs, and it ends with one token) on a simulated clock,
against a reference that says from the limit's history alone which requests
must finish, which must fail, and by when."""

from __future__ import annotations

import random

import pytest
import torch
from budget_helpers import budget_name  # noqa: F401 (fixture)
from budget_reference import check_outcomes

import vattn
from vattn.engine.requests import Request
from vattn.engine.scheduler import Scheduler

PAGE = 4096
ID_BYTES = 2 * PAGE  # one page of K and one of V
TOKENS_PER_PAGE = PAGE // 256  # 1 KV head of 64 fp32: 256 bytes a token per buffer
STEP_S = 0.1  # simulated seconds per iteration
WAIT_S = 3.0  # budget_wait_s: long next to the iterations the fitting requests need


def _need_bytes(tokens: int) -> int:
    return -(-tokens // TOKENS_PER_PAGE) * ID_BYTES


def _manager(name: str) -> vattn.KVCacheManager:
    return vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=4,
                                max_context_len=256, page_size=PAGE, budget=name, idle_release_s=None,
                                policy=vattn.Policy(background=False, eager=False))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(kv: vattn.KVCacheManager, budget: vattn.Budget, arrivals: list[tuple[int, int]],
              limits: dict[int, int], iterations: int) -> tuple[dict[int, tuple[str, int, str | None]], list[int]]:
    """Runs the scheduler ``iterations`` iterations: ``arrivals`` (iteration, prompt tokens) by request
    id, the limit set at the iterations ``limits`` names. Returns each request's (finish reason,
    iteration, error) and the limit in force at every iteration."""
    clock = Clock()
    scheduler = Scheduler(kv, None, None, budget_wait_s=WAIT_S, clock=clock)
    outcome: dict[int, tuple[str, int, str | None]] = {}
    history = []
    for it in range(iterations):
        clock.now = it * STEP_S
        if it in limits:
            budget.set_limit(limits[it])
        history.append(budget.limit)
        for rid, (at, tokens) in enumerate(arrivals):
            if at == it:
                scheduler.waiting.append(Request(rid, [1] * tokens, 1, 0.0, 1.0, None, clock.now))
        finished = []
        for req, n in scheduler.schedule(finished):
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                req.output.append(1)
                scheduler.retire(req)
                finished.append(req.finished("length"))
        for out in finished:
            assert out.request_id not in outcome, f"request {out.request_id} finished twice"
            outcome[out.request_id] = (out.finish_reason, it, out.error)
    return outcome, history


def _check_against_reference(arrivals, history, outcome, last_change: int) -> None:
    check_outcomes(arrivals, history, outcome, last_change, _need_bytes, round(WAIT_S / STEP_S), "error", "length")
    for rid, got in outcome.items():
        if got[0] == "error":
            need = _need_bytes(arrivals[rid][1])
            assert got[2].startswith("OutOfPages:") and f"needs {need} bytes" in got[2], got[2]
            assert f"limit of {history[got[1]]} bytes" in got[2], got[2]


def test_scheduler_against_the_reference_over_random_limits(budget_name):
    """16 random runs: requests of 1-200 tokens arriving over 3 s, the limit set 1-4 times to 1-14 page
    ids (some half a page more); every outcome as the reference says."""
    budget = vattn.Budget.create(budget_name, 16 * ID_BYTES)
    reasons = []
    for seed in range(16):
        rng = random.Random(seed)
        n = rng.randint(3, 8)
        arrivals = [(rng.randint(0, 30), rng.randint(1, 200)) for _ in range(n)]
        changes = sorted(rng.sample(range(0, 60), rng.randint(1, 4)))
        limits = {it: rng.randint(1, 14) * ID_BYTES + rng.choice((0, 0, PAGE)) for it in changes}
        iterations = changes[-1] + round(WAIT_S / STEP_S) + n + 8
        budget.set_limit(16 * ID_BYTES)
        with _manager(budget_name) as kv:
            outcome, history = _simulate(kv, budget, arrivals, limits, iterations)
        _check_against_reference(arrivals, history, outcome, changes[-1])
        assert sorted(outcome) == list(range(n)), (seed, outcome, arrivals, limits)  # each ended, once
        reasons += [got[0] for got in outcome.values()]
    assert reasons.count("error") >= 5 and reasons.count("length") >= 40, reasons  # both sides were exercised


def test_a_request_over_the_limit_lets_the_ones_behind_it_run_then_fails(budget_name):
    budget = vattn.Budget.create(budget_name, 4 * ID_BYTES)
    arrivals = [(0, 120), (0, 16), (1, 30), (2, 60)]  # 8 page ids, then 1, 2, 4: the first never fits
    with _manager(budget_name) as kv:
        outcome, history = _simulate(kv, budget, arrivals, {}, round(WAIT_S / STEP_S) + 4)
    assert {rid: got[:2] for rid, got in outcome.items()} == {
        1: ("length", 0), 2: ("length", 1), 3: ("length", 2), 0: ("error", round(WAIT_S / STEP_S))}
    error = outcome[0][2]
    assert error == (f"OutOfPages: budget '{budget_name}': this request needs {8 * ID_BYTES} bytes of KV cache "
                     f"(120 tokens) alone, more than the budget's limit of {4 * ID_BYTES} bytes, and the limit did "
                     f"not rise within 3 s (VATTN_BUDGET_WAIT_S / budget_wait_s)")


def test_a_request_over_the_limit_runs_when_the_limit_rises_in_time(budget_name):
    budget = vattn.Budget.create(budget_name, 4 * ID_BYTES)
    wait_its = round(WAIT_S / STEP_S)
    with _manager(budget_name) as kv:
        outcome, _ = _simulate(kv, budget, [(0, 120), (0, 16)], {wait_its - 2: 8 * ID_BYTES}, wait_its + 2)
    assert outcome[1][:2] == ("length", 0)
    assert outcome[0][:2] == ("length", wait_its - 2)


def test_budget_wait_s_is_checked(budget_name, monkeypatch):
    vattn.Budget.create(budget_name, 4 * ID_BYTES)
    with _manager(budget_name) as kv:
        for bad, kind in ((-1, ValueError), (float("nan"), ValueError), (2e6, ValueError), ("5", TypeError),
                          (True, TypeError)):
            with pytest.raises(kind, match=r"budget_wait_s must be a number of seconds in \[0, 1e6\]"):
                Scheduler(kv, None, None, budget_wait_s=bad)
        monkeypatch.setenv("VATTN_BUDGET_WAIT_S", "soon")
        with pytest.raises(ValueError, match=r"VATTN_BUDGET_WAIT_S must be a number of seconds in \[0, 1e6\], "
                                             r"got 'soon'"):
            Scheduler(kv, None, None)
        monkeypatch.setenv("VATTN_BUDGET_WAIT_S", "7.5")
        assert Scheduler(kv, None, None).budget_wait_s == 7.5
        monkeypatch.delenv("VATTN_BUDGET_WAIT_S")
        assert Scheduler(kv, None, None).budget_wait_s == 30.0
