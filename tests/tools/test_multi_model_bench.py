"""The arithmetic of benchmarks/multi_model.py and multi_model_runs.py (the
engines themselves run in the benchmark, not here): the trace alternates
bursts between the models, B fits the largest burst at full length, the
schedulers' blocks in use add up across engines step by step, and throughput
is taken per burst."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import BENCHMARKS, load_benchmark

multi_model = load_benchmark("multi_model")
runs = load_benchmark("multi_model_runs")  # what both pipelines (in-process, --serve) share


def test_bursts_alternate_between_the_models_and_arrive_within_half_a_second():
    trace = multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=1)
    assert [len(reqs) for reqs in trace] == [15, 10, 10]  # bursts 0, 3, 6 / 1, 4 / 2, 5
    for model, reqs in enumerate(trace):
        assert {r["burst"] for r in reqs} == set(range(model, 7, 3))
        for r in reqs:
            start = 1.0 + r["burst"] * 6.0
            assert start <= r["arrival_s"] <= start + 0.5
            assert multi_model.PROMPT_TOKENS[0] <= len(r["prompt"]) <= multi_model.PROMPT_TOKENS[1]
            assert multi_model.OUTPUT_TOKENS[0] <= r["max_tokens"] <= multi_model.OUTPUT_TOKENS[1]
    assert trace == multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=1)
    assert trace != multi_model.make_trace(k=3, bursts=7, burst_requests=5, period_s=6.0, seed=2)


def test_a_burst_at_full_length_counts_whole_blocks():
    block = runs.BLOCK
    requests = [dict(prompt=[0] * (block - 10), max_tokens=10),  # exactly one block
                dict(prompt=[0] * block, max_tokens=1)]  # one token into a second block
    per_token = multi_model.kv_bytes_per_token(4)
    assert per_token == 2 * 4 * 2 * 64 * 2
    assert multi_model.burst_peak_bytes(requests, 4) == 3 * block * per_token


def test_blocks_in_use_add_up_across_engines_at_every_step():
    engines = [dict(usage_block_bytes=10, usage_series=[(0.0, 1), (2.0, 3), (4.0, 0)]),
               dict(usage_block_bytes=100, usage_series=[(1.0, 2), (3.0, 0)])]
    out = multi_model.blocks_in_use(engines)
    assert out["blocks_in_use_t_s"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["blocks_in_use_bytes"] == [10, 210, 230, 30, 0]


def test_throughput_is_per_burst_from_first_arrival_to_last_answer():
    requests = [dict(burst=0, arrival_s=1.0, finish_s=1.0, generated_tokens=10),
                dict(burst=0, arrival_s=1.5, finish_s=1.5, generated_tokens=30),  # answered at 3.0
                dict(burst=2, arrival_s=10.0, finish_s=4.0, generated_tokens=8)]
    assert runs.burst_throughput(requests) == pytest.approx((40 / 2.0 + 8 / 4.0) / 2)
    assert runs.percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert runs.percentile([float(i) for i in range(100)], 99) == 99.0
    assert runs.percentile([float(i) for i in range(200)], 50) == 100.0


def test_a_burst_is_late_when_its_last_answer_comes_after_the_next_burst_began():
    requests = [dict(burst=0, arrival_s=1.2, finish_s=5.0),  # answered at 6.2 < 7.0: in time
                dict(burst=1, arrival_s=7.1, finish_s=6.0),  # 13.1 > 13.0: burst 2 began at 13.0
                dict(burst=1, arrival_s=7.4, finish_s=1.0),
                dict(burst=2, arrival_s=13.0, finish_s=5.9)]  # 18.9 < 19.0
    assert runs.late_bursts(requests, period_s=6.0) == [1]
    assert runs.late_bursts(requests, period_s=7.0) == []


def test_the_dtype_follows_the_cpus_bf16_instructions():
    assert multi_model.auto_dtype(["avx2", "avx512f", "avx512_bf16"]) == "bfloat16"
    assert multi_model.auto_dtype(["avx2", "avx512f", "amx_bf16"]) == "bfloat16"
    assert multi_model.auto_dtype(["avx2", "avx512f"]) == "float32"  # AVX-512 without BF16
    assert multi_model.auto_dtype(["avx2"]) == "float32"
    assert multi_model.kv_bytes_per_token(4, "float32") == 2 * multi_model.kv_bytes_per_token(4, "bfloat16")


# Stands in for the vLLM environment's python: make-model does nothing; `serve` of a static configuration
# answers every request at once; `serve` under a budget (vattn elastic) records its pid and sleeps.
FAKE_ENGINE = """#!{python}
import json, os, sys, time
if sys.argv[2] == "make-model":
    sys.exit(0)
spec, out = json.load(open(sys.argv[4])), sys.argv[5]
if os.environ.get("VATTN_BUDGET"):
    open(os.path.join({pids!r}, str(os.getpid())), "w").close()
    time.sleep(600)
