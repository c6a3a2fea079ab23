"""`python -m vattn info` / `demo`, and the README's commands matching CI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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
    # every request arrives at once, so the batch outgrows 1 MiB however fast the machine
    # serves (at the default rate a fast machine finishes each request before the next comes)
    out = run_cli("demo", "--quick", "--physical-memory-mb", "1", "--rate", "1000")
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
