"""The backend registry: every place that lists backends reads it, and a backend
added from outside the library (here, the fault-injecting test doubles of
vattn._testing) works everywhere a built-in one does."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import vattn
import vattn.cli.info
from conftest import assert_invariants, assert_table_is_real, load_setup
from host_faults import FAULTY_HOST, faulty_host_backend
from vattn import _C, _testing
from vattn.backends import (
    backend_names,
    default_backend,
    get_backend,
    native_factory,
    parse_device,
    register_backend,
    unregister_backend,
)

PAGE = 4096


def make(policy: dict | None = None, **overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                max_context_len=512, page_size=PAGE)
    args.update(overrides)
    return vattn.KVCacheManager(**args, policy={"background": False, **(policy or {})})


def test_the_built_in_backends_and_their_devices():
    assert backend_names()[:3] == ("host", "cuda", "cuda_uvm")
    assert default_backend("cpu").name == "host" and default_backend("cuda").name == "cuda"
    assert [get_backend(n).device for n in ("host", "cuda", "cuda_uvm")] == ["cpu", "cuda[:i]", "cuda[:i]"]
    for name in ("host", "cuda", "cuda_uvm"):  # each is one C++ file that registered its factory
        assert get_backend(name).factory is native_factory and name in _C.backend_factories()
    with pytest.raises(ValueError, match=r"no C\+\+ backend is registered as 'rocm' \(registered: cuda, cuda_uvm, "):
        _C.make_backend("rocm", 0, PAGE, 4)


def test_a_backend_registered_from_a_test_serves_a_manager_and_shows_in_info():
    with faulty_host_backend() as faults:
        assert FAULTY_HOST in backend_names()
        with make(backend=FAULTY_HOST) as kv:
            assert kv.stats()["backend"] == FAULTY_HOST and kv.device == torch.device("cpu")
            r = kv.alloc_reqid()
            assert kv.step([100 if i == r else 0 for i in range(4)])
            faults.fail("map")  # the registered factory built it: the plan reaches its calls
            with pytest.raises(vattn.DriverError, match=r"map \(injected\) failed: errno 12"):
                kv.step([300 if i == r else 0 for i in range(4)])
            assert_table_is_real(kv)
            assert_invariants(kv)
        info = vattn.cli.info.collect()
        assert info["backends"][FAULTY_HOST] == {"description": get_backend(FAULTY_HOST).description}
        assert f"backend {FAULTY_HOST}: the host backend, failing" in vattn.cli.info.render(info)
        assert json.loads(json.dumps(info)) == info
        with pytest.raises(ValueError, match=f"backend '{FAULTY_HOST}' does not serve device cuda"):
            make(backend=FAULTY_HOST, device="cuda")
    assert FAULTY_HOST not in backend_names() and FAULTY_HOST not in vattn.cli.info.collect()["backends"]
    with pytest.raises(ValueError, match=r"backend must be one of \('host', 'cuda', 'cuda_uvm'\) or None"):
        make(backend=FAULTY_HOST)


def test_the_decorator_wraps_any_backend_and_fails_part_way_through_a_batch():
    plan = _testing.FaultPlan()
    register_backend("host_wrapped", device="cpu", defaults=get_backend("host").defaults,
                     factory=lambda spec: _testing.fault_injecting_backend(
                         native_factory(dataclasses.replace(spec, name="host")), plan),
                     description="the native host backend inside the fault-injecting decorator")
    try:
        with make(backend="host_wrapped", policy={"deferred_reclaim": False}) as kv:
            a, b = kv.alloc_reqid(), kv.alloc_reqid()
            plan.fail("map", skip=1)  # the second run of the batch: the first stays mapped
            with pytest.raises(vattn.DriverError, match=r"map \(injected\)"):
                kv.step([64 if i in (a, b) else 0 for i in range(4)])
            assert_table_is_real(kv)
            assert_invariants(kv)
            plan.fail("create_pages", skip=2, errno=errno.ENOSPC)  # the third page of a creation
            with pytest.raises(vattn.DriverError, match=r"create_pages \(injected\) failed: errno 28"):
                kv.step([200 if i == a else 0 for i in range(4)])
            assert_table_is_real(kv)
            assert_invariants(kv)
            assert kv.step([200 if i in (a, b) else 0 for i in range(4)])  # the plan fired once each
            plan.fail("unmap", skip=1)
            with pytest.raises(vattn.DriverError, match=r"unmap \(injected\)"):
                kv.free_reqid(b)
            assert_table_is_real(kv)
            assert kv.stats()["pages_orphaned"] > 0
            kv.reclaim()  # retries the orphans
            assert kv.stats()["pages_orphaned"] == 0
            assert_table_is_real(kv)
        with pytest.raises(ValueError, match="call must be one of reserve, free_reservation"):
            plan.fail("mmap_map")
    finally:
        unregister_backend("host_wrapped")


def test_the_decorator_around_the_cuda_backend_releases_what_a_failed_creation_made(fake_cuda):
    plan = _testing.FaultPlan()
    register_backend("cuda_faulty", device="cuda[:i]", defaults=get_backend("cuda").defaults,
                     factory=lambda spec: _testing.fault_injecting_backend(
                         native_factory(dataclasses.replace(spec, name="cuda")), plan),
                     description="the cuda backend inside the fault-injecting decorator")
    try:
        with make(backend="cuda_faulty", device="cuda", page_size=2 << 20, num_kv_heads=8, head_dim=128,
                  max_context_len=4096) as kv:
            r = kv.alloc_reqid()
            plan.fail("create_pages", skip=3)  # 4 buffers x 2 pages: fails part-way
            with pytest.raises(vattn.DriverError, match="create_pages"):
                kv.step([1000 if i == r else 0 for i in range(4)])
            assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles
            assert_table_is_real(kv, fake_cuda)
            assert kv.step([1000 if i == r else 0 for i in range(4)])
    finally:
        unregister_backend("cuda_faulty")
    assert fake_cuda.fake_cuda_live_handles() == fake_cuda.baseline_handles


def test_device_patterns_come_from_the_registry():
    assert parse_device("cpu") == ("cpu", 0) and parse_device(torch.device("cuda", 3)) == ("cuda", 3)
    assert parse_device("cuda") == ("cuda", 0)  # no CUDA in this torch: device 0
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:<index>', got 'xpu:1'"):
        parse_device("xpu:1")
    register_backend("host_as_xpu", device="xpu[:i]", defaults=get_backend("host").defaults,
                     factory=native_factory, description="a second device type")
    try:
        assert parse_device("xpu:1") == ("xpu", 1)
        with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda', 'cuda:<index>', 'xpu' or 'xpu:<index>'"):
            parse_device("tpu")
        with pytest.raises(ValueError, match="one device type has one pattern"):
            register_backend("xpu_single", device="xpu", defaults=get_backend("host").defaults,
                             factory=native_factory, description="disagrees")
    finally:
        unregister_backend("host_as_xpu")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:<index>'"):
        parse_device("xpu:1")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(name="host"), ValueError, r"a backend named 'host' is registered already"),
        (dict(name="2fast"), ValueError, r"name must be letters, digits and '_'"),
        (dict(device="cuda:0"), ValueError, r"device must be a device type, optionally with '\[:i\]'"),
        (dict(device="nope"), ValueError, r"torch knows no device type 'nope'"),
        (dict(factory="host"), TypeError, r"factory must be callable, got str"),
        (dict(description=" "), ValueError, r"description must be a non-empty string"),
    ],
)
def test_bad_registrations_are_refused_and_change_nothing(kwargs, exc, match):
    before = backend_names()
    args = dict(name="new_backend", device="cpu", factory=native_factory, defaults=get_backend("host").defaults,
                description="a backend")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        register_backend(**args)
    assert backend_names() == before
    with pytest.raises(ValueError, match="no backend is registered as 'new_backend'"):
        unregister_backend("new_backend")


def test_replace_swaps_an_entry_in_place():
    register_backend("swap_me", device="cpu", factory=native_factory, defaults=get_backend("host").defaults,
                     description="first")
    try:
        register_backend("swap_me", device="cpu", factory=native_factory, defaults=get_backend("host").defaults,
                         description="second", replace=True)
        assert get_backend("swap_me").description == "second"
        assert backend_names().count("swap_me") == 1
    finally:
        unregister_backend("swap_me")


def test_a_device_without_an_index_is_torchs_current_one(monkeypatch):
    """``device="cuda"`` is the device torch would use (``torch.cuda.current_device()``), as
    ``torch.device("cuda")`` is for torch, not ordinal 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert parse_device("cuda") == ("cuda", 2) and parse_device(torch.device("cuda")) == ("cuda", 2)
    assert parse_device("cuda:0") == ("cuda", 0) and parse_device("cpu") == ("cpu", 0)


