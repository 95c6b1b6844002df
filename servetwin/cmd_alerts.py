"""`servetwin alerts`: the alert rules as a Prometheus rules file, and their evaluation
over a run directory (`servetwin simulate --out` or `servetwin live replay --out`).
Also the `--alerts` option of `servetwin simulate` (rules evaluated in the twin run)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from twin.errors import ConfigError

DEFAULT = "default"
AUTO = "auto"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "alerts", help="alert rules: export to Prometheus, evaluate over a run",
        description="Alert rules as data (the users' P99-three-windows and fragmentation "
        "rules plus SLO burn-rate rules; docs/monitoring.md). `rules` prints them as a "
        "Prometheus rules file over SGLang's metric names (promtool check rules accepts "
        "it); `eval` evaluates them over a run directory.")
    cmds = p.add_subparsers(dest="alerts_cmd", metavar="{rules,eval}", required=True)
    r = cmds.add_parser("rules", help="print the rules as a Prometheus rules file (YAML)",
                        description="Print the rules as a Prometheus rules file: "
                        "`servetwin alerts rules > rules.yml && promtool check rules rules.yml`.")
    _rule_args(r, burn_default="1")
    r.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="the server's max_running_requests: batch_efficiency becomes "
                   "avg(sglang:num_running_reqs) / N (default: the twin's batch_efficiency "
                   "gauge, which SGLang itself does not export)")
    r.add_argument("--per-instance", action="store_true",
                   help="for a fleet scraped server by server: each rule aggregated `by "
                   "(instance)` (label scope=replica) and, where the metric has a fleet-wide "
                   "value, summed over the instances (scope=fleet); the defragment rule is "
                   "per instance only (docs/monitoring.md)")
    r.set_defaults(func=run_rules)
    e = cmds.add_parser("eval", help="evaluate the rules over a run directory",
                        description="Evaluate the rules over DIR: a `servetwin simulate "
                        "--out` directory (requests.jsonl, timeseries.csv, summary.json) or a "
                        "`servetwin live replay --out` directory (requests.jsonl, "
                        "metrics_*.prom, and metrics_series.jsonl when it was scraped), or a "
                        "fleet's (`servetwin simulate --deployment ... --out`: every rule per "
                        "replica and for the fleet). Prints the alerts with start and end "
                        "times and the metric windows.")
    e.add_argument("dir", type=Path, metavar="DIR")
    _rule_args(e, burn_default=AUTO)
    e.add_argument("--deployment", default=None, metavar="FILE|PRESET",
                   help="a fleet directory written without --alerts: the run's deployment, "
                   "for its replicas' capacities and budgets (default: the summary's "
                   "deployment when it is a preset)")
    e.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="max_running_requests for batch_efficiency (default: from the run; "
                   "a live replay through a fleet: each server's)")
    e.add_argument("--json", action="store_true", help="print JSON (alerts and windows)")
    e.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="also write the alerts as JSON lines to FILE")
    e.set_defaults(func=run_eval)


BURN_HELP = ("multiply every burn-rate rule's windows (the built-in 1 h/5 min and "
             "6 h/30 min, or a rules file's) by F; 'auto': the scale at which the longest "
             "burn-rate window spans the run (at most 1; a 20-minute run: 0.05556, the "
             "slow burn's 6 h/30 min become 1200 s/100 s); the scale used is printed and "
             "stored (simulate: the summary's alerts section; eval: its --json)")


def _rule_args(p: argparse.ArgumentParser, burn_default: str) -> None:
    p.add_argument("--rules", default=DEFAULT, metavar="FILE",
                   help="a YAML/JSON rules file (default: the built-in set)")
    p.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="the evaluation window and interval in seconds (default 60)")
    p.add_argument("--slo-ttft", type=float, default=1.5, metavar="S",
                   help="the built-in rules' TTFT target (default 1.5: the users' P99)")
    if burn_default == AUTO:
        p.add_argument("--burn-scale", default=AUTO, metavar="F|auto",
                       help=BURN_HELP + " (default auto)")
    else:
        p.add_argument("--burn-scale", default=burn_default, metavar="F",
                       help="multiply every burn-rate rule's windows (the built-in 1 h/5 "
                       "min, 6 h/30 min) by F, e.g. 0.0833 for a run of minutes (default 1)")


def burn_scale_arg(text: str, allow_auto: bool = True) -> float | None:
    """`--burn-scale`'s value: a positive number, or None for 'auto'."""
    if allow_auto and text == AUTO:
        return None
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = None
    if v is None or not (v > 0 and math.isfinite(v)):
        allowed = "a positive number or 'auto'" if allow_auto else "a positive number"
        raise ConfigError(f"--burn-scale {text!r}: allowed values: {allowed}")
    return v


