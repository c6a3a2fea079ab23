"""Command line: `python -m vattn info`, `demo`, `budget` and `top`."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backends, granularity, page sizes, memory, build")
    info.add_argument("--json", action="store_true", help="print as JSON")
    demo = sub.add_parser("demo", help="serve a model with continuous batching on vattn (CPU)")
    from .demo import add_arguments

    add_arguments(demo)
    from .budget_cli import _CommandParser, add_commands, join_option_values

    add_commands(sub)
    argv = join_option_values(sys.argv[1:] if argv is None else list(argv))
    _CommandParser.argv = argv
    args = parser.parse_args(argv)
    if hasattr(args, "run_command"):
        return args.run_command(args)
    if args.command == "info":
        from .info import collect, render

        data = collect()
        print(json.dumps(data, indent=2) if args.json else render(data))
        return 0
    from .demo import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
