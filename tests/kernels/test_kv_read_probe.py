"""benchmarks/kv_read_probe.cpp, the plain read that benchmarks/decode_bandwidth.py
times beside the kernel's decode: built with setup.py's flags of each x86
kernel unit this CPU runs, it loads vectors of that unit's width and reads
every byte of every request's K and V rows exactly once (its result, the XOR of
the words it read, is the XOR of the words it was given: a byte missed or read
twice changes it), for contiguous and strided rows of any length; and so does
its read in a decode item's order (kv_read_by_head), head by head in tiles,
with and without requests ahead."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark, load_setup

from vattn.attention import host_attention_info

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "benchmarks" / "kv_read_probe.cpp"
# (kernel unit whose flags build it, the path that unit serves, bytes per vector load)
BUILDS = [(None, "scalar", 16), ("kernel_avx2.cpp", "avx2", 32), ("kernel_avx512.cpp", "avx512", 64)]


def isa_flags() -> dict[str, list[str]]:
    return load_setup().isa_flags(platform.machine())


@pytest.fixture(scope="module", params=BUILDS, ids=[b[1] for b in BUILDS])
def probe(request, tmp_path_factory) -> tuple[ctypes.CDLL, int]:
    unit, isa, vector_bytes = request.param
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"needs an x86-64 CPU: the probe's vector widths are x86's, this is {platform.machine()}")
    if isa not in host_attention_info()["supported"]:
        pytest.skip(f"needs a CPU with {isa}: this one does not run it")
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++: the probe is built per ISA with the kernel's flags")
    library = tmp_path_factory.mktemp("probe") / f"probe_{isa}.so"
    flags = isa_flags().get(unit, []) if unit else []
    proc = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", *flags, str(PROBE),
                           "-o", str(library)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = load_benchmark("decode_bandwidth").declare_probe(ctypes.CDLL(str(library)))
    return lib, vector_bytes


@pytest.mark.parametrize("row_words,stride_words", [(64, 64), (25, 25), (25, 40), (300, 301)],
                         ids=["contiguous", "contiguous-tail", "strided-tail", "strided-wide"])
def test_reads_every_byte_of_every_row_once(probe, row_words: int, stride_words: int) -> None:
    lib, vector_bytes = probe
    assert lib.kv_read_vector_bytes() == vector_bytes
    k, v = random_cache(row_words * 1000 + stride_words, stride_words)
    expected = xor_of(k, v, [slice(0, row_words)])
    assert lib.kv_read(*rows_of(k, v), len(TOKENS), stride_words * 4, row_words * 4) == expected


TOKENS = [1, 7, 33, 130]  # tokens of each request: under, at and over a tile's, and a partial last tile


def random_cache(seed: int, stride_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of len(TOKENS) requests, 130 tokens of stride_words random words each."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(-2**31, 2**31 - 1, (len(TOKENS), 130, stride_words), dtype=torch.int32, generator=gen)
                 for _ in range(2))


def xor_of(k: torch.Tensor, v: torch.Tensor, words: list[slice]) -> int:
    """The XOR of the given words of each request's first TOKENS[r] tokens of K and V."""
    expected = 0
    for t in (k, v):
        for r, n in enumerate(TOKENS):
            for w in words:
                for word in t[r, :n, w].flatten().tolist():
                    expected ^= word & 0xFFFFFFFF
    return expected


def rows_of(k: torch.Tensor, v: torch.Tensor) -> tuple:
    return ((ctypes.c_void_p * len(TOKENS))(*[k[r].data_ptr() for r in range(len(TOKENS))]),
            (ctypes.c_void_p * len(TOKENS))(*[v[r].data_ptr() for r in range(len(TOKENS))]),
            (ctypes.c_int64 * len(TOKENS))(*TOKENS))


@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["no-requests", "half-a-tile", "a-whole-tile"])
@pytest.mark.parametrize("heads,head_words,head_stride_words,tile_tokens,to_l2",
                         [(2, 32, 32, 8, 1), (2, 25, 40, 32, 0), (4, 16, 16, 128, 1), (1, 64, 64, 4, 0)],
                         ids=["2-heads", "2-strided-heads-tail", "4-heads-one-tile", "1-head"])
def test_the_decode_order_reads_every_head_row_once(probe, heads: int, head_words: int, head_stride_words: int,
                                                    tile_tokens: int, ahead: int, to_l2: int) -> None:
    lib, _ = probe
    stride_words = heads * head_stride_words + 3  # tokens further apart than their heads
    k, v = random_cache(heads * 1000 + head_words, stride_words)
    expected = xor_of(k, v, [slice(h * head_stride_words, h * head_stride_words + head_words) for h in range(heads)])
    assert lib.kv_read_by_head(*rows_of(k, v), len(TOKENS), stride_words * 4, heads, head_stride_words * 4,
                               head_words * 4, tile_tokens, ahead, to_l2) == expected


def test_the_decode_tiles_are_the_kernels(probe) -> None:
    # powers of two from 8 to 128 tokens under the bytes of K a tile may take (key_tile)
    lib, _ = probe
    assert lib.kv_decode_tile_tokens(256, 16 << 10) == 64  # 2 kv heads of 64 in bf16, AVX2's narrow tiles
    assert lib.kv_decode_tile_tokens(256, 64 << 10) == 128  # capped at 128 tokens
    assert lib.kv_decode_tile_tokens(512, 16 << 10) == 32
    assert lib.kv_decode_tile_tokens(8192, 16 << 10) == 8  # never under 8
