"""`servetwin live` pieces for the SGLang plugin: the `--policy` / `--decision-log` flags
of serve-cpu and command, and `servetwin live decisions LOG`."""

from __future__ import annotations

import argparse
import shlex

from servetwin.cli import UserError


def add_plugin_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", metavar="SPEC", default=None,
                        help="run this policy (a name or a .json/.yaml spec) inside SGLang's "
                        "scheduler through servetwin's plugin")
    parser.add_argument("--decision-log", metavar="F", default=None,
                        help="with --policy: write each decision as a JSON line to F "
                        "(and counters to F.counters.json)")


def plugin_env_from(args: argparse.Namespace) -> dict[str, str]:
    if not args.policy:
        if args.decision_log:
            raise UserError("--decision-log needs --policy")
        return {}
    from runtime.plugin.env import plugin_env
    from twin.policy.registry import PolicyError

    try:
        return plugin_env(args.policy, args.decision_log)
    except PolicyError as exc:
        raise UserError(str(exc)) from exc


def print_plugin_env(args: argparse.Namespace) -> None:
    """The environment lines `servetwin live command --policy` adds to the launch command."""
    env = plugin_env_from(args)
    if not env:
        return
    print("# servetwin's plugin: `pip install servetwin` into the SGLang 0.5.23 env, then "
          "start the server with")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    from twin.policy.registry import PolicyError, build_policy

    try:
        policy = build_policy(args.policy)
    except PolicyError as exc:
        raise UserError(str(exc)) from exc
    if policy.preempts:
        print("# this policy preempts: SGLang asks for victims only with "
              "--enable-priority-scheduling (and only when request slots run out)")


def require_plugin(harness) -> None:
    from runtime.cpu.install import plugin_installed_from

    if plugin_installed_from(harness) is None:
        raise UserError(f"servetwin's plugin is not installed in the harness at "
                        f"{harness.prefix}: run `servetwin live install-cpu`")


def register_decisions(sub) -> None:
    p = sub.add_parser(
        "decisions", help="replay a plugin decision log through the twin's policy",
        description="Replay every snapshot of a decision log (written by the plugin with "
        "--decision-log / SERVETWIN_DECISION_LOG) through the twin's policy, built from the "
        "spec in the log's first line, and print the share of identical decisions.")
    p.add_argument("log", metavar="LOG")
    p.add_argument("--show", type=int, default=5, metavar="N",
                   help="disagreements to show (default 5)")
    p.set_defaults(func=run_decisions)


def run_decisions(ns: argparse.Namespace) -> int:
    from runtime.plugin.decisions import policy_from_header, read_lines, replay
    from twin.policy.registry import PolicyError

    try:
        lines = list(read_lines(ns.log))
        if any(d.get("spec", {}).get("name", "").startswith("fault-") for d in lines[:1]):
            from runtime.plugin.faults import register_all

            register_all()
        policy = policy_from_header(lines[0] if lines else {})
        result = replay(lines, policy, keep=ns.show)
    except (OSError, ValueError, KeyError, PolicyError) as exc:
        raise UserError(f"decision log {ns.log}: {exc}") from exc
    header = lines[0]
    params = header["spec"].get("params")
    print(f"policy {header['spec']['name']}{f' {params}' if params else ''}"
          f"{' (native)' if header.get('native') else ''}: {result.decisions} decisions, "
          f"{result.identical} identical ({100 * result.share:.1f} %)"
          + (f", {result.skipped} logged without a plan (the live policy failed)"
             if result.skipped else ""))
    for number, question, live, twin in result.disagreements:
        print(f"  line {number} ({question}): live {_plan(question, live)}, "
              f"twin {_plan(question, twin)}")
    return 0 if result.identical == result.decisions else 1


def _plan(question: str, plan) -> str:
    if plan is None:
        return "raised"
    if question == "chunk":
        return f"chunk limit {plan.limit} park {plan.park}"
    if question == "order":
        order = list(plan.order or ())
        return f"order {order[:12]}{' ...' if len(order) > 12 else ''}"
    return f"victims {sorted(plan.victims)}"
