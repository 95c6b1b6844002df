"""`servetwin live`: the real SGLang engine, one command away.

Subcommands register themselves in `LIVE_SUBCOMMANDS`; adding one (replay, compare)
means writing a `register_NAME(sub)` function and listing it there.
"""

from __future__ import annotations

import argparse
import sys

from servetwin.cli import UserError
from servetwin.cmd_live_fleet import register_fleet
from servetwin.cmd_live_launch import register_command
from servetwin.cmd_live_plugin import (
    add_plugin_args,
    plugin_env_from,
    register_decisions,
    require_plugin,
)
from servetwin.cmd_live_replay import register_compare, register_replay
from servetwin.cmd_live_step_cpu import register_step_cpu
from servetwin.cmd_live_vllm import register_install_vllm, register_serve_vllm


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "live",
        help="run the real SGLang engine (CPU harness, replay, compare)",
        description="Run the real SGLang engine: install and serve the CPU harness.",
    )
    sub = parser.add_subparsers(
        dest="live_command", metavar="SUBCOMMAND", parser_class=PassThroughParser
    )
    for register_one in LIVE_SUBCOMMANDS:
        register_one(sub)
    parser.set_defaults(func=lambda args: _no_subcommand(parser))


class PassThroughParser(argparse.ArgumentParser):
    """A parser that can hand the arguments it does not know to another program.

    With `passthrough_dest` set, unknown arguments are kept in order in that
    attribute instead of being an error (argparse's REMAINDER fails when the first
    of them looks like an option).
    """

    passthrough_dest: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--pre` must not match our `--prefix`
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self.passthrough_dest is None:
            return namespace, extras
        setattr(namespace, self.passthrough_dest, [a for a in extras if a != "--"])
        return namespace, []


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def register_install_cpu(sub) -> None:
    parser = sub.add_parser(
        "install-cpu",
        help="install SGLang 0.5.23 for CPU into an isolated venv (idempotent)",
        description="Install SGLang 0.5.23 with a CPU torch into an isolated venv, with the "
        "import shims and a tiny dummy-weight model, and servetwin itself (editable, "
        "`pip install --no-deps -e`) so SGLang finds servetwin's plugin; and the real "
        "sglang-router 0.3.2 in a venv of its own (for `live fleet`). Re-running is a "
        "no-op once complete.",
    )
    parser.add_argument(
        "--prefix",
        metavar="DIR",
        help="where the venv goes (default: $SERVETWIN_SGLANG_ENV or ~/.cache/servetwin/sglang-cpu)",
    )
    parser.add_argument(
        "--router-prefix",
        metavar="DIR",
        help="the sglang-router 0.3.2 venv that `live fleet` uses (default: "
        "$SERVETWIN_ROUTER_ENV or ~/.cache/servetwin/sglang-router)",
    )
    parser.set_defaults(func=run_install_cpu)


def run_install_cpu(args: argparse.Namespace) -> int:
    from runtime.cpu.install import HarnessError, ensure_plugin, install

    try:
        harness = install(args.prefix, log=lambda line: print(line, flush=True))
        ensure_plugin(harness, log=lambda line: print(line, flush=True))
        from runtime.router import install_router

        install_router(args.router_prefix, log=lambda line: print(line, flush=True))
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    return 0


def register_serve_cpu(sub) -> None:
    parser = sub.add_parser(
        "serve-cpu",
        help="start a real SGLang server on the CPU harness (foreground)",
        description="Start a real SGLang server with the tiny dummy-weight model on the CPU "
        "harness, in the foreground; Ctrl-C stops it and its children. Every other "
        "argument is passed to `sglang.launch_server` and overrides the harness's own, "
        "e.g. `servetwin live serve-cpu --port 30000`; all arguments after `--` are "
        "passed, even `--prefix`. With --policy, servetwin's SGLang plugin runs that policy "
        "inside the server's scheduler (install-cpu installs the plugin into the harness; "
        "in any other SGLang 0.5.23 env, `pip install servetwin` does).",
        usage="servetwin live serve-cpu [--prefix DIR] [--start-timeout S] [--policy SPEC] "
        "[--decision-log F] [--step-probe PREFIX] [SGLang args ...]",
    )
    add_plugin_args(parser)
    parser.add_argument(
        "--step-probe", metavar="PREFIX", default=None,
        help="time the scheduler loop's CPU work per step into PREFIX.<pid> (servetwin's "
        "plugin; read by `servetwin live step-cpu --probe PREFIX`)")
    parser.add_argument(
        "--prefix", metavar="DIR", help="the harness venv (default as for install-cpu)"
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="seconds to wait for the server to answer (default 180)",
    )
    parser.passthrough_dest = "sglang_args"
    parser.set_defaults(func=run_serve_cpu)


def run_serve_cpu(args: argparse.Namespace) -> int:
    from runtime.cpu.install import HarnessError
    from runtime.cpu.serve import CpuServer

    try:
        env = plugin_env_from(args)
        if args.step_probe:
            from runtime.plugin.env import step_probe_env

            env |= step_probe_env(args.step_probe)
        server = CpuServer(args.sglang_args, prefix=args.prefix, start_timeout=args.start_timeout,
                           env=env)
        if args.policy or args.step_probe:
            require_plugin(server.harness)
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    if args.policy:
        print(f"policy {args.policy} through servetwin's plugin"
              + (f"; decision log {args.decision_log}" if args.decision_log else ""), flush=True)
    if args.step_probe:
        print(f"step probe: {args.step_probe}.<pid> (`servetwin live step-cpu --url URL "
              f"--probe {args.step_probe} --out FILE`)", flush=True)
    print(f"starting SGLang on {server.url} (log {server.log_path})", flush=True)
    try:
        server.start()
        print(f"ready in {server.start_seconds:.0f} s: {server.url}  port {server.port}  "
              f"log {server.log_path}; Ctrl-C stops it", flush=True)  # fmt: skip
        code = server.wait()
        print(f"the server exited with code {code}; log {server.log_path}", file=sys.stderr)
        return 1
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    except KeyboardInterrupt:
        print("stopping the server ...", flush=True)
        return 0
    finally:
        server.stop()


LIVE_SUBCOMMANDS = [register_install_cpu, register_serve_cpu, register_replay, register_compare,
                    register_command, register_decisions, register_fleet, register_install_vllm,
                    register_serve_vllm, register_step_cpu]