def rules_from(spec: str, slo_ttft: float = 1.5, window: float = 60.0,
               flag: str = "--rules"):
    """The rules of `spec` (a file, or 'default'), their burn-rate windows unscaled."""
    from twin.alerts import default_rules, load_rules
    from twin.inputs import POSITIVE, check

    check("--window", window, POSITIVE)
    check("--slo-ttft", slo_ttft, POSITIVE)
    if spec == DEFAULT:
        return default_rules(slo_ttft)
    return load_rules(spec, flag)


def scaled_rules(rules: list, scale: float | None, run_s: float) -> tuple[list, dict]:
    """`rules` with the burn-rate windows scaled (`scale`, or None: auto from the run's
    length), and the summary's record of it."""
    from twin.alerts import auto_burn_scale, burn_windows, scale_burn

    f = auto_burn_scale(rules, run_s) if scale is None else scale
    out = scale_burn(rules, f)
    return out, {"burn_scale": f, "burn_scale_from": "auto" if scale is None else "given",
                 "run_s": round(run_s, 6), "burn_windows_s": burn_windows(out)}


def scale_note(info: dict) -> str | None:
    """One line saying which burn-rate windows were used (None without burn-rate rules)."""
    wins = info["burn_windows_s"]
    if not wins:
        return None
    why = (f"auto: the longest window spans the run's {info['run_s']:.0f} s"
           if info["burn_scale_from"] == "auto" else "--burn-scale")
    each = "; ".join(f"{n} {lw:g} s / {sw:g} s" for n, (lw, sw) in wins.items())
    return f"burn-rate windows x{info['burn_scale']:g} ({why}): {each}"


def run_rules(ns: argparse.Namespace) -> int:
    from twin.alerts import scale_burn
    from twin.prometheus_rules import prometheus_fleet_rules, prometheus_rules

    rules = rules_from(ns.rules, ns.slo_ttft, ns.window)
    rules = scale_burn(rules, burn_scale_arg(ns.burn_scale, allow_auto=False))
    if ns.max_running is not None and ns.max_running < 1:
        raise ConfigError(f"--max-running {ns.max_running}: must be >= 1")
    if ns.per_instance:
        sys.stdout.write(prometheus_fleet_rules(rules, ns.window, ns.max_running))
    else:
        sys.stdout.write(prometheus_rules(rules, ns.window, ns.max_running))
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    from runtime.live_metrics import load_run
    from twin.alerts import alerts_jsonl, evaluate, evaluation_end, needs_series
    from twin.monitoring import metric_windows, windows_json
    from twin.outputs import atomic_write_text, check_out_file

    rules = rules_from(ns.rules, ns.slo_ttft, ns.window)
    scale = burn_scale_arg(ns.burn_scale)
    if ns.out:
        check_out_file(ns.out)
    run = load_run(ns.dir, ns.deployment)
    if run.replicas:  # a simulated fleet, or a live replay through a fleet's router
        return _eval_fleet(ns, rules, scale, run)
    if ns.deployment:
        raise ConfigError(f"--deployment {ns.deployment}: {ns.dir} is a {run.kind} run of "
                          "one server, not a fleet's (its timeseries.csv has no replica "
                          "column); drop the flag")
    max_running = ns.max_running or run.max_running
    usable = [r for r in rules if not needs_series(r) or r.metric in run.gauges]
    skipped = [r for r in rules if r not in usable]
    usable, info = scaled_rules(usable, scale, evaluation_end(run.records, run.gauges))
    alerts = evaluate(usable, run.records, run.gauges, ns.window, max_running)
    if ns.out:
        atomic_write_text(ns.out, alerts_jsonl(alerts))
    windows = metric_windows(run.records, run.gauges, max_running, ns.window)
    if ns.json:
        print(json.dumps({"run": run.kind, "window_s": ns.window, **info,
                          "alerts": [a.to_json() for a in alerts],
                          "skipped": [r.name for r in skipped],
                          "windows": windows_json(windows)}, indent=2))
        return 0
    print(f"{ns.dir}: {run.kind} run, {len(run.records)} records, windows of {ns.window:g} s")
    if scale_note(info):
        print(scale_note(info))
    print(format_alerts(alerts))
    for r in skipped:
        print(f"not evaluated: {r.name} ({r.metric}: this run has no sampled {r.metric}"
              f"{'; SGLang exports none' if r.metric == 'kv_external_fragmentation' else ''})")
    print(format_windows(windows))
    return 0


