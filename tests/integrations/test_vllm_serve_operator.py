"""API servers in vLLM's default process layout under a budget, at the size an operator ran them: the tiny
fp32 Llama of ``python -m vattn make-model``, ``--max-model-len 1024``, 128-token blocks of 512 KiB, the
``openai`` client, ``python -m vattn budget ...`` and ``top`` (docs/elastic.md "Liveness" and "Failure
semantics", docs/vllm.md "Under a budget"). Long tests (``VATTN_LONG_TESTS=1``); the servers keep
``VATTN_BUDGET_WAIT_S`` at its default, 30 s, as the operator did.

1. Under 2 MiB (4 blocks) a 786-token prompt sent first, then four one-block requests: the four are
   answered at once, the big one with an error naming the limit and its need once the bounded wait
   passed, ``top`` shows the engine waiting while it waits, and the server idles meanwhile.
2. The limit lowered to 2560 KiB (5 blocks) under load: eight 4-block requests are answered within a
   minute; a 5-block prompt that grows to 6 blocks and a 6-block prompt get an error after the wait.
3. One request waiting on the budget with nothing else running costs the server's processes under 0.1
   CPU-s/s: for a request waiting for memory another member holds, ``test_an_api_server_waiting_on_the_budget_costs_no_cpu``
   (tests/integrations/test_vllm_serve.py) measures it in this layout and is not repeated here; scenario 1
   measures it for a request waiting over the limit.
4. ``python -m vattn budget rm --force`` under load (238 requests of about 170 tokens over 16 clients,
   more blocks wanted than the limit holds): every request is answered, and later ones too.
5. The budget's segment truncated under two busy servers (24 requests): both serve on, every request
   is answered.

Scenarios 1-4 share one server (4 removes its budget, so it runs last of them); 5 starts two more.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import vattn
from test_vllm import needs_vllm
from test_vllm_serve import LONG, TOKEN_BYTES, clients, model, server, session_cpu_seconds, wait_until  # noqa: F401

BLOCK = 128
BLOCK_BYTES = BLOCK * TOKEN_BYTES  # 512 KiB: a block of every layer's K and V
OPERATOR_ARGS = ("--max-model-len", "1024", "--block-size", str(BLOCK))
WAIT_S = 30.0  # VATTN_BUDGET_WAIT_S's default, which the servers keep
START_LIMIT = 16 * BLOCK_BYTES  # two requests of max-model-len: the server starts without a warning


def tokens(count: int, seed: int) -> list[int]:
    """A prompt of ``count`` token ids of the test model's vocabulary, different for each ``seed``."""
    return [3 + (seed * 7919 + i * 31) % 250 for i in range(count)]


def ask(tag: str, prompt_tokens: int, max_tokens: int, seed: int, delay_s: float = 0.0) -> dict:
    """One request for vllm_clients.py's timed mode."""
    return dict(tag=tag, prompt=tokens(prompt_tokens, seed), max_tokens=max_tokens, delay_s=delay_s)


def answers(proc: subprocess.Popen, tmp: Path, tag: str, with_start: bool = False):
    """The timed clients' answers, by tag, once they exited; ``with_start``: and when they started
    (``time.monotonic()``, the same clock in every process)."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    result = json.loads((tmp / f"{tag}.json").read_text())
    done = {a["tag"]: a for a in result["answers"]}
    return (done, result["started_monotonic_s"]) if with_start else done


@contextlib.contextmanager
def running(*procs: subprocess.Popen):
    """Clients that must not outlive a failed test: their requests would load the next one."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def failures(done: dict[str, dict]) -> list[str]:
    return [f"{tag}: {a['error']}" for tag, a in done.items() if "error" in a]


def vllm_member(budget: vattn.Budget):
    (member,) = [m for m in budget.usage().members if m.label.startswith("vllm")]
    return member


