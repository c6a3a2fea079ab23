"""The page manager's policy knobs, as :class:`~vattn.KVCacheManager` sets them.

The knobs are described once, in the core (``csrc/core/policy_knobs.h``):
each one's type, default, accepted range and doc reach Python as
``vattn._C.POLICY_KNOBS``, and ``vattn._C.PolicyConfig`` checks a value's
type and range when it is set. This module adds only what depends on the
cache (token knobs are bounded by ``max_context_len``) and the manager's
logic between knobs, so a new knob needs no line here unless it brings logic
of its own (docs/design.md section 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vattn import _C

# name -> {name, type ("bool", "int", "float"), range ("bool", "tokens",
# "fraction", "count"), accepts (the range in words), default (the core's), doc}
KNOBS: dict[str, dict[str, Any]] = {knob["name"]: dict(knob) for knob in _C.POLICY_KNOBS}

EAGER_TOKENS_MAX = 1024  # eager_tokens=None pre-maps this many tokens, or max_context_len when shorter
BATCH_PAGES = 1024  # physical pages per mapper batch when max_batch_ids is not given


def resolve_policy(policy: Mapping[str, Any] | None, *, defaults: Mapping[str, Any], max_context_len: int,
                   num_buffers: int, external: bool) -> _C.PolicyConfig:
    """The policy the core runs with: knobs by name from ``policy``, over
    ``defaults`` (the manager's keyword arguments), the core's defaults for
    the rest. Checked before anything is built: ``TypeError`` / ``ValueError``
    naming the knob and what it accepts; token knobs are in
    ``[0, max_context_len]``.

    Between knobs: ``eager_tokens`` None pre-maps ``min(max_context_len,
    1024)`` tokens; ``eager`` needs ``background``; external page ids
    (``external``) turn ``background`` and ``eager`` off, since the framework
    maps and nothing runs ahead of it; ``max_batch_ids``, unless given, is
    ``max(1, 1024 // num_buffers)``: about 1024 physical pages per batch.
    """
    if policy is not None and not isinstance(policy, Mapping):
        raise TypeError(f"policy must be a mapping of knob names to values, got {type(policy).__name__}")
    knobs = {**defaults, **(policy or {})}
    if knobs.get("eager_tokens") is None:
        knobs["eager_tokens"] = min(max_context_len, EAGER_TOKENS_MAX)
    knobs.setdefault("max_batch_ids", max(1, BATCH_PAGES // num_buffers))
    config = _C.PolicyConfig(**knobs)  # each knob's name, type and range, as it is set
    config.validate(max_context_len)  # token knobs against the requests' length
    if external:
        config.background = False
    config.eager = config.eager and config.background
    return config
