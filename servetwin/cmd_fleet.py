"""`servetwin simulate --deployment FILE|PRESET`: a workload through a simulated fleet.

Only argument handling and printing; the fleet is `twin.fleet.simulate_fleet`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from servetwin.args import given_server_args, workload_from
from twin.errors import ConfigError
from twin.faults import Fault
from twin.metrics import SLO, format_summary
from twin.outputs import check_out_dir

# simulate's flags that describe one server: a deployment names its own
_ONE_SERVER = ("calibration", "policy", "step_time_backend")
# simulate's twin-only flags (its dest names): a deployment sets them per replica (`twin:`)
_TWIN_ONLY = ("preemption_mode", "time_slice_ms", "priority_weights", "preemption_threshold",
              "swap_min_tokens", "host_kv_bytes", "kv_allocator", "buddy_min_block",
              "kv_reserve_fraction", "defrag_every", "defrag_threshold", "ignore_eos")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (docs/fleet.md)")
    g.add_argument("--deployment", default=None, metavar="FILE|PRESET",
                   help="simulate a fleet: a YAML/JSON deployment (pools, replicas, router, "
                   "failover, faults) or a preset (finance-hybrid, finance-sglang-pool, "
                   "finance-sglang-cache-aware); server flags then come from the file")
    g.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="add a fault: crash:REPLICA:AT_S[:REPAIR_S], "
                   "slow:REPLICA:AT_S[:FACTOR[:DURATION_S]], hang:REPLICA:AT_S[:DURATION_S] "
                   "(repeatable; with --deployment)")


def run(ns: argparse.Namespace, default_workload: str) -> int:
    from twin.fleet import load_spec, simulate_fleet

    given = sorted(given_server_args(ns)) + [k for k in _ONE_SERVER if getattr(ns, k, None)]
    if given:
        raise ConfigError(f"--deployment {ns.deployment}: server flags come from the "
                          f"deployment; drop --{given[0].replace('_', '-')} (or put it in "
                          "the file's server_args)")
    parser = getattr(ns, "_parser", None)
    twin = [k for k in _TWIN_ONLY if parser is not None and hasattr(ns, k)
            and getattr(ns, k) != parser.get_default(k)]
    if twin:
        flag = "--no-ignore-eos" if twin[0] == "ignore_eos" else "--" + twin[0].replace("_", "-")
        raise ConfigError(f"--deployment {ns.deployment}: twin settings come from the "
                          f"deployment; drop {flag} (or set it in each replica's twin: "
                          "section, by SimConfig's field name; docs/fleet.md)")
    spec = load_spec(ns.deployment)
    faults = [Fault.parse(f) for f in ns.fault]
    names = {r.name for r in spec.replicas}
    for f in faults:
        if f.replica not in names:
            raise ConfigError(f"--fault {f.kind}:{f.replica}:...: no replica {f.replica!r}; "
                              f"replicas: {', '.join(r.name for r in spec.replicas)}")
    spec = replace(spec, faults=[*spec.faults, *faults])
    workload = workload_from(ns, default_workload)
    slo = SLO(ns.slo_ttft, ns.slo_tpot, ns.slo_e2e)
    if ns.out:
        check_out_dir(ns.out)
    if not ns.json:
        print(f"workload: {workload.name} ({len(workload.requests)} requests"
              + (f", closed loop x{workload.concurrency}" if workload.concurrency else "")
              + ")")
        print(describe(spec))
    def started() -> None:
        if not ns.json:
            print(f"simulating {len(workload.requests)} requests on {len(spec.replicas)} "
                  "replicas ...", file=sys.stderr, flush=True)

    from servetwin.cmd_alerts import simulate_rules

    rules = simulate_rules(ns)  # --alerts: per replica and for the fleet
    if rules:
        res, alerts, note = _with_alerts(spec, workload, slo, ns, rules, started)
    else:
        res = simulate_fleet(spec, workload, slo, horizon_s=ns.horizon,
                             debug_checks=ns.debug_checks, on_start=started, out=ns.out,
                             record_chunk=ns.record_chunk)
    if ns.out:
        res.write(ns.out)
        if rules:
            from twin.alerts import alerts_jsonl
            from twin.outputs import atomic_write_text

            atomic_write_text(ns.out / "alerts.jsonl", alerts_jsonl(alerts))
    if ns.json:
        print(json.dumps(res.summary, indent=2, default=str))
    else:
        print(format_fleet(res.summary))
        print(format_loops(res.deployment.workers))
        if rules:
            from servetwin.cmd_alerts import format_alerts

            if note:
                print(note)
            print(format_alerts(alerts))
        if ns.out:
            print(f"wrote {ns.out}/requests.jsonl (with replica, pool, attempts), summary.json, "
                  "timeseries.csv (a replica column)" + (", alerts.jsonl" if rules else ""))
    if res.interrupted:
        from servetwin.cmd_simulate import interrupted_note

        print(interrupted_note(res.interrupted, res.summary, ns.out), file=sys.stderr)
        return 130
    return 0


def _with_alerts(spec, workload, slo, ns: argparse.Namespace, rules: list, started):
    """The fleet run of `--alerts`: a defragment rule sets each SGLang replica's
    defrag_threshold where its spec has none; compactions are logged per replica."""
    import simpy

    from servetwin.cmd_alerts import attach_fleet_alerts, defrag_threshold
    from twin.fleet import build_fleet, run_deployment

    thr = defrag_threshold(rules)
    if thr is not None:
        spec = replace(spec, replicas=[
            replace(r, twin=(*r.twin, ("defrag_threshold", thr)))
            if r.engine == "sglang" and "defrag_threshold" not in dict(r.twin) else r
            for r in spec.replicas])
    dep = build_fleet(simpy.Environment(), spec, workload, ns.horizon,
                      debug_checks=ns.debug_checks)
    for w in dep.workers:
        if hasattr(w.replica, "compaction_log"):
            w.replica.compaction_log = []
    started()
    res = run_deployment(dep, slo, ns.out, ns.record_chunk)
    res.summary["deployment"] = spec.name
    alerts, note = attach_fleet_alerts(rules, res, ns.alert_window, ns.burn_scale)
    return res, alerts, note


def describe(spec) -> str:
    r = dict(spec.router)
    lines = [f"deployment {spec.name}: router {r.pop('name')}"
             + (f" {r}" if r else "")]
    for pool in spec.pools:
        reps = [x for x in spec.replicas if x.pool == pool]
        inner = spec.pool_routers.get(pool)
        lines.append(f"  pool {pool}" + (f" (router {inner['name']})" if inner else "") + ": "
                     + ", ".join(f"{x.name} {x.engine} {_tp(x)}x {x.gpu}" for x in reps))
    for f in spec.faults:
        lines.append(f"  fault {f}")
    return "\n".join(lines)


def _tp(rep) -> int:
    args = dict(rep.server_args)
    return args.get("tp_size") or args.get("tensor_parallel_size") or 1


def format_loops(workers) -> str:
    """Which scheduler loop ran each replica: the typed core, or the Python replica and
    why (twin/core.py `why_not_fleet`)."""
    typed = [w.name for w in workers if w.loop is None]
    why: dict[str, list[str]] = {}
    for w in workers:
        if w.loop is not None:
            why.setdefault(w.loop, []).append(w.name)
    parts = [f"the typed core (twin/_corec.pyx) on {', '.join(typed)}"] if typed else []
    parts += [f"the Python replica on {', '.join(names)} ({reason})"
              for reason, names in why.items()]
    return "scheduler loop: " + "; ".join(parts)


def format_fleet(s: dict) -> str:
    out = [f"fleet ({s['gpus']} GPUs):", format_summary(s),
           f"failover: {s['failover']}"]
    if "router_decisions" in s:
        out.append(f"router decisions: {s['router_decisions']}")
    for name, part in s["pools"].items():
        out.append(_line(f"pool {name}", part))
    for name, part in s["replicas"].items():
        extra = ""
        if part["crashes"] or part["health_events"] or part["breaker_opens"]:
            extra = (f"; crashes {part['crashes']}, health {part['health_events']}, "
                     f"breaker opens {part['breaker_opens']}")
        out.append(_line(f"replica {name} ({part['kind']}, {part['pool']})", part)
                   + f"; routed {part['routed']}" + extra)
    return "\n".join(out)


def _line(label: str, part: dict) -> str:
    t = part["ttft_s"]
    ttft = "-" if t["p99"] is None else f"{t['p50'] * 1e3:.0f}/{t['p99'] * 1e3:.0f} ms"
    slo = part.get("slo", {}).get("attainment")
    return (f"  {label}: {part['requests']} requests {part['status']}; TTFT p50/p99 {ttft}"
            + (f"; SLO {slo:.1%}" if slo is not None else "") + f"; {part['gpus']} GPUs")
