"""`python -m vattn budget create|set|rm|ls` and `python -m vattn top`: memory budgets from the shell."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, NoReturn

from vattn.common.errors import BudgetError, VAttnError
from vattn.common.sizes import format_bytes, parse_size

from .budget import DEFAULT_MAX_MEMBERS, Budget, BudgetUsage, names, remove, remove_leftovers
from .devices import create_for_devices, family
from .top import run_top

SET_RULE = ("Changes a budget's limit, live. Nothing is taken from members: below what they hold, grants are "
            "refused until they have released enough. Padding is charged whatever the limit: a member's padding "
            "(null) blocks, such as a vLLM engine's null block (one block on every rank, from start to exit), are "
            "never given back, and pages under requests only as those finish; so a limit below what members hold "
            "as padding leaves the budget above its limit for as long as those members run. set warns, with the "
            "figures, when the new limit is below what members cannot give back now: their held bytes minus their "
            "free-held bytes, as top shows them.")
NAME_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, not starting with '.' or '-'"  # csrc/budget/segment.h
_SHORT_WORD = re.compile(r"^-[^-\d.]")  # "-x", "-name": a short option's form; not "-5", "--x" or "--"

# Options whose value may start with '-' (argparse takes "--limit -1GiB" for
# two options and says only "expected one argument"; joined as
# "--limit=-1GiB" the value reaches the size check, which names the range).
VALUE_OPTIONS = ("--limit",)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _limit(text: str) -> int:
    """A new budget's limit: 1 byte or more."""
    try:
        return parse_size(text, minimum=1)
    except ValueError as e:
        zero = False
        try:
            zero = parse_size(text) == 0
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"{e}: a budget of 0 bytes grants nothing" if zero else str(e)) from None


def join_option_values(argv: list[str], options: tuple[str, ...] = VALUE_OPTIONS) -> list[str]:
    """``argv`` with each ``OPTION VALUE`` of ``options`` (default ``--limit``) whose
    value starts with '-' joined into ``OPTION=VALUE``, so a negative size gets
    its own error message."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose errors also name the options it does not
    know: argparse reports a missing required option first and stays silent
    about a mistyped one (``--size 1GiB`` for ``--limit 1GiB``); and say that
    a word such as ``-x`` is no budget name either (argparse takes it for an
    option and reports only "name is required"). Arguments it does not know
    are its own error, under its own usage line."""

    argv: list[str] = []  # the command line being parsed, set by vattn.cli.main.main

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        unknown = []
        words = _CommandParser.argv
        for i, word in enumerate(words):
            option = word.split("=", 1)[0]
            if option.startswith("--") and option not in self._option_string_actions:
                value = words[i + 1] if "=" not in word and i + 1 < len(words) and \
                    not words[i + 1].startswith("-") else None
                unknown.append(word if value is None else f"{word} {value}")
        if unknown and "unrecognized arguments" not in message:
            message = f"{message}; unrecognized arguments: {' '.join(unknown)}"
        dashed = [w for w in words if _SHORT_WORD.match(w) and w[:2] not in self._option_string_actions]
        if dashed and any(action.dest == "name" for action in self._actions):
            message = (f"{message}; {dashed[0]!r} is not an option of {self.prog}, and a budget name cannot start "
                       f"with '-' (names: {NAME_RULE})")
        super().error(message)


