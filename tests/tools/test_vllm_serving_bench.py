"""benchmarks/vllm_serving.py's --dtype: bf16 runs are set up and named as
the committed results were, float32 runs get files of their own (the engines
themselves run in the benchmark, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import BENCHMARKS, load_benchmark

vllm_serving = load_benchmark("vllm_serving")
RESULTS = BENCHMARKS / "results"


@pytest.mark.parametrize("suite,name", [("short", "vllm_serving_cpu-2core"),
                                        ("long", "vllm_serving_long_cpu-2core")])
def test_bf16_is_set_up_and_named_as_the_committed_results(suite, name):
    assert vllm_serving.result_name("serving", suite, "bfloat16", "cpu-2core") == name
    committed = json.loads((RESULTS / f"{name}.json").read_text())
    model, engine = vllm_serving.suite_setup(vllm_serving.SUITES[suite], "bfloat16")
    assert model == committed["model"]
    assert {k: committed["engine"][k] for k in engine} == engine  # the run adds block_size, num_blocks, ...
    assert vllm_serving.result_name("profile", suite, "bfloat16", "cpu-2core") == f"vllm_serving_{suite}_profile_cpu-2core"


def test_float32_runs_in_float32_and_writes_files_of_its_own():
    model, engine = vllm_serving.suite_setup(vllm_serving.SUITES["long"], "float32")
    assert engine["dtype"] == "float32" and model.endswith(", fp32")
    assert vllm_serving.SUITES["long"]["engine"].get("dtype") is None  # the suite itself names no dtype
    names = {vllm_serving.result_name(kind, suite, "float32", "cpu-2core")
             for kind in ("serving", "profile") for suite in ("short", "long")}
    assert names == {"vllm_serving_fp32_cpu-2core", "vllm_serving_long_fp32_cpu-2core",
                     "vllm_serving_short_fp32_profile_cpu-2core", "vllm_serving_long_fp32_profile_cpu-2core"}
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_serving.py"), "--dtype", "float16"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'float16'" in bad.stderr


def test_the_budget_and_the_default_layout_get_files_of_their_own():
    name = vllm_serving.result_name
    assert name("serving", "short", "float32", "cpu-2core", budget=True) == "vllm_serving_fp32_budget_cpu-2core"
    assert name("serving", "short", "float32", "cpu-2core", budget=True, layout="default") == \
        "vllm_serving_fp32_budget_mp_cpu-2core"
    assert name("serving", "long", "bfloat16", "cpu-2core", layout="default") == "vllm_serving_long_mp_cpu-2core"
    assert name("serving", "short", "bfloat16", "cpu-2core", label="avx2") == "vllm_serving_avx2_cpu-2core"
    # a tagged profile run keeps the committed profile (--profile --tag once wrote over it)
    assert name("profile", "long", "bfloat16", "cpu-2core", label="zen4") == "vllm_serving_long_zen4_profile_cpu-2core"


def fake_run(rates: dict[str, float], outputs: list, vattn: bool = False) -> dict:
    """What one engine's run returns, with ``rates`` tokens/s per trace (100 tokens each)."""
    phases = {t: {"generated_tokens": 100, "generate_s": 100 / r, "outputs": outputs, "ttft_s": [0.1, 0.3],
                  "prefix_cache_hits": 0, "preemptions": 0, "start": 0.0} for t, r in rates.items()}
    return {"phases": phases, "block_bytes": 4096, "usage_series": [],
            "vattn": [{"time_s_series": [], "bytes_mapped_series": []}] if vattn else None}


def test_every_ratio_is_per_round_with_its_median_interval_and_the_aa_pair():
    runs = {"stock": [fake_run({"a": 10.0}, [[1, 2]]), fake_run({"a": 20.0}, [[1, 2]]),
                      fake_run({"a": 10.0}, [[1, 2]])],
            "vattn": [fake_run({"a": 12.0}, [[1, 2]], True), fake_run({"a": 22.0}, [[1, 3]], True),
                      fake_run({"a": 13.0}, [[1, 2]], True)],
            "vattn+budget": [fake_run({"a": 12.0}, [[1, 2]], True), fake_run({"a": 11.0}, [[1, 2]], True),
                             fake_run({"a": 13.0}, [[1, 2]], True)],
            "stock-again": [fake_run({"a": 11.0}, [[1, 2]]), fake_run({"a": 18.0}, [[1, 2]]),
                            fake_run({"a": 10.0}, [[1, 2]])]}
    row = vllm_serving.summarize(runs, ("a",), "stock", low_precision=False)["a"]
    assert set(row["ratios"]) == {"vattn / stock", "vattn+budget / vattn", "stock-again / stock"}
    ours = row["ratios"]["vattn / stock"]
    assert ours["per_round"] == [1.2, 1.1, 1.3]  # within each round, not of means over rounds
    assert ours["median"] == pytest.approx(1.2) and row["tokens_per_s_ratio_vattn_over_stock"] == ours["median"]
    assert ours["verdict"] == "ahead" and ours["interval_95"] == pytest.approx([1.1, 1.3])
    assert row["ratios"]["vattn+budget / vattn"]["per_round"] == [1.0, 0.5, 1.0]
    assert row["ratios"]["stock-again / stock"]["verdict"] == "within noise"
    assert row["stock_tokens_per_s"] == 10.0 and row["vattn_tokens_per_s_rounds"] == [12.0, 22.0, 13.0]
    assert row["identical_outputs"] == "1/1 (first token 1/1)" and row["vattn+budget_identical_outputs_to_vattn"] == 1


