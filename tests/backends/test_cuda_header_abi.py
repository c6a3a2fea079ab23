"""Our hand-written CUDA driver declarations (csrc/backends/cuda_driver.h)
against NVIDIA's own cuda.h, for CUDA 12 and 13: a compile-only check
(tests/backends/cuda_header_check.cpp: sizes, offsets, enum values and every function
pointer against the real prototype of the symbol it is bound to).

cuda.h ships in the CUDA runtime wheels (nvidia-cuda-runtime-cu12 for 12.x,
nvidia-cuda-runtime for 13.x, under nvidia/cuda_runtime/include and
nvidia/cu13/include). The test downloads each with ``pip download --no-deps``
into a cache folder ($VATTN_CUDA_HEADERS_CACHE, default
~/.cache/vattn/cuda-headers), takes cuda.h out of it, and compiles. Without
network it uses a wheel cached earlier, or skips saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECK_SOURCE = HERE / "cuda_header_check.cpp"

# (CUDA major, pip requirement of the wheel that holds include/cuda.h)
WHEELS = {
    12: "nvidia-cuda-runtime-cu12>=12.0,<13",
    13: "nvidia-cuda-runtime>=13.0,<14",
}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "vattn" / "cuda-headers"
    return Path(os.environ.get("VATTN_CUDA_HEADERS_CACHE") or default)


def newest_wheel(folder: Path) -> Path | None:
    wheels = sorted(folder.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


def fetch_cuda_h(major: int) -> Path:
    """Returns a folder holding cuda.h of CUDA ``major``, or skips."""
    folder = cache_dir() / f"cuda{major}"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(folder), WHEELS[major]]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        why = done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    wheel = newest_wheel(folder)
    if wheel is None:
        pytest.skip(f"cannot fetch {WHEELS[major]!r} (pip download failed: {why or 'no wheel'}), "
                    f"and no cached wheel in {folder}")
    include = folder / f"include-{wheel.stem}"
    header = include / "cuda.h"
    if not header.exists():
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith("/include/cuda.h")]
            assert names, f"{wheel.name} ships no include/cuda.h"
            include.mkdir(parents=True, exist_ok=True)
            header.write_bytes(z.read(names[0]))
    return include


@pytest.mark.parametrize("major", sorted(WHEELS))
def test_driver_declarations_match_cuda_h(major):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    include = fetch_cuda_h(major)
    version = next(line.split()[2] for line in (include / "cuda.h").read_text().splitlines()
                   if line.startswith("#define CUDA_VERSION "))
    assert int(version) // 1000 == major, f"cuda.h says CUDA_VERSION {version}, expected {major}.x"
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", f"-I{include}",
                           f"-I{ROOT / 'csrc'}", str(CHECK_SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"cuda_driver.h disagrees with cuda.h {version}:\n{done.stderr[-4000:]}"