def _positive(kind: type, at_most: float | None = None):
    def parse(text: str):
        value = kind(text)
        if not value > 0 or (at_most is not None and not value <= at_most):
            accepted = "> 0" if at_most is None else f"in (0, {at_most:g}]"
            raise argparse.ArgumentTypeError(f"must be {accepted}, got {text}")
        return value

    return parse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the `budget` and `top` subcommands on ``sub``."""
    budget = sub.add_parser("budget", help="create, resize, remove or list machine-wide memory budgets")
    actions = budget.add_subparsers(dest="budget_command", required=True, parser_class=_CommandParser)
    create = actions.add_parser("create", help="create a budget")
    create.add_argument("name", help=NAME_RULE)
    create.add_argument("--limit", type=_limit, required=True,
                        help="bytes, at least 1: 4GiB, 512MiB, 4G (= 4 GiB), 2e9, 1.5GB ...")
    create.add_argument("--device", action="append",
                        help="cpu (default), cuda, cuda:N, or a GPU UUID (GPU-...); given several times, one budget "
                             "per GPU, each of --limit, named NAME.GPU-<the UUID's last 12 hex digits>")
    create.add_argument("--per-device", action="store_true",
                        help="name the budget of one GPU NAME.GPU-... too (a GPU added to NAME's per-device budgets)")
    create.add_argument("--max-members", type=int, default=DEFAULT_MAX_MEMBERS,
                        help=f"managers it has room for (default {DEFAULT_MAX_MEMBERS})")
    change = actions.add_parser("set", help="change a budget's limit, live", description=SET_RULE)
    change.add_argument("name", help="a budget, or a name and its per-device budgets (NAME.GPU-...): each one's limit")
    change.add_argument("--limit", type=_size, required=True,
                        help="bytes: 2GiB, 512MiB, 2e9 ...; below what members cannot give back, the budget "
                             "stays above it (see above)")
    rm = actions.add_parser("rm", help="remove a budget (also a corrupt one); refused while processes use it")
    rm.add_argument("name", help="a budget, or a name and its per-device budgets (NAME.GPU-...)")
    rm.add_argument("--force", action="store_true",
                    help="remove it although processes use it: they are refused new memory from it from then on")
    ls = actions.add_parser("ls", help="list the budgets on this machine (and remove what killed creators left)")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    budget.set_defaults(run_command=run_budget)

    top = sub.add_parser("top", help="live table of budgets: per process and manager, bytes in use and free-held")
    top.add_argument("name", nargs="?",
                     help="one budget and its per-device budgets (default: every budget on this machine)")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.add_argument("--json", action="store_true", help="print JSON (with --once: one snapshot for scripts)")
    top.add_argument("--interval", type=_positive(float, at_most=86400), default=1.0,
                     help="seconds between refreshes, up to a day (default 1)")
    top.add_argument("-n", "--iterations", type=_positive(int), help="exit after this many refreshes")
    top.set_defaults(run_command=lambda args: run_top(args.name, args.once, args.json, args.interval, args.iterations))


def run_budget(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.budget_command](args)
    except (VAttnError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _create(args: argparse.Namespace) -> int:
    for b in create_for_devices(args.name, args.limit, args.device or ["cpu"], args.per_device or None,
                                max_members=args.max_members):
        print(f"created budget {b.name}: limit {format_bytes(b.limit)} ({b.limit} bytes), device {b.device}, "
              f"room for {b.max_members} members")
    return 0


def _set(args: argparse.Namespace) -> int:
    for name in family(args.name) or [args.name]:  # none: attach names what is missing
        _set_one(name, args.limit)
    return 0


def _set_one(name: str, limit: int) -> None:
    b = Budget.attach(name)
    before = b.limit
    b.set_limit(limit)
    usage = b.usage()
    held = usage.held_bytes
    print(f"budget {b.name}: limit {format_bytes(before)} -> {format_bytes(limit)} ({limit} bytes); "
          f"members hold {format_bytes(held)}")
    if held > limit:
        print(f"members hold {format_bytes(held - limit)} more than the new limit: grants are refused "
              f"until they have released that much (pages under requests are never taken)")
    warning = pinned_warning(usage, limit)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def pinned_warning(usage: BudgetUsage, limit_bytes: int) -> str | None:
    """What a limit of ``limit_bytes`` below the bytes members cannot give back
    now means, with the figures; None when it is not below them.

    The segment keeps no padding figure of its own: per member, what cannot be
    given back is its held bytes minus its free-held bytes as last reported
    (``top``'s columns): the bytes under requests, and the rest, held but
    neither in use nor free, which is padding such as a vLLM engine's null
    block (pages changing hands since the last report, 20 ms at most, count
    there too)."""
    in_use = sum(min(m.in_use_bytes, m.held_bytes) for m in usage.members)
    padding = sum(max(0, m.held_bytes - m.in_use_bytes - m.free_held_bytes) for m in usage.members)
    pinned = in_use + padding
    if limit_bytes >= pinned:
        return None
    lasts = ("for as long as those members run" if limit_bytes < padding
             else "until requests finish and their pages are released")
    return (f"the new limit {format_bytes(limit_bytes)} is below the {format_bytes(pinned)} ({pinned} bytes) members "
            f"cannot give back now (held minus free-held, as they last reported): {format_bytes(in_use)} under "
            f"requests and {format_bytes(padding)} of padding (held, neither in use nor free: a vLLM engine's null "
            f"block), which is charged whatever the limit; the budget stays above its limit {lasts}")


def _rm(args: argparse.Namespace) -> int:
    for name in family(args.name) or [args.name]:  # none: remove names what is missing
        processes = 0
        try:
            processes = len(Budget.attach(name).usage().processes)
        except BudgetError:
            pass  # missing (remove says so) or corrupt (removed all the same)
        members = remove(name, args.force)
        note = (f"; {members} member(s) in {processes} process(es) were told it is gone: they are refused new "
                f"memory from it and keep what they hold") if members else ""
        print(f"removed budget {name}{note}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    for leftover in remove_leftovers():  # on stderr: --json keeps stdout to the listing
        print(f"removed {leftover}: the staging file of a budget creator that died half-way", file=sys.stderr)
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
