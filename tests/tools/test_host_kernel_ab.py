"""benchmarks/host_kernel_ab.py end to end on a tiny point: both builds
compile from their own sources under their own module and namespace names,
load side by side in one process, agree on the output, and the JSON names
both revisions and the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("VATTN_LONG_TESTS") != "1",
                    reason="long test: set VATTN_LONG_TESTS=1 (two builds of the host kernel)")
def test_two_builds_side_by_side(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs a C++ compiler: no g++ to build the two kernels")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout: the base build is HEAD's sources")
    env = {**os.environ, "VATTN_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_kernel_ab.py"), "HEAD", ".",
                           "--points", "2:40:float32,1:70:bfloat16", "--rounds", "2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("host_kernel_ab_*.json")
    payload = json.loads(result.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert payload["base"] == {"rev": "HEAD", "commit": head}
    assert payload["test"] == {"rev": ".", "commit": "working tree"}
    assert payload["machine"]["cores"] >= 1
    assert [(r["batch"], r["ctx"], r["dtype"]) for r in payload["results"]] == [(2, 40, "float32"),
                                                                                (1, 70, "bfloat16")]
    for row in payload["results"]:
        for kind in ("cold", "warm"):
            base, test = row[f"{kind}_us"]
            assert base > 0 and test > 0
            assert row["base_over_test"][kind] == round(base / test, 3)


def test_a_revision_that_does_not_exist_is_refused(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout: the revision is looked up with git")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_kernel_ab.py"), "no-such-rev-xyz"],
                          env={**os.environ, "VATTN_RESULTS_DIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "'no-such-rev-xyz' is not a commit of this checkout" in proc.stderr
    assert not list(tmp_path.iterdir())
