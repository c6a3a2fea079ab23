"""`python -m vattn info` / `demo`, and the README's commands matching CI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vattn.backends import host_granularity
from vattn.cli import demo
from vattn.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_info_reports_backends():
    out = run_cli("info")
    assert "backend host: available" in out
    assert re.search(r"^extension: compiler \S", out, re.M)  # labelled, not a bare version number
    assert re.search(r"granularity \d+ bytes", out)
    assert "backend cuda:" in out
    data = json.loads(run_cli("info", "--json"))
    assert data["backends"]["host"]["granularity"] > 0
    assert "available" in data["backends"]["cuda"]


def test_demo_quick_serves_the_trace_and_reports_throughput_and_memory(tmp_path):
    plot = tmp_path / "demo.png"
    out = run_cli("demo", "--quick", "--plot", str(plot))
    assert "finished 12 requests" in out
    assert float(re.search(r"([\d.]+) requests/s", out).group(1)) > 0
    assert int(re.search(r"(\d+) generated tokens/s", out).group(1)) > 0
    assert re.search(r"time to first token: mean [\d.]+ s", out)
    peak = float(re.search(r"peak mapped ([\d.]+) MiB", out).group(1))
    static = float(re.search(r"static max-length reservation needs (\d+) MiB", out).group(1))
    assert 0 < peak < static
    assert re.search(r"fragmentation: \d+%", out)
    assert plot.stat().st_size > 10_000


def test_demo_preempts_under_a_small_budget():
    # every request arrives before the first step (1e9 a second: 12 arrivals within nanoseconds), so
    # the batch outgrows 1 MiB whatever the machine's speed or load; at 1000 a second the arrivals
    # spread over ~12 ms of wall-clock time and interleaved with the steps, and a loaded CI run once
    # saw no preemption (at the default rate a fast machine finishes each request before the next comes)
    out = run_cli("demo", "--quick", "--physical-memory", "1MiB", "--rate", "1e9", "--page-size", "16KiB")
    assert "pages of 16 KiB" in out
    assert "finished 12 requests" in out
    assert int(re.search(r"(\d+) preemptions", out).group(1)) > 0


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", readme, re.S)
    assert match, "README must show the test command after <!-- test-command -->"
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith("#")]
    assert match.group(1).strip() in [l.strip() for l in ci_lines if not l.startswith("set ")]


def test_version_prints_the_package_version():
    import importlib.metadata

    import vattn

    out = run_cli("--version").strip()
    assert out == f"vattn {vattn.__version__}"
    assert vattn.__version__ == importlib.metadata.version("vattn")  # the installed distribution's, pyproject's


@pytest.mark.parametrize("args, says", [
    (["--requests", "0"], "argument --requests: must be at least 1, got 0"),
    (["--requests", "-3"], "argument --requests: must be at least 1, got -3"),
    (["--requests", "many"], "argument --requests: must be a whole number of at least 1, got 'many'"),
    (["--rate", "0"], "argument --rate: must be a finite number of arrivals per second above 0, got '0'"),
    (["--rate", "nan"], "argument --rate: must be a finite number of arrivals per second above 0, got 'nan'"),
    (["--max-batch-size", "0"], "argument --max-batch-size: must be at least 1, got 0"),
    (["--max-context-len", "15"], f"argument --max-context-len: must be at least {demo.MIN_CONTEXT_LEN} tokens, got 15"),
    (["--eager-tokens", "-1"], "argument --eager-tokens: must be at least 0 tokens, got -1"),
    (["--page-size", "1000"], f"argument --page-size: 1000 is not a multiple of the host backend's granularity, "
                              f"{host_granularity()} bytes (the OS page size): e.g. "),
    (["--page-size", "6KiB"], "argument --page-size: 6KiB (6144 bytes) is not a multiple of the host backend's "
                              "granularity"),
    (["--page-size", "-4KiB"], "argument --page-size: size '-4KiB' must be in [1, 2**64 - 1] bytes"),
    (["--page-size", "16 pages"], "argument --page-size: size '16 pages' is not understood"),
    (["--physical-memory", "0"], "argument --physical-memory: size '0' must be in [1, 2**64 - 1] bytes"),
])
def test_demo_options_out_of_range_end_in_one_line_naming_the_option(args, says, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--quick", *args])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m vattn demo: error: " + says), last


def test_demo_sizes_take_units_and_the_granularity():
    granularity = host_granularity()
    assert demo.page_size("16KiB") == 16 * 1024 == demo.page_size("16384")
    assert demo.page_size(f"{4 * granularity}") == 4 * granularity
    assert demo.physical_memory("1.5MiB") == 3 << 19


def test_demo_options_that_give_no_cache_end_in_one_line(capsys):
    # a pool below one page in every buffer: the cache's own check, after the model is built
    assert main(["demo", "--quick", "--physical-memory", "4KiB"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("python -m vattn demo: error: no KV cache for these options") and \
        "physical_memory must be at least one page per buffer" in line and "got 4096" in line


def test_demo_with_a_pool_too_small_for_its_requests_says_so(capsys):
    """A valid pool (one page per buffer and more) that holds none of the trace's requests ends in one
    line, exit status 2; one that holds some serves those and counts the others. (The report had ended
    in a StatisticsError traceback when no request was served, and counted failed requests as finished.)"""
    assert main(["demo", "--quick", "--page-size", "4KiB", "--physical-memory", "32KiB", "--rate", "1e9"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # after the progress bar's
    assert line.startswith("python -m vattn demo: error: no request could be served with these options") and \
        "more than the physical pool holds (32768 bytes)" in line
    assert main(["demo", "--quick", "--page-size", "4KiB", "--physical-memory", "160KiB", "--rate", "1e9"]) == 0
    out, err = capsys.readouterr()
    failed = int(re.search(r"(\d+) of 12 requests could not be served", out).group(1))
    assert 0 < failed < 12 and f"finished {12 - failed} requests" in out, out


def test_demo_gives_the_cache_its_eager_tokens(monkeypatch, capsys):
    import vattn.engine

    built_engine, policies = vattn.engine.Engine, []

    def engine_then_stop(*args, **options):  # the demo's engine, read, closed, and the demo stopped there
        with built_engine(*args, **options) as built:
            policies.append(built.kv.policy)
        raise ValueError("stopped after the cache was built")

    monkeypatch.setattr(vattn.engine, "Engine", engine_then_stop)
    assert main(["demo", "--quick", "--eager-tokens", "48"]) == 2
    assert [p["eager_tokens"] for p in policies] == [48]
    assert "stopped after the cache was built" in capsys.readouterr().err

def test_import_vattn_leaves_torch_to_first_use():
    """`import vattn` (the first thing `python -m vattn` does) loads no torch; the names
    that need it load it when first used, with KVCacheManager's parameter list for init."""
    code = ("import inspect, sys\nimport vattn\nassert 'torch' not in sys.modules, 'import vattn'\n"
            "assert vattn.Budget and vattn.BudgetError and vattn.get_manager\n"
            "assert 'torch' not in sys.modules, 'torch-free names'\n"
            "assert inspect.signature(vattn.init).parameters == inspect.signature(vattn.KVCacheManager).parameters\n"
            "assert 'torch' in sys.modules and vattn.core.KVCacheManager is vattn.KVCacheManager\n"
            "from vattn import *\n"
            "assert sorted(set(vattn.__all__) - set(dir(vattn))) == []\n"
            "try:\n    vattn.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "module 'vattn' has no attribute 'no_such_name'"
