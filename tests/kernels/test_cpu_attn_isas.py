"""Every ISA path of the host attention kernel, run: tests/kernels/cpu_attn_check.cpp
built from the kernel's sources (the extension's units with setup.py's
per-unit flags) and checked against its double-precision reference.

- natively: every path this CPU supports (scalar, AVX2, AVX-512 where present);
- for AArch64 with a cross compiler, under qemu-aarch64: NEON, and SVE at a
  256-bit vector length (the sve256 path), and at 128 bits, where sve256 must
  not be chosen;
- with a 16-float vector emulated in plain C++ (tests/kernels/cpu_attn_wide16.h, the
  width of AVX-512) in place of the scalar unit, so the code that depends on
  the vector width runs at AVX-512's width on any CPU;
- once more with every native path and the emulated AMX tiles under
  AddressSanitizer and UndefinedBehaviorSanitizer.

The AArch64 runs skip, naming what is missing, without aarch64-linux-gnu-g++
or qemu-aarch64 (Debian: g++-aarch64-linux-gnu, qemu-user).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import load_setup

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "csrc" / "cpu_attn"
UNITS = ["attention", "kernel_amx", "kernel_avx2", "kernel_avx512", "kernel_neon", "kernel_scalar", "kernel_sve",
         "thread_pool"]
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


SETUP = load_setup()


@functools.lru_cache(maxsize=None)
def compiler_accepts(compiler: str, flag: str) -> bool:
    proc = subprocess.run([compiler, flag, "-x", "c++", "-c", "-o", "/dev/null", "-"], input="int x;\n",
                          capture_output=True, text=True)
    return proc.returncode == 0


_COMPILED: dict[tuple, Path] = {}  # (compiler, machine, source, flags, sanitized) -> an earlier test's object file


# AddressSanitizer and UndefinedBehaviorSanitizer, the first finding fatal. Without -Werror: their
# instrumentation keeps GCC from folding the constant row counts of the register blocks, and -Warray-bounds
# then reports the branches those counts rule out. At -O1 (ASan's advice for its builds; the checks are the
# same): at -O2 the instrumented units took 100 s of a 2-core VM to build, at -O1 about 60.
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
SANITIZED_OPT = "-O1"
# The ISA of each unit that holds one. A sanitized build instruments only the units whose ISA this CPU runs,
# as the kernel's own CPU check says (the built extension's info()["supported"]): the others build without
# their target flags, as "absent" (kernel_unit.h), their code never reached here (instrumented, the AMX unit
# took 19 s of a 2-core Zen 4 without AMX to build).
UNIT_ISA = {"kernel_avx2": "avx2", "kernel_avx512": "avx512", "kernel_amx": "amx"}


@functools.lru_cache(maxsize=None)
def isas_run_here() -> frozenset[str] | None:
    """The ISAs the built extension finds this CPU runs, or None without the extension (every unit instrumented)."""
    try:
        from vattn import _cpu_attn
    except ImportError:
        return None
    return frozenset(_cpu_attn.info()["supported"])


def runs_here(unit: str) -> bool:
    here = isas_run_here()
    return here is None or unit not in UNIT_ISA or UNIT_ISA[unit] in here


def build(compiler: str, machine: str, out: Path, link: list[str], scalar_unit: Path | None = None,
          sanitize: bool = False) -> Path:
    """The harness and the kernel units, each unit compiled with its own flags
    (``scalar_unit``: a source to build in place of kernel_scalar.cpp; ``sanitize``: every object and the
    link with SANITIZERS)."""
    flags = SETUP.isa_flags(machine)
    common = ["-std=c++17", SANITIZED_OPT if sanitize else "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
              f"-I{SRC}", f"-I{ROOT / 'tests' / 'kernels'}", *(SANITIZERS if sanitize else ["-Werror"])]
    sources = {u: SRC / f"{u}.cpp" for u in UNITS}
    if scalar_unit is not None:
        sources["kernel_scalar"] = scalar_unit
    # as setup.py builds them: a unit whose flags this compiler lacks builds without them, as "absent"
    jobs = [(sources[u], out / f"{u}.o",
             SETUP.usable_flags(flags.get(f"{u}.cpp", []), functools.partial(compiler_accepts, compiler))
             if not sanitize or runs_here(u) else [])
            for u in UNITS]
    jobs.append((ROOT / "tests" / "kernels" / "cpu_attn_check.cpp", out / "check.o", []))

    def compile_one(job: tuple[Path, Path, list[str]]) -> subprocess.CompletedProcess:
        src, obj, extra = job
        key = (compiler, machine, src, tuple(extra), sanitize)
        if key in _COMPILED and _COMPILED[key].is_file():  # the same unit, the same flags: an earlier test's object
            shutil.copyfile(_COMPILED[key], obj)
            return subprocess.CompletedProcess([], 0, "", "")
        proc = subprocess.run([compiler, *common, *extra, "-c", str(src), "-o", str(obj)], capture_output=True,
                              text=True)
        if proc.returncode == 0:
            _COMPILED[key] = obj
        return proc

    with ThreadPoolExecutor() as pool:
        for (src, _, _), proc in zip(jobs, pool.map(compile_one, jobs)):
            assert proc.returncode == 0, f"{compiler} failed on {src.name}:\n{proc.stderr[-3000:]}"
    exe = out / "cpu_attn_check"
    proc = subprocess.run([compiler, *(str(o) for _, o, _ in jobs), "-o", str(exe), "-pthread", *link,
                           *(SANITIZERS if sanitize else [])],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"link failed:\n{proc.stderr[-3000:]}"
    return exe


def run(cmd: list[str], timeout: int = 600, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    return proc.stdout


def listed(output: str, key: str) -> list[str]:
    line = next(x for x in output.splitlines() if x.startswith(f"{key}:"))
    return line.split()[1:]


def supported(output: str) -> list[str]:
    return listed(output, "supported")


EVERY_DTYPE_AND_LAYOUT = sorted(f"{d}/{lay}" for d in ("f32", "bf16", "f16") for lay in ("per_layer", "all_layers"))


@pytest.fixture(scope="module")
def aarch64_check(tmp_path_factory) -> Path:
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs an AArch64 cross toolchain: {' and '.join(missing)} not found, so the NEON and SVE "
                    "paths do not run (Debian: g++-aarch64-linux-gnu, qemu-user)")
    return build(CROSS, "aarch64", tmp_path_factory.mktemp("aarch64"), ["-static"])


def native_compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler: no g++ or c++ on PATH")
    return cxx


def test_native_paths_match_reference(tmp_path):
    # up to 16 kv heads: fp32 decode items of 16 x 128 take 8-token key tiles
    out = run([str(build(native_compiler(), platform.machine(), tmp_path, [])), "24", "700", "16"])
    assert "scalar" in supported(out)
    assert sorted(listed(out, "covered")) == EVERY_DTYPE_AND_LAYOUT
    assert "0 mismatches" in out


def test_a_16_float_vector_on_narrow_key_tiles(tmp_path):
    # AVX-512's width where key tiles are 8 tokens: each score row is padded to 16 (a regression:
    # rows laid out `tile` apart overwrote the next row's scores)
    exe = build(native_compiler(), platform.machine(), tmp_path, [], ROOT / "tests" / "kernels" / "cpu_attn_wide16.cpp")
    out = run([str(exe), "18", "300", "16"])
    assert sorted(listed(out, "covered")) == EVERY_DTYPE_AND_LAYOUT
    assert "0 mismatches" in out


def test_amx_tiles_emulated(tmp_path):
    # the AMX unit's tile code (K/V packing, padded 16-row and 32-key tiles, bf16 Q and P) with emulated
    # tiles and 16-float vectors in place of the scalar unit: bf16 prefill blocks go through the tiles
    exe = build(native_compiler(), platform.machine(), tmp_path, [], ROOT / "tests" / "kernels" / "cpu_attn_amx_emulated.cpp")
    out = run([str(exe), "24", "300", "16"])
    assert sorted(listed(out, "covered")) == EVERY_DTYPE_AND_LAYOUT
    assert "0 mismatches" in out
    assert int(listed(out, "amx tile products")[-1]) > 0, out


def test_every_path_clean_under_the_sanitizers(tmp_path):
    # every native path and the emulated AMX tiles (in place of the scalar unit) under ASan and UBSan: a read
    # or write past a scratch buffer, a stack array or a cache row, or undefined arithmetic, ends the run
    compiler = native_compiler()
    probe = subprocess.run([compiler, *SANITIZERS, "-x", "c++", "-o", str(tmp_path / "probe"), "-"],
                           input="int main() { return 0; }\n", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a compiler that links ASan and UBSan (libasan, libubsan): {probe.stderr.strip()[-200:]}")
    exe = build(compiler, platform.machine(), tmp_path, [], ROOT / "tests" / "kernels" / "cpu_attn_amx_emulated.cpp",
                sanitize=True)
    # leaks are not this test's question, and LeakSanitizer cannot run where ptrace is refused
    out = run([str(exe), "12", "300", "16"], env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert isas_run_here() is None or set(supported(out)) >= isas_run_here(), out  # no path this CPU runs left out
    assert sorted(listed(out, "covered")) == EVERY_DTYPE_AND_LAYOUT
    assert "0 mismatches" in out
    assert int(listed(out, "amx tile products")[-1]) > 0, out


def test_neon_and_sve256_under_qemu(aarch64_check):
    # 256-bit SVE: every AArch64 path runs (sve256, neon, scalar) and agrees with the reference
    out = run([QEMU, "-cpu", "max,sve-default-vector-length=32", str(aarch64_check), "8", "600"])
    assert supported(out) == ["scalar", "neon", "sve256"]
    assert sorted(listed(out, "covered")) == EVERY_DTYPE_AND_LAYOUT
    assert "0 mismatches" in out


def test_sve256_not_chosen_at_another_vector_length(aarch64_check):
    # 128-bit SVE: the 256-bit unit would compute wrong results, so only NEON and scalar may run
    out = run([QEMU, "-cpu", "max,sve-default-vector-length=16", str(aarch64_check), "2", "100"])
    assert supported(out) == ["scalar", "neon"]
    assert "0 mismatches" in out
