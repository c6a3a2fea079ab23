"""benchmarks/fma_peak_probe.cpp, the multiply-add ceiling that
benchmarks/prefill_ceiling.py times beside the kernel's fp32 prefill, and the
prefill's flop count that the share divides: built with setup.py's flags of
each x86 kernel unit this CPU runs, the probe's loop is twelve full-width FMAs
of that unit (read from its machine code), and the count is that of a causal
prefill, pair by pair."""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess

import pytest
from conftest import load_benchmark

from vattn.attention import host_attention_info

ceiling = load_benchmark("prefill_ceiling")

# (x86 path, the register a full-width vector of that path's unit occupies)
BUILDS = [("avx2", "ymm"), ("avx512", "zmm")]


@pytest.mark.parametrize("batch,prompt,heads_q,head_dim", [(1, 1, 1, 1), (1, 5, 2, 3), (3, 17, 4, 8)])
def test_the_prefill_flops_are_four_per_head_dim_per_visible_pair(batch, prompt, heads_q, head_dim):
    pairs = sum(1 for _ in range(batch) for query in range(prompt) for key in range(prompt) if key <= query)
    assert ceiling.prefill_flops(batch, prompt, heads_q, head_dim) == 4 * heads_q * head_dim * pairs


@pytest.mark.parametrize("isa,register", BUILDS, ids=[b[0] for b in BUILDS])
def test_the_probe_runs_twelve_full_width_fmas_of_each_unit(isa, register, tmp_path):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"needs an x86-64 CPU: the probe's widths are x86's, this is {platform.machine()}")
    if isa not in host_attention_info()["supported"]:
        pytest.skip(f"needs a CPU with {isa}: this one does not run it")
    if shutil.which(ceiling.CXX) is None or shutil.which("objdump") is None:
        pytest.skip("needs g++ and objdump: the probe is built per ISA and its loop read back")
    probe = ceiling.build_probe(isa, tmp_path)
    assert probe.fma_chains() == 12 and probe.fma_vector_floats() == ceiling.PROBE_UNIT[isa][1]
    assert probe.fma_run(1000) == pytest.approx(12 * probe.fma_vector_floats(), rel=1e-5)  # every chain near 1
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(tmp_path / f"fma_peak_probe_{isa}.so")],
                          capture_output=True, text=True, check=True).stdout
    body = code[code.index("<fma_run>:"):]
    body = body[:body.index("ret")]
    fmas = re.findall(r"vfmadd\w+ps\s+%(\w+),", body)
    assert len(fmas) == 12 and all(r.startswith(register) for r in fmas), body


def test_points_are_checked_before_any_build():
    assert ceiling.parse_point("llama-3-8b:4:512") == ("llama-3-8b", 4, 512)
    for bad in ("llama-3-8b:0:512", "llama-3-8b:4", "llama-3-8b:four:512", ":1:2"):
        with pytest.raises(SystemExit, match="is not model:batch:prompt"):
            ceiling.parse_point(bad)
