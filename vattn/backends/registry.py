"""The backend registry: one entry per VMM backend, read by every place that
needs to know the backends (device strings, argument checks, defaults,
``python -m vattn info``).

A backend is one C++ file in ``csrc/backends/`` that registers its factory
and its probes by name (``VATTN_REGISTER_BACKEND``; built by
:func:`native_factory`, probed with ``vattn._C.backend_probe``), plus one
:func:`register_backend` call here or in the caller's own code. The first
backend registered for a device type is that device's default.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vattn import _C

MAX_DEVICE_INDEX = 2**31 - 1  # device ordinals are C ints
# Address space a cache may reserve: x86-64 and arm64 user space is 128 TiB
# (47 bits) with 4-level page tables; half of it leaves room for everything else.
MAX_RESERVATION_BYTES = 2**46


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend resolved for one cache: what :meth:`make` builds."""

    name: str  # registry name
    device_index: int  # the device of its type ("cuda:1" -> 1; 0 for "cpu")
    granularity: int  # bytes; page sizes are multiples of it
    page_size: int  # bytes per physical page
    num_pages: int  # physical pool capacity in pages
    driver_path: str | None = None  # the driver library the backend loads, if any
    # What the defaults' query kept for this backend (BackendDefaults.release):
    # given back once make() has built it, or failed to.
    release: Callable[[], None] | None = dataclasses.field(default=None, compare=False, repr=False)

    def make(self) -> Any:
        """The C++ ``VmmBackend`` (a ``vattn._C.VmmBackend``) from the registry's factory."""
        try:
            return get_backend(self.name).factory(self)
        finally:
            if self.release is not None:
                self.release()


@dataclasses.dataclass(frozen=True)
class BackendDefaults:
    """What a backend offers on one device, found before anything is built."""

    granularity: int  # bytes: page sizes are positive multiples of it
    page_size: int  # bytes: the page size when the caller names none
    budget: int  # bytes of physical memory the pool may take when physical_memory is None
    page_sizes: tuple[int, ...] | None = None  # the only page sizes served; None: any multiple of granularity
    max_reservation: int = MAX_RESERVATION_BYTES  # bytes of address space one cache may reserve
    max_reservation_why: str = "the address space vattn reserves at most"  # names the limit in errors
    driver_path: str | None = None  # the driver library the factory loads, if any
    handover: str | None = None  # automatic choice only: another backend of the device serves this page size
    # Gives back what the query kept for the backend built next (a CUDA primary
    # context); called by resolve_backend when it fails after the query, and by
    # the factory after the build. None: nothing kept.
    release: Callable[[], None] | None = None


