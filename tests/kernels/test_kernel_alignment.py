"""The built host kernel starts every function of its ISA units on a 64-byte
line (setup.py's KERNEL_FLAGS): where a hot loop falls against the fetch
windows then depends on its own function's code alone. Unaligned, a change to
prefill code moved decode's unchanged Q K^T block and cost bf16 decode 3%
(docs/kernels.md, "Where the code lands")."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import vattn._cpu_attn as cpu_attn


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm to list the extension's symbols")
def test_every_kernel_function_starts_on_a_cache_line():
    listing = subprocess.run(["nm", "--defined-only", "-C", cpu_attn.__file__], capture_output=True, text=True,
                             check=True).stdout
    functions = [line.split(" ", 2) for line in listing.splitlines() if " t " in line or " T " in line]
    kernel = [(int(address, 16), name) for address, _, name in functions if "_isa::" in name]
    assert kernel, "no kernel unit function (namespace *_isa) found in the extension's symbols"
    misplaced = [f"{name} at {address:#x}" for address, name in kernel if address % 64]
    assert not misplaced, f"{len(misplaced)} of {len(kernel)} kernel functions off a 64-byte line: {misplaced[:3]}"