def clocked_run(rate: float, rest_s: float, layers: tuple[float, float] | None, vattn: bool = False) -> dict:
    """A run whose one trace ("a") carries the worker's forward clocks; ``layers``: (layer_s,
    outside_layers_s) where the layers were clocked."""
    run = fake_run({"a": rate}, [[1]], vattn)
    clocks = {"attention_s": 1.0, "metadata_s": 0.1, "rest_s": rest_s, "step_s": 1.1 + rest_s,
              "rest_cpu_s": rest_s / 2, "step_involuntary_switches": 3}
    if layers:
        clocks |= {"layer_s": layers[0], "outside_layers_s": layers[1]}
    run["phases"]["a"]["forward_clocks"] = [clocks]
    return run


def test_the_forward_parts_are_compared_within_each_round_and_the_layers_where_clocked():
    runs = {"stock": [clocked_run(10.0, 2.0, (1.2, 1.8)), clocked_run(10.0, 4.0, (1.2, 3.6))],
            "vattn": [clocked_run(12.0, 1.0, (1.1, 0.9), True), clocked_run(12.0, 3.0, (1.1, 2.7), True)]}
    row = vllm_serving.summarize(runs, ("a",), None, low_precision=False)["a"]
    assert row["stock_forward_s_rounds"]["outside_layers_s"] == [1.8, 3.6]
    assert row["forward_rest_vattn_over_stock"]["per_round"] == [0.5, 0.75]  # vattn / stock, round by round
    assert row["forward_outside_layers_vattn_over_stock"]["per_round"] == [0.5, 0.75]
    assert row["forward_rest_cpu_vattn_over_stock"]["per_round"] == [0.5, 0.75]  # the rest in CPU time too
    assert row["stock_forward_s_rounds"]["step_involuntary_switches"] == [3, 3]
    runs["stock-again"] = [clocked_run(10.0, 1.0, (1.2, 0.9)), clocked_run(10.0, 2.0, (1.2, 3.6))]
    row = vllm_serving.summarize(runs, ("a",), "stock", low_precision=False)["a"]  # the A/A engine's parts too
    assert row["forward_rest_stock-again_over_stock"]["per_round"] == [0.5, 0.5]
    assert row["forward_outside_layers_stock-again_over_stock"]["per_round"] == [0.5, 1.0]
    assert row["forward_rest_vattn_over_stock"]["per_round"] == [0.5, 0.75]
    unclocked = {"stock": [clocked_run(10.0, 2.0, None)] * 2, "vattn": [clocked_run(12.0, 1.0, (1.1, 0.9), True)] * 2}
    row = vllm_serving.summarize(unclocked, ("a",), None, low_precision=False)["a"]
    assert "forward_outside_layers_vattn_over_stock" not in row and "forward_rest_vattn_over_stock" in row


def faulting_run(faults: int, vattn: bool = False) -> dict:
    """A clocked run whose rest is 0.5 s plus 2 us per minor fault of its trace."""
    run = clocked_run(10.0, 0.5 + 2e-6 * faults, None, vattn)
    run["phases"]["a"] |= {"minor_faults": faults, "modules_imported": []}
    return run


def test_the_rest_is_set_against_the_minor_faults_of_every_round():
    runs = {"stock": [faulting_run(100_000), faulting_run(400_000)],
            "vattn": [faulting_run(50_000, True), faulting_run(300_000, True)],
            "stock-again": [faulting_run(250_000), faulting_run(10_000)]}
    row = vllm_serving.summarize(runs, ("a",), "stock", low_precision=False)["a"]
    fit = row["rest_against_minor_faults"]
    assert fit["seconds_per_fault"] == pytest.approx(2e-6) and fit["r_squared"] == pytest.approx(1.0)
    assert fit["rest_less_faults_s_rounds"]["vattn"] == pytest.approx([0.5, 0.5])
    # the rest alone differs round by round with the faults; less their share, it is equal
    assert row["forward_rest_vattn_over_stock"]["per_round"] != [1.0, 1.0]
    assert row["forward_rest_less_faults_vattn_over_stock"]["per_round"] == pytest.approx([1.0, 1.0])
    assert row["forward_rest_less_faults_stock-again_over_stock"]["per_round"] == pytest.approx([1.0, 1.0])
    unfaulted = {"stock": [clocked_run(10.0, 1.0, None)] * 2, "vattn": [clocked_run(12.0, 1.0, None, True)] * 2}
    assert "rest_against_minor_faults" not in vllm_serving.summarize(unfaulted, ("a",), None, False)["a"]


