"""`python -m vattn info`: what this machine and build can do."""

from __future__ import annotations

import platform
from typing import Any

import torch

from . import __version__, _C
from .backends import (
    CUDA_UVM_DEFAULT_PAGE_SIZE,
    HOST_DEFAULT_PAGE_SIZE,
    UVM_PAGE_SIZES,
    UVM_PATCH_README,
    cuda_info,
    host_meminfo,
    uvm_patch_info,
)
from .errors import VAttnError

GiB = 1024**3


def collect() -> dict[str, Any]:
    """Backends, granularity, page sizes, memory and build facts as a dict."""
    mem = host_meminfo()
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            max_map_count: int | None = int(f.read())
    except OSError:
        max_map_count = None
    host = {
        "available": True,
        "granularity": _C.host_granularity(),
        "page_sizes": f"any multiple of {_C.host_granularity()} bytes",
        "default_page_size": max(HOST_DEFAULT_PAGE_SIZE, _C.host_granularity()),
        "mem_total": mem.get("MemTotal"),
        "mem_available": mem.get("MemAvailable"),
        "max_map_count": max_map_count,
    }
    driver = _C.default_cuda_driver_path()
    try:
        first = cuda_info(0, driver)
        devices = [first] + [cuda_info(i, driver) for i in range(1, first["device_count"])]
        cuda: dict[str, Any] = {
            "available": True,
            "driver_library": driver,
            "driver_version": first["driver_version"],
            "devices": [
                dict(index=i, name=d["name"], granularity=d["granularity"],
                     page_sizes=f"multiples of {d['granularity']} bytes",
                     free_bytes=d["free_bytes"], total_bytes=d["total_bytes"])
                for i, d in enumerate(devices)
            ],
        }
    except VAttnError as e:
        cuda = {"available": False, "driver_library": driver, "reason": str(e)}
    from .attention import host_attention_info

    return {
        "vattn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "build": dict(_C.build_info),
        "backends": {"host": host, "cuda": cuda, "cuda_uvm": _cuda_uvm(cuda)},
        "host_attention": host_attention_info(),
    }


def _cuda_uvm(cuda: dict[str, Any]) -> dict[str, Any]:
    """The patched nvidia-uvm (driver_patch/): loaded or not, and its page sizes."""
    patch = uvm_patch_info()
    out: dict[str, Any] = {
        "available": bool(patch["available"] and cuda["available"]),
        "patched_module": bool(patch["available"]),
        "device_path": patch["device_path"],
        "abi_version": patch["abi_version"] or None,
        "page_sizes": list(UVM_PAGE_SIZES) if patch["available"] else [],
        "default_page_size": CUDA_UVM_DEFAULT_PAGE_SIZE,
    }
    if not patch["available"]:
        out["reason"] = f"{patch['reason']}; pages below the CUDA granularity need it, see {UVM_PATCH_README}"
    elif not cuda["available"]:
        out["reason"] = f"the patched nvidia-uvm is loaded but CUDA is unavailable ({cuda['reason']})"
    return out


def _sizes(sizes: list[int]) -> str:
    return ", ".join(f"{s // 1024} KiB" if s < 1024 * 1024 else f"{s // (1024 * 1024)} MiB" for s in sizes)


def _bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def render(info: dict[str, Any]) -> str:
    host, cuda, build = info["backends"]["host"], info["backends"]["cuda"], info["build"]
    lines = [
        f"vattn {info['vattn']}  (python {info['python']}, torch {info['torch']}, "
        f"torch CUDA {'yes' if info['torch_cuda'] else 'no'})",
        f"extension: {build['compiler']}, C++ {build['cplusplus']}, pybind11 {build['pybind11']}, "
        f"DLPack {build['dlpack_capsule']}; CUDA driver {build['cuda_driver']}",
        "backend host: available",
        f"  granularity {host['granularity']} bytes; page sizes: {host['page_sizes']} "
        f"(default {host['default_page_size'] // 1024} KiB)",
        f"  memory: {_bytes(host['mem_total'])} total, {_bytes(host['mem_available'])} available; "
        f"vm.max_map_count {host['max_map_count']} (each mapped page may be one mapping)",
    ]
    attn = info["host_attention"]
    lines.append(f"host attention kernel: {attn['isa']} path, {attn['threads']} threads, pool {attn['pool']} "
                 f"(CPU supports {', '.join(attn['supported'])}; built with {', '.join(attn['compiled'])})"
                 + (f"; {attn['note']}" if attn["note"] else ""))
    if cuda["available"]:
        lines.append(f"backend cuda: available (driver {cuda['driver_version']}, {cuda['driver_library']})")
        for d in cuda["devices"]:
            lines.append(
                f"  cuda:{d['index']} {d['name']}: granularity {d['granularity']} bytes, page sizes: "
                f"{d['page_sizes']}; memory {_bytes(d['free_bytes'])} free of {_bytes(d['total_bytes'])}"
            )
    else:
        lines.append(f"backend cuda: unavailable ({cuda['reason']})")
    uvm = info["backends"]["cuda_uvm"]
    module = (f"patched nvidia-uvm loaded (ABI {uvm['abi_version']}, {uvm['device_path']})" if uvm["patched_module"]
              else "patched nvidia-uvm not loaded")
    if uvm["available"]:
        lines.append(f"backend cuda_uvm: available ({module})")
        lines.append(f"  page sizes: {_sizes(uvm['page_sizes'])} (default {_sizes([uvm['default_page_size']])})")
    else:
        lines.append(f"backend cuda_uvm: unavailable ({module}: {uvm['reason']})")
    return "\n".join(lines)
