"""A KV cache manager's place in a machine-wide memory budget (docs/elastic.md):
which budget it joins (the ``budget`` argument, else the ``VATTN_BUDGET``
environment variable, so engines a framework starts join without code
changes), as what, and the checks of the budget arguments."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from vattn.common.config import KVCacheConfig
from vattn.common.errors import BudgetError

from .budget import Budget, BudgetMember, resolve_device
from .devices import attach_for_device

ENV_VAR = "VATTN_BUDGET"
# Seconds without a step after which a manager in a budget gives its free
# pages back: long enough that a pause between bursts keeps the cache warm,
# short next to the minutes an idle model may sit (kvcached's issue #359).
DEFAULT_IDLE_RELEASE_S = 30.0
WAIT_ENV_VAR = "VATTN_BUDGET_WAIT_S"
# Seconds a request larger than the budget's current limit (alone) waits for
# the limit to rise before it fails: a limit lowered for a moment is raised
# again well within it, and a client waiting on a request that cannot run
# hears so within it.
DEFAULT_BUDGET_WAIT_S = 30.0


def idle_release_seconds(value: object) -> float:
    """``idle_release_s`` as the core takes it: seconds, 0.0 for never (None)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"idle_release_s must be a number of seconds or None, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= 1e9):
        raise ValueError(f"idle_release_s must be in (0, 1e9] seconds, or None for never; got {value}")
    return float(value)


def budget_wait_seconds(value: object = None) -> float:
    """Seconds a request over a budget's current limit waits for the limit to rise: ``value``
    when given, else ``VATTN_BUDGET_WAIT_S`` when set and not empty, else 30. A number in
    [0, 1e6]; 0 fails such a request at once."""
    source = "budget_wait_s"
    if value is None:
        raw = os.environ.get(WAIT_ENV_VAR, "").strip()
        if not raw:
            return DEFAULT_BUDGET_WAIT_S
        source = WAIT_ENV_VAR
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{WAIT_ENV_VAR} must be a number of seconds in [0, 1e6], got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{source} must be a number of seconds in [0, 1e6], got {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= 1e6):
        raise ValueError(f"{source} must be a number of seconds in [0, 1e6], got {value}")
    return float(value)


def default_label(config: KVCacheConfig) -> str:
    """What ``python -m vattn top`` shows for a manager that gave no label."""
    dtype = str(config.dtype).replace("torch.", "")
    return f"kv {config.num_layers}x{config.num_kv_heads}x{config.head_dim} {dtype}"


def budget_name_from_environment() -> str:
    """The budget ``VATTN_BUDGET`` names ("" when it is unset or blank)."""
    return os.environ.get(ENV_VAR, "").strip()


def join_budget(budget: Any, device: torch.device, label: str) -> tuple[Budget | None, BudgetMember | None]:
    """The budget a manager on ``device`` joins, and its membership.

    ``budget``: a :class:`vattn.Budget`, a budget's name, ``None`` (the
    budget named by ``VATTN_BUDGET`` when that is set and not empty, else
    none) or ``False`` (none, whatever the environment says). Raises
    :class:`vattn.BudgetError` when the named budget does not exist or cannot
    be joined, ``ValueError`` when it governs another device. A name finds
    the budget of ``device`` among one name's per-device budgets
    (:func:`vattn.budget.devices.attach_for_device`).
    """
    source = "budget"
    if budget is False:
        return None, None
    if budget is None:
        name = budget_name_from_environment()
        if not name:
            return None, None
        budget, source = name, f"environment variable {ENV_VAR}={name}"
    wanted = resolve_device(device)
    if isinstance(budget, str):
        try:
            budget = attach_for_device(budget, wanted)  # the name itself, or its segment for this GPU
        except (BudgetError, ValueError) as e:
            if source == "budget":
                raise
            raise type(e)(f"{source}: {e}") from None  # the user set no argument: name what they did set
    elif not isinstance(budget, Budget):
        raise TypeError(f"budget must be a vattn.Budget, a budget's name, None or False, "
                        f"got {type(budget).__name__}")
    if budget.device != wanted:
        raise ValueError(f"{source}: budget '{budget.name}' governs device {budget.device}, but this cache "
                         f"lives on {device} ({wanted}); create a budget for that device")
    return budget, budget.join(label)