# ---- probes: registered with their backend, answered through one generic binding ----------


ROOT = Path(__file__).resolve().parents[2]
BINDINGS = ROOT / "csrc" / "python" / "bindings.cpp"


def test_each_backend_registers_its_probes_with_itself():
    probes = _C.backend_probes()
    assert {name: sorted(p) for name, p in probes.items() if name in ("host", "cuda", "cuda_uvm")} == {
        "host": ["granularity"], "cuda": ["device_info", "driver_path", "release_context"],
        "cuda_uvm": ["abi", "patch_info"]}
    assert probes["cuda"]["device_info"]["args"] == ["driver_path", "device", "keep_context"]
    assert all(p["doc"] for backend in probes.values() for p in backend.values())
    assert _C.backend_probe("host", "granularity") == {"granularity": os.sysconf("SC_PAGE_SIZE")}
    assert vattn.backends.host_granularity() == os.sysconf("SC_PAGE_SIZE")
    abi = _C.backend_probe("cuda_uvm", "abi")
    assert abi["page_sizes"] == [64 * 1024, 128 * 1024, 256 * 1024, 2 << 20] and abi["abi_version"] >= 1
    assert _C.backend_probe("cuda", "driver_path")["driver_path"] == vattn.backends.cuda_driver_path()


def test_a_probe_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match=r"no C\+\+ backend is registered as 'rocm' \(registered: cuda, "):
        _C.backend_probe("rocm", "granularity")
    with pytest.raises(ValueError, match=r"backend 'host' has no probe 'device_info' \(its probes: granularity\)"):
        _C.backend_probe("host", "device_info")
    with pytest.raises(ValueError, match=r"host.granularity takes no argument 'device' \(its arguments: none\)"):
        _C.backend_probe("host", "granularity", device=0)
    with pytest.raises(ValueError, match=r"cuda.device_info: device must be an int"):
        _C.backend_probe("cuda", "device_info", device="0")
    with pytest.raises(ValueError, match=r"cuda.device_info: device must be in \[0, 2147483647\], got -1"):
        _C.backend_probe("cuda", "device_info", device=-1)
    with pytest.raises(TypeError, match=r"cuda.device_info: device must be a bool, int, float, str or a sequence"):
        _C.backend_probe("cuda", "device_info", device=None)