def _eval_fleet(ns: argparse.Namespace, rules: list, scale: float | None, run) -> int:
    """`alerts eval` over a fleet directory: every rule per replica and for the fleet.
    A live fleet's `--max-running N` is every server's budget."""
    from dataclasses import replace

    from twin.alerts import alerts_jsonl, needs_series
    from twin.fleet_alerts import evaluate_fleet, fleet_end
    from twin.outputs import atomic_write_text

    if ns.max_running is not None:
        if run.kind == "fleet":
            raise ConfigError("--max-running: a simulated fleet's replicas each have their "
                              "own budget (read from the run); drop the flag")
        run.replicas = [replace(v, max_running=ns.max_running) for v in run.replicas]
    skipped = [r for r in rules if needs_series(r)
               and not any(r.metric in v.gauges for v in run.replicas)]
    rules = [r for r in rules if r not in skipped]
    rules, info = scaled_rules(rules, scale, fleet_end(run.records, run.replicas))
    alerts = evaluate_fleet(rules, run.records, run.replicas, ns.window)
    if ns.out:
        atomic_write_text(ns.out, alerts_jsonl(alerts))
    windows = scope_windows(run.records, run.replicas, ns.window)
    if ns.json:
        from twin.monitoring import windows_json

        print(json.dumps({"run": run.kind, "fleet": True, "window_s": ns.window, **info,
                          "replicas": [r.name for r in run.replicas],
                          "alerts": [a.to_json() for a in alerts],
                          "skipped": [r.name for r in skipped],
                          "windows": {k: windows_json(w) for k, w in windows.items()}},
                         indent=2))
        return 0
    kind = "fleet run" if run.kind == "fleet" else "live replay through a fleet"
    print(f"{ns.dir}: {kind}, {len(run.records)} records, replicas "
          f"{', '.join(r.name for r in run.replicas)}, windows of {ns.window:g} s")
    if scale_note(info):
        print(scale_note(info))
    print(format_alerts(alerts))
    for r in skipped:
        print(f"not evaluated: {r.name} ({r.metric}: this run has no per-replica sampled "
              f"{r.metric})")
    for scope, w in windows.items():
        print(f"{scope}:")
        print(format_windows(w))
    return 0


def scope_windows(records: list, replicas: list, window_s: float) -> dict:
    """{"fleet": its windows, replica: its windows} on the fleet's grid."""
    from twin.fleet_alerts import fleet_end, fleet_windows
    from twin.monitoring import metric_windows

    end = fleet_end(records, replicas)
    out = {"fleet": fleet_windows(records, replicas, window_s, end)}
    for v in replicas:
        mine = [r for r in records if r.get("replica") == v.name]
        out[v.name] = metric_windows(mine, v.gauges or None, v.max_running, window_s, end)
    return out


def format_alerts(alerts) -> str:
    if not alerts:
        return "alerts: none"
    lines = ["alerts:"]
    for a in alerts:
        end = f"{a.end_s:.0f} s" if a.end_s is not None else "still firing at the end"
        act = f", action {a.action}" if a.action else ""
        who = f"{a.replica}: " if a.replica else ""
        lines.append(f"  {who}{a.rule} [{a.severity}] {a.metric} > {a.threshold:g}: pending from "
                     f"{a.since_s:.0f} s, fired {a.start_s:.0f} s, resolved {end}; peak "
                     f"{a.peak:.4g}{act}")
    return "\n".join(lines)


SHOWN = ("ttft_p99", "queue_p99", "radix_sharing_ratio", "batch_efficiency",
         "memory_pressure_score", "kv_external_fragmentation")


def format_windows(windows: dict) -> str:
    names = [n for n in SHOWN if n in windows]
    head = "window_s  " + "  ".join(f"{n:>24s}" for n in names)
    rows = [head]
    for k, w in enumerate(windows[names[0]]):
        cells = [windows[n][k].value for n in names]
        rows.append(f"{w.start_s:8.0f}  " + "  ".join(
            f"{'-' if v is None else f'{v:.4g}':>24s}" for v in cells))
    return "\n".join(rows)


# ---- `servetwin simulate --alerts` --------------------------------------------------------
def add_simulate_args(group) -> None:
    group.add_argument("--alerts", default=None, metavar="FILE",
                       help="evaluate alert rules over the run ('default' for the built-in "
                       "set, or a YAML/JSON rules file; docs/monitoring.md): the summary "
                       "gets an 'alerts' section and --out an alerts.jsonl; a "
                       "'defragment' rule sets --defrag-threshold when that is not given. "
                       "With --deployment: every rule per replica and for the fleet")
    group.add_argument("--alert-window", type=float, default=60.0, metavar="S",
                       help="the alert rules' window in simulated seconds (default 60)")
    group.add_argument("--burn-scale", default=AUTO, metavar="F|auto",
                       help="with --alerts: " + BURN_HELP + " (default auto)")


