"""`servetwin live command`: the real SGLang launch command for a simulated configuration."""

from __future__ import annotations

import argparse
import shlex

from servetwin.args import add_server_args, gpu_from, server_args_from
from servetwin.cmd_live_plugin import add_plugin_args, print_plugin_env


def register_command(sub) -> None:
    p = sub.add_parser(
        "command", help="print the sglang.launch_server command for a configuration",
        description="Print the real `python -m sglang.launch_server` command for the same "
        "server arguments `servetwin simulate` takes, and list the twin-only settings that "
        "no SGLang flag carries. With --check, compare the twin's flags and defaults with "
        "an installed SGLang's own ServerArgs (default: the CPU harness). With --policy, also the "
        "environment that runs that policy inside SGLang's scheduler through servetwin's "
        "plugin (`pip install servetwin` into the SGLang env installs it).")
    add_server_args(p)
    if "--policy" not in p._option_string_actions:  # the twin's own flags may define it
        add_plugin_args(p)
    else:
        p.add_argument("--decision-log", metavar="F", default=None,
                       help="with --policy: the plugin's decision log (JSON lines)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--check", action="store_true",
                   help="compare with SGLang's own ServerArgs (needs an installed SGLang)")
    p.add_argument("--sglang-python", default=None,
                   help="python with SGLang installed for --check (default: the CPU harness)")
    p.set_defaults(func=run_command, _parser=p)


def run_command(ns: argparse.Namespace) -> int:
    from runtime.launch import check_flags, launch_command, sglang_server_args
    from twin.config import derive_capacity

    args = server_args_from(ns)
    derive_capacity(args, gpu_from(ns))  # refuse what cannot run, with the numbers
    print_plugin_env(ns)
    print(shlex.join(launch_command(args, host=ns.host, port=ns.port)))
    if ns.gpu:
        print(f"# --gpu {ns.gpu}: the twin's GPU type; the live server uses the machine's GPUs")
    if ns.check:
        from runtime.cpu.install import harness_env, require_harness

        python = ns.sglang_python or str(require_harness().python)
        missing, differ = check_flags(sglang_server_args(python, harness_env()))
        for m in missing:
            print(f"# {m}: accepted by the twin, not a flag of this SGLang")
        for d in differ:
            print(f"# default differs: {d}")
        if not missing and not differ:
            print("# every twin server flag exists in this SGLang with the same default")
        return 1 if missing or differ else 0
    return 0

