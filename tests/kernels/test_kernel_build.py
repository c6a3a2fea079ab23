"""How the host kernel's units are built (setup.py's KERNEL_FLAGS, after
Python's own CFLAGS): every function starts on a 64-byte line, so that where a
hot loop falls against the fetch windows depends on its own function's code
alone (unaligned, a change to prefill code moved decode's unchanged Q K^T
block and cost bf16 decode 3%), and signed overflow is undefined again
although Python's CFLAGS say -fwrapv (under it the kernels ran 2-8% slower).
docs/kernels.md, "How the kernel is built"."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest

import vattn._cpu_attn as cpu_attn
from conftest import load_setup


def kernel_flags() -> list[str]:
    return load_setup().KERNEL_FLAGS


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm: binutils' nm lists the extension's symbols")
def test_every_kernel_function_starts_on_a_cache_line():
    listing = subprocess.run(["nm", "--defined-only", "-C", cpu_attn.__file__], capture_output=True, text=True,
                             check=True).stdout
    functions = [line.split(" ", 2) for line in listing.splitlines() if " t " in line or " T " in line]
    kernel = [(int(address, 16), name) for address, _, name in functions if "_isa::" in name]
    assert kernel, "no kernel unit function (namespace *_isa) found in the extension's symbols"
    misplaced = [f"{name} at {address:#x}" for address, name in kernel if address % 64]
    assert not misplaced, f"{len(misplaced)} of {len(kernel)} kernel functions off a 64-byte line: {misplaced[:3]}"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++: the compiler setup.py builds the kernel with")
def test_signed_overflow_is_undefined_in_the_kernel_units_despite_pythons_cflags(tmp_path):
    # x + 1 > x folds to true only where signed overflow is undefined; under -fwrapv it must be computed
    probe = tmp_path / "probe.cpp"
    probe.write_text("extern \"C\" int grows(int x) { return x + 1 > x; }\n")
    python_flags = (sysconfig.get_config_var("CFLAGS") or "").split()

    def assembly(flags: list[str]) -> str:
        out = tmp_path / "probe.s"
        subprocess.run(["g++", *python_flags, "-O3", *flags, "-S", str(probe), "-o", str(out)], check=True)
        return out.read_text()

    folded = "movl\t$1, %eax" if "x86_64" in sysconfig.get_platform() else "mov\tw0, 1"
    assert folded in assembly(kernel_flags()), "the kernel units are built with wrapping signed overflow"
    if "-fwrapv" in python_flags:  # the probe tells the two apart: without the kernel's flags it is not folded
        assert folded not in assembly([])


def test_isa_flags_are_probed_before_any_unit_compiles(monkeypatch):
    """pybind11's has_flag changes the process's working directory while it
    probes, and the parallel compiles name their sources relative to it: a
    probe made from a compile thread left other threads' sources "No such
    file" on a 16-core machine. Every unit's flags are probed before the
    compiles start."""
    from setuptools import Distribution

    setup = load_setup()
    probed: list[str] = []
    probed_when_compiling: list[list[str]] = []
    monkeypatch.setattr(setup, "has_flag", lambda compiler, flag: probed.append(flag) is None)
    # the parent's build_extensions is where the (parallel) compiles run
    monkeypatch.setattr(setup.build_ext, "build_extensions", lambda self: probed_when_compiling.append(list(probed)))
    command = setup.BuildExt(Distribution())
    command.compiler = type("Compiler", (), {"_compile": lambda *args: None})()
    command.build_extensions()
    assert set(probed_when_compiling[0]) == {flag for flags in setup.ISA_FLAGS.values() for flag in flags}

