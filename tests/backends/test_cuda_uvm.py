"""The cuda_uvm backend (small CUDA pages through driver_patch/) without a GPU.

- The ABI header and the module stand-in (tests/backends/fake_uvm/fake_uvm.c) agree on
  every struct size, field offset and command number.
- On a stock driver (the fake driver's 2 MiB granularity, no patched module), a
  page size below the granularity raises BackendUnavailable, never rounds up.
- The backend against the stand-in: tests/backends/fake_uvm/uvm_cases.py, run in a child
  process that has the stand-in in LD_PRELOAD (ioctl cannot be interposed in a
  process that is already running).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vattn
import vattn.cli.info
from conftest import c_compiler

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ABI_DIR = ROOT / "csrc" / "backends"  # the nvidia-uvm ABI headers live with the backend that includes them
KiB, MiB = 1024, 1024 * 1024

# Every struct and field the stand-in decodes, printed from the header itself.
LAYOUT_PROBE = r"""
#include <stdio.h>
#include "vattn_uvm_ioctl.h"
#include "uvm_stock_ioctl.h"
#define S(t, name) printf("%s %zu %zu\n", name, (size_t)0, sizeof(t))
#define F(t, f, name) printf("%s.%s %zu %zu\n", name, #f, offsetof(t, f), sizeof(((t*)0)->f))
#define C(c) printf("%s %lu\n", #c, (unsigned long)(c))
int main(void) {
  S(VATTN_UVM_QUERY_PARAMS, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, gpuUuid, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, rangeBase, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, rangeLength, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, pageSizes, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, abiVersion, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, flags, "VATTN_UVM_QUERY_PARAMS");
  F(VATTN_UVM_QUERY_PARAMS, rmStatus, "VATTN_UVM_QUERY_PARAMS");
  S(VATTN_UVM_CREATE_PARAMS, "VATTN_UVM_CREATE_PARAMS");
  F(VATTN_UVM_CREATE_PARAMS, gpuUuid, "VATTN_UVM_CREATE_PARAMS");
  F(VATTN_UVM_CREATE_PARAMS, pageSize, "VATTN_UVM_CREATE_PARAMS");
  F(VATTN_UVM_CREATE_PARAMS, handle, "VATTN_UVM_CREATE_PARAMS");
  F(VATTN_UVM_CREATE_PARAMS, flags, "VATTN_UVM_CREATE_PARAMS");
  F(VATTN_UVM_CREATE_PARAMS, rmStatus, "VATTN_UVM_CREATE_PARAMS");
  S(VATTN_UVM_MAP_ENTRY, "VATTN_UVM_MAP_ENTRY");
  F(VATTN_UVM_MAP_ENTRY, va, "VATTN_UVM_MAP_ENTRY");
  F(VATTN_UVM_MAP_ENTRY, handle, "VATTN_UVM_MAP_ENTRY");
  S(VATTN_UVM_MAP_PARAMS, "VATTN_UVM_MAP_PARAMS");
  F(VATTN_UVM_MAP_PARAMS, entries, "VATTN_UVM_MAP_PARAMS");
  F(VATTN_UVM_MAP_PARAMS, count, "VATTN_UVM_MAP_PARAMS");
  F(VATTN_UVM_MAP_PARAMS, done, "VATTN_UVM_MAP_PARAMS");
  F(VATTN_UVM_MAP_PARAMS, access, "VATTN_UVM_MAP_PARAMS");
  F(VATTN_UVM_MAP_PARAMS, rmStatus, "VATTN_UVM_MAP_PARAMS");
  S(VATTN_UVM_UNMAP_PARAMS, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, gpuUuid, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, addrs, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, count, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, done, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, flags, "VATTN_UVM_UNMAP_PARAMS");
  F(VATTN_UVM_UNMAP_PARAMS, rmStatus, "VATTN_UVM_UNMAP_PARAMS");
  S(VATTN_UVM_RELEASE_PARAMS, "VATTN_UVM_RELEASE_PARAMS");
  F(VATTN_UVM_RELEASE_PARAMS, handle, "VATTN_UVM_RELEASE_PARAMS");
  F(VATTN_UVM_RELEASE_PARAMS, flags, "VATTN_UVM_RELEASE_PARAMS");
  F(VATTN_UVM_RELEASE_PARAMS, rmStatus, "VATTN_UVM_RELEASE_PARAMS");
  S(VATTN_STOCK_UVM_INITIALIZE_PARAMS, "INITIALIZE_PARAMS");
  F(VATTN_STOCK_UVM_INITIALIZE_PARAMS, flags, "INITIALIZE_PARAMS");
  F(VATTN_STOCK_UVM_INITIALIZE_PARAMS, rmStatus, "INITIALIZE_PARAMS");
  S(VATTN_STOCK_UVM_RANGE_PARAMS, "RANGE_PARAMS");
  F(VATTN_STOCK_UVM_RANGE_PARAMS, base, "RANGE_PARAMS");
  F(VATTN_STOCK_UVM_RANGE_PARAMS, length, "RANGE_PARAMS");
  F(VATTN_STOCK_UVM_RANGE_PARAMS, rmStatus, "RANGE_PARAMS");
  S(VATTN_STOCK_UVM_REGISTER_GPU_PARAMS, "REGISTER_GPU_PARAMS");
  F(VATTN_STOCK_UVM_REGISTER_GPU_PARAMS, gpuUuid, "REGISTER_GPU_PARAMS");
  F(VATTN_STOCK_UVM_REGISTER_GPU_PARAMS, rmStatus, "REGISTER_GPU_PARAMS");
  S(VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS, "REGISTER_GPU_VASPACE_PARAMS");
  F(VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS, gpuUuid, "REGISTER_GPU_VASPACE_PARAMS");
  F(VATTN_STOCK_UVM_REGISTER_GPU_VASPACE_PARAMS, rmStatus, "REGISTER_GPU_VASPACE_PARAMS");
  C(VATTN_UVM_QUERY);
  C(VATTN_UVM_CREATE);
  C(VATTN_UVM_MAP);
  C(VATTN_UVM_UNMAP);
  C(VATTN_UVM_RELEASE);
  return 0;
}
"""


def test_header_structs_match_what_the_stand_in_decodes(fake_uvm_lib, tmp_path):
    src = tmp_path / "probe.c"
    src.write_text(LAYOUT_PROBE)
    exe = tmp_path / "probe"
    subprocess.run([c_compiler(), "-std=c11", "-Wall", "-Werror", f"-I{ABI_DIR}", str(src), "-o",
                    str(exe)], check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    lib = ctypes.CDLL(str(fake_uvm_lib))  # loaded, not preloaded: its ioctl interposes nothing here
    lib.fake_uvm_field_name.restype = ctypes.c_char_p
    lib.fake_uvm_command.restype = ctypes.c_ulong
    header_fields, commands = {}, {}
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            header_fields[parts[0]] = (int(parts[1]), int(parts[2]))
        else:
            commands[parts[0]] = int(parts[1])
    shim_fields = {}
    i = 0
    while (name := lib.fake_uvm_field_name(i)) is not None:
        offset, size = ctypes.c_long(), ctypes.c_long()
        assert lib.fake_uvm_field(name, ctypes.byref(offset), ctypes.byref(size)) == 0
        shim_fields[name.decode()] = (offset.value, size.value)
        i += 1
    # QUERY's trailing pad0 is the one field the stand-in never reads
    assert header_fields == shim_fields
    assert len(commands) == 5
    for name, number in commands.items():
        assert lib.fake_uvm_command(name.encode()) == number, name
    assert lib.fake_uvm_command(b"VATTN_UVM_NOPE") == 0


def test_header_constants_reach_python():
    assert vattn.backends.UVM_PAGE_SIZES == (64 * KiB, 128 * KiB, 256 * KiB, 2 * MiB)
    text = (ABI_DIR / "vattn_uvm_ioctl.h").read_text()
    version = int(re.search(r"#define VATTN_UVM_ABI_VERSION (\d+)u", text).group(1))
    assert vattn.backends.cuda.UVM_ABI["abi_version"] == version


def test_the_patch_series_carries_the_header_verbatim():
    """Patch 0001 adds the ABI header to the module tree: its copy must be the
    header the backend compiles, byte for byte (check.sh checks the same)."""
    patch = next((ROOT / "driver_patch").glob("0001-*.patch")).read_text()
    hunk = patch.split("+++ b/kernel-open/nvidia-uvm/vattn_uvm_ioctl.h\n", 1)[1].partition("\n-- \n")[0]
    range_line, *lines = hunk.splitlines()
    header = (ABI_DIR / "vattn_uvm_ioctl.h").read_text()
    assert "".join(line[1:] + "\n" for line in lines if line.startswith("+")) == header
    assert range_line == f"@@ -0,0 +1,{len(header.splitlines())} @@"
    assert not (ROOT / "driver_patch" / "vattn_uvm_ioctl.h").exists()  # one copy: the backend's


# ---- a stock driver: small pages are refused, never rounded up ----------------------


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=4,
                max_context_len=8192, device="cuda", physical_memory=64 * MiB)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


@pytest.fixture
def stock_uvm(tmp_path, monkeypatch):
    """What /dev/nvidia-uvm would be without the patch: a missing device, or a
    file whose ioctls are refused (ENOTTY), like a module that routes none of ours."""
    def point_at(kind: str) -> None:
        path = tmp_path / "nvidia-uvm"
        if kind == "file":
            path.write_bytes(b"")
        monkeypatch.setenv("VATTN_UVM_DEVICE", str(path))
    return point_at


@pytest.mark.parametrize("device", ["missing", "file"])
@pytest.mark.parametrize("page_size", [64 * KiB, 128 * KiB, 256 * KiB])
def test_small_pages_on_a_stock_driver_raise_backend_unavailable(fake_cuda, stock_uvm, device, page_size):
    stock_uvm(device)
    refs = fake_cuda.fake_cuda_primary_refs()
    with pytest.raises(vattn.BackendUnavailable) as info:
        make(page_size=page_size)
    message = str(info.value)
    assert f"page_size {page_size} bytes is below the CUDA driver's granularity of 2097152 bytes" in message
    assert "smaller than that need the patched nvidia-uvm module" in message
    assert "driver_patch/README.md" in message
    assert ("module is not loaded" in message) if device == "missing" else ("is not an nvidia-uvm device" in message)
    assert fake_cuda.fake_cuda_live_reservations() == fake_cuda.baseline_reservations
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles
    assert fake_cuda.fake_cuda_primary_refs() == refs  # the failed call holds no context
    with pytest.raises(vattn.BackendUnavailable, match=r"below the CUDA driver's granularity of 2097152 bytes"):
        make(page_size=page_size, backend="cuda")  # asking for the stock backend changes nothing
    with pytest.raises(vattn.BackendUnavailable, match=r"the cuda_uvm backend needs the patched nvidia-uvm module"):
        make(page_size=page_size, backend="cuda_uvm")
    with make(page_size=2 * MiB) as kv:  # the driver's own granularity still works
        assert kv.backend.name == "cuda" and kv.page_size == 2 * MiB


def test_bad_backend_and_page_size_arguments(fake_cuda, stock_uvm):
    stock_uvm("missing")
    with pytest.raises(ValueError, match=r"backend must be one of \('host', 'cuda', 'cuda_uvm'\) or None, got 'rocm'"):
        make(backend="rocm")
    with pytest.raises(ValueError, match=r"backend 'cuda_uvm' does not serve device cpu"):
        make(backend="cuda_uvm", device="cpu")
    with pytest.raises(ValueError, match=r"backend 'host' does not serve device cuda"):
        make(backend="host")
    # a size no driver serves is a bad argument, whatever is loaded
    with pytest.raises(ValueError, match=r"multiple of the CUDA driver's granularity \(2097152 bytes\), or, with "
                                         r"the patched nvidia-uvm module .* one of \(65536, 131072, 262144, 2097152\)"):
        make(page_size=96 * KiB)
    with pytest.raises(ValueError, match=r"positive multiple of the cuda backend's granularity"):
        make(page_size=3 * MiB)
    assert fake_cuda.fake_cuda_live_reservations() == fake_cuda.baseline_reservations


def test_info_says_the_patched_module_is_not_loaded(stock_uvm):
    stock_uvm("missing")
    info = vattn.cli.info.collect()
    uvm = info["backends"]["cuda_uvm"]
    assert uvm["patched_module"] is False and uvm["available"] is False and uvm["page_sizes"] == []
    assert "the nvidia-uvm module is not loaded" in uvm["reason"] and "driver_patch/README.md" in uvm["reason"]
    text = vattn.cli.info.render(info)
    assert "backend cuda_uvm: unavailable (patched nvidia-uvm not loaded: cannot open" in text
    assert json.loads(json.dumps(info)) == info  # --json can print it


# ---- the backend against the patched module's stand-in ------------------------------


def test_cuda_uvm_backend_against_the_stand_in(fake_uvm_lib, tmp_path):
    device = tmp_path / "nvidia-uvm"
    device.write_bytes(b"")
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(fake_uvm_lib),
        FAKE_UVM_LIB=str(fake_uvm_lib),
        FAKE_UVM_DEVICE=str(device),
        VATTN_UVM_DEVICE=str(device),
        FAKE_CUDA_UVM_DEVICE=str(device),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]),
    )
    cases = HERE / "fake_uvm" / "uvm_cases.py"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", str(cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 63 and "skipped" not in summary and "failed" not in summary, report