# (device_index, page_size or None, automatic) -> defaults. ``automatic``: the
# caller named no backend, so a device's default may hand over to another.
DefaultsFn = Callable[[int, "int | None", bool], BackendDefaults]
FactoryFn = Callable[[BackendSpec], Any]
InfoFn = Callable[[Mapping[str, dict[str, Any]]], dict[str, Any]]
RenderFn = Callable[[dict[str, Any]], list[str]]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registry entry (see :func:`register_backend`)."""

    name: str
    device: str  # the device pattern it serves: "cpu" (one device) or "cuda[:i]" (indexed)
    factory: FactoryFn
    defaults: DefaultsFn
    description: str
    info: InfoFn | None = None
    render: RenderFn | None = None

    @property
    def device_type(self) -> str:
        """The torch device type: "cpu", "cuda"."""
        return self.device.removesuffix("[:i]")

    @property
    def indexed(self) -> bool:
        """Whether the device type has several devices ("cuda:i")."""
        return self.device.endswith("[:i]")


_lock = threading.Lock()
_backends: dict[str, Backend] = {}  # in registration order


def register_backend(
    name: str,
    *,
    device: str,
    factory: FactoryFn,
    defaults: DefaultsFn,
    description: str,
    info: InfoFn | None = None,
    render: RenderFn | None = None,
    replace: bool = False,
) -> Backend:
    """Adds a VMM backend that ``KVCacheManager(backend=name)`` can use.

    Args:
        name: the name callers pass as ``backend=``; letters, digits and ``_``.
        device: the devices it serves: ``"cpu"`` (one device) or a torch
            device type with ``"[:i]"`` for indexed devices (``"cuda[:i]"``:
            ``"cuda"`` and ``"cuda:<index>"``). Every backend of one device
            type must agree on the pattern. The first backend registered for
            a type is the default for that device.
        factory: builds the C++ backend (a ``vattn._C.VmmBackend``) for a
            resolved :class:`BackendSpec`. A backend whose C++ file registers
            its factory under ``name`` uses :func:`native_factory`.
        defaults: ``(device_index, page_size, automatic) -> BackendDefaults``:
            granularity, default page size (bytes), physical budget (bytes)
            and the sizes served on that device; it queries the device and
            raises :class:`vattn.BackendUnavailable` when the backend cannot
            run there. ``page_size`` is the caller's (bytes) or None;
            ``automatic`` is True when the caller named no backend.
        description: one line for ``python -m vattn info``.
        info: ``python -m vattn info``'s facts about the backend (a
            JSON-able dict), given those of the backends registered before;
            None: ``{"description": description}``.
        render: those facts as lines of text; None: one line with the description.
        replace: replace an entry of the same name instead of refusing it.

    Returns the entry. Raises ValueError for a taken name (unless
    ``replace``) or a bad pattern, TypeError for a callable that is not one.

    Example (the host backend with failures injected, as the tests use it)::

        from vattn import _testing
        plan = _testing.FaultPlan()
        vattn.backends.register_backend(
            "host_faulty", device="cpu",
            factory=lambda spec: _testing.make_faulty_host_backend(spec.page_size, spec.num_pages, plan),
            defaults=vattn.backends.get_backend("host").defaults,
            description="the host backend, failing the calls a FaultPlan names")
        kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=64, backend="host_faulty")
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"name must be letters, digits and '_' (not first a digit), got {name!r}")
    if not isinstance(device, str) or not re.fullmatch(r"[a-z][a-z0-9_]*(\[:i\])?", device):
        raise ValueError(
            f"device must be a device type, optionally with '[:i]' (e.g. 'cpu', 'cuda[:i]'), got {device!r}")
    for arg, fn in (("factory", factory), ("defaults", defaults), ("info", info), ("render", render)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{arg} must be callable, got {type(fn).__name__}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError("description must be a non-empty string")
    entry = Backend(name, device, factory, defaults, description.strip(), info, render)
    try:
        torch.device(entry.device_type)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device {device!r}: torch knows no device type {entry.device_type!r} ({e})") from None
    with _lock:
        if name in _backends and not replace:
            raise ValueError(f"a backend named {name!r} is registered already (pass replace=True to replace it)")
        for other in _backends.values():
            if other.name != name and other.device_type == entry.device_type and other.device != device:
                raise ValueError(f"device {device!r} disagrees with backend {other.name!r}, which serves "
                                 f"{other.device!r}: one device type has one pattern")
        _backends[name] = entry
    return entry


def unregister_backend(name: str) -> None:
    """Removes the backend registered as ``name`` (ValueError when none is)."""
    with _lock:
        if _backends.pop(name, None) is None:
            raise ValueError(f"no backend is registered as {name!r}")


def get_backend(name: str) -> Backend:
    """The entry registered as ``name`` (ValueError naming the registered ones)."""
    entry = _backends.get(name)
    if entry is None:
        raise ValueError(f"no backend is registered as {name!r} (registered: {', '.join(backend_names())})")
    return entry


def backend_names() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    return tuple(_backends)


def registered_backends() -> tuple[Backend, ...]:
    """Every entry, in registration order."""
    return tuple(_backends.values())


def default_backend(device_type: str) -> Backend:
    """The backend a device of ``device_type`` gets when none is named."""
    for entry in registered_backends():
        if entry.device_type == device_type:
            return entry
    raise ValueError(f"no backend serves device type {device_type!r}")


def native_factory(spec: BackendSpec) -> Any:
    """The C++ backend registered under ``spec.name`` in ``csrc/backends``
    (``VATTN_REGISTER_BACKEND``), built through ``vattn._C.make_backend``."""
    return _C.make_backend(spec.name, spec.device_index, spec.page_size, spec.num_pages, spec.driver_path or "")


# ---- devices ------------------------------------------------------------------


def _device_types() -> dict[str, bool]:
    """Device type -> indexed, in registration order."""
    out: dict[str, bool] = {}
    for entry in registered_backends():
        out.setdefault(entry.device_type, entry.indexed)
    return out


def parse_device(device: str | torch.device) -> tuple[str, int]:
    """``"cpu"`` / ``"cpu:0"`` -> ("cpu", 0); ``"cuda:i"`` -> ("cuda", i);
    ``"cuda"`` -> ("cuda", torch's current CUDA device), as torch reads a
    device without an index: the device type and index, for every device
    type a backend serves.

    Accepts the strings and ``torch.device`` objects torch accepts for these.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    types = _device_types()
    match = re.fullmatch(r"([a-z][a-z0-9_]*)(?::(\d+))?", str(device))
    if not match or match.group(1) not in types:
        choices = [f"'{t}{alt}'" for t, indexed in types.items() for alt in (("", ":<index>") if indexed else ("",))]
        listed = choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ValueError(f"device must be {listed}, got {device!r}")
    device_type = match.group(1)
    if match.group(2) is not None:
        index = int(match.group(2))
    else:  # torch's current device of an indexed type
        index = current_index(device_type) if types[device_type] else 0
    if not types[device_type]:
        if index != 0:
            raise ValueError(f"the {default_backend(device_type).name} backend has one device, '{device_type}' "
                             f"(= '{device_type}:0'), got {device!r}")
        return device_type, 0
    if index > MAX_DEVICE_INDEX:
        raise ValueError(f"device index must be in [0, {MAX_DEVICE_INDEX}], got {index}")
    return device_type, index


def current_index(device_type: str) -> int:
    """The device of ``device_type`` torch uses when none is named (its
    current device: ``torch.cuda.current_device()``), or 0 where torch has
    no such devices."""
    try:
        module = torch.get_device_module(device_type)
    except (AttributeError, RuntimeError, ValueError):
        return 0
    if not (hasattr(module, "current_device") and getattr(module, "is_available", lambda: False)()):
        return 0
    index = module.current_device()
    return index if isinstance(index, int) else 0


def torch_device(device_type: str, index: int) -> torch.device:
    """The torch device of a parsed device: ``cpu`` has no index, indexed types have one."""
    return torch.device(device_type, index) if _device_types().get(device_type) else torch.device(device_type)
