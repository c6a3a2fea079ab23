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


def test_the_budgets_cost_is_per_round_against_vattn_alone():
    def run(rate_per_trace: dict[str, float], outputs: list) -> dict:
        return {"phases": {t: {"generated_tokens": 100, "generate_s": 100 / r, "outputs": outputs}
                           for t, r in rate_per_trace.items()}}

    alone = [run({"a": 10.0, "b": 20.0}, [[1, 2]]), run({"a": 12.0, "b": 20.0}, [[1, 2]])]
    budgeted = [run({"a": 9.0, "b": 20.0}, [[1, 2]]), run({"a": 12.0, "b": 22.0}, [[1, 3]])]
    cost = vllm_serving.budget_cost(alone, budgeted, ("a", "b"))
    assert cost["a"]["ratio_budget_over_vattn_per_round"] == [0.9, 1.0]
    assert cost["a"]["ratio_budget_over_vattn"] == pytest.approx(10.5 / 11.0)
    assert cost["b"]["vattn_budget_tokens_per_s_rounds"] == [20.0, 22.0]
    assert cost["a"]["identical_outputs_to_vattn"] == 1  # first rounds' outputs compared


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
