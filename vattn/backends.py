"""Choosing and sizing a VMM backend: page size and physical budget defaults."""

from __future__ import annotations

import dataclasses
import resource
from typing import Any

from . import _C
from .config import KVCacheConfig
from .errors import BackendUnavailable

KiB = 1024
MiB = 1024 * KiB

# Host pages are cheap to map at any size; 256 KiB keeps per-request waste low
# and the number of mappings (bounded by vm.max_map_count) moderate.
HOST_DEFAULT_PAGE_SIZE = 256 * KiB
HOST_BUDGET_FRACTION = 0.5  # of MemAvailable, when physical_memory is None
# Address space a cache may reserve: x86-64 and arm64 user space is 128 TiB
# (47 bits) with 4-level page tables; half of it leaves room for everything else.
MAX_RESERVATION_BYTES = 2**46
CUDA_BUDGET_FRACTION = 0.9  # of free device memory, when physical_memory is None

# cuda_uvm: CUDA memory in pages below the driver's 2 MiB granularity, from the
# nvidia-uvm module patched by driver_patch/ (see driver_patch/README.md).
BACKENDS = ("host", "cuda", "cuda_uvm")
UVM_PAGE_SIZES: tuple[int, ...] = tuple(_C.uvm_page_sizes)  # bytes: 64 KiB, 128 KiB, 256 KiB, 2 MiB
CUDA_UVM_DEFAULT_PAGE_SIZE = 64 * KiB  # the smallest: least memory mapped but unused
UVM_PATCH_README = "driver_patch/README.md"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend resolved for one cache: what `make()` will build."""

    name: str  # "host", "cuda" or "cuda_uvm"
    device_index: int
    granularity: int  # bytes; page sizes are multiples of it
    page_size: int  # bytes per physical page
    num_pages: int  # physical pool capacity in pages
    driver_path: str | None = None  # cuda only

    def make(self) -> Any:
        if self.name == "host":
            return _C.make_host_backend(self.page_size, self.num_pages)
        if self.name == "cuda_uvm":
            return _C.make_cuda_uvm_backend(self.driver_path, self.device_index, self.page_size, self.num_pages)
        return _C.make_cuda_backend(self.driver_path, self.device_index, self.page_size, self.num_pages)


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


def cuda_info(device_index: int, driver_path: str | None = None) -> dict[str, Any]:
    """Device name, granularity and memory; raises BackendUnavailable without a GPU."""
    return _C.cuda_device_info(driver_path or _C.default_cuda_driver_path(), device_index)


def uvm_patch_info() -> dict[str, Any]:
    """Whether the loaded nvidia-uvm is the patched one (driver_patch/): keys
    available, device_path ($VATTN_UVM_DEVICE or /dev/nvidia-uvm), abi_version,
    reason. Needs no GPU context."""
    return _C.uvm_patch_info()


def uvm_patch_available() -> bool:
    """True when the nvidia-uvm module answers the small-page ioctls."""
    return _C.uvm_patch_available()


def pool_pages(config: KVCacheConfig, page_size: int, budget: int, capped: bool = True) -> int:
    """Pages of the physical pool for a budget in bytes. ``capped``: never
    more than every reqid at full length can map at once (the manager's own
    ids); uncapped for external page ids, which a framework may keep alive
    unmapped (a prefix cache holds more blocks than its running requests map)."""
    if capped:
        budget = min(budget, config.num_buffers * config.max_batch_size * config.slot_bytes(page_size))
    return budget // page_size


def resolve_backend(
    kind: str,
    device_index: int,
    config: KVCacheConfig,
    page_size: int | None,
    physical_memory: int | None,
    backend: str | None = None,
    external_ids: bool = False,
) -> BackendSpec:
    """Validates page_size and physical_memory against the backend and fills defaults.

    ``external_ids``: the pool is sized by ``physical_memory`` alone, not
    capped at what the reqids can map at once (see :func:`pool_pages`).

    ``backend``: "host" (device cpu), "cuda" or "cuda_uvm" (a CUDA device), or
    None: the device's backend, and cuda_uvm on a CUDA device when the page size
    is below the driver's granularity and the patched nvidia-uvm is loaded.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend is not None and (backend == "host") != (kind == "host"):
        raise ValueError(f"backend {backend!r} does not serve device {'cpu' if kind == 'host' else 'cuda'}")
    if page_size is not None and (isinstance(page_size, bool) or not hasattr(page_size, "__index__")):
        raise TypeError(f"page_size must be an int number of bytes or None, got {type(page_size).__name__}")
    page_size = None if page_size is None else int(page_size)
    driver_path = None
    if kind == "host":
        granularity = _C.host_granularity()
        default_page = max(HOST_DEFAULT_PAGE_SIZE, granularity)
        budget_share = int(host_meminfo().get("MemAvailable", 0) * HOST_BUDGET_FRACTION)
    else:
        driver_path = _C.default_cuda_driver_path()
        info = cuda_info(device_index, driver_path)
        granularity = info["granularity"]
        default_page = granularity
        budget_share = int(info["free_bytes"] * CUDA_BUDGET_FRACTION)
        kind = _cuda_backend(backend, page_size, granularity)
        if kind == "cuda_uvm":
            granularity, default_page = UVM_PAGE_SIZES[0], CUDA_UVM_DEFAULT_PAGE_SIZE

    if page_size is None:
        page_size = default_page
    elif kind == "cuda_uvm" and page_size not in UVM_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {UVM_PAGE_SIZES} bytes for the cuda_uvm backend, got {page_size}")
    elif page_size <= 0 or page_size % granularity:
        raise ValueError(
            f"page_size must be a positive multiple of the {kind} backend's granularity "
            f"({granularity} bytes), got {page_size}"
        )

    elif page_size > MAX_RESERVATION_BYTES:
        raise ValueError(f"page_size must be at most {MAX_RESERVATION_BYTES} bytes, got {page_size}")
    _check_reservation(kind, config, page_size)

    min_budget = config.num_buffers * page_size  # one page in every buffer
    if physical_memory is None:
        budget = max(budget_share, min_budget)  # capped by pool_pages unless external
    elif isinstance(physical_memory, bool) or not hasattr(physical_memory, "__index__"):
        raise TypeError(f"physical_memory must be an int number of bytes or None, got {type(physical_memory).__name__}")
    elif physical_memory < min_budget:
        raise ValueError(
            f"physical_memory must be at least one page per buffer = {config.num_buffers} x "
            f"{page_size} = {min_budget} bytes, got {physical_memory}"
        )
    else:
        budget = int(physical_memory)
    return BackendSpec(
        name=kind,
        device_index=device_index,
        granularity=granularity,
        page_size=page_size,
        num_pages=pool_pages(config, page_size, budget, capped=not external_ids or physical_memory is None),
        driver_path=driver_path,
    )


