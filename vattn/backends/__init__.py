"""VMM backends: the registry (one entry per backend), the built-in ones
(host, cuda, cuda_uvm), and resolving one for a cache (page size, budget).

To add a backend: one C++ file in ``csrc/backends/`` that implements
``VmmBackend`` and registers its factory and probes (``VATTN_REGISTER_BACKEND``;
Python asks a probe by name: ``vattn._C.backend_probe(backend, probe, **args)``),
and one :func:`register_backend` call naming it, its device pattern, defaults and
description (a module here imported below, or the caller's own code).
"""

from __future__ import annotations

from .registry import (
    MAX_DEVICE_INDEX,
    MAX_RESERVATION_BYTES,
    Backend,
    BackendDefaults,
    BackendSpec,
    backend_names,
    default_backend,
    get_backend,
    native_factory,
    parse_device,
    register_backend,
    registered_backends,
    torch_device,
    unregister_backend,
)

# The built-in backends, in this order: the first of a device type is its default.
from .host import HOST_BUDGET_FRACTION, HOST_DEFAULT_PAGE_SIZE, host_granularity, host_meminfo  # registers "host"
from .cuda import (  # registers "cuda", then "cuda_uvm"
    CUDA_BUDGET_FRACTION,
    CUDA_UVM_DEFAULT_PAGE_SIZE,
    UVM_PAGE_SIZES,
    UVM_PATCH_README,
    cuda_driver_path,
    cuda_info,
    uvm_patch_available,
    uvm_patch_info,
)
from .resolve import pool_pages, resolve_backend

__all__ = [
    "Backend",
    "BackendDefaults",
    "BackendSpec",
    "CUDA_BUDGET_FRACTION",
    "CUDA_UVM_DEFAULT_PAGE_SIZE",
    "HOST_BUDGET_FRACTION",
    "HOST_DEFAULT_PAGE_SIZE",
    "MAX_DEVICE_INDEX",
    "MAX_RESERVATION_BYTES",
    "UVM_PAGE_SIZES",
    "UVM_PATCH_README",
    "backend_names",
    "cuda_driver_path",
    "cuda_info",
    "default_backend",
    "get_backend",
    "host_granularity",
    "host_meminfo",
    "native_factory",
    "parse_device",
    "pool_pages",
    "register_backend",
    "registered_backends",
    "resolve_backend",
    "torch_device",
    "unregister_backend",
    "uvm_patch_available",
    "uvm_patch_info",
]