def test_faults_that_only_tell_the_engines_apart_are_not_subtracted():
    """vattn's rounds fault more and its rest is shorter, but within each engine the rest does not follow
    the faults: a line across all rounds would read the engine as a slope, the fit within engines does not."""
    def run(faults: int, rest: float, vattn: bool = False) -> dict:
        r = clocked_run(10.0, rest, None, vattn)
        r["phases"]["a"] |= {"minor_faults": faults, "modules_imported": []}
        return r

    runs = {"stock": [run(50, 0.70), run(60, 0.66), run(55, 0.74)],
            "vattn": [run(1300, 0.60, True), run(1400, 0.62, True), run(1350, 0.58, True)]}
    row = vllm_serving.summarize(runs, ("a",), None, low_precision=False)["a"]
    assert row["rest_against_minor_faults"]["r_squared"] < vllm_serving.MIN_FAULTS_R_SQUARED
    assert "rest_less_faults_s_rounds" not in row["rest_against_minor_faults"]
    assert not any(k.startswith("forward_rest_less_faults_") for k in row)


def test_the_base_checkout_is_the_denominator_of_this_checkouts_vattn():
    assert vllm_serving.ratio_pairs(["stock", "vattn", "vattn-base"], None) == [("vattn", "stock"),
                                                                               ("vattn", "vattn-base")]
    assert vllm_serving.ratio_pairs(["stock", "vattn"], "vattn") == [("vattn", "stock"), ("vattn-again", "vattn")]


def test_the_padded_engine_is_compared_with_vattn_and_its_rest_with_both_engines():
    assert vllm_serving.ratio_pairs(["stock", "vattn", "vattn+padded"], "stock") == [
        ("vattn", "stock"), ("vattn+padded", "vattn"), ("stock-again", "stock")]
    runs = {"stock": [clocked_run(10.0, 2.0, None), clocked_run(10.0, 4.0, None)],
            "vattn": [clocked_run(20.0, 1.0, None, True), clocked_run(20.0, 2.0, None, True)],
            "vattn+padded": [clocked_run(10.0, 1.5, None, True), clocked_run(10.0, 3.0, None, True)]}
    row = vllm_serving.summarize(runs, ("a",), None, low_precision=False)["a"]
    assert row["ratios"]["vattn+padded / vattn"]["per_round"] == [0.5, 0.5]
    assert row["forward_rest_vattn+padded_over_vattn"]["per_round"] == [1.5, 1.5]
    assert row["forward_rest_vattn+padded_over_stock"]["per_round"] == [0.75, 0.75]


