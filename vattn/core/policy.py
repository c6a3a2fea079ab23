"""The page manager's policy knobs, as :class:`~vattn.KVCacheManager` takes them.

The knobs are described once, in the core (``csrc/core/policy_knobs.h``):
each one's type, default, accepted range and doc reach Python as
``vattn._C.POLICY_KNOBS``, and ``vattn._C.PolicyConfig`` checks a value's
type and range when it is set. :class:`Policy` is generated from that list
(fields, defaults, docstring); this module adds only what depends on the
cache (token knobs are bounded by ``max_context_len``, two defaults follow
the cache's shape) and the manager's logic between knobs, so a new knob needs
no line here unless it brings logic of its own (docs/design.md section 3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from vattn import _C
from vattn.common.deprecation import warn_deprecated, warn_renamed

# name -> {name, type ("bool", "int", "float"), range ("bool", "tokens",
# "fraction", "count"), accepts (the range in words), default (the core's), doc}
KNOBS: dict[str, dict[str, Any]] = {knob["name"]: dict(knob) for knob in _C.POLICY_KNOBS}

EAGER_TOKENS_MAX = 1024  # eager_tokens=None pre-maps this many tokens, or max_context_len when shorter
ROUND_PAGES = 1024  # physical pages per mapper round when max_round_ids is None
# Knob names the glossary retired (docs/design.md): still taken in a policy mapping, with a warning.
RENAMED_KNOBS = {"max_batch_ids": "max_round_ids"}

# Knobs whose default follows the cache: None in Policy, this rule when the manager is built.
# name -> (the rule in words, the rule of (max_context_len, num_buffers))
DERIVED: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "eager_tokens": (f"min(max_context_len, {EAGER_TOKENS_MAX})",
                     lambda tokens, buffers: min(tokens, EAGER_TOKENS_MAX)),
    "max_round_ids": (f"max(1, {ROUND_PAGES} // num_buffers): about {ROUND_PAGES} physical pages per round",
                      lambda tokens, buffers: max(1, ROUND_PAGES // buffers)),
}
_TYPES = {"bool": bool, "int": int, "float": float}


def _policy_class() -> type:
    fields, lines = [], []
    for name, knob in KNOBS.items():
        kind = _TYPES[knob["type"]]
        if name in DERIVED:
            fields.append((name, kind | None, dataclasses.field(default=None)))
            default = f"None: {DERIVED[name][0]}"
        else:
            fields.append((name, kind, dataclasses.field(default=knob["default"])))
            default = repr(knob["default"])
        lines.append(f"    {name} ({knob['type']}, {knob['accepts']}; default {default}): {knob['doc']}.")
    cls = dataclasses.make_dataclass("Policy", fields, frozen=True, kw_only=True)
    cls.__module__ = __name__  # pickling and reprs find it here
    cls.__doc__ = ("The page manager's policy: ``KVCacheManager(policy=Policy(...))``. Generated from the\n"
                   "core's knob list (csrc/core/policy_knobs.h), so its fields, defaults and these docs are\n"
                   "the core's. Values are checked when a manager is built with it.\n\nKnobs:\n" + "\n".join(lines))
    return cls


Policy = _policy_class()


def resolve_policy(policy: Any, *, keywords: Mapping[str, Any], max_context_len: int, num_buffers: int,
                   external: bool) -> _C.PolicyConfig:
    """The policy the core runs with: ``policy`` (a :class:`Policy`, a
    mapping of knob names to values, or None: the defaults) over
    ``keywords`` (the manager's deprecated knob keywords that were given,
    each warned about here). Checked before anything is built:
    ``TypeError`` / ``ValueError`` naming the knob and what it accepts;
    token knobs are in ``[0, max_context_len]``.

    Between knobs: :data:`DERIVED` knobs left None follow the cache;
    ``eager`` needs ``background``; external page ids (``external``) turn
    ``background`` and ``eager`` off, since the framework maps and nothing
    runs ahead of it.
    """
    for name in keywords:
        warn_deprecated(f"KVCacheManager({name}=...) is deprecated; use policy=vattn.Policy({name}=...)")
    if isinstance(policy, Policy):
        # a dataclass keeps no record of which fields were given: those off their default were, and win over
        # a deprecated keyword; the rest yield to it (all of them had, dropping every such keyword)
        defaults = dataclasses.asdict(Policy())
        named = {k: v for k, v in dataclasses.asdict(policy).items() if v != defaults[k]}
    elif policy is None or isinstance(policy, Mapping):
        named = dict(policy or {})
        for old in RENAMED_KNOBS.keys() & named.keys():
            warn_renamed(f"policy[{old!r}]", f"policy[{RENAMED_KNOBS[old]!r}]")
            named.setdefault(RENAMED_KNOBS[old], named.pop(old))
    else:
        raise TypeError(f"policy must be a vattn.Policy or a mapping of knob names to values, "
                        f"got {type(policy).__name__}")
    knobs = {**dataclasses.asdict(Policy()), **keywords, **named}
    for name, (_, rule) in DERIVED.items():
        if knobs.get(name) is None:
            knobs[name] = rule(max_context_len, num_buffers)
    config = _C.PolicyConfig(**knobs)  # each knob's name, type and range, as it is set
    config.validate(max_context_len)  # token knobs against the requests' length
    if external:
        config.background = False
    config.eager = config.eager and config.background
    return config