def test_a_backend_and_its_probes_are_one_file_even_outside_the_library():
    """vattn._testing registers testing_host (csrc/testing/registered_backend.cpp):
    the bindings build it and answer its probe although no line of them names it,
    and it is in the one registry of the process, the one vattn._C lists."""
    assert "testing_host" in _C.backend_factories() and "echo" in _C.backend_probes()["testing_host"]
    backend = _C.make_backend("testing_host", 0, PAGE, 4)
    assert (backend.name, backend.page_size, backend.num_pages) == ("host", PAGE, 4)
    args = dict(flag=True, count=-3, ratio=0.5, text="x", values=[1, 2, 2**40])
    assert _C.backend_probe("testing_host", "echo", **args) == {**args, "registered_by": "vattn._testing"}
    assert _C.backend_probe("testing_host", "echo", values=np.arange(3)) == {"values": [0, 1, 2],
                                                                            "registered_by": "vattn._testing"}
    with pytest.raises(ValueError, match=r"testing_host.echo: count is beyond int64"):
        _C.backend_probe("testing_host", "echo", count=2**63)
    source = BINDINGS.read_text()
    assert "testing_host" not in source and "echo" not in source
    # the bindings include no backend and name none: every backend is reached through the registry
    includes = re.findall(r'#include "backends/(\w+)\.h"', source)
    assert sorted(includes) == ["backend_registry", "vmm_backend"]
    assert not re.search(r"\b(host|cuda|cuda_uvm|uvm)_\w+\(|\bcu::", source)


def test_the_test_module_links_the_library_instead_of_copying_it():
    """One library per process: vattn._C and vattn._testing compile only their
    bindings and link libvattn.so, which the process maps once."""
    setup = load_setup()
    assert not hasattr(setup, "TESTING_LIBRARY_SOURCES")
    assert all(s.startswith("csrc/testing/") for s in setup.testing.sources)
    assert all(s.startswith("csrc/python/") for s in setup.ext.sources)
    assert {"vattn"} <= set(setup.testing.libraries) and {"vattn"} <= set(setup.ext.libraries)
    assert all(not s.startswith(("csrc/python/", "csrc/testing/")) for s in setup.library.sources)
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if line.rstrip().endswith("/libvattn.so")}
    assert len(libraries) == 1 and Path(next(iter(libraries))).parent == Path(vattn.__file__).parent