def test_a_bad_aa_engine_or_base_checkout_is_refused_by_name(tmp_path):
    for flags, message in ((["--aa", "dynamic"], "--aa must be one of stock, vattn or none"),
                           (["--base", str(tmp_path)], "--base must be a vattn checkout"),
                           (["--pad-attention", "1"], "--pad-attention must be above 1"),
                           (["--pad-attention", "2", "--pad-threads", "0"], "--pad-threads must be in [1, 64]"),
                           (["--pinned", "--budget"], "--pinned runs stock and vattn in the in-process layout only")):
        bad = subprocess.run([sys.executable, str(BENCHMARKS / "vllm_serving.py"), *flags],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_pinned_runs_get_files_of_their_own_and_their_aa_pair_ran_side_by_side():
    name = vllm_serving.result_name
    assert name("serving", "short", "bfloat16", "cpu-2core", pinned=True) == "vllm_serving_pinned_cpu-2core"
    assert name("serving", "long", "bfloat16", "cpu-2core", label="zen4", pinned=True) == \
        "vllm_serving_long_pinned_zen4_cpu-2core"
    assert vllm_serving.ratio_pairs(["stock", "vattn", "stock-beside"], "stock", pinned=True) == [
        ("vattn", "stock"), ("stock-again", "stock-beside")]
    runs = {"stock": [clocked_run(10.0, 2.0, None), clocked_run(20.0, 2.0, None)],
            "vattn": [clocked_run(12.0, 1.0, None, True), clocked_run(22.0, 1.0, None, True)],
            "stock-beside": [clocked_run(8.0, 1.0, None), clocked_run(16.0, 4.0, None)],
            "stock-again": [clocked_run(8.0, 2.0, None), clocked_run(20.0, 2.0, None)]}
    row = vllm_serving.summarize(runs, ("a",), "stock", low_precision=False, pinned=True)["a"]
    # the A/A pair is the two runs that shared the machine's moment, not stock-again against the stock beside vattn
    assert set(row["ratios"]) == {"vattn / stock", "stock-again / stock-beside"}
    assert row["ratios"]["stock-again / stock-beside"]["per_round"] == [1.0, 1.25]
    assert row["forward_rest_stock-again_over_stock-beside"]["per_round"] == [2.0, 0.5]
    assert row["stock-beside_tokens_per_s_rounds"] == [8.0, 16.0]


def test_pinned_rounds_run_two_engines_at_once_on_cpus_of_their_own_swapped_every_other_round(monkeypatch, tmp_path):
    import threading

    started = threading.Barrier(2, timeout=30)  # each run waits for its partner: both run at once
    calls = []

    def fake_run_traces(python, model, spec, out, vattn, label, traces, kv_cache_space_gib, cpus):
        calls.append((out.name, vattn, cpus, spec.name))
        started.wait()
        return clocked_run(10.0, 1.0, None, vattn)

    monkeypatch.setattr(vllm_serving, "run_traces", fake_run_traces)
    monkeypatch.setattr(vllm_serving.os, "sched_getaffinity", lambda pid: {3, 5, 7})
    args = vllm_serving.argparse.Namespace(rounds=2, python="py", kv_cache_gib=1)
    runs = vllm_serving.run_pinned(args, tmp_path, ("a",), "stock")
    assert {arm: len(r) for arm, r in runs.items()} == {"stock": 2, "vattn": 2, "stock-beside": 2, "stock-again": 2}
    by_run = {name: (vattn, cpus, spec) for name, vattn, cpus, spec in calls}
    assert by_run["stock0.json"] == (False, [3], "spec0.json") and by_run["vattn0.json"] == (True, [5], "spec0.json")
    assert by_run["stock-beside0.json"][1] == [3] and by_run["stock-again0.json"][1] == [5]
    assert by_run["stock1.json"] == (False, [5], "spec1.json") and by_run["vattn1.json"] == (True, [3], "spec1.json")
    assert not by_run["stock-again1.json"][0] and by_run["stock-again1.json"][1] == [3]
    # round 2 runs the A/A pair first
    assert [c[0] for c in calls].index("stock-again1.json") < [c[0] for c in calls].index("vattn1.json")


def test_an_engine_on_given_cpus_runs_under_taskset_with_its_threads_bound_there(monkeypatch, tmp_path):
    from workloads import vllm_launch

    seen = {}

    def fake_run(command, stdout, stderr, env, cwd, timeout):
        seen.update(command=command, env=env)
        (tmp_path / "out.json").write_text("{}")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(vllm_launch.subprocess, "run", fake_run)
    vllm_launch.run_engine("py", tmp_path / "model", tmp_path / "spec.json", tmp_path / "out.json", False, cpus=[1])
    assert seen["command"][:4] == ["taskset", "-c", "1", "py"]
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1" and seen["env"]["VATTN_CPU_ATTN_THREADS"] == "1"
    vllm_launch.run_engine("py", tmp_path / "model", tmp_path / "spec.json", tmp_path / "out.json", False)
    assert seen["command"][0] == "py"  # without cpus: the engine's environment as it was
    assert seen["env"].get("VLLM_CPU_OMP_THREADS_BIND") == vllm_launch.os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def outer_part():
    total = 0
    for _ in range(50):
        total += inner_part()  # called directly, as the builder calls the planner
    return total


def inner_part():
    return sum(range(2000))


def test_a_profile_part_counts_a_function_inside_another_of_the_same_part_once(monkeypatch):
    """vattn's metadata builder calls the planner's build: both match the
    part, and the part is the outer one's time, not the two added."""
    import cProfile

    from workloads import vllm_scenario as scenario

    here = __file__.rsplit("/", 1)[-1]
    monkeypatch.setattr(scenario, "PROFILE_PARTS", {"nested": [(here, "outer_part"), (here, "inner_part")],
                                                    "inner": [(here, "inner_part")]})
    profiler = cProfile.Profile()
    profiler.runcall(outer_part)
    parts = scenario.profile_summary(profiler, 1.0)["parts_s"]
    outer = next(v[3] for k, v in __import__("pstats").Stats(profiler).stats.items() if k[2] == "outer_part")
    assert parts["nested"] == outer and 0 < parts["inner"] < parts["nested"]
