"""`python -m vattn budget create|set|rm|ls` and `python -m vattn top`: memory budgets from the shell."""

from __future__ import annotations

import argparse
import json
import sys

from .budget import DEFAULT_MAX_MEMBERS, Budget, names, remove
from .top import run_top
from vattn.common.errors import BudgetError, VAttnError
from vattn.common.sizes import format_bytes, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the `budget` and `top` subcommands on ``sub``."""
    budget = sub.add_parser("budget", help="create, resize, remove or list machine-wide memory budgets")
    actions = budget.add_subparsers(dest="budget_command", required=True)
    create = actions.add_parser("create", help="create a budget")
    create.add_argument("name", help="1-64 characters of A-Z a-z 0-9 . _ -")
    create.add_argument("--limit", type=_size, required=True,
                        help="bytes: 4GiB, 512MiB, 4G (= 4 GiB), 2e9, 1.5GB ...")
    create.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or a GPU UUID (GPU-...)")
    create.add_argument("--max-members", type=int, default=DEFAULT_MAX_MEMBERS,
                        help=f"managers it has room for (default {DEFAULT_MAX_MEMBERS})")
    change = actions.add_parser("set", help="change a budget's limit, live")
    change.add_argument("name")
    change.add_argument("--limit", type=_size, required=True, help="bytes: 2GiB, 512MiB, 2e9 ...")
    rm = actions.add_parser("rm", help="remove a budget (also a corrupt one)")
    rm.add_argument("name")
    ls = actions.add_parser("ls", help="list the budgets on this machine")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    budget.set_defaults(run_command=run_budget)

    top = sub.add_parser("top", help="live table of budgets: per process and manager, bytes in use and free-held")
    top.add_argument("name", nargs="?", help="one budget (default: every budget on this machine)")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.add_argument("--json", action="store_true", help="print JSON (with --once: one snapshot for scripts)")
    top.add_argument("--interval", type=_positive(float), default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("-n", "--iterations", type=_positive(int), help="exit after this many refreshes")
    top.set_defaults(run_command=lambda args: run_top(args.name, args.once, args.json, args.interval, args.iterations))


def run_budget(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.budget_command](args)
    except (VAttnError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _create(args: argparse.Namespace) -> int:
    b = Budget.create(args.name, args.limit, args.device, args.max_members)
    print(f"created budget {b.name}: limit {format_bytes(b.limit)} ({b.limit} bytes), device {b.device}, "
          f"room for {b.max_members} members")
    return 0


def _set(args: argparse.Namespace) -> int:
    b = Budget.attach(args.name)
    before = b.limit
    b.set_limit(args.limit)
    held = b.usage().held_bytes
    print(f"budget {b.name}: limit {format_bytes(before)} -> {format_bytes(args.limit)} ({args.limit} bytes); "
          f"members hold {format_bytes(held)}")
    if held > args.limit:
        print(f"members hold {format_bytes(held - args.limit)} more than the new limit: grants are refused "
              f"until they have released that much (pages under requests are never taken)")
    return 0


def _rm(args: argparse.Namespace) -> int:
    note = ""
    try:
        u = Budget.attach(args.name).usage()
        if u.members:
            note = (f"; {len(u.members)} member(s) in {len(u.processes)} process(es) keep using it until they "
                    f"exit, new processes no longer find it")
    except BudgetError:
        pass  # missing (remove says so) or corrupt (removed all the same)
    remove(args.name)
    print(f"removed budget {args.name}{note}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    rows = []
    for name in names():
        try:
            u = Budget.attach(name).usage()
            rows.append({"name": name, "device": u.device, "limit_bytes": u.limit_bytes, "held_bytes": u.held_bytes,
                         "members": len(u.members), "processes": len(u.processes)})
        except BudgetError as e:
            rows.append({"name": name, "error": str(e)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no budgets on this machine")
    for r in rows:
        if "error" in r:
            print(f"{r['name']}: unreadable: {r['error']}")
        else:
            print(f"{r['name']}: device {r['device']}, limit {format_bytes(r['limit_bytes'])}, held "
                  f"{format_bytes(r['held_bytes'])}, {r['members']} member(s) in {r['processes']} process(es)")
    return 0


_COMMANDS = {"create": _create, "set": _set, "rm": _rm, "ls": _ls}
