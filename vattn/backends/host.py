"""The host backend (device ``cpu``): a memfd page pool mapped with mmap
(csrc/backends/host_backend.cpp). Runs everywhere."""

from __future__ import annotations

import resource
from collections.abc import Mapping
from typing import Any

from vattn import _C
from .registry import MAX_RESERVATION_BYTES, BackendDefaults, native_factory, register_backend

KiB = 1024
GiB = 1024**3

# Host pages are cheap to map at any size; 256 KiB keeps per-request waste low
# and the number of mappings (bounded by vm.max_map_count) moderate.
HOST_DEFAULT_PAGE_SIZE = 256 * KiB
HOST_BUDGET_FRACTION = 0.5  # of MemAvailable, when physical_memory is None


def host_granularity() -> int:
    """Bytes host page sizes are multiples of: the OS page size (the host backend's probe)."""
    return _C.backend_probe("host", "granularity")["granularity"]


def host_meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (KiB if len(parts) > 1 else 1)
    return out


def host_defaults(device_index: int, page_size: int | None, automatic: bool) -> BackendDefaults:
    """The OS page size as granularity, 256 KiB pages, half of MemAvailable;
    reservations are bounded by RLIMIT_AS (ulimit -v) where that is lower."""
    granularity = host_granularity()
    limit, why = MAX_RESERVATION_BYTES, "the address space vattn reserves at most"
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and soft < limit:
        limit, why = soft, "RLIMIT_AS (ulimit -v)"
    return BackendDefaults(
        granularity=granularity,
        page_size=max(HOST_DEFAULT_PAGE_SIZE, granularity),
        budget=int(host_meminfo().get("MemAvailable", 0) * HOST_BUDGET_FRACTION),
        max_reservation=limit,
        max_reservation_why=why,
    )


def host_info(earlier: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Granularity, page sizes, memory and vm.max_map_count."""
    mem = host_meminfo()
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            max_map_count: int | None = int(f.read())
    except OSError:
        max_map_count = None
    granularity = host_granularity()
    return {
        "available": True,
        "granularity": granularity,
        "page_sizes": f"any multiple of {granularity} bytes",
        "default_page_size": max(HOST_DEFAULT_PAGE_SIZE, granularity),
        "mem_total": mem.get("MemTotal"),
        "mem_available": mem.get("MemAvailable"),
        "max_map_count": max_map_count,
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def host_render(info: dict[str, Any]) -> list[str]:
    return [
        "backend host: available",
        f"  granularity {info['granularity']} bytes; page sizes: {info['page_sizes']} "
        f"(default {info['default_page_size'] // 1024} KiB)",
        f"  memory: {_gib(info['mem_total'])} total, {_gib(info['mem_available'])} available; "
        f"vm.max_map_count {info['max_map_count']} (each mapped page may be one mapping)",
    ]


register_backend(
    "host",
    device="cpu",
    factory=native_factory,
    defaults=host_defaults,
    description="CPU memory: a memfd page pool, mapped with mmap",
    info=host_info,
    render=host_render,
)
