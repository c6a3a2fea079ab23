"""vLLM engines under one machine-wide budget (vattn/integrations/vllm/engine_budget.py).

Two engines in two processes share a budget that fits one engine's peak but not
both, one with its worker in the engine-core process, one in vLLM's default
layout (engine-core process, worker process): each must produce stock vLLM's
fp32 greedy tokens, nothing may fail in the model runner (the scheduler waits
or preempts), the budget's total never passes its limit, and an idle engine,
or one put to sleep(), gives its pages back."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import vattn
from test_vllm import SCENARIO, TOKEN_BYTES, needs_vllm, run_scenario, two_cpus_bind, vllm_python
from test_vllm_models import GROUP_WINDOWS, long_unless_in_suite
from workloads.vllm_models import ENGINE as MODEL_ENGINE
from workloads.vllm_models import phases as model_phases

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "budget"))
from budget_helpers import stuck_lock_holder  # noqa: E402

BLOCK = 32
BLOCK_BYTES = BLOCK * TOKEN_BYTES  # one block's pages, K and V of both layers
LIMIT_BLOCKS = 20  # one engine's peak (4 running requests of up to 5 blocks), not two
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, block_size=BLOCK, enable_prefix_caching=True)


def engine_phases(seed: int) -> list[dict]:
    rng = random.Random(seed)
    mixed = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 90))] for _ in range(8)]
    system = [rng.randrange(3, 256) for _ in range(70)]
    shared = [system + [rng.randrange(3, 256) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    return [dict(name=f"mixed-{seed}", prompts=mixed, max_tokens=[rng.randint(30, 60) for _ in mixed]),
            dict(name=f"shared-{seed}", prompts=shared, max_tokens=[rng.randint(8, 30) for _ in shared])]


def held_peak_while(budget: vattn.Budget, work: list[threading.Thread]) -> int:
    """Starts ``work`` and returns the most bytes the budget held while it ran (sampled every 10 ms)."""
    peak = 0
    for t in work:
        t.start()
    while any(t.is_alive() for t in work):
        peak = max(peak, budget.held_bytes)
        time.sleep(0.01)
    return peak


@needs_vllm
def test_two_engines_share_a_budget_with_stock_tokens_preempting_instead_of_failing(tmp_path):
    model = tmp_path / "model"
    subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(model)], check=True, capture_output=True,
                   timeout=300)
    budget = vattn.Budget.create(f"vllm-{os.getpid()}", LIMIT_BLOCKS * BLOCK_BYTES)
    env = dict(VLLM_CPU_KVCACHE_SPACE="1")
    layouts = {1: dict(VLLM_ENABLE_V1_MULTIPROCESSING="0"), 2: {}}  # engine 2: vLLM's default layout
    try:
        barrier = tmp_path / "barrier"
        barrier.mkdir()
        procs, outs = [], []
        for seed in (1, 2):
            spec = tmp_path / f"budget-{seed}.spec.json"
            # engine 1 goes idle, engine 2 is put to sleep: either gives its free blocks' pages back
            after = dict(idle_s=2.0) if seed == 1 else dict(sleep=True)
            spec.write_text(json.dumps(dict(engine=ENGINE, phases=engine_phases(seed), **after,
                                            barrier=dict(dir=str(barrier), parties=2))))
            outs.append(tmp_path / f"budget-{seed}.json")
            procs.append(threading.Thread(target=lambda s=spec, o=outs[-1]: procs_done.append(run_scenario(
                model, s, o, tmp_path, True, VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S="1", **env,
                **layouts[seed]))))
        procs_done: list[subprocess.CompletedProcess] = []
        held_peak = held_peak_while(budget, procs)
        for proc in procs_done:
            assert proc.returncode == 0, proc.stderr[-4000:]
        stock_spec = tmp_path / "stock.spec.json"
        stock_spec.write_text(json.dumps(dict(engine=ENGINE, phases=engine_phases(1) + engine_phases(2))))
        stock = run_scenario(model, stock_spec, tmp_path / "stock.json", tmp_path, False, **env, **layouts[1])
        assert stock.returncode == 0, stock.stderr[-4000:]
        stock_out = json.loads((tmp_path / "stock.json").read_text())["phases"]
        preemptions = 0
        for seed, out in zip((1, 2), outs):
            result = json.loads(out.read_text())
            for name, phase in result["phases"].items():
                assert phase["outputs"] == stock_out[name]["outputs"], name
                preemptions += phase["preemptions"]
            (v,) = result["vattn"]
            pool = result["budget"]  # the engine core's membership, in whichever process it runs
            assert pool["budget"] == budget.name and pool["block_bytes"] == BLOCK_BYTES and pool["world_size"] == 1
            assert pool["label"] == "vllm model rank 0"
            assert v["bytes_created"] <= LIMIT_BLOCKS * BLOCK_BYTES
            print(f"engine {seed}: {pool}")
            # idle or asleep: every free block's pages went back (the null padding block may stay), in the
            # worker and in the budget
            asleep = "idle" if seed == 1 else "asleep"
            (idle,), idle_pool = result[f"vattn_{asleep}"], result[f"budget_{asleep}"]
            assert idle_pool["sleeps"] == (seed == 2)
            assert idle["bytes_created"] <= BLOCK_BYTES, idle_pool
            assert idle_pool["held_bytes"] <= BLOCK_BYTES, idle_pool
            assert idle_pool["blocks_released"] > 0
        assert preemptions > 0  # the budget, not the pools (1 GiB each), bounded the engines
        assert 0 < held_peak <= LIMIT_BLOCKS * BLOCK_BYTES
    finally:
        budget.remove(force=True)  # teardown: a member still exiting must not keep the budget


def serve_under_budget(model: Path, spec: Path, out: Path, cwd: Path, budget: vattn.Budget, **env: str) -> int:
    """Runs the scenario ``spec`` with vattn under ``budget`` (idle pages back after 1 s) while sampling
    the budget; returns the most it held, in bytes."""
    done: list[subprocess.CompletedProcess] = []
    work = threading.Thread(target=lambda: done.append(run_scenario(
        model, spec, out, cwd, True, VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S="1", **env)))
    held_peak = held_peak_while(budget, [work])
    assert done[0].returncode == 0, done[0].stderr[-4000:]
    return held_peak


@needs_vllm
@pytest.mark.parametrize("arch,limit_blocks", [
    pytest.param("gemma2", 16, id="gemma2"),
    pytest.param("gemma3", 20, id="gemma3", marks=long_unless_in_suite("gemma3").marks)])
def test_a_hybrid_model_under_a_budget_serves_stock_tokens(arch, limit_blocks, tmp_path):
    """``limit_blocks``: below stock's peak, above the longest request's need (Gemma-2: 8 global blocks + 3
    in the window; Gemma-3: 8 + 3 + 3)."""
    model = tmp_path / arch
    subprocess.run([vllm_python(), str(SCENARIO), "make-arch", str(model), arch], check=True,
                   capture_output=True, timeout=300)
    env = dict(VLLM_CPU_KVCACHE_SPACE="1")
    stock_spec = tmp_path / "stock.spec.json"
    stock_spec.write_text(json.dumps(dict(engine=MODEL_ENGINE, phases=model_phases(), record_usage=True)))
    proc = run_scenario(model, stock_spec, tmp_path / "stock.json", tmp_path, False, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stock = json.loads((tmp_path / "stock.json").read_text())
    block_bytes = stock["usage_block_bytes"]  # one block id: a page of every layer of every group
    assert max(blocks for _, blocks in stock["usage_series"]) > limit_blocks
    budget = vattn.Budget.create(f"vllm-hybrid-{os.getpid()}", limit_blocks * block_bytes)
    try:
        spec = tmp_path / "vattn.spec.json"
        spec.write_text(json.dumps(dict(engine=MODEL_ENGINE, phases=model_phases(), record_usage=True, idle_s=2.0)))
        held_peak = serve_under_budget(model, spec, tmp_path / "vattn.json", tmp_path, budget, **env)
    finally:
        budget.remove(force=True)  # teardown: a member still exiting must not keep the budget
    ours = json.loads((tmp_path / "vattn.json").read_text())
    for name, phase in stock["phases"].items():
        assert ours["phases"][name]["outputs"] == phase["outputs"], name
    (v,) = ours["vattn"]
    assert [g["window"] for g in v["groups"]] == GROUP_WINDOWS[arch]
    assert max(v["bytes_behind_windows_series"]) > 0  # the window's group still unmapped what slid out
    assert 0 < held_peak <= limit_blocks * block_bytes
    assert max(blocks for _, blocks in ours["usage_series"]) <= limit_blocks
    assert sum(p["preemptions"] for p in ours["phases"].values()) + \
        ours["budget"]["waits_recorded"] > 0  # the budget, not the 1 GiB pool, bounded the engine
    (idle,) = ours["vattn_idle"]
    assert idle["bytes_created"] <= block_bytes and ours["budget_idle"]["blocks_released"] > 0
    assert ours["budget_idle"]["held_bytes"] <= block_bytes


def test_a_budget_works_with_vllms_own_executors_and_either_scheduling(monkeypatch):
    from types import SimpleNamespace

    from vattn.integrations.vllm import engine_budget as vllm_budget

    def config(backend: str | None, world: int = 1, async_scheduling: bool = False) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=world),
                               scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    from vattn.integrations.vllm import runtime

    device = "cpu"
    monkeypatch.setattr(runtime, "platform_device", lambda: device)
    monkeypatch.delenv("VATTN_BUDGET", raising=False)
    vllm_budget.check_config(config("ray", 2))  # no budget: anything goes
    monkeypatch.setenv("VATTN_BUDGET", "kv")
    for fine in (config("uni"), config("mp"), config(None), config("mp", 2), config("mp", 4)):  # CPU ranks
        vllm_budget.check_config(fine)
    device = "cuda"
    for fine in (config("mp"), config("mp", 2)):  # GPU ranks: each device's own budget is charged
        vllm_budget.check_config(fine)
    with pytest.raises(ValueError, match="executor 'ray' places ranks on other machines"):
        vllm_budget.check_config(config("ray", 2))
    vllm_budget.check_config(config("mp", async_scheduling=True))  # vLLM's default on a GPU
    monkeypatch.setenv("VATTN_VLLM_IDLE_RELEASE_S", "soon")
    with pytest.raises(ValueError, match="VATTN_VLLM_IDLE_RELEASE_S"):
        vllm_budget.idle_release_setting()


def test_a_members_label_names_the_served_model_and_its_ranks():
    from vattn.integrations.vllm.engine_member import LABEL_CHARACTERS, member_label

    assert member_label(["llama-8b"], 1, 1) == "vllm llama-8b rank 0"
    assert member_label("/models/llama-8b/", 2, 1) == "vllm llama-8b ranks 0-1 tp2"
    assert member_label("m", 2, 2) == "vllm m ranks 0-3 tp2 pp2"
    long = member_label("x" * 100, 2, 1)
    assert len(long) == LABEL_CHARACTERS and long.endswith("~ ranks 0-1 tp2")
    assert member_label("caf\u00e9\n", 1, 1) == "vllm caf?? rank 0"


@needs_vllm
@pytest.mark.skipif(os.environ.get("VATTN_LONG_TESTS") != "1",
                    reason="long test: set VATTN_LONG_TESTS=1 (two compiled pipeline-parallel vLLM start-ups)")
def test_pipeline_parallel_2_under_a_budget_serves_stock_tokens(tmp_path):
    """Two pipeline stages, a worker process each (vLLM's multiprocessing executor): the engine core charges a
    block as both stages' pages together, below stock's peak; stock's tokens, the limit held, idle pages back.
    Compilation on: vLLM-CPU runs pipeline parallel only so (tests/integrations/test_vllm_pipeline.py)."""
    bind = two_cpus_bind()
    model = tmp_path / "llama"
    subprocess.run([vllm_python(), str(SCENARIO), "make-arch", str(model), "llama"], check=True, capture_output=True,
                   timeout=300)
    engine = dict(MODEL_ENGINE, pipeline_parallel_size=2, enforce_eager=False, distributed_executor_backend="mp")
    env = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind)
    stock_spec = tmp_path / "stock.spec.json"
    stock_spec.write_text(json.dumps(dict(engine=engine, phases=model_phases())))
    proc = run_scenario(model, stock_spec, tmp_path / "stock.json", tmp_path, False, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stock = json.loads((tmp_path / "stock.json").read_text())
    limit_blocks = 14  # the longest request's 7 blocks twice; 4 requests of up to 7 blocks need more
    budget = vattn.Budget.create(f"vllm-pp-{os.getpid()}", limit_blocks * stock["block_bytes"])
    try:
        spec = tmp_path / "vattn.spec.json"
        spec.write_text(json.dumps(dict(engine=engine, phases=model_phases(), idle_s=2.0)))
        held_peak = serve_under_budget(model, spec, tmp_path / "vattn.json", tmp_path, budget, **env)
    finally:
        budget.remove(force=True)
    ours = json.loads((tmp_path / "vattn.json").read_text())
    for name, phase in stock["phases"].items():
        assert ours["phases"][name]["outputs"] == phase["outputs"], name
    pool = ours["budget"]
    assert pool["world_size"] == 2 and pool["label"] == "vllm llama ranks 0-1 pp2"
    assert pool["block_bytes"] == stock["block_bytes"]  # both stages' layers together
    assert 0 < held_peak <= limit_blocks * stock["block_bytes"]
    assert sum(p["preemptions"] for p in ours["phases"].values()) + pool["waits_recorded"] > 0
    assert ours["budget_idle"]["held_bytes"] <= stock["block_bytes"]
    assert sum(v["bytes_created"] for v in ours["vattn"]) <= stock["block_bytes"]


WAITS = Path(__file__).with_name("vllm_budget_waits.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("waits") / "model"
    subprocess.run([vllm_python(), str(SCENARIO), "make-model", str(model)], check=True, capture_output=True,
                   timeout=300)
    return model


def run_waits(mode: str, model: Path, tmp_path: Path, limit_blocks: int, **env: str) -> tuple[dict, str]:
    """``vllm_budget_waits.py MODE`` under a budget of ``limit_blocks`` blocks: its result and its log."""
    budget = vattn.Budget.create(f"waits-{mode}-{os.getpid()}", limit_blocks * BLOCK_BYTES)
    try:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
        environ.update(VATTN_VLLM="1", VATTN_BUDGET=budget.name, VLLM_CPU_KVCACHE_SPACE="1", **env)
        proc = subprocess.run([vllm_python(), str(WAITS), mode, str(model)], capture_output=True, text=True,
                              timeout=600, env=environ, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"mode"')][-1]
        return json.loads(line), proc.stdout + proc.stderr
    finally:
        try:
            budget.remove(force=True)  # teardown: whatever the engine left (gone already when removed)
        except vattn.BudgetError:
            pass


@needs_vllm
def test_a_request_over_the_limit_fails_after_the_wait_and_the_others_run(tiny_model, tmp_path):
    """vLLM's default layout under 5 blocks: a request of 7 blocks is set aside (vLLM's queue would stop
    at it), the three 1-block requests behind it finish at once, and it finishes with an error naming the
    limit and its need once VATTN_BUDGET_WAIT_S (3 s) passed. Start-up said the budget cannot hold one
    request of max-model-len. Idle, the budget holds exactly what the worker created (no padding block
    is charged that no worker created)."""
    result, log = run_waits("over-limit", tiny_model, tmp_path, 5, VATTN_BUDGET_WAIT_S="3",
                            VATTN_VLLM_IDLE_RELEASE_S="1")
    done = result["requests"]
    assert {rid: reason for rid, (reason, _, _) in done.items()} == {"0": "error", "1": "length", "2": "length",
                                                                     "3": "length"}
    assert max(done[r][1] for r in "123") < 2.5, done  # not behind the request over the limit
    assert 3.0 <= done["0"][1] < 8.0, done
    assert done["0"][2].startswith(f"vattn: budget 'waits-over-limit-{os.getpid()}': this request needs "
                                   f"{7 * BLOCK_BYTES} bytes (200 tokens) alone, more than the budget's limit of "
                                   f"{5 * BLOCK_BYTES} bytes, and the limit did not rise within 3 s"), done["0"]
    assert (f"cannot hold one request of max-model-len 256 tokens: that needs {8 * BLOCK_BYTES} bytes (8 blocks "
            f"of {BLOCK_BYTES} bytes on every rank, and 0 bytes of padding)") in log
    pool = result["budget"]
    assert pool["requests_over_limit"] == pool["requests_failed_over_limit"] == 1 and not pool["detached"]
    assert pool["padding_bytes"] == 0 and result["held_bytes"] == sum(result["bytes_created"]), result


@needs_vllm
@pytest.mark.parametrize("layout", [
    "in-process", pytest.param("default", marks=pytest.mark.skipif(
        os.environ.get("VATTN_LONG_TESTS") != "1", reason="long test: set VATTN_LONG_TESTS=1 (a vLLM start-up)"))])
def test_a_request_waiting_on_the_budget_costs_no_cpu(layout, tiny_model, tmp_path):
    """Another member holds the whole budget for 5 s while one request waits: the engine's processes
    (engine core and worker, in one process or three) use under 0.1 CPU-seconds a second meanwhile (a
    step per refusal took a core and more), and the request runs once the memory comes back."""
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0") if layout == "in-process" else {}
    result, _ = run_waits("idle-wait", tiny_model, tmp_path, 8, VATTN_VLLM_IDLE_RELEASE_S="0.5", **env)
    cpu = sum(result["cpu_s"].values())
    print(f"{layout}: {cpu:.3f} CPU-s in {result['window_s']:.2f} s of waiting: {result['cpu_s']}")
    assert cpu / result["window_s"] < 0.1, result["cpu_s"]
    assert result["requests"]["0"][0] == "length" and result["requests"]["0"][1] >= 4.9
    assert result["budget"]["idle_waits"] >= 1 and result["budget"]["waits_recorded"] >= 1
    assert result["waited_s"] and result["waited_s"][0] >= 4.0, result["waited_s"]  # top's "for", not 0.0s


@needs_vllm
@pytest.mark.parametrize("damage,layout", [("removed", "default"), ("truncated", "in-process")])
def test_a_removed_or_truncated_budget_leaves_the_engine_serving(damage, layout, tiny_model, tmp_path):
    """The budget removed (rm --force) or its segment truncated while 12 requests run under it: the engine
    core says once that it goes on without the budget, and every request finishes."""
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0") if layout == "in-process" else {}
    result, log = run_waits(damage, tiny_model, tmp_path, 8, **env)
    done = result["requests"]
    assert len(done) == 12 and all(reason == "length" for reason, _, _ in done.values()), done
    assert max(t for _, t, _ in done.values()) > result["damaged_s"]  # requests were still running
    assert result["budget"]["detached"] and log.count("can no longer be used") == 1, result["budget"]
    assert ("was removed" if damage == "removed" else "truncated") in result["budget"]["detached"]


@needs_vllm
def test_vllms_scheduler_under_the_hooks_against_the_reference(tiny_model, tmp_path):
    """vLLM's own scheduler with vattn's budget hooks, in one process without a model
    (vllm_scheduler_budget.py): 10 random runs of requests of 1-200 tokens arriving over 3 s, the limit
    set 1-4 times to 1-7 blocks (some half a block more), VATTN_BUDGET_WAIT_S=3 on a simulated clock;
    every outcome as tests/budget_reference.py says: a request over the limit never holds up the ones
    behind it, fails only after the wait and on time, every request within the final limit runs."""
    from budget_reference import check_outcomes

    budget = vattn.Budget.create(f"vllm-sim-{os.getpid()}", 8 * BLOCK_BYTES)
    try:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
        proc = subprocess.run([vllm_python(), str(Path(__file__).with_name("vllm_scheduler_budget.py")),
                               str(tiny_model), budget.name, "10"], capture_output=True, text=True, timeout=600,
                              env=dict(environ, VATTN_BUDGET_WAIT_S="3"), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("[")][-1])
    finally:
        budget.remove(force=True)
    reasons = []
    for run in runs:
        outcome = {int(rid): got for rid, got in run["outcome"].items()}
        check_outcomes([tuple(a) for a in run["arrivals"]], run["history"], outcome, run["last_change"],
                       lambda tokens: -(-tokens // BLOCK) * BLOCK_BYTES, 30, "error", "length")
        assert sorted(outcome) == list(range(len(run["arrivals"]))), run  # each ended, once
        for got in outcome.values():
            reasons.append(got[0])
            if got[0] == "error":
                assert "more than the budget's limit of" in got[2], got
    assert reasons.count("error") >= 3 and reasons.count("length") >= 20, reasons  # both sides exercised


@needs_vllm
def test_a_stuck_budget_lock_keeps_the_engine_in_the_budget_and_serving(tiny_model, tmp_path):
    """Another process holds the budget's lock past lock_timeout_s (stopped, stuck) while vLLM's scheduler
    runs under the hooks (vllm_budget_lock.py): a request that needs new blocks waits (no grant can be
    had) and then runs on blocks that have pages, releases made meanwhile stay charged and are given back
    once the lock is free, and the engine stays in the budget. (The timeout was a BudgetError like a
    removed budget's: the engine detached for good and charged nothing from then on.)"""
    script = Path(__file__).with_name("vllm_budget_lock.py")
    block_bytes = BLOCK * 1024  # the script's: the test model's 1 KiB a token
    budget = vattn.Budget.create(f"vllm-lock-{os.getpid()}", 6 * block_bytes)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    proc = subprocess.Popen([vllm_python(), str(script), str(tiny_model), budget.name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=environ, cwd=tmp_path)
    try:
        lines = iter(proc.stdout)

        def until(said: str) -> None:
            for line in lines:
                if line.strip() == said:
                    return
            raise AssertionError(f"the script ended before saying {said!r} (exit {proc.wait()})")

        until("hold")
        with stuck_lock_holder(budget.name) as let_go:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            until("let go")
            let_go()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(list(lines)[-1])
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
        budget.remove(force=True)
    stages = result["stages"]
    assert all(stage["detached"] is None for stage in stages.values()), stages
    assert stages["first admitted"]["held"] == 4 * block_bytes
    waits = stages["second waits"]
    assert waits["scheduled"] == [["first"]] and waits["lock_timeouts"] >= 1 and waits["held"] == 4 * block_bytes
    reuse = stages["second on first's blocks"]
    assert ["second"] in reuse["scheduled"] and reuse["finished"] == ["first", "second"], reuse
    assert reuse["held"] == 4 * block_bytes  # nothing granted or given back while the lock is held
    released = stages["released"]
    assert released["held"] == 4 * block_bytes and released["unreturned"] == 4 * block_bytes, released
    assert stages["lock free"]["held"] == 0 and stages["lock free"]["unreturned"] == 0, stages["lock free"]
    assert stages["third admitted"]["scheduled"] == [["third"]] and stages["third admitted"]["held"] == 5 * block_bytes
    assert result["held_after_close"] == 0
