"""vLLM's scheduler under a budget with steps that overlap (asynchronous scheduling: two batches in flight),
and a grant whose bytes another process takes after the scheduler counted on them: what
vattn/integrations/vllm/engine_budget.py promises there (docs/vllm.md "Asynchronous scheduling",
docs/elastic.md "Liveness"). Each case runs vllm_budget_async.py in vLLM's environment, in one process
without a model."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


import vattn
from test_vllm import needs_vllm, vllm_python
from test_vllm_budget import tiny_model  # noqa: F401  (the module's tiny checkpoint, one fixture for both)

BLOCK_BYTES = 16 * 1024  # vllm_budget_async.BLOCK tokens of the test model's 1 KiB
SCRIPT = Path(__file__).with_name("vllm_budget_async.py")



def run_case(mode: str, model: Path, tmp_path: Path, limit_blocks: int) -> dict:
    budget = vattn.Budget.create(f"vllm-{mode}-{os.getpid()}", limit_blocks * BLOCK_BYTES)
    try:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
        proc = subprocess.run([vllm_python(), str(SCRIPT), mode, str(model), budget.name], capture_output=True,
                              text=True, timeout=600, env=environ, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
        assert budget.usage().held_bytes == 0  # every member left (usage() drops the dead ones)
    finally:
        budget.remove(force=True)
    return result


@needs_vllm
def test_overlapping_steps_never_give_back_pages_a_forward_in_flight_reads(tiny_model, tmp_path):
    """AsyncScheduler stepped as EngineCore.step_with_batch_queue steps it (two batches in flight), 24
    requests (a third sharing a prefix, some stopping on a token the scheduler learns a step late) in
    a budget of 14 blocks, another member asking for memory after every output: no release carries a
    block a forward still in flight reads (a request finished or preempted while the next step reads
    its blocks), the worker's pages never exceed the engine's charge, the budget never its limit, and
    every request finishes."""
    result = run_case("overlap", tiny_model, tmp_path, 14)
    assert result["released_while_read"] == [], result
    assert result["num_above_charge"] == 0, result["above_charge"]
    assert result["grant_waits"] == 0 and result["detached"] is None, result  # the count backed every hand-out
    assert result["peak"] <= result["limit"] == 14 * BLOCK_BYTES
    assert len(result["finished"]) == 24 and set(result["finished"].values()) == {"stop", "length"}, result
    assert result["blocks_released"] >= 20 and result["releases_sent"] >= 5, result  # releases all the time


@needs_vllm
def test_bytes_taken_between_the_count_and_the_grant_leave_the_request_waiting(tiny_model, tmp_path):
    """Another member takes a block's bytes just before each of the engine's grants while a 4-block
    request is scheduled in a budget of 6 blocks (2 free blocks with pages): the engine core goes on (no
    exception out of schedule()), the request waits with its refusal recorded, and it runs at the first
    step after the memory comes back; the budget never passes its limit."""
    result = run_case("race", tiny_model, tmp_path, 6)
    assert result["error"] is None, result
    assert result["taken"] > 0 and result["detached"] is None, result
    assert result["finished"] == {"x": ["length", 0], "y": ["length", 6]}, result
    assert result["waits_recorded"] >= 1 and result["grant_waits"] == 0, result
    assert result["peak"] <= result["limit"] and result["num_above_charge"] == 0, result


@needs_vllm
def test_a_hand_out_past_the_count_detaches_instead_of_ending_the_engine(tiny_model, tmp_path):
    """Blocks handed out outside allocate_slots, whose bytes another member takes before the grant: after
    the bounded wait (0.5 s in the case) the engine detaches from the budget, with the reason, and keeps
    the blocks, instead of raising into vLLM's engine core."""
    result = run_case("outside", tiny_model, tmp_path, 10)
    assert result["error"] is None and result["handed_out"] == 2, result
    assert "not granted within 0.5 s" in result["detached"], result
    assert 0.5 <= result["waited_s"] < 3.0 and result["grant_waits"] >= 1, result


