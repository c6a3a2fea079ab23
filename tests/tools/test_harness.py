"""benchmarks/harness.py: the order of an A/B's rounds, the statistics every
A/B reports, and results published where matplotlib is missing."""

from __future__ import annotations

import builtins
import json
import os
import sys

import pytest

from conftest import load_benchmark

harness = load_benchmark("harness")


def test_rounds_alternate_and_the_aa_run_stands_at_the_far_end():
    assert harness.round_order(["stock", "vattn"], "stock", 0) == ["stock", "vattn", "stock-again"]
    assert harness.round_order(["stock", "vattn"], "stock", 1) == ["stock-again", "vattn", "stock"]
    assert harness.round_order(["a", "b"], None, 3) == ["b", "a"]


@pytest.mark.parametrize("per_round,verdict", [([1.10, 1.20, 1.15, 1.30, 1.12, 1.18], "ahead"),
                                               ([0.80, 0.90, 0.85, 0.88, 0.92, 0.83], "behind"),
                                               ([0.90, 1.10, 1.00, 0.95, 1.05, 1.02], "within noise")])
def test_the_verdict_follows_the_medians_interval(per_round, verdict):
    q = harness.ratio_summary(per_round)
    low, high = q["interval_95"]
    assert min(per_round) <= low <= q["median"] <= high <= max(per_round)
    assert q["verdict"] == verdict and q["per_round"] == per_round
    assert harness.ratio_summary(per_round) == q  # seeded: the same rounds give the same interval
    assert verdict in harness.describe_ratio("x", q)


def test_one_outlier_round_does_not_move_the_interval_past_the_others():
    q = harness.ratio_summary([1.10, 1.12, 1.15, 1.11, 1.14, 3.0])
    assert q["interval_95"][1] < 3.0 and q["verdict"] == "ahead"


def test_a_ratio_needs_a_round_and_a_verdict_three():
    with pytest.raises(ValueError, match="at least one round"):
        harness.ratio_summary([])
    assert harness.ratio_summary([1.5, 1.6])["verdict"] == "no verdict: 2 rounds, fewer than 3"


def test_results_are_written_and_the_figure_deferred_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)

    def plot(payload, name):
        harness.pyplot()

    harness.publish("r", {"x": [1, 2]}, plot, {"shown": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": [1, 2]}
    assert "--replot" in capsys.readouterr().out


def test_the_machine_is_described_before_vattn_is_built(monkeypatch):
    """The GPU suite describes the machine before its build stage, on a
    fresh machine where vattn's extension does not exist yet: the driver's
    details (which need it) are None then, the rest is there."""
    monkeypatch.setitem(sys.modules, "vattn.backends", None)  # importing it raises ImportError
    info = harness.machine()
    assert info["driver"] is None
    assert info["cpu"] and info["cores"] >= 1



ZEN4_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n" \
               "flags\t\t: avx2 avx512f avx512_bf16\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n"
AARCH64_CPUINFO = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("text,family,model,isa", [(ZEN4_CPUINFO, 25, 17, ["avx2", "avx512f", "avx512_bf16"]),
                                                    (AARCH64_CPUINFO, None, None, ["asimd", "sve"])],
                         ids=["zen4", "aarch64"])
def test_the_machine_names_the_cpu_generation(tmp_path, monkeypatch, text, family, model, isa):
    """Zen 4 and Zen 5 VMs both call themselves "AMD EPYC": a result names
    the first processor's family and model numbers as /proc/cpuinfo gives
    them, and None where the CPU has no such fields (AArch64)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    monkeypatch.setattr(harness, "CPUINFO", str(cpuinfo))
    info = harness.machine()
    assert (info["cpu_family"], info["cpu_model"], info["isa"]) == (family, model, isa)
    assert harness._cpuinfo_int({"model": "0x11"}, "model") is None


def test_a_benchmark_refuses_a_build_older_than_its_sources(tmp_path):
    (tmp_path / "vattn").mkdir()
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "setup.py").write_text("")
    source = tmp_path / "csrc" / "core" / "page_table.cpp"
    source.write_text("")
    older, newer = tmp_path / "vattn" / "_C.so", tmp_path / "vattn" / "_cpu_attn.so"
    for path in (older, newer):
        path.write_bytes(b"")
    for path, when in ((tmp_path / "setup.py", 1000), (older, 1500), (source, 2000), (newer, 3000)):
        os.utime(path, (when, when))
    harness.require_current_build(tmp_path)  # the last build came after the last edit
    os.utime(source, (4000, 4000))
    with pytest.raises(SystemExit, match=r"csrc/core/page_table.cpp changed after the last build"):
        harness.require_current_build(tmp_path)
    for path in (older, newer):
        path.unlink()
    with pytest.raises(SystemExit, match="no built extension"):
        harness.require_current_build(tmp_path)
