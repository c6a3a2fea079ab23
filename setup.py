"""Builds vattn._C, vattn._testing (over the library vattn/libvattn.so) and vattn._cpu_attn. Needs a
C++17 compiler and pybind11; not torch, not CUDA."""

import os
import platform
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext, has_flag
from setuptools import setup

ROOT = Path(__file__).resolve().parent


def sources(folder: str) -> list[str]:
    """Every C++ source file of ``folder``, relative to the repository root."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob("*.cpp"))


# csrc/ is layered: common/ (errors, DLPack) <- backends/ (one VMM backend per
# file, each registering its factory and probes, and what they share) <- core/
# (page bookkeeping and the mapper) <- python/ (the bindings) and testing/ (the
# test hooks). budget/ (the machine-wide memory budget in shared memory) uses
# common/ only. A new backend is a new file in csrc/backends/: every file there
# is compiled.
#
# Every source below the bindings is compiled once, into one shared library,
# vattn/libvattn.so, that both extension modules link (found beside them:
# rpath $ORIGIN). So a process holds one copy of the library's state, the
# backend registry above all: a backend vattn._testing registers is one that
# vattn._C builds and probes, and the test hooks drive the library's own page
# table, policy and host backend, not copies of them. The library holds no
# Python code; only the modules bind it.
LIBRARY = "vattn.libvattn"
LIBRARY_FILE = "libvattn.so"
LIBRARY_SOURCES = [*sources("csrc/backends"), *sources("csrc/budget"), *sources("csrc/core")]
LIBRARY_HEADERS = ("csrc/common", "csrc/backends", "csrc/budget", "csrc/core")

WARNINGS = ["-Wall", "-Wextra", "-Wno-missing-field-initializers"]


def headers(*folders: str) -> list[str]:
    """The headers in ``folders``: an extension's ``depends``, so that an edit
    to a header alone rebuilds it (build_ext compares only these and the sources)."""
    return sorted(str(p.relative_to(ROOT)) for folder in folders for p in (ROOT / folder).glob("*.h"))


library = Pybind11Extension(  # the modules' compiler flags, without pybind11
    LIBRARY,
    LIBRARY_SOURCES,
    include_pybind11=False,
    include_dirs=["csrc"],
    depends=headers(*LIBRARY_HEADERS),
    cxx_std=17,
    extra_compile_args=["-O2", *WARNINGS],
    extra_link_args=[f"-Wl,-soname,{LIBRARY_FILE}"],
    libraries=["dl", "pthread"],  # dlopen of libcuda.so.1 at run time; the mapper and keeper threads
)
# The library exports what the modules call: default visibility, not the modules' hidden one.
library.extra_compile_args.remove("-fvisibility=hidden")


def on_library(name: str, sources: list[str], folder: str) -> Pybind11Extension:
    """An extension module of the bindings in ``folder`` over the library."""
    return Pybind11Extension(
        name,
        sources,
        include_dirs=["csrc"],
        depends=headers(*LIBRARY_HEADERS, folder),
        cxx_std=17,
        extra_compile_args=["-O2", *WARNINGS],
        libraries=["vattn"],  # -lvattn: libvattn.so
        extra_link_args=["-Wl,-rpath,$ORIGIN"],  # libvattn.so lies beside the module, wherever it is installed
    )


ext = on_library("vattn._C", sources("csrc/python"), "csrc/python")
# vattn._testing: test hooks and benchmark probes, out of the production module.
# Every file of csrc/testing is one part of it; it compiles no library source.
testing = on_library("vattn._testing", sources("csrc/testing"), "csrc/testing")

# The host attention kernels: one unit per ISA, each compiled with its own
# target flags; the module picks one at run time from the CPU's features.
CPU_ATTN_SOURCES = [
    "csrc/cpu_attn/attention.cpp",
    "csrc/cpu_attn/bindings.cpp",
    "csrc/cpu_attn/kernel_amx.cpp",
    "csrc/cpu_attn/kernel_avx2.cpp",
    "csrc/cpu_attn/kernel_avx512.cpp",
    "csrc/cpu_attn/kernel_neon.cpp",
    "csrc/cpu_attn/kernel_scalar.cpp",
    "csrc/cpu_attn/kernel_sve.cpp",
    "csrc/cpu_attn/thread_pool.cpp",
]


def isa_flags(machine: str) -> dict[str, list[str]]:
    """Each kernel unit's own target flags on ``machine`` (platform.machine());
    units absent here take the baseline flags (NEON is baseline on AArch64).
    tests/kernels/test_cpu_attn_isas.py compiles the units with these too."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        avx512 = ["-mavx512f", "-mavx2", "-mfma", "-mf16c"]
        return {"kernel_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
                "kernel_avx512.cpp": avx512,
                "kernel_amx.cpp": [*avx512, "-mamx-tile", "-mamx-bf16"]}
    if machine in ("aarch64", "arm64"):
        return {"kernel_sve.cpp": ["-march=armv8.2-a+sve", "-msve-vector-bits=256"]}
    return {}


def usable_flags(flags: list[str], accepts) -> list[str]:
    """A unit's flags if the compiler ``accepts`` (flag -> bool) every one, else
    none: a compiler that lacks them (AMX needs GCC 11 / clang 12) builds the
    unit without them, and the unit then compiles to "absent" (kernel_unit.h)."""
    return flags if all(accepts(f) for f in flags) else []


