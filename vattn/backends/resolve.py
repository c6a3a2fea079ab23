"""Choosing and sizing a backend for one cache: page size and physical budget,
checked against what the registered backend offers on the device."""

from __future__ import annotations

from typing import Any

from vattn.common.config import KVCacheConfig
from .registry import MAX_RESERVATION_BYTES, BackendDefaults, BackendSpec, backend_names, default_backend, get_backend


def pool_pages(config: KVCacheConfig, page_size: int, budget: int, capped: bool = True) -> int:
    """Pages of the physical pool for a budget in bytes. ``capped``: never
    more than every reqid at full length can map at once (the manager's own
    ids); uncapped for external page ids, which a framework may keep alive
    unmapped (a prefix cache holds more blocks than its running requests map)."""
    if capped:
        budget = min(budget, config.num_buffers * config.max_batch_size * config.slice_bytes(page_size))
    return budget // page_size


def resolve_backend(
    device_type: str,
    device_index: int,
    config: KVCacheConfig,
    page_size: int | None,
    physical_memory: int | None,
    backend: str | None = None,
    external_ids: bool = False,
) -> BackendSpec:
    """Validates page_size and physical_memory against the backend and fills defaults.

    ``device_type`` / ``device_index``: the device, as
    :func:`~vattn.backends.parse_device` returns it. ``backend``: a registered
    name serving that device, or None: the device's default backend, which may
    hand over to another one of the device for the page size asked (cuda:
    cuda_uvm for a page size below the driver's granularity when the patched
    nvidia-uvm is loaded). ``external_ids``: the pool is sized by
    ``physical_memory`` alone, not capped at what the reqids can map at once
    (see :func:`pool_pages`). Sizes are bytes.
    """
    if backend is not None and backend not in backend_names():
        raise ValueError(f"backend must be one of {backend_names()} or None, got {backend!r}")
    entry = get_backend(backend) if backend is not None else default_backend(device_type)
    if entry.device_type != device_type:
        raise ValueError(f"backend {backend!r} does not serve device {device_type}")
    if page_size is not None and (isinstance(page_size, bool) or not hasattr(page_size, "__index__")):
        raise TypeError(f"page_size must be an int number of bytes or None, got {type(page_size).__name__}")
    page_size = None if page_size is None else int(page_size)
    defaults = entry.defaults(device_index, page_size, backend is None)
    try:
        return _resolve_with(defaults, entry, backend, device_index, config, page_size, physical_memory,
                             external_ids)
    except BaseException:
        if defaults.release is not None:  # no backend follows: what the query kept goes back
            defaults.release()
        raise


def _resolve_with(defaults: BackendDefaults, entry: Any, backend: str | None, device_index: int,
                  config: KVCacheConfig, page_size: int | None, physical_memory: int | None,
                  external_ids: bool) -> BackendSpec:
    if backend is None and defaults.handover is not None:
        entry = get_backend(defaults.handover)

    if page_size is None:
        page_size = defaults.page_size
    elif defaults.page_sizes is not None and page_size not in defaults.page_sizes:
        raise ValueError(
            f"page_size must be one of {defaults.page_sizes} bytes for the {entry.name} backend, got {page_size}"
        )
    elif page_size <= 0 or page_size % defaults.granularity:
        raise ValueError(
            f"page_size must be a positive multiple of the {entry.name} backend's granularity "
            f"({defaults.granularity} bytes), got {page_size}"
        )
    elif page_size > MAX_RESERVATION_BYTES:
        raise ValueError(f"page_size must be at most {MAX_RESERVATION_BYTES} bytes, got {page_size}")
    _check_reservation(defaults, config, page_size)

    min_budget = config.num_buffers * page_size  # one page in every buffer
    if physical_memory is None:
        if 0 < defaults.budget < min_budget:  # (0: free memory unknown, one page per buffer it is)
            raise ValueError(
                f"physical_memory=None takes a share of free memory (half of MemAvailable on the host, 90% of "
                f"free device memory on CUDA): {defaults.budget} bytes here, less than one page per buffer = "
                f"{config.num_buffers} x {page_size} = {min_budget} bytes; pass physical_memory (at least "
                f"{min_budget}) or a smaller page_size")
        budget = max(defaults.budget, min_budget)  # capped by pool_pages unless external
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
        name=entry.name,
        device_index=device_index,
        granularity=defaults.granularity,
        page_size=page_size,
        num_pages=pool_pages(config, page_size, budget, capped=not external_ids or physical_memory is None),
        driver_path=defaults.driver_path,
        release=defaults.release,
    )


def _check_reservation(defaults: BackendDefaults, config: KVCacheConfig, page_size: int) -> None:
    """Refuses, before any system call, a cache whose address range cannot be
    reserved; the message names the bytes and the arguments to lower."""
    need = config.reservation_bytes(page_size)
    if need > defaults.max_reservation:
        per_request = config.num_buffers * config.slice_bytes(page_size)
        raise ValueError(
            f"the cache needs {need} bytes of virtual address space ({config.max_batch_size} reqids x "
            f"{per_request} bytes each: {config.num_buffers} buffers x max_context_len {config.max_context_len} "
            f"tokens x {config.token_bytes_per_buffer} bytes, in {page_size}-byte pages), more than "
            f"{defaults.max_reservation_why} ({defaults.max_reservation} bytes): "
            f"lower max_batch_size or max_context_len"
        )