@needs_vllm
def test_an_engine_with_asynchronous_scheduling_under_a_budget_serves_stock_tokens(tiny_model, tmp_path):
    """vllm.LLM (engine core in this process) with vLLM-CPU's asynchronous scheduling turned back on
    (AsyncScheduler, a batch queue of two) on vattn under a budget of 12 blocks, below the 4 running
    requests' peak, while another member asks for 2 blocks every 0.05 s: the greedy fp32 tokens equal stock
    vLLM's (synchronous, without vattn), the budget's total never passes the limit and bounds the engine,
    every release is confirmed, no hand-out waits for a grant; idle, it gives every page back."""
    block_bytes = 32 * 1024  # vllm_budget_async.ENGINE_BLOCK tokens of the test model's 1 KiB
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VATTN_VLLM_IDLE_RELEASE_S="0.5")

    def run(scheduling: str, budget_name: str, **env: str) -> dict:
        proc = subprocess.run([vllm_python(), str(SCRIPT), "engine", str(tiny_model), budget_name, scheduling],
                              capture_output=True, text=True, timeout=600, env=dict(environ, **env), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])

    stock = run("sync", "-")
    budget = vattn.Budget.create(f"vllm-async-engine-{os.getpid()}", 12 * block_bytes)
    try:
        ours = run("async", budget.name, VATTN_VLLM="1", VATTN_BUDGET=budget.name)
        assert budget.usage().held_bytes == 0  # the engine core left, or its process ended
    finally:
        budget.remove(force=True)
    assert (stock["scheduler"], stock["batch_queue_size"]) == ("Scheduler", 1)
    assert (ours["scheduler"], ours["batch_queue_size"]) == ("AsyncScheduler", 2)
    assert ours["tokens"] == stock["tokens"]
    assert 0 < ours["peak"] <= ours["limit"] == 12 * block_bytes
    pool, idle, (worker,) = ours["budget"], ours["idle"], ours["vattn"]
    print(f"busy: {pool}\nidle: {idle}")
    assert pool["detached"] is None and pool["block_bytes"] == block_bytes, pool
    assert pool["releases_sent"] == pool["releases_confirmed"], pool  # every step's output came back
    assert pool["budget_limited_allocations"] > 0 and pool["grant_waits"] == 0, pool  # the budget bounded it
    # idle: every block's pages went back, none kept for a step still counted in flight
    assert idle["held_bytes"] == 0 and idle["blocks_with_pages"] == 1 and idle["blocks_released"] > 0, idle
    assert worker["bytes_created"] == 0 and worker["release_backlog"] == 0, worker


@needs_vllm
def test_a_request_waiting_on_the_budget_costs_no_cpu_with_asynchronous_scheduling(tiny_model, tmp_path):
    """vllm_budget_waits.py's idle wait (another member holds the whole budget for 5 s while one request
    waits) with asynchronous scheduling and the engine core in the caller's process, which then steps
    EngineCore.step_with_batch_queue: under 0.1 CPU-seconds a second meanwhile (a step per refusal took a
    core), and the request runs once the memory comes back."""
    budget = vattn.Budget.create(f"vllm-async-idle-{os.getpid()}", 8 * 32 * 1024)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_VLLM", "VATTN_BUDGET"))}
    environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VATTN_VLLM="1",
                   VATTN_BUDGET=budget.name, VATTN_VLLM_IDLE_RELEASE_S="0.5")
    try:
        proc = subprocess.run([vllm_python(), str(SCRIPT), "idle-wait", str(tiny_model), budget.name],
                              capture_output=True, text=True, timeout=600, env=environ, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    finally:
        budget.remove(force=True)
    assert (result["scheduler"], result["batch_queue_size"]) == ("AsyncScheduler", 2)
    cpu = sum(result["cpu_s"].values())
    assert cpu / result["window_s"] < 0.1, result["cpu_s"]
    assert result["requests"]["0"][0] == "length" and result["requests"]["0"][1] >= 4.9
    assert result["budget"]["idle_waits"] >= 1 and result["budget"]["waits_recorded"] >= 1