ISA_FLAGS = isa_flags(platform.machine())

# Flags of every kernel unit, after Python's own CFLAGS (which setuptools puts first on every extension's
# command line):
# - each function starts on a cache line, so that where a hot loop falls against the 32- and 64-byte fetch
#   windows depends on that function's own code only, not on how much code a change elsewhere in the unit
#   put before it. Without it, a change to prefill code moved decode's Q K^T block (code unchanged) 16
#   bytes along and bf16 decode on the AVX2 path ran 3% slower (docs/kernels.md);
# - signed overflow is undefined again: Python's CFLAGS carry -fwrapv, under which GCC must keep int
#   index arithmetic wrapping and optimizes the kernels' loops less. Without it, one thread of a 2-core
#   AVX-512 EPYC ran decode and prefill of Llama-3-8B and small-model heads 1.01-1.08x as fast; on the
#   AVX2 path 1.00-1.16x, except fp32 decode of 4 q / 2 kv heads of 128 over 512 tokens, 0.96-0.98x
#   (benchmarks/host_kernel_ab.py, which builds as this file does; docs/kernels.md).
KERNEL_FLAGS = ["-falign-functions=64", "-fno-wrapv"]

cpu_attn = Pybind11Extension(
    "vattn._cpu_attn",
    CPU_ATTN_SOURCES,
    include_dirs=["csrc/cpu_attn", "csrc"],  # common/dlpack.h is shared with vattn._C
    depends=headers("csrc/cpu_attn", "csrc/common"),
    cxx_std=17,
    extra_compile_args=["-O3", *WARNINGS],
    libraries=["pthread"],
)


def torch_missing_warning(python: str, environ: dict[str, str]) -> str | None:
    """A warning when ``python`` (the interpreter vattn is being installed for)
    cannot find torch. The build never needs torch (tensors cross through DLPack),
    but ``import vattn`` does, and pip installs vattn without it: torch is not
    declared, so that pip never swaps an installed CUDA build of torch for another.
    pip's build isolation hides the target's site-packages from this process,
    hence the question goes to a child without pip's overlay on its path."""
    env = dict(environ)
    path = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and "pip-build-env" not in p]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    env.pop("PYTHONNOUSERSITE", None)  # set by pip's isolation; user site-packages count at run time
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    try:
        found = subprocess.run([python, "-c", probe], env=env, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None  # cannot tell: say nothing rather than something wrong
    if found:
        return None
    return (f"WARNING: torch is not installed for {python}. vattn builds without it, but `import vattn` "
            "needs it: install torch first (see README), e.g. `pip install torch` (a CUDA build on a GPU "
            "machine); the extension built here works with any torch version.")


class BuildExt(build_ext):
    """pybind11's build_ext, plus the library the modules link and each kernel
    unit's own ISA flags."""

    def get_ext_filename(self, fullname: str) -> str:
        # The library is no module: a plain shared object's name, beside the modules.
        filename = super().get_ext_filename(fullname)
        if fullname.split(".")[-1] == LIBRARY.split(".")[-1]:
            return os.path.join(os.path.dirname(filename), LIBRARY_FILE)
        return filename

    def build_extension(self, ext):
        if "vattn" in ext.libraries:  # the modules link the library where this build just made it
            folder = os.path.dirname(self.get_ext_fullpath(LIBRARY))
            if folder not in ext.library_dirs:
                ext.library_dirs.append(folder)
        super().build_extension(ext)

    def build_extensions(self):
        compile_one = self.compiler._compile
        known: dict[str, bool] = {}

        def accepts(flag: str) -> bool:
            if flag not in known:
                known[flag] = has_flag(self.compiler, flag)
            return known[flag]

        # Every unit's flags are settled here, before any compiler runs: has_flag changes the process's
        # working directory while it probes, and the parallel compiles name their sources relative to it
        # (a probe from a compile thread made the others' sources "No such file" on a 16-core machine).
        unit_flags = {unit: usable_flags(flags, accepts) for unit, flags in ISA_FLAGS.items()}

        def compile_with_isa(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if "cpu_attn" not in Path(src).parts:
                return compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)
            flags = [*KERNEL_FLAGS, *unit_flags.get(Path(src).name, [])]
            return compile_one(obj, src, ext, cc_args, [*extra_postargs, *flags], pp_opts)

        self.compiler._compile = compile_with_isa
        super().build_extensions()


if __name__ == "__main__":  # pip and `python setup.py` run it as __main__; tests import isa_flags
    # one compiler per CPU (VATTN_BUILD_JOBS=N to choose): sixteen units, each a few seconds
    with ParallelCompile("VATTN_BUILD_JOBS"):
        setup(ext_modules=[library, ext, testing, cpu_attn], cmdclass={"build_ext": BuildExt})  # the library first
    # once per install (pip runs this file for metadata too), last, where a verbose install's output ends
    builds = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}
    warning = torch_missing_warning(sys.executable, dict(os.environ)) if builds & set(sys.argv[1:]) else None
    if warning:
        print(warning, file=sys.stderr)