def simulate_rules(ns: argparse.Namespace) -> list:
    """The rules of `--alerts` (empty without it); a defragment rule over the KV
    fragmentation becomes `--defrag-threshold` when that was not given."""
    if not ns.alerts:
        given = [f for f, on in (("--burn-scale", ns.burn_scale != AUTO),
                                 ("--alert-window", ns.alert_window != 60.0)) if on]
        if given:
            raise ConfigError(f"{given[0]}: only with --alerts (FILE or default)")
        return []
    burn_scale_arg(ns.burn_scale)  # refuse a bad value before the run
    rules = rules_from(ns.alerts, ns.slo_ttft, ns.alert_window, "--alerts")
    thr = defrag_threshold(rules)
    if thr is not None:
        if ns.defrag_threshold is None:
            ns.defrag_threshold = thr
        elif ns.defrag_threshold != thr:
            print(f"servetwin: note: --defrag-threshold {ns.defrag_threshold} compacts; "
                  f"alert rule's defragment threshold is {thr}", file=sys.stderr)
    return rules


def defrag_threshold(rules: list) -> float | None:
    """The threshold of the first `defragment` rule over the KV fragmentation, if any."""
    return next((r.threshold for r in rules if r.action == "defragment"
                 and r.metric == "kv_external_fragmentation"), None)


def attach_alerts(rules: list, result, window_s: float, burn_scale: str = AUTO) -> tuple:
    """Evaluate `rules` over a finished simulation; the summary's `alerts` section.
    Returns (alerts, the burn-scale line to print or None)."""
    from twin.alerts import evaluate, evaluation_end
    from twin.metrics import SERIES_FIELDS
    from twin.monitoring import twin_gauges

    cap = result.capacity
    gauges = twin_gauges(result.series, SERIES_FIELDS, cap.max_total_num_tokens)
    rules, info = scaled_rules(rules, burn_scale_arg(burn_scale),
                               evaluation_end(result.records, gauges))
    alerts = evaluate(rules, result.records, gauges, window_s, cap.max_running_requests)
    log = result.compaction_log
    result.summary["alerts"] = {
        "window_s": window_s, **info, "rules": [r.name for r in rules],
        "max_running_requests": cap.max_running_requests,
        "capacity_tokens": cap.max_total_num_tokens,
        "fired": [a.to_json() for a in alerts],
        "compactions": compactions(log),
    }
    return alerts, scale_note(info)


def compactions(log: list) -> dict:
    return {"count": len(log), "by_cause": _by_cause(log), "times_s": [t for t, _, _ in log]}


def attach_fleet_alerts(rules: list, res, window_s: float, burn_scale: str = AUTO) -> tuple:
    """Evaluate `rules` over a finished fleet run (`twin.fleet.FleetResult`) per replica and
    for the fleet; the summary's `alerts` section. Returns (alerts, the burn-scale line)."""
    from twin.fleet_alerts import evaluate_fleet, fleet_end, replica_views
    from twin.metrics import SERIES_FIELDS
    from twin.monitoring import twin_gauges

    views = replica_views(res.deployment,
                          lambda series, cap: twin_gauges(series, SERIES_FIELDS, cap))
    rules, info = scaled_rules(rules, burn_scale_arg(burn_scale),
                               fleet_end(res.records, views))
    alerts = evaluate_fleet(rules, res.records, views, window_s)
    reps = {}
    for v, w in zip(views, res.deployment.workers, strict=True):
        log = getattr(w.replica, "compaction_log", None)
        reps[v.name] = {"pool": v.pool, "kind": v.kind, "capacity_tokens": v.capacity_tokens,
                        "max_running_requests": v.max_running,
                        "fired": sum(a.replica == v.name for a in alerts),
                        **({"compactions": compactions(log)} if log is not None else {})}
    res.summary["alerts"] = {
        "window_s": window_s, **info, "rules": [r.name for r in rules],
        "scopes": ["fleet", *reps], "fleet_fired": sum(a.replica == "fleet" for a in alerts),
        "replicas": reps, "fired": [a.to_json() for a in alerts],
    }
    return alerts, scale_note(info)


def _by_cause(log: list) -> dict:
    out: dict[str, int] = {}
    for _, cause, _ in log:
        out[cause] = out.get(cause, 0) + 1
    return dict(sorted(out.items()))
