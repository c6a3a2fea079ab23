"""The GPU suite's dry run: benchmarks/gpu_suite.sh end to end on the CPU.

It runs every stage the way a GPU machine would (build, tests, each
benchmark), with tiny grids, the cuda backend on the fake driver and the
model forward on the host, installs carried wheels, and must leave one JSON
per benchmark naming the machine, the summary, and one archive holding them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
BENCHMARKS = ["vmm_latency", "attention_ab", "decode_trace", "prefill", "engine_e2e"]
MACHINE_FIELDS = {"gpu", "driver", "cuda", "torch", "cpu", "cores"}


def suite_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VATTN_", "FAKE_CUDA_"))}
    env.update(PYTHON=sys.executable, **extra)
    return env


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, standing for a carried package (transformers)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "vattn_suite_probe-1.0-py3-none-any.whl"
    info = "vattn_suite_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vattn_suite_probe/__init__.py", "__version__ = '1.0'\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: vattn-suite-probe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


RESUMED = ("build",)  # the stage the first, cut-off call of the dry run finishes


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The dry run in two calls, as on a machine whose first call is cut off:
    the first is killed once its summary shows RESUMED finished, the second
    resumes with the same OUTDIR."""
    pytest.importorskip("matplotlib", reason="needs matplotlib: the benchmarks plot with it")
    pytest.importorskip("transformers", reason="needs transformers: the engine benchmark runs a model")
    base = tmp_path_factory.mktemp("gpu_suite")
    out = base / "out"
    wheels = probe_wheel(base / "wheels").parent
    results_before = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    command = ["bash", str(SUITE), str(out), "--wheels", str(wheels), "--archive", str(base / "archive")]
    first = subprocess.Popen(command, env=suite_env(VATTN_GPU_SUITE_DRY_RUN="1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not set(RESUMED) <= finished(out):
            assert first.poll() is None, "the first call ended before it was cut off"
            assert time.monotonic() < deadline, "the first call did not finish its first stages"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    proc = subprocess.run(command, env=suite_env(VATTN_GPU_SUITE_DRY_RUN="1"), capture_output=True, text=True,
                          timeout=480)
    assert sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir()) == results_before, \
        "the dry run wrote into benchmarks/results"
    return out, proc


def finished(out: Path) -> set[str]:
    """The stages the summary in ``out`` shows finished ok (none before it is written)."""
    try:
        return {r["name"] for r in json.loads((out / "gpu_suite.json").read_text())["stages"] if r["status"] == "ok"}
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return set()


def test_a_second_call_resumes_after_the_first(dry_run):
    """Each stage's result is written as it finishes: the stages the cut-off
    call finished are kept, the others (the one it was killed in too) run."""
    out, proc = dry_run
    summary = json.loads((out / "gpu_suite.json").read_text())
    assert summary["complete"] is True
    resumed = [s["name"] for s in summary["stages"] if s.get("resumed")]
    assert resumed == list(RESUMED), summary["stages"]
    for name in RESUMED:
        assert f"[gpu_suite] {name}: ok in an earlier call, kept" in proc.stdout
    log = (out / "gpu_suite.log").read_text()
    assert log.count("==== gpu_suite dry run") == 2 and log.count("==== build:") == 1


def test_every_stage_runs(dry_run):
    out, proc = dry_run
    log = (out / "gpu_suite.log").read_text() if (out / "gpu_suite.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log[-4000:]}"
    summary = json.loads((out / "gpu_suite.json").read_text())
    assert summary["dry_run"] is True
    assert [s["name"] for s in summary["stages"]] == ["build", "tests", "vmm_latency", "flashinfer_jit", "attention_ab",
                                                       "decode_trace", "decode_trace_host_model", "prefill",
                                                       "engine_e2e", "engine_e2e_graphs", "host_kernel"]
    assert all(s["status"] == "ok" for s in summary["stages"]), summary["stages"]
    # the GPU tests ran on the host and the fake driver (the GPU variants skipped, with their reason)
    assert summary["tests"]["failed"] == summary["tests"]["errors"] == 0
    assert summary["tests"]["passed"] >= 15 and summary["tests"]["skipped"] > 0
    assert any("needs a CUDA GPU" in r for r in summary["tests"]["skip_reasons"])
    # the host kernel's tests ran on this CPU, and the summary names its paths
    assert summary["host_kernel_tests"]["passed"] > 0 and summary["host_kernel_tests"]["failed"] == 0
    assert "scalar" in summary["host_kernel"]["supported"], summary["host_kernel"]
    # and the compiler that built it, with the C++ runtime the process loaded (a mismatch is a crash's suspect)
    assert summary["host_kernel"]["compiler"], summary["host_kernel"]
    assert any("libstdc++" in lib for lib in summary["host_kernel"]["runtime_libraries"]), summary["host_kernel"]


def test_each_benchmark_writes_json_naming_the_machine(dry_run):
    out, _ = dry_run
    for name in BENCHMARKS:
        files = [p for p in out.glob(f"{name}_*.json") if "_host_model_" not in p.name and "_graphs_" not in p.name]
        assert len(files) == 1, f"{name}: {sorted(p.name for p in out.iterdir())}"
        data = json.loads(files[0].read_text())
        assert data["dry_run"] is True and data["benchmark"] == name
        assert MACHINE_FIELDS <= set(data["machine"]), data["machine"]
        assert data["machine"]["torch"]
        assert data["results"], f"{name} measured nothing"
        assert (out / f"{files[0].stem}.png").exists()
    summary = json.loads((out / "gpu_suite.json").read_text())
    assert MACHINE_FIELDS <= set(summary["machine"])


def test_the_attention_grid_names_the_kernel_sdpa_picked(dry_run):
    """The SDPA times are of whichever kernel torch picked for the call: each
    grid point names it (on the H200 SDPA beat torch's FlashAttention-2 op
    in prefill, and which kernel it was went unrecorded)."""
    from torch.nn.attention import SDPBackend

    out, _ = dry_run
    (grid,) = out.glob("attention_ab_*.json")
    rows = json.loads(grid.read_text())["results"]
    assert rows and all(r["sdpa_backend"] in SDPBackend.__members__ for r in rows), rows


def test_the_engine_graphs_stage_alternates_rounds_with_an_aa_pair(dry_run):
    """engine_e2e_graphs: the engine with and without CUDA graphs (on the CPU
    both eager), 2 rounds in alternating order, the engine with graphs twice."""
    out, _ = dry_run
    data = json.loads(next(out.glob("engine_e2e_graphs_*.json")).read_text())
    assert data["dry_run"] is True and data["rounds"] == 2 and data["aa"] == "vattn"
    orders = [[r["cache"] for r in data["results"] if r["round"] == i] for i in range(2)]
    assert orders == [["vattn", "vattn-nographs", "vattn-again"], ["vattn-again", "vattn-nographs", "vattn"]]
    assert set(data["ratios"]) == {"vattn-nographs / vattn", "vattn-again / vattn"}
    aa = data["ratios"]["vattn-again / vattn"]
    assert len(aa["per_round"]) == 2 and aa["min"] <= aa["median"] <= aa["max"]
    assert all(r["decode_graph_replays"] is None for r in data["results"])  # no graphs on the CPU
    assert (out / f"{next(out.glob('engine_e2e_graphs_*.json')).stem}.png").exists()


def test_the_model_forward_ran_on_the_host(dry_run):
    out, _ = dry_run
    data = json.loads(next(out.glob("decode_trace_host_model_*.json")).read_text())
    assert data["forward"] == "model" and data["dry_run"] is True
    assert {r["device"] for r in data["results"]} == {"cpu"}
    assert {r["mode"] for r in data["results"]} == {"sync", "mapper", "premapped"}


def test_one_archive_carries_every_result(dry_run):
    out, proc = dry_run
    archives = list((out.parent / "archive").iterdir())
    assert len(archives) == 1 and archives[0].name.startswith("gpu_suite_")
    assert archives[0].name.endswith("_dryrun.tar.gz")
    assert proc.stdout.strip().splitlines()[-1] == f"[gpu_suite] archive {archives[0]}"
    with tarfile.open(archives[0]) as tar:
        names = {Path(m.name).name for m in tar.getmembers()}
        assert len({Path(m.name).parent for m in tar.getmembers()}) == 1  # one folder, named like the archive
        summary = json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/gpu_suite.json"))))
    written = {p.name for p in out.iterdir() if p.is_file() and p.suffix in (".json", ".png", ".xml", ".log")}
    assert names == written
    assert {"gpu_suite.json", "gpu_suite.log", "tests.xml", "host_kernel_tests.xml"} <= names
    for name in BENCHMARKS:
        assert any(n.startswith(f"{name}_") and n.endswith(".json") for n in names), name
    assert summary["dry_run"] is True


def test_carried_wheels_are_installed_for_the_stages(dry_run):
    out, _ = dry_run
    summary = json.loads((out / "gpu_suite.json").read_text())
    assert summary["wheels_installed"] == ["vattn_suite_probe-1.0-py3-none-any.whl"]
    assert (out / "site" / "vattn_suite_probe" / "__init__.py").exists()
    packages = summary["packages"]
    assert packages["torch"] and packages["transformers"]
    assert packages["transformers_in_checked_range"] is True  # this machine's is pyproject's


def test_cuda_paths_ran_on_the_fake_driver(dry_run):
    out, _ = dry_run
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler: the dry run had no fake driver")
    summary = json.loads((out / "gpu_suite.json").read_text())
    assert summary["machine"]["driver"]["device"].startswith("Fake CUDA")
    findings = summary["driver_findings"]
    assert findings and all(f["unmap"] in ("runs", "per_page") and f["unmap_probe"] for f in findings)
    vmm = json.loads(next(out.glob("vmm_latency_*.json")).read_text())
    cuda = [r for r in vmm["results"] if r["backend"] == "cuda"]
    assert cuda and all(r["map_over_floor"] > 0 for r in cuda)
    trace = json.loads(next(out.glob("decode_trace_*.json")).read_text())
    assert {r["device"] for r in trace["results"]} == {"cuda"}
    assert {r["mode"] for r in trace["results"]} == {"sync", "mapper"}


def test_without_a_gpu_the_suite_refuses_and_points_to_the_dry_run(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch: the suite checks torch for CUDA")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU: on a GPU the suite runs instead of refusing")
    proc = subprocess.run(["bash", str(SUITE), str(tmp_path)], env=suite_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--dry-run" in proc.stderr
    assert not list(tmp_path.glob("*.json"))


def test_usage_without_an_output_folder():
    proc = subprocess.run(["bash", str(SUITE)], env=suite_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_the_build_is_skipped_only_while_no_source_is_newer(tmp_path, monkeypatch):
    """A machine that built the extension ahead gives the stages the build's
    time; a source edited after that build makes the stage build again."""
    from conftest import load_benchmark

    suite = load_benchmark("gpu_suite")
    (tmp_path / "vattn").mkdir()
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    source, setup = tmp_path / "csrc" / "core" / "page_table.cpp", tmp_path / "setup.py"
    old_so, new_so = tmp_path / "vattn" / "_cpu_attn.so", tmp_path / "vattn" / "_C.so"
    for path in (source, setup, old_so, new_so):
        path.write_text("")
    monkeypatch.setattr(suite, "ROOT", tmp_path)
    os.utime(old_so, (100, 100))  # an extension whose sources did not change since an earlier build
    os.utime(source, (200, 200))
    os.utime(setup, (200, 200))
    os.utime(new_so, (300, 300))
    assert suite.extension_up_to_date()
    os.utime(source, (400, 400))
    assert not suite.extension_up_to_date()
    new_so.unlink()
    old_so.unlink()
    assert not suite.extension_up_to_date()


def test_the_gpu_tests_stage_runs_every_cuda_test_file_and_they_exist():
    """One call of the suite runs the CUDA test files, vLLM's planner in a
    CUDA graph among them (it needs no vLLM); every file named exists."""
    from conftest import load_benchmark

    suite = load_benchmark("gpu_suite")
    command = dict((name, cmd) for name, cmd, _ in suite.stages(dry=False, have_fake_cuda=False))["tests"]
    assert "tests/integrations/test_vllm_planner_gpu.py" in command
    assert all((ROOT / path).is_file() for path in suite.CUDA_TESTS)


def test_a_crashed_test_stage_is_run_again_under_a_debugger(tmp_path):
    """A stage whose process died of a signal (not one whose tests failed)
    is run again under gdb / cuda-gdb, and the native stack of the crash is
    in what it printed."""
    from conftest import load_benchmark

    suite = load_benchmark("gpu_suite")
    assert suite.crashed({"returncode": -11}) and suite.crashed({"returncode": 139})
    assert not suite.crashed({"returncode": 1}) and not suite.crashed({"returncode": None})
    dbg = suite.debugger()
    if dbg is None:
        pytest.skip("needs gdb or cuda-gdb: the debugger the stage runs under")
    crash = tmp_path / "test_crash.py"
    crash.write_text("import ctypes\n\n\ndef test_reads_address_zero():\n    ctypes.string_at(0)\n")
    proc = subprocess.run(suite.backtrace_command(dbg, [sys.executable, "-m", "pytest", "-q", "-p",
                                                        "no:cacheprovider", str(crash)]),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "SIGSEGV" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "#0 " in proc.stdout and "#1 " in proc.stdout, proc.stdout[-3000:]


def test_the_gpu_engine_stage_gives_its_ratios_an_interval_and_an_aa_pair():
    """On a GPU the engine against transformers' caches runs alternated
    rounds (three or more: harness.ratio_summary's minimum for a verdict)
    with the engine twice per round, on a trace short enough that the
    stages after it still run within the suite's deadline."""
    from conftest import load_benchmark

    suite = load_benchmark("gpu_suite")
    harness = load_benchmark("harness")
    command = dict((name, cmd) for name, cmd, _ in suite.stages(dry=False, have_fake_cuda=False))["engine_e2e"]
    option = lambda name: command[command.index(name) + 1]  # noqa: E731
    assert int(option("--rounds")) >= harness.MIN_ROUNDS and option("--aa") == "vattn"
    assert int(option("--requests")) * int(option("--new-tokens")) <= 32 * 64

