"""The backends of a CUDA device (``cuda`` / ``cuda:i``): ``cuda``, the
driver's VMM API (csrc/backends/cuda_backend.cpp), and ``cuda_uvm``, pages
below the driver's granularity from the nvidia-uvm module patched by
driver_patch/ (csrc/backends/cuda_uvm_backend.cpp). One device query serves
both, and picks between them when the caller names neither."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vattn import _C
from vattn.common.errors import BackendUnavailable, VAttnError
from .registry import BackendDefaults, native_factory, register_backend

KiB = 1024
GiB = 1024**3

CUDA_BUDGET_FRACTION = 0.9  # of free device memory, when physical_memory is None
# What this build speaks to the patched module: its ABI version and page sizes
# (bytes: 64 KiB, 128 KiB, 256 KiB, 2 MiB), from the header the backend compiles.
UVM_ABI: dict[str, Any] = _C.backend_probe("cuda_uvm", "abi")
UVM_PAGE_SIZES: tuple[int, ...] = tuple(UVM_ABI["page_sizes"])
CUDA_UVM_DEFAULT_PAGE_SIZE = 64 * KiB  # the smallest: least memory mapped but unused
UVM_PATCH_README = "driver_patch/README.md"


def cuda_driver_path() -> str:
    """The CUDA driver library vattn loads at run time ($VATTN_CUDA_DRIVER_LIB, else libcuda.so.1)."""
    return _C.backend_probe("cuda", "driver_path")["driver_path"]


def cuda_info(device_index: int, driver_path: str | None = None, keep_context: bool = False) -> dict[str, Any]:
    """Device name, granularity and memory; raises BackendUnavailable without a GPU.

    The queries need the device's primary context; no context is left current
    on the calling thread afterwards. If someone holds the primary context
    (torch, once it has initialised CUDA) the query only borrows it. If nobody
    does, the query creates it, and then:

    - ``keep_context=False`` (the default): destroys it again before
      returning; nothing is left behind.
    - ``keep_context=True``: keeps its reference (``context_kept`` in the
      answer) for the next cuda or cuda_uvm backend made on this device in this
      process, which takes it over, so that "device info, then a manager"
      creates one context, not two. Whoever asks for this must build that
      backend or give the reference back with :func:`release_cuda_context`;
      otherwise the context lives until the process ends. Resolving a backend
      for a manager does this (its defaults carry the release, which
      ``resolve_backend`` calls when it fails and ``BackendSpec.make`` after
      building).
    """
    return _C.backend_probe("cuda", "device_info", driver_path=driver_path or "", device=device_index,
                            keep_context=keep_context)


def release_cuda_context(device_index: int, driver_path: str | None = None) -> bool:
    """Gives back the primary context reference that ``cuda_info(keep_context=True)``
    kept for ``device_index`` when no backend took it over (destroying the
    context if nobody else holds it). Whether there was one."""
    return _C.backend_probe("cuda", "release_context", driver_path=driver_path or "", device=device_index)["released"]


def uvm_patch_info() -> dict[str, Any]:
    """Whether the loaded nvidia-uvm is the patched one (driver_patch/): keys
    available, device_path ($VATTN_UVM_DEVICE or /dev/nvidia-uvm), abi_version,
    reason. Needs no GPU context."""
    return _C.backend_probe("cuda_uvm", "patch_info")


def uvm_patch_available() -> bool:
    """True when the nvidia-uvm module answers the small-page ioctls."""
    return uvm_patch_info()["available"]


# ---- defaults and the choice between the two ----------------------------------------


def _device_defaults(wanted: str | None, device_index: int, page_size: int | None) -> BackendDefaults:
    """Defaults on the device for the backend ``wanted`` ("cuda", "cuda_uvm",
    or None: whichever serves ``page_size``, named in ``handover``)."""
    driver_path = cuda_driver_path()
    # A context this query creates is kept for the backend built next (one
    # context, not two); it goes back if no backend follows.
    info = cuda_info(device_index, driver_path, keep_context=True)

    def release() -> None:
        release_cuda_context(device_index, driver_path)

    try:
        granularity = info["granularity"]
        budget = int(info["free_bytes"] * CUDA_BUDGET_FRACTION)
        chosen = _choose(wanted, page_size, granularity)
    except BaseException:
        release()
        raise
    if chosen == "cuda_uvm":
        return BackendDefaults(granularity=UVM_PAGE_SIZES[0], page_size=CUDA_UVM_DEFAULT_PAGE_SIZE, budget=budget,
                               page_sizes=UVM_PAGE_SIZES, driver_path=driver_path,
                               handover="cuda_uvm" if wanted is None else None, release=release)
    return BackendDefaults(granularity=granularity, page_size=granularity, budget=budget, driver_path=driver_path,
                           release=release)


def _choose(wanted: str | None, page_size: int | None, granularity: int) -> str:
    """"cuda" or "cuda_uvm" for a CUDA device. A page size below the driver's
    granularity is never rounded up: it needs the patched nvidia-uvm."""
    small = page_size is not None and 0 < page_size < granularity
    if small and page_size not in UVM_PAGE_SIZES:
        raise ValueError(
            f"page_size must be a positive multiple of the CUDA driver's granularity ({granularity} bytes), or, "
            f"with the patched nvidia-uvm module ({UVM_PATCH_README}), one of {UVM_PAGE_SIZES}; got {page_size}"
        )
    if wanted != "cuda_uvm" and not small:
        return "cuda"
    patch = uvm_patch_info()
    if wanted == "cuda_uvm" or (wanted is None and patch["available"]):
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


def cuda_defaults(device_index: int, page_size: int | None, automatic: bool) -> BackendDefaults:
    """Multiples of the driver's granularity (2 MiB with the stock driver),
    90% of free device memory; chosen automatically, it hands a smaller page
    size over to cuda_uvm when the patched module is loaded."""
    return _device_defaults(None if automatic else "cuda", device_index, page_size)


def cuda_uvm_defaults(device_index: int, page_size: int | None, automatic: bool) -> BackendDefaults:
    """64 KiB, 128 KiB, 256 KiB or 2 MiB (default 64 KiB), 90% of free device
    memory; BackendUnavailable without the patched nvidia-uvm."""
    return _device_defaults("cuda_uvm", device_index, page_size)


# ---- python -m vattn info ---------------------------------------------------------


def cuda_info_facts(earlier: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The driver library and version, and each device's granularity and memory."""
    driver = cuda_driver_path()
    try:
        first = cuda_info(0, driver)
        devices = [first] + [cuda_info(i, driver) for i in range(1, first["device_count"])]
    except VAttnError as e:
        return {"available": False, "driver_library": driver, "reason": str(e)}
    return {
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


def cuda_uvm_info_facts(earlier: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The patched nvidia-uvm (driver_patch/): loaded or not, and its page sizes."""
    cuda = earlier.get("cuda") or cuda_info_facts({})
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


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _sizes(sizes: list[int]) -> str:
    return ", ".join(f"{s // 1024} KiB" if s < 1024 * 1024 else f"{s // (1024 * 1024)} MiB" for s in sizes)


def cuda_render(info: dict[str, Any]) -> list[str]:
    if not info["available"]:
        return [f"backend cuda: unavailable ({info['reason']})"]
    lines = [f"backend cuda: available (driver {info['driver_version']}, {info['driver_library']})"]
    for d in info["devices"]:
        lines.append(f"  cuda:{d['index']} {d['name']}: granularity {d['granularity']} bytes, page sizes: "
                     f"{d['page_sizes']}; memory {_gib(d['free_bytes'])} free of {_gib(d['total_bytes'])}")
    return lines


def cuda_uvm_render(info: dict[str, Any]) -> list[str]:
    module = (f"patched nvidia-uvm loaded (ABI {info['abi_version']}, {info['device_path']})"
              if info["patched_module"] else "patched nvidia-uvm not loaded")
    if not info["available"]:
        return [f"backend cuda_uvm: unavailable ({module}: {info['reason']})"]
    return [f"backend cuda_uvm: available ({module})",
            f"  page sizes: {_sizes(info['page_sizes'])} (default {_sizes([info['default_page_size']])})"]


register_backend(
    "cuda",
    device="cuda[:i]",
    factory=native_factory,
    defaults=cuda_defaults,
    description="CUDA device memory through the driver's VMM API (cuMemCreate / cuMemMap)",
    info=cuda_info_facts,
    render=cuda_render,
)
register_backend(
    "cuda_uvm",
    device="cuda[:i]",
    factory=native_factory,
    defaults=cuda_uvm_defaults,
    description="CUDA device memory in 64 KiB - 2 MiB pages from the patched nvidia-uvm (driver_patch/)",
    info=cuda_uvm_info_facts,
    render=cuda_uvm_render,
)