requests = [dict(arrival_s=r["arrival_s"], ttft_s=0.1, finish_s=0.5, generated_tokens=r["max_tokens"], outputs=[])
            for r in spec["requests"]]
json.dump(dict(start_unix=time.time(), requests=requests, preemptions=0, usage_series=[[0.0, 0]],
               usage_block_bytes=1, num_blocks=1, vattn=None), open(out, "w"))
"""


def test_sigterm_stops_the_engines_and_removes_the_budget(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import BENCHMARKS

    import vattn.budget

    pids = tmp_path / "engines"
    pids.mkdir()
    fake = tmp_path / "python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable, pids=str(pids)))
    fake.chmod(0o755)
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "multi_model.py"), "--python", str(fake), "--bursts",
                             "2", "--burst-requests", "1", "--rounds", "1", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    budget = f"multi-model-{proc.pid}"
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(pids)) < 2 or budget not in vattn.budget.names():  # both elastic engines serve
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        engines = [int(pid) for pid in os.listdir(pids)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "stopped by SIGTERM: the engines were stopped and the budget removed" in err
        assert budget not in vattn.budget.names()
        for pid in engines:  # killed and reaped by the benchmark: gone
            assert not os.path.exists(f"/proc/{pid}"), pid
    finally:  # whatever a failure left behind
        proc.kill()
        proc.wait()
        for pid in os.listdir(pids):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if budget in vattn.budget.names():
            vattn.budget.remove(budget)


def test_result_names_keep_the_committed_files_and_a_tag_names_a_run_of_its_own():
    name = multi_model.result_name
    assert name(2, "bfloat16", False, False, "cpu-2core") == "multi_model_2models_cpu-2core"
    assert name(2, "float32", True, False, "cpu-2core") == "multi_model_2models_fp32_serve_cpu-2core"
    assert name(2, "float32", True, True, "cpu-2core") == "multi_model_2models_fp32_serve_tp2_cpu-2core"
    assert name(2, "float32", True, False, "cpu-2core", "avx512") == "multi_model_2models_fp32_serve_avx512_cpu-2core"
    for committed in ("multi_model_2models_cpu-2core", "multi_model_3models_cpu-2core",
                      "multi_model_2models_fp32_serve_cpu-2core"):
        assert (BENCHMARKS / "results" / f"{committed}.json").exists()
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "multi_model.py"), "--tag", "a b"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tag must be letters, digits and '-'" in bad.stderr, bad.stderr


def _round(ttfts: list[float], tokens: int) -> dict:
    """One configuration's run in one round: one engine, one burst of requests with these TTFTs."""
    requests = [dict(burst=0, arrival_s=0.0, finish_s=2.0, generated_tokens=tokens, ttft_s=t) for t in ttfts]
    return {"engines": [{"requests": requests, "preemptions": 0}]}


def test_rounds_give_per_round_ratios_with_an_interval_and_the_aa_pair_beside_them():
    """Each round's ratio is of that round's runs (its own trace); with three
    rounds or more the median has an interval and a verdict; --aa's second
    stock run gives the same ratios of stock static to itself."""
    models = [("m0", 4, 256, 4)]
    stock = [_round([2.0, 2.0], 100), _round([3.0, 3.0], 100), _round([2.0, 2.0], 100)]
    again = [_round([2.2, 2.2], 100), _round([3.0, 3.0], 100), _round([1.8, 1.8], 100)]
    elastic = [_round([1.0, 1.0], 200), _round([1.0, 1.0], 200), _round([0.5, 0.5], 200)]
    runs_by_config = {"stock static": stock, "vattn static": stock, "vattn elastic": elastic,
                      multi_model.AGAIN: again}
    row = multi_model.summarize(models, runs_by_config)["m0"]
    assert row["ttft_rounds"]["per_round"] == [2.0, 3.0, 4.0]
    assert row["ttft_rounds"]["median"] == 3.0 and row["ttft_rounds"]["verdict"] == "ahead"
    assert row["throughput_rounds"]["per_round"] == [2.0, 2.0, 2.0]
    assert row["ttft_rounds_aa"]["per_round"] == pytest.approx([2.0 / 2.2, 1.0, 2.0 / 1.8], abs=1e-4)
    assert row["ttft_rounds_aa"]["verdict"] == "within noise"
    assert row[multi_model.AGAIN]["ttft_mean_s"] == pytest.approx(7.0 / 3)
    without_aa = multi_model.summarize(models, {c: r for c, r in runs_by_config.items() if c != multi_model.AGAIN})
    assert "ttft_rounds_aa" not in without_aa["m0"] and "ttft_rounds" in without_aa["m0"]
    two_rounds = multi_model.summarize(models, {c: r[:2] for c, r in runs_by_config.items()})["m0"]
    assert two_rounds["ttft_rounds"]["verdict"].startswith("no verdict")
