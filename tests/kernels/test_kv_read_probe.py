"""benchmarks/kv_read_probe.cpp, the plain read that benchmarks/decode_bandwidth.py
times beside the kernel's decode: built with setup.py's flags of each x86
kernel unit this CPU runs, it loads vectors of that unit's width and reads
every byte of every request's K and V rows exactly once (its result, the XOR of
the words it read, is the XOR of the words it was given: a byte missed or read
twice changes it), for contiguous and strided rows of any length."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import load_setup

from vattn.attention import host_attention_info

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "benchmarks" / "kv_read_probe.cpp"
# (kernel unit whose flags build it, the path that unit serves, bytes per vector load)
BUILDS = [(None, "scalar", 16), ("kernel_avx2.cpp", "avx2", 32), ("kernel_avx512.cpp", "avx512", 64)]


def isa_flags() -> dict[str, list[str]]:
    return load_setup().isa_flags(platform.machine())


@pytest.fixture(params=BUILDS, ids=[b[1] for b in BUILDS])
def probe(request, tmp_path) -> tuple[ctypes.CDLL, int]:
    unit, isa, vector_bytes = request.param
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"needs an x86-64 CPU: the probe's vector widths are x86's, this is {platform.machine()}")
    if isa not in host_attention_info()["supported"]:
        pytest.skip(f"needs a CPU with {isa}: this one does not run it")
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++: the probe is built per ISA with the kernel's flags")
    library = tmp_path / f"probe_{isa}.so"
    flags = isa_flags().get(unit, []) if unit else []
    proc = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", *flags, str(PROBE),
                           "-o", str(library)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    lib.kv_read.restype = ctypes.c_int64
    lib.kv_read.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib, vector_bytes


@pytest.mark.parametrize("row_words,stride_words", [(64, 64), (25, 25), (25, 40), (300, 301)],
                         ids=["contiguous", "contiguous-tail", "strided-tail", "strided-wide"])
def test_reads_every_byte_of_every_row_once(probe, row_words: int, stride_words: int) -> None:
    lib, vector_bytes = probe
    assert lib.kv_read_vector_bytes() == vector_bytes
    gen = torch.Generator().manual_seed(row_words * 1000 + stride_words)
    tokens = [1, 7, 33, 130]
    k = torch.randint(-2**31, 2**31 - 1, (len(tokens), 130, stride_words), dtype=torch.int32, generator=gen)
    v = torch.randint(-2**31, 2**31 - 1, (len(tokens), 130, stride_words), dtype=torch.int32, generator=gen)
    expected = 0
    for t in (k, v):
        for r, n in enumerate(tokens):
            for word in t[r, :n, :row_words].flatten().tolist():
                expected ^= word & 0xFFFFFFFF
    k_rows = (ctypes.c_void_p * len(tokens))(*[k[r].data_ptr() for r in range(len(tokens))])
    v_rows = (ctypes.c_void_p * len(tokens))(*[v[r].data_ptr() for r in range(len(tokens))])
    counts = (ctypes.c_int64 * len(tokens))(*tokens)
    assert lib.kv_read(k_rows, v_rows, counts, len(tokens), stride_words * 4, row_words * 4) == expected
