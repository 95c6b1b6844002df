"""The `servetwin` command: argument parsing and printing only.

Each subcommand lives in its own module under `servetwin/` and exposes
`register(subparsers)`; the module sets `func` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from twin.errors import ServetwinError

# Errors the user caused: printed as one clear line, exit code 2.
UserError = ServetwinError

# Subcommand modules, in the order `--help` lists them. A module that fails to
# import (an optional extra missing) is reported when its command is used.
COMMAND_MODULES = (
    "servetwin.cmd_simulate",
    "servetwin.cmd_perf",
    "servetwin.cmd_live",
    "servetwin.cmd_claims",
    "servetwin.cmd_calibrate",
    "servetwin.cmd_rl",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servetwin",
        description="A digital twin of an SGLang deployment: simulate it, compare it with the "
        "live engine, calibrate it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        argv = ["simulate"]  # the built-in default: the finance-qa workload
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_accepts_extra", False):
        sub = getattr(args, "_parser", parser)
        valid = sorted({o for a in sub._actions for o in a.option_strings if o.startswith("--")})
        print(f"{sub.prog}: error: unknown argument(s): {' '.join(extra)}\n"
              f"valid flags: {' '.join(valid)}", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except UserError as exc:
        print(f"servetwin {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
