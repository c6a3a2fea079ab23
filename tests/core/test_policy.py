"""The policy knobs: described once in the core (csrc/core/policy_knobs.h),
every one reaches the core from Python by name and reads back, a bad value
names its knob and range and changes nothing, and no other file lists them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import vattn
from vattn import _C
from vattn.backends import get_backend, register_backend, unregister_backend
from vattn.core.policy import DERIVED, KNOBS

ROOT = Path(__file__).resolve().parents[2]
L = 64  # max_context_len of the caches here
KNOB_NAMES = [knob["name"] for knob in _C.POLICY_KNOBS]
KEYWORD_KNOBS = ["background", "deferred_reclaim", "eager", "lookahead_tokens", "eager_tokens", "reclaim_threshold"]


def make(**overrides) -> vattn.KVCacheManager:
    args = dict(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, max_batch_size=2,
                max_context_len=L, page_size=4096)
    return vattn.KVCacheManager(**{**args, **overrides})


def other_value(knob: dict) -> object:
    """A valid value of ``knob`` other than its default."""
    return {"bool": not knob["default"], "tokens": 7, "fraction": 0.25, "count": 5}[knob["range"]]


@pytest.mark.parametrize("knob", _C.POLICY_KNOBS, ids=KNOB_NAMES)
def test_every_knob_round_trips_from_python_to_the_core_and_back(knob):
    name, value = knob["name"], other_value(knob)
    config = _C.PolicyConfig(**{name: value})
    assert getattr(config, name) == value and config.as_dict() == {**_C.PolicyConfig().as_dict(), name: value}
    with make(policy={name: value}) as kv:  # the manager's defaults: background and eager on
        assert kv.policy[name] == value and type(kv.policy[name]).__name__ == knob["type"]
        assert kv._pages.policy == _C.PolicyConfig(**kv.policy)


def test_the_manager_logic_between_knobs():
    with pytest.warns(DeprecationWarning), make(lookahead_tokens=3, policy={"lookahead_tokens": 5}) as kv:
        assert kv.policy == dict(background=True, deferred_reclaim=True, eager=True, lookahead_tokens=5,
                                 eager_tokens=L, reclaim_threshold=0.1, max_round_ids=1024 // 2)
    with make(num_layers=600, max_context_len=2048, policy=vattn.Policy(background=False)) as kv:  # 1200 buffers
        assert (kv.policy["max_round_ids"], kv.policy["eager_tokens"]) == (1, 1024)
    with make(policy={"background": False, "max_round_ids": 9}) as kv:
        assert (kv.policy["background"], kv.policy["eager"], kv.policy["max_round_ids"]) == (False, False, 9)
    with make(page_allocator="external", policy={"background": True}) as kv:
        assert (kv.policy["background"], kv.policy["eager"]) == (False, False)


def bad_values(knob: dict, max_context_len: int | None = L) -> list[tuple[object, type, str]]:
    """(value, exception, message) for ``knob``: a value of another type, then
    ones out of its range (the token bound only with a ``max_context_len``)."""
    name = knob["name"]
    wrong_type = {"bool": (1, "a bool"), "float": ("0.5", r"a number \(int or float\)"), "int": (0.5, "an int")}
    value, what = wrong_type[knob["type"]]
    out = [(value, TypeError, f"{name} must be {what}, got {type(value).__name__}")]
    if knob["range"] == "tokens":
        out.append((-1, ValueError, rf"{name} must be in \[0, max_context_len\] \(tokens\), got -1"))
        if max_context_len is not None:
            out.append((max_context_len + 1, ValueError,
                        rf"{name} must be in \[0, {max_context_len}\] \(max_context_len\), got {max_context_len + 1}"))
    elif knob["range"] == "fraction":
        out += [(1.5, ValueError, rf"{name} must be in \[0, 1\], got 1.5"),
                (float("nan"), ValueError, rf"{name} must be in \[0, 1\], got nan")]
    elif knob["range"] == "count":
        out += [(0, ValueError, rf"{name} must be in \[1, 4294967295\], got 0"),
                (2**32, ValueError, rf"{name} must be in \[1, 4294967295\], got 4294967296")]
    return out


@pytest.fixture
def counted_backend():
    """The host backend, counting the backends built: a manager refused before it builds one counts none."""
    host, built = get_backend("host"), []
    register_backend("host_counted", device="cpu",
                     factory=lambda spec: built.append(spec) or host.factory(dataclasses.replace(spec, name="host")),
                     defaults=host.defaults, description="the host backend, counting the backends built")
    try:
        yield built
    finally:
        unregister_backend("host_counted")


@pytest.mark.parametrize("knob", _C.POLICY_KNOBS, ids=KNOB_NAMES)
def test_a_bad_value_names_its_knob_and_range_and_changes_nothing(knob, counted_backend):
    name = knob["name"]
    for value, exc, message in bad_values(knob):
        with pytest.raises(exc, match=message):
            make(backend="host_counted", policy={name: value})
        if name in KEYWORD_KNOBS:  # the deprecated keyword argument takes the same path
            with pytest.raises(exc, match=message), pytest.warns(DeprecationWarning):
                make(backend="host_counted", **{name: value})
        config = _C.PolicyConfig(**{name: value}) if exc is ValueError and value == L + 1 else None
        if config is not None:  # a token count is bounded once the requests' length is known
            with pytest.raises(exc, match=message):
                config.validate(L)
    config = _C.PolicyConfig()
    for value, exc, message in bad_values(knob, max_context_len=None):
        with pytest.raises(exc, match=message):
            setattr(config, name, value)
        assert config == _C.PolicyConfig()  # a refused value changes nothing
    assert counted_backend == []  # no manager got as far as building a backend
    with make(backend="host_counted") as kv:
        assert kv.stats()["backend"] == "host_counted" and len(counted_backend) == 1


def test_an_unknown_knob_or_a_policy_that_is_no_mapping_is_refused():
    with pytest.raises(TypeError, match=r"no policy knob is named 'lookahead' \(knobs: background, deferred_"):
        make(policy={"lookahead": 4})
    with pytest.raises(TypeError, match="policy must be a vattn.Policy or a mapping of knob names to values, got list"):
        make(policy=[("eager", False)])
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_round_ids'"):  # never a keyword
        make(max_round_ids=4)


@pytest.mark.parametrize("name", KEYWORD_KNOBS)
def test_a_knob_keyword_is_a_deprecated_alias_of_policy(name):
    """The keyword still sets the knob, warns naming its replacement, and a
    knob named in policy wins over it."""
    value = other_value(KNOBS[name])
    with pytest.warns(DeprecationWarning, match=rf"KVCacheManager\({name}=...\) is deprecated; "
                                                rf"use policy=vattn.Policy\({name}=...\)") as warned:
        kv = make(**{name: value})
    assert warned[0].filename == __file__  # points at the caller
    with kv:
        assert kv.policy[name] == value
    with pytest.warns(DeprecationWarning), make(**{name: value}, policy={name: KNOBS[name]["default"] or 3}) as kv:
        assert kv.policy[name] == (KNOBS[name]["default"] or 3)
    # a vattn.Policy beside it: its fields off their default are named (they win), the others are not (the
    # keyword had been dropped whenever a Policy came with it)
    other = "max_round_ids"  # never a keyword
    with pytest.warns(DeprecationWarning), make(**{name: value},
                                                policy=vattn.Policy(**{other: other_value(KNOBS[other])})) as kv:
        assert kv.policy[name] == value and kv.policy[other] == other_value(KNOBS[other])
    with pytest.warns(DeprecationWarning), make(**{name: value}, policy=vattn.Policy(**{name: value})) as kv:
        assert kv.policy[name] == value


def test_every_knob_has_one_default_through_every_path():
    """The core's PolicyConfig(), vattn.Policy and a manager built with
    nothing agree on every knob; the two knobs whose default follows the
    cache are None in Policy and follow their rule in the manager."""
    core = _C.PolicyConfig().as_dict()
    policy = dataclasses.asdict(vattn.Policy())
    assert list(policy) == KNOB_NAMES
    with make() as kv, make(policy=vattn.Policy()) as same, make(policy={}) as empty:
        assert kv.policy == same.policy == empty.policy
        for name in KNOB_NAMES:
            if name in DERIVED:
                assert policy[name] is None
                assert kv.policy[name] == DERIVED[name][1](L, kv.config.num_buffers)
            else:
                assert policy[name] == core[name] == KNOBS[name]["default"] == kv.policy[name], name
    assert (kv.policy["eager_tokens"], kv.policy["max_round_ids"]) == (L, 1024 // 2)


def test_policy_is_generated_from_the_cores_knob_list():
    fields = {f.name: f for f in dataclasses.fields(vattn.Policy)}
    assert list(fields) == KNOB_NAMES
    for name, knob in KNOBS.items():
        assert f"    {name} ({knob['type']}, {knob['accepts']}; default " in vattn.Policy.__doc__
        assert knob["doc"] in vattn.Policy.__doc__
    p = vattn.Policy(lookahead_tokens=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.eager = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        vattn.Policy(16)  # keywords only: a knob is named where it is set
    with make(policy=p) as kv:
        assert kv.policy["lookahead_tokens"] == 16 and kv.policy["background"] is True


def test_a_knob_is_described_in_one_place():
    """The knob list of csrc/core/policy_knobs.h is the only one: the struct,
    the bindings, POLICY_KNOBS, the manager's policy and vattn.core.policy.KNOBS
    follow it, and the bindings and the argument checks name no knob. A new
    knob is one entry there, plus the logic that reads it."""
    entries = re.findall(r"X\((?:bool|size_t|double), (\w+),", (ROOT / "csrc/core/policy_knobs.h").read_text())
    assert entries == KNOB_NAMES == list(_C.PolicyConfig().as_dict()) == list(KNOBS)
    with make() as kv:
        assert list(kv.policy) == entries
    assert all(set(k) == {"name", "type", "range", "accepts", "default", "doc"} and k["doc"] for k in KNOBS.values())

    def named(path: Path) -> set[str]:
        """Knobs the code of ``path`` names: as a string, an attribute or a keyword (not in prose)."""
        text = path.read_text()
        return {n for n in entries if re.search(rf"[\"'.]{n}\b|\b{n}\s*=(?!=)", text)}

    for path in [*(ROOT / "csrc/python").glob("*.*"), ROOT / "vattn/common/argument_checks.py"]:
        assert named(path) == set(), f"{path.relative_to(ROOT)} names a knob"
    assert named(ROOT / "vattn/core/manager.py") == set(KEYWORD_KNOBS)  # only its documented keyword arguments