def top_once(name: str) -> dict:
    """``python -m vattn top NAME --once --json``: the budget's snapshot as the command prints it."""
    out = subprocess.run([sys.executable, "-m", "vattn", "top", name, "--once", "--json"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    (usage,) = json.loads(out)["budgets"]
    return usage


def healthy(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
        return answer.status == 200
    return False


def over_limit_error(answer: dict, limit: int) -> int:
    """The bytes an error answer says its request needs; asserts it names the limit and a need above it."""
    assert "error" in answer, answer
    message = answer["error"]["message"]
    need = re.search(r"needs (\d+) bytes", message)
    assert need and f"limit of {limit} bytes" in message, answer
    assert int(need.group(1)) > limit, answer
    return int(need.group(1))


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):  # noqa: F811 - the served-model fixture imported above
    """One API server (vLLM's default layout, the operator's sizes) under a budget of its own; yields
    (url, budget, session id of its processes, log path)."""
    tmp = tmp_path_factory.mktemp("operator")
    budget = vattn.Budget.create(f"operator-{os.getpid()}", START_LIMIT)
    sessions: list[int] = []
    try:
        with server(model, "tiny-llama", tmp / "server.log", True, command="serve", args=OPERATOR_ARGS,
                    sessions=sessions, VATTN_BUDGET=budget.name) as url:
            yield url, budget, sessions[0], tmp / "server.log"
    finally:
        with contextlib.suppress(vattn.BudgetError):
            budget.remove(force=True)  # teardown: scenario 4 removed it already


def over_limit_run(run: subprocess.Popen, budget: vattn.Budget, session: int, tmp: Path) -> tuple:
    """While scenario 1's big request waits: the engine's wait as the budget records it, as ``top`` shows it
    5 s later, and the server's CPU seconds over those 5 s; then the answers."""
    member = wait_until(lambda: (m := vllm_member(budget)).waiting_seconds > 0 and m, 20,
                        f"the engine never showed a wait: {budget.usage()}")
    time.sleep(2.0)  # the small ones are done, vLLM's worker stops polling its queue 1 s after a step
    cpu0, t0 = session_cpu_seconds(session), time.monotonic()
    time.sleep(5.0)
    cpu, wall = session_cpu_seconds(session) - cpu0, time.monotonic() - t0
    shown = [m for m in top_once(budget.name)["members"] if m["label"].startswith("vllm")]
    return answers(run, tmp, "over"), member, shown, cpu, wall


@LONG
@needs_vllm
def test_a_request_over_the_limit_is_answered_after_the_wait_while_small_ones_run(served, tmp_path):
    url, budget, session, _ = served
    limit = 4 * BLOCK_BYTES  # 2 MiB
    budget.set_limit(limit)
    big = ask("big", 786, 128, 0)  # 786 + 128 tokens: 8 blocks, 7 of them for the prompt
    small = [ask(f"small-{i}", 20, 16, i + 1, delay_s=0.5) for i in range(4)]  # one block each
    run = clients(url, "tiny-llama", tmp_path, "over", requests=[big, *small], concurrency=5)
    with running(run):
        done, member, shown, cpu, wall = over_limit_run(run, budget, session, tmp_path)
    smalls = [done[s["tag"]]["answered_s"] - done[s["tag"]]["sent_s"] for s in small]
    error_s = done["big"]["answered_s"] - done["big"]["sent_s"]
    print(f"small requests answered in {max(smalls):.2f} s; the big one's error after {error_s:.2f} s; "
          f"waiting over the limit {cpu:.3f} CPU-s in {wall:.2f} s; top: {shown}")
    assert not failures({tag: a for tag, a in done.items() if tag != "big"}), failures(done)
    assert max(smalls) < 60, f"the small requests took {max(smalls):.2f} s behind the big one"
    need = over_limit_error(done["big"], limit)
    assert need >= 7 * BLOCK_BYTES, done["big"]
    assert WAIT_S <= error_s < WAIT_S + 10, f"the big one's error came after {error_s:.2f} s"
    assert member.waiting_bytes == need, member  # what top showed: the request's need, from its first look
    assert shown and shown[0]["waiting_seconds"] > 5.0 and shown[0]["waiting_bytes"] == need, shown
    assert cpu / wall < 0.1, f"waiting over the limit: {cpu:.3f} CPU-s in {wall:.2f} s"


@LONG
@needs_vllm
def test_a_limit_lowered_under_load_lets_the_fitting_requests_finish(served, tmp_path):
    """The eight fitting requests are sent first and the limit lowered (in this process, at once) while
    they run; the two over it come right after the lowering, so neither can run to its end before it
    (the tiny model answers all ten within a second or two)."""
    url, budget, _, _ = served
    budget.set_limit(START_LIMIT)
    lowered_limit = 5 * BLOCK_BYTES  # 2560 KiB
    # 400 + 64 tokens: 4 blocks, within the lowered limit; 600 + 64: a 5-block prompt that grows to 6;
    # 700 + 64: a 6-block prompt
    fitting = [ask(f"fits-{i}", 400, 64, 10 + i) for i in range(8)]
    over = [ask("grows-over", 600, 64, 30), ask("over", 700, 64, 31)]
    run = clients(url, "tiny-llama", tmp_path, "fitting", requests=fitting, concurrency=len(fitting))
    with running(run):
        wait_until(lambda: budget.held_bytes > lowered_limit, 60, "the load never held more than the lowered limit")
        budget.set_limit(lowered_limit)
        lowered_at = time.monotonic()  # CLOCK_MONOTONIC, the clients' clock too
        assert run.poll() is None  # the load is on
        run_over = clients(url, "tiny-llama", tmp_path, "over", requests=over, concurrency=len(over))
        with running(run_over):
            done, started_at = answers(run, tmp_path, "fitting", with_start=True)
            done_over = answers(run_over, tmp_path, "over")
    fits = {tag: a["answered_s"] - a["sent_s"] for tag, a in done.items()}
    errors = {tag: a["answered_s"] - a["sent_s"] for tag, a in done_over.items()}
    print(f"limit lowered {lowered_at - started_at:.2f} s in; fitting requests answered within "
          f"{max(fits.values()):.2f} s; the two over it answered after {errors} s")
    assert len(done) == 8 and not failures(done), failures(done)
    assert max(fits.values()) < 60, f"the fitting requests took {fits} s"
    for tag in ("grows-over", "over"):
        assert over_limit_error(done_over[tag], lowered_limit) == 6 * BLOCK_BYTES, done_over[tag]
        assert WAIT_S <= errors[tag] < WAIT_S + max(fits.values()) + 10, \
            f"{tag}'s error {errors[tag]:.2f} s after it was sent (fitting requests: {max(fits.values()):.2f} s)"


@LONG
@needs_vllm
def test_a_budget_removed_under_load_leaves_the_server_answering(served, tmp_path):
    url, budget, _, log = served
    budget.set_limit(6 * BLOCK_BYTES)  # 16 clients, up to 8 running requests of 2 blocks: more than it holds
    requests = [ask(f"r{i}", 160 + i % 20, 32, 100 + i) for i in range(238)]  # 160-179 + 32 tokens: 2 blocks
    run = clients(url, "tiny-llama", tmp_path, "removed", requests=requests, concurrency=16)
    with running(run):
        wait_until(lambda: budget.held_bytes >= 4 * BLOCK_BYTES, 60, "the load never held 4 blocks")
        removing = time.monotonic()
        subprocess.run([sys.executable, "-m", "vattn", "budget", "rm", "--force", budget.name], check=True,
                       capture_output=True, timeout=300)
        removed_s = time.monotonic() - removing
        assert run.poll() is None, "the load was over before the budget was removed"
        done = answers(run, tmp_path, "removed")
    later = answers(clients(url, "tiny-llama", tmp_path, "later", requests=[ask(f"later-{i}", 170, 32, 400 + i)
                                                                            for i in range(8)], concurrency=8),
                    tmp_path, "later")
    seconds = max(a["answered_s"] for a in done.values())
    print(f"rm --force took {removed_s:.2f} s; 238 requests answered in {seconds:.2f} s")
    assert len(done) == 238 and not failures(done), (f"{len(failures(done))} of 238 failed in {seconds:.2f} s "
                                                     f"(rm --force took {removed_s:.2f} s)", failures(done)[:5])
    assert not failures(later), failures(later)
    assert healthy(url)
    text = log.read_text()
    assert text.count("can no longer be used") == 1 and "EngineDeadError" not in text, text[-4000:]


@LONG
@needs_vllm
def test_a_truncated_budget_leaves_two_busy_servers_answering(model, tmp_path):  # noqa: F811
    """12 requests of 170 + 128 tokens (3 blocks) on each server, 6 clients each, under 8 blocks; the segment
    truncated once they hold 4 blocks."""
    budget = vattn.Budget.create(f"operator-trunc-{os.getpid()}", 8 * BLOCK_BYTES)
    try:
        env = dict(VATTN_BUDGET=budget.name)
        with server(model, "tiny-llama-a", tmp_path / "a.log", True, args=OPERATOR_ARGS, **env) as a, \
                server(model, "tiny-llama-b", tmp_path / "b.log", True, args=OPERATOR_ARGS, **env) as b:
            runs = {name: clients(url, name, tmp_path, name, concurrency=6,
                                  requests=[ask(f"{name}-{i}", 170, 128, 200 + i) for i in range(12)])
                    for name, url in (("tiny-llama-a", a), ("tiny-llama-b", b))}
            with running(*runs.values()):
                wait_until(lambda: budget.held_bytes >= 4 * BLOCK_BYTES, 60, "the servers never held 4 blocks")
                os.truncate(f"/dev/shm/vattn-budget-{budget.name}", 64)
                assert all(run.poll() is None for run in runs.values()), "the load was over before the truncation"
                done = {name: answers(run, tmp_path, name) for name, run in runs.items()}
            seconds = {name: round(max(x["answered_s"] for x in d.values()), 2) for name, d in done.items()}
            print(f"answered within {seconds} s")
            for name, d in done.items():
                assert len(d) == 12 and not failures(d), (f"{name}: {len(failures(d))} of 12 failed within {seconds} s",
                                                          failures(d)[:5])
            assert healthy(a) and healthy(b)
            for name, url in (("tiny-llama-a", a), ("tiny-llama-b", b)):
                later = answers(clients(url, name, tmp_path, f"{name}-later", requests=[ask("later", 170, 16, 300)]),
                                tmp_path, f"{name}-later")
                assert not failures(later), failures(later)
            for log in ("a.log", "b.log"):
                text = (tmp_path / log).read_text()
                assert "EngineDeadError" not in text and text.count("can no longer be used") == 1, text[-4000:]
    finally:
        with contextlib.suppress(vattn.BudgetError):
            budget.remove(force=True)
