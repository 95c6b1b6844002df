"""The `servetwin` command: argument parsing and printing only.

Each subcommand lives in its own module under `servetwin/` and exposes
`register(subparsers)`; the module sets `func` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    "servetwin.cmd_plan",
    "servetwin.cmd_report",
    "servetwin.cmd_alerts",
    "servetwin.cmd_emulate",
)
# The module of each command: `servetwin COMMAND ...` imports only that one (start-up
# time: the live, calibration and RL commands pull in much that `simulate` never uses).
COMMANDS = {"simulate": "servetwin.cmd_simulate", "perf": "servetwin.cmd_perf",
            "live": "servetwin.cmd_live", "claims": "servetwin.cmd_claims",
            "calibrate": "servetwin.cmd_calibrate", "validate": "servetwin.cmd_calibrate",
            "rl": "servetwin.cmd_rl", "plan": "servetwin.cmd_plan",
            "report": "servetwin.cmd_report", "alerts": "servetwin.cmd_alerts",
            "emulate": "servetwin.cmd_emulate"}
# Commands whose numpy work is on small arrays and that start no server: one OpenBLAS
# thread (unless the user set it), since OpenBLAS starts a thread per core when numpy is
# imported, and those threads' start-up alone costs about 0.1 CPU-s a process
# (benchmarks/startup_speed.py). Not for `live`, `calibrate`, `validate`, `emulate` or `rl`:
# the servers they start and torch inherit the environment.
ONE_BLAS_THREAD = ("simulate", "perf", "plan", "claims", "report", "alerts")
# Commands whose process ends with a run that makes no cycles worth collecting: as a
# console script (`argv` None) the collector is off from the start and nothing is
# collected on the way out (twin/collector.py `off_to_the_end`; docs/perf.md, seventeenth
# round). Not `live`, `calibrate`, `emulate` or `rl`: servers and training run for long.
COLLECTOR_OFF = ("simulate",)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`command` given) one with only that command's module."""
    parser = argparse.ArgumentParser(
        prog="servetwin",
        description="A digital twin of an SGLang deployment: simulate it, compare it with the "
        "live engine, calibrate it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = (COMMANDS[command],) if command in COMMANDS else COMMAND_MODULES
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    process = argv is None  # the console script: the process ends with the command
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["simulate"]  # the built-in default: the finance-qa workload
    if process and argv[0] in COLLECTOR_OFF:
        from twin.collector import off_to_the_end

        with off_to_the_end():
            return _main(argv)
    return _main(argv)


def _main(argv: list[str]) -> int:
    # only in a fresh process: once numpy is loaded the setting no longer acts here, and a
    # caller's process (a test session calling `main`) must not pass it to the servers it
    # starts later
    if argv[0] in ONE_BLAS_THREAD and "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parser = build_parser(argv[0])
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
