"""Our hand-written CUDA driver declarations (csrc/backends/cuda_driver.h)
against NVIDIA's own cuda.h, for CUDA 12 and 13: a compile-only check
(tests/backends/cuda_header_check.cpp: sizes, offsets, enum values and every function
pointer against the real prototype of the symbol it is bound to).

Where cuda.h comes from, first found: $VATTN_CUDA_INCLUDE (folders, ':'
between them); a CUDA toolkit ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda*,
/opt/cuda); the wheels installed beside torch (nvidia-cuda-runtime's
nvidia/cu13/include or nvidia/cuda_runtime/include, Triton's
triton/backends/nvidia/include). A GPU machine without network has one of
these. Otherwise the CUDA runtime wheel (nvidia-cuda-runtime-cu12 for 12.x,
nvidia-cuda-runtime for 13.x) downloaded with ``pip download --no-deps`` into
a cache folder ($VATTN_CUDA_HEADERS_CACHE, default ~/.cache/vattn/cuda-headers)
or cached there earlier; else the test skips saying where it looked.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
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


def header_version(header: Path) -> int | None:
    """CUDA_VERSION of a cuda.h (13000 for 13.0), None when it has none."""
    try:
        for line in header.read_text(errors="replace").splitlines():
            if line.startswith("#define CUDA_VERSION "):
                return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_include_dirs() -> list[Path]:
    """Folders on this machine that may hold cuda.h, in the order they are tried."""
    dirs = [Path(d) for d in os.environ.get("VATTN_CUDA_INCLUDE", "").split(os.pathsep) if d]
    toolkits = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                *sorted(str(p) for p in Path("/usr/local").glob("cuda-*")), "/opt/cuda"]
    dirs += [Path(t) / "include" for t in toolkits if t]
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec and torch_spec.submodule_search_locations:
        sites.insert(0, str(Path(list(torch_spec.submodule_search_locations)[0]).parent))
    for sp in dict.fromkeys(sites):
        dirs += sorted(Path(sp).glob("nvidia/*/include"))
        dirs.append(Path(sp) / "triton" / "backends" / "nvidia" / "include")
    return list(dict.fromkeys(dirs))


def local_cuda_h(major: int) -> Path | None:
    """A folder on this machine holding cuda.h of CUDA ``major``, or None."""
    for folder in local_include_dirs():
        version = header_version(folder / "cuda.h")
        if version is not None and version // 1000 == major:
            return folder
    return None


def fetch_cuda_h(major: int) -> Path:
    """Returns a folder holding cuda.h of CUDA ``major``: this machine's, or a
    downloaded (or cached) wheel's; else skips."""
    local = local_cuda_h(major)
    if local is not None:
        return local
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
        pytest.skip(f"needs CUDA's cuda.h: none of CUDA {major} on this machine (looked in $VATTN_CUDA_INCLUDE, the CUDA toolkits "
                    f"and the nvidia / triton wheels), cannot fetch {WHEELS[major]!r} (pip download failed: "
                    f"{why or 'no wheel'}), and no cached wheel in {folder}")
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
        pytest.skip("needs a C++ compiler: no c++ or g++ on PATH")
    include = fetch_cuda_h(major)
    version = header_version(include / "cuda.h")
    assert version is not None and version // 1000 == major, f"cuda.h says CUDA_VERSION {version}, expected {major}.x"
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", f"-I{include}",
                           f"-I{ROOT / 'csrc'}", str(CHECK_SOURCE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"cuda_driver.h disagrees with cuda.h {version}:\n{done.stderr[-4000:]}"


def test_a_local_cuda_h_is_found_without_network(tmp_path, monkeypatch):
    """A GPU machine with no network: the header its toolkit or wheels hold is used, no download."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "cuda.h").write_text("#pragma once\n#define CUDA_VERSION 13000\n")
    monkeypatch.setenv("VATTN_CUDA_INCLUDE", str(include))
    monkeypatch.setenv("VATTN_CUDA_HEADERS_CACHE", str(tmp_path / "no-cache"))
    assert fetch_cuda_h(13) == include
    assert not (tmp_path / "no-cache").exists()  # pip was never asked
