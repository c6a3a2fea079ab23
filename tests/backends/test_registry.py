"""The backend registry: every place that lists backends reads it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import vattn
import vattn.info
from vattn import _C
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


def make(**overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_batch_size=4,
                max_context_len=512, page_size=PAGE, background=False)
    args.update(overrides)
    return vattn.KVCacheManager(**args)


def test_the_built_in_backends_and_their_devices():
    assert backend_names()[:3] == ("host", "cuda", "cuda_uvm")
    assert default_backend("cpu").name == "host" and default_backend("cuda").name == "cuda"
    assert [get_backend(n).device for n in ("host", "cuda", "cuda_uvm")] == ["cpu", "cuda[:i]", "cuda[:i]"]
    for name in ("host", "cuda", "cuda_uvm"):  # each is one C++ file that registered its factory
        assert get_backend(name).factory is native_factory and name in _C.backend_factories()
    with pytest.raises(ValueError, match=r"no C\+\+ backend is registered as 'rocm' \(registered: cuda, cuda_uvm, "):
        _C.make_backend("rocm", 0, PAGE, 4)


def test_a_backend_registered_from_a_test_serves_a_manager_and_shows_in_info():
    register_backend("host_again", device="cpu", defaults=get_backend("host").defaults,
                     factory=lambda spec: native_factory(dataclasses.replace(spec, name="host")),
                     description="the host backend under a second name")
    try:
        with make(backend="host_again") as kv:
            assert kv.stats()["backend"] == "host_again" and kv.device == torch.device("cpu")
            r = kv.alloc_reqid()
            assert kv.step([100 if i == r else 0 for i in range(4)])
        info = vattn.info.collect()
        assert info["backends"]["host_again"] == {"description": "the host backend under a second name"}
        assert "backend host_again: the host backend under a second name" in vattn.info.render(info)
        assert json.loads(json.dumps(info)) == info
        with pytest.raises(ValueError, match="backend 'host_again' does not serve device cuda"):
            make(backend="host_again", device="cuda")
    finally:
        unregister_backend("host_again")
    assert "host_again" not in backend_names() and "host_again" not in vattn.info.collect()["backends"]
    with pytest.raises(ValueError, match=r"backend must be one of \('host', 'cuda', 'cuda_uvm'\) or None"):
        make(backend="host_again")


def test_device_patterns_come_from_the_registry():
    assert parse_device("cpu") == ("cpu", 0) and parse_device(torch.device("cuda", 3)) == ("cuda", 3)
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
