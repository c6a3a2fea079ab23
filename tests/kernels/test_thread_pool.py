"""The host kernel's thread pool on its own (tests/kernels/thread_pool_check.cpp): each task runs once, and
the task a thread claimed ahead (so that a decode item can ask for the next item's lines before it starts)
is the one that thread runs next, never one of the last tasks, on the pool of its own and on an OpenMP
runtime's threads."""

import os
import subprocess
from pathlib import Path

import pytest
from test_cpu_attn_isas import ROOT, SRC, native_compiler, run


def build(tmp_path: Path, openmp: bool) -> Path:
    exe = tmp_path / ("pool_check_omp" if openmp else "pool_check")
    if openmp:
        require_openmp(tmp_path)
    run([native_compiler(), "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SRC}",
         *(["-fopenmp"] if openmp else []), str(SRC / "thread_pool.cpp"),
         str(ROOT / "tests" / "kernels" / "thread_pool_check.cpp"), "-o", str(exe), "-pthread", "-ldl"])
    return exe


def require_openmp(tmp_path: Path) -> None:
    """Skips where the compiler cannot build and link an OpenMP program (no libgomp installed)."""
    probe = tmp_path / "omp_probe.cpp"
    probe.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    proc = subprocess.run([native_compiler(), "-fopenmp", str(probe), "-o", str(tmp_path / "omp_probe")],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"needs OpenMP: {native_compiler()} -fopenmp failed: {proc.stderr.strip()[-300:]}")


@pytest.mark.parametrize("threads", ["1", "2", "3", "5"])
def test_tasks_claimed_ahead_on_the_pool_of_its_own(tmp_path: Path, threads: str) -> None:
    out = run([str(build(tmp_path, openmp=False))],
              env=dict(os.environ, VATTN_CPU_ATTN_POOL="own", VATTN_CPU_ATTN_THREADS=threads)).splitlines()
    assert out == ["own", "ok"]


@pytest.mark.parametrize("threads", ["2", "3"])
def test_tasks_claimed_ahead_on_openmp_threads(tmp_path: Path, threads: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VATTN_CPU_ATTN_POOL"}
    out = run([str(build(tmp_path, openmp=True))],
              env=dict(env, VATTN_CPU_ATTN_THREADS=threads, OMP_NUM_THREADS=threads)).splitlines()
    assert out[0].startswith("openmp (") and out[-1] == "ok", out