def _cuda_backend(backend: str | None, page_size: int | None, granularity: int) -> str:
    """"cuda" or "cuda_uvm" for a CUDA device. A page size below the driver's
    granularity is never rounded up: it needs the patched nvidia-uvm."""
    small = page_size is not None and 0 < page_size < granularity
    if small and page_size not in UVM_PAGE_SIZES:
        raise ValueError(
            f"page_size must be a positive multiple of the CUDA driver's granularity ({granularity} bytes), or, "
            f"with the patched nvidia-uvm module ({UVM_PATCH_README}), one of {UVM_PAGE_SIZES}; got {page_size}"
        )
    if backend != "cuda_uvm" and not small:
        return "cuda"
    patch = uvm_patch_info()
    if backend == "cuda_uvm" or (backend is None and patch["available"]):
        if not patch["available"]:
            raise BackendUnavailable(
                f"the cuda_uvm backend needs the patched nvidia-uvm module ({patch['reason']}); "
                f"see {UVM_PATCH_README}"
            )
        return "cuda_uvm"
    if patch["available"]:  # backend="cuda" asked for explicitly
        raise ValueError(
            f"the cuda backend maps multiples of the driver's granularity ({granularity} bytes); page_size "
            f"{page_size} needs backend='cuda_uvm' (the patched nvidia-uvm module is loaded)"
        )
    raise BackendUnavailable(
        f"page_size {page_size} bytes is below the CUDA driver's granularity of {granularity} bytes: pages "
        f"smaller than that need the patched nvidia-uvm module, which is not loaded ({patch['reason']}); "
        f"see {UVM_PATCH_README}, or use a page_size that is a multiple of {granularity}"
    )


def _check_reservation(kind: str, config: KVCacheConfig, page_size: int) -> None:
    """Refuses, before any system call, a cache whose address range cannot be
    reserved; the message names the bytes and the arguments to lower."""
    need = config.reservation_bytes(page_size)
    limit, why = MAX_RESERVATION_BYTES, "the address space vattn reserves at most"
    if kind == "host":
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and soft < limit:
            limit, why = soft, "RLIMIT_AS (ulimit -v)"
    if need > limit:
        per_request = config.num_buffers * config.slot_bytes(page_size)
        raise ValueError(
            f"the cache needs {need} bytes of virtual address space ({config.max_batch_size} reqids x "
            f"{per_request} bytes each: {config.num_buffers} buffers x max_context_len {config.max_context_len} "
            f"tokens x {config.token_bytes_per_buffer} bytes, in {page_size}-byte pages), more than {why} "
            f"({limit} bytes): lower max_batch_size or max_context_len"
        )
