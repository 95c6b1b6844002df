"""`servetwin live fleet`: N CPU SGLang servers behind the real sglang-router (runtime/fleet.py),
optionally with vLLM CPU servers and the users' length router in front (runtime/length_router.py).
Argument parsing and printing only."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from servetwin.cli import UserError
from servetwin.cmd_live_plugin import add_plugin_args, plugin_env_from

# RouterOptions fields that become flags of their own name (sglang-router's own names).
_ROUTER_SKIP = ("policy", "log_level")


def register_fleet(sub) -> None:
    from runtime.router import POLICIES, RouterOptions

    p = sub.add_parser(
        "fleet", help="start N CPU SGLang servers behind the real sglang-router (foreground)",
        description="Start N real SGLang servers on the CPU harness (127.0.0.1, distinct "
        "ports) behind the real sglang-router 0.3.2, print the router's URL, and stop "
        "everything on Ctrl-C. `servetwin live replay --url ROUTER` works through it: its "
        "records name the replica that served each request and workers.json has the "
        "per-worker split. Router flags below are sglang-router's own (its defaults when "
        "not given); every other argument goes to each SGLang server. With --vllm-replicas "
        "and --length-thresholds, vLLM CPU servers start too and servetwin's length router "
        "(sglang-router cannot route by prompt length) is put in front of the pools.",
        usage="servetwin live fleet [--replicas N] [--router-policy P] [--policy SPEC] "
        "[--port PORT] [router flags] [--vllm-replicas M --length-thresholds T,...] "
        "[SGLang args ...]")
    p.add_argument("--replicas", type=int, default=2, help="SGLang servers (default 2)")
    p.add_argument("--router-policy", choices=POLICIES, default="cache_aware",
                   help="sglang-router --policy (default cache_aware, the router's default)")
    p.add_argument("--port", type=int, default=None,
                   help="the front URL's port (default: a free one)")
    add_plugin_args(p)
    for f in dataclasses.fields(RouterOptions):
        if f.name in _ROUTER_SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help="sglang-router's flag")
        else:
            kind = int if "int" in str(f.type) else float
            p.add_argument(flag, type=kind, default=None, metavar="X", help="sglang-router's flag")
    p.add_argument("--vllm-replicas", type=int, default=0,
                   help="vLLM CPU servers to start as the users' vLLM pools (default 0)")
    p.add_argument("--length-thresholds", default=None, metavar="T1,T2",
                   help="with --vllm-replicas M: M thresholds; prompts of at most T1 tokens go "
                   "to the SGLang pool (the router), up to T2 to vLLM server 1, ..., above the "
                   "last to vLLM server M (e.g. 32000,64000: the users' design)")
    p.add_argument("--log-dir", type=Path, default=None, help="logs (default: a temp dir)")
    p.add_argument("--start-timeout", type=float, default=240.0, metavar="S",
                   help="seconds to wait for each server (default 240)")
    p.add_argument("--prefix", metavar="DIR", help="the SGLang harness venv")
    p.passthrough_dest = "sglang_args"
    p.set_defaults(func=run_fleet)


def router_options_from(ns: argparse.Namespace):
    from runtime.router import RouterOptions

    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RouterOptions)
             if f.name not in _ROUTER_SKIP}
    return RouterOptions(policy=ns.router_policy, **given)


def thresholds_from(ns: argparse.Namespace) -> tuple[int, ...]:
    if not ns.vllm_replicas:
        if ns.length_thresholds:
            raise UserError("--length-thresholds needs --vllm-replicas")
        return ()
    if not ns.length_thresholds:
        raise UserError("--vllm-replicas needs --length-thresholds (one per vLLM server)")
    try:
        values = tuple(int(v) for v in ns.length_thresholds.split(","))
    except ValueError:
        raise UserError(f"--length-thresholds {ns.length_thresholds!r}: integers, "
                        "comma-separated") from None
    if len(values) != ns.vllm_replicas:
        raise UserError(f"--length-thresholds has {len(values)} values; --vllm-replicas "
                        f"{ns.vllm_replicas} needs {ns.vllm_replicas}")
    return values


def run_fleet(ns: argparse.Namespace) -> int:
    from runtime.cpu.install import HarnessError
    from runtime.fleet import Fleet, FleetSpec

    thresholds = thresholds_from(ns)
    try:
        spec = FleetSpec(replicas=ns.replicas, router=router_options_from(ns),
                         server_args=tuple(ns.sglang_args),
                         server_env=tuple(plugin_env_from(ns).items()),
                         port=None if thresholds else ns.port, log_dir=ns.log_dir,
                         start_timeout_s=ns.start_timeout)
        fleet = Fleet(spec, prefix=ns.prefix)
    except (ValueError, HarnessError) as exc:
        raise UserError(str(exc)) from exc
    _stop_on_signals()
    print(f"starting {ns.replicas} SGLang servers and sglang-router "
          f"(policy {ns.router_policy}); logs in {fleet.log_dir}", flush=True)
    try:
        fleet.start()
        if thresholds:
            return _serve_length_routed(ns, fleet, thresholds)
        for line in fleet.describe():
            print(line, flush=True)
        print(f"ready in {fleet.start_seconds:.0f} s: {fleet.url}  (Ctrl-C stops everything)",
              flush=True)
        code = fleet.router.wait()
        print(f"the router exited with code {code}; log {fleet.router.log_path}",
              file=sys.stderr)
        return 1
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    except KeyboardInterrupt:
        print("stopping the fleet ...", flush=True)
        return 0
    finally:
        fleet.stop()


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both stop the fleet cleanly (a shell's background job starts with
    SIGINT ignored; restore Python's handler so the fleet still stops on it)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)


def _serve_length_routed(ns: argparse.Namespace, fleet, thresholds: tuple[int, ...]) -> int:
    from runtime.length_router import LengthRouterProcess, Pool
    from runtime.vllm_cpu.serve import VllmServer

    servers = [VllmServer(log_path=fleet.log_dir / f"vllm-{i}.log",
                          start_timeout=max(ns.start_timeout, 300.0))
               for i in range(ns.vllm_replicas)]
    try:
        for s in servers:
            print(f"starting vLLM on {s.url} (log {s.log_path})", flush=True)
            s.start()
        bounds = (*thresholds, None)
        pools = [Pool("sglang", fleet.url, "sglang", bounds[0])]
        pools += [Pool(f"vllm-{i}", s.url, "vllm", bounds[i + 1]) for i, s in enumerate(servers)]
        with LengthRouterProcess(pools, port=ns.port,
                                 log_path=fleet.log_dir / "length-router.log") as front:
            for line in fleet.describe():
                print(line, flush=True)
            for pool in pools:
                print(f"  pool {pool.name}: {pool.url} ({pool.engine}, prompts "
                      f"{'<= ' + str(pool.max_prompt_tokens) if pool.max_prompt_tokens else 'above'})",
                      flush=True)
            print(f"ready: {front.url}  (length router; Ctrl-C stops everything)", flush=True)
            front.wait()
        return 1
    finally:
        for s in servers:
            s.stop()
