"""`python -m vattn top`: the budgets' members as a table refreshed like top(1)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from .budget import Budget, BudgetUsage, names
from .devices import family
from vattn.common.errors import BudgetError
from vattn.common.sizes import format_bytes

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: redraw in place on a terminal
LABEL_WIDTH = 42  # a vLLM engine's label (40 characters: served model name and ranks) and its indent
COLUMNS = f"{'PID':>8}  {'LABEL':<{LABEL_WIDTH}} {'IN USE':>11} {'FREE-HELD':>11} {'HELD':>11} {'SHARE':>7}  WAITING"


def snapshot(budget_names: list[str] | None) -> tuple[list[BudgetUsage], list[dict[str, str]]]:
    """Usage of the named budgets (every budget on the machine when None) and,
    for each one that could not be read, {"name", "error"}."""
    usages: list[BudgetUsage] = []
    errors: list[dict[str, str]] = []
    for name in names() if budget_names is None else budget_names:
        try:
            usages.append(Budget.attach(name).usage())
        except (BudgetError, ValueError) as e:  # missing, corrupt, removed meanwhile, or a bad name
            errors.append({"name": name, "error": str(e)})
    return usages, errors


def _share(nbytes: int, limit: int) -> str:
    return f"{100.0 * nbytes / limit:.1f}%" if limit else "-"


def _waiting(nbytes: int, seconds: float | None = None) -> str:
    if not nbytes:
        return "-"
    return format_bytes(nbytes) + (f" for {seconds:.1f}s" if seconds is not None else "")


def render_budget(u: BudgetUsage) -> list[str]:
    """The header lines and one line per process and per manager of budget ``u``."""
    pct = _share(u.held_bytes, u.limit_bytes)
    lines = [
        f"budget {u.name}  device {u.device}  limit {format_bytes(u.limit_bytes)}  "
        f"held {format_bytes(u.held_bytes)} ({pct})  available {format_bytes(u.available_bytes)}",
        f"  in use {format_bytes(u.in_use_bytes)}  free-held {format_bytes(u.free_held_bytes)}  "
        f"waiting {format_bytes(u.waiting_bytes)}  processes {len(u.processes)}  "
        f"members {len(u.members)}/{u.max_members}",
        COLUMNS,
    ]
    by_pid: dict[int, list[Any]] = {}
    for m in u.members:
        by_pid.setdefault(m.pid, []).append(m)
    for p in u.processes:
        managers = f"process ({len(p.managers)} manager{'s' if len(p.managers) != 1 else ''})"
        lines.append(f"{p.pid:>8}  {managers:<{LABEL_WIDTH}} {format_bytes(p.in_use_bytes):>11} "
                     f"{format_bytes(p.free_held_bytes):>11} {format_bytes(p.held_bytes):>11} "
                     f"{_share(p.held_bytes, u.limit_bytes):>7}  {_waiting(p.waiting_bytes)}")
        for m in by_pid[p.pid]:
            label = ("  " + m.label)[:LABEL_WIDTH]
            lines.append(f"{'':>8}  {label:<{LABEL_WIDTH}} {format_bytes(m.in_use_bytes):>11} "
                         f"{format_bytes(m.free_held_bytes):>11} {format_bytes(m.held_bytes):>11} "
                         f"{_share(m.held_bytes, u.limit_bytes):>7}  {_waiting(m.waiting_bytes, m.waiting_seconds)}")
    if not u.members:
        lines.append(f"{'':>8}  (no members)")
    return lines


def render(usages: list[BudgetUsage], errors: list[dict[str, str]], all_budgets: bool) -> str:
    """The whole screen: every budget's table, then the budgets that could not be read."""
    blocks = ["\n".join(render_budget(u)) for u in usages]
    blocks += [f"budget {e['name']}: {e['error']}" for e in errors]
    if not blocks:
        blocks = ["no budgets on this machine (create one: python -m vattn budget create NAME --limit 4GiB)"
                  if all_budgets else "nothing to show"]
    stamp = time.strftime("%H:%M:%S")
    return f"vattn top - {stamp}\n\n" + "\n\n".join(blocks)


def as_json(usages: list[BudgetUsage], errors: list[dict[str, str]]) -> str:
    return json.dumps({"time_unix_seconds": time.time(), "budgets": [u.to_dict() for u in usages],
                       "errors": errors}, indent=2)


def run_top(budget_name: str | None, once: bool, as_json_output: bool, interval_s: float,
            iterations: int | None, out: TextIO | None = None) -> int:
    """Shows ``budget_name`` and its per-device budgets (every budget when None) once, ``iterations``
    times, or until Ctrl-C; every ``interval_s`` seconds. On a terminal the
    table is redrawn in place, elsewhere each refresh is printed after the
    last (to ``out``, default stdout). Returns the exit status: 1 when a
    named budget cannot be read."""
    out = sys.stdout if out is None else out
    tty = out.isatty() and not as_json_output
    shown = 0
    status = 0
    try:
        while True:
            # a name shows its per-device budgets (NAME.GPU-...) too, those created since included
            wanted = None if budget_name is None else (family(budget_name) or [budget_name])
            usages, errors = snapshot(wanted)
            status = 1 if wanted and errors else 0
            text = as_json(usages, errors) if as_json_output else render(usages, errors, wanted is None)
            out.write((CLEAR if tty else ("\n" if shown else "")) + text + "\n")
            out.flush()
            shown += 1
            if once or (iterations is not None and shown >= iterations):
                return status
            time.sleep(interval_s)
    except KeyboardInterrupt:  # Ctrl-C ends top; no traceback
        if tty:
            out.write("\n")
        return status
