"""`servetwin alerts`: the alert rules as a Prometheus rules file, and their evaluation
over a run directory (`servetwin simulate --out` or `servetwin live replay --out`).
Also the `--alerts` option of `servetwin simulate` (rules evaluated in the twin run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from twin.errors import ConfigError

DEFAULT = "default"


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
    _rule_args(r)
    r.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="the server's max_running_requests: batch_efficiency becomes "
                   "avg(sglang:num_running_reqs) / N (default: the twin's batch_efficiency "
                   "gauge, which SGLang itself does not export)")
    r.set_defaults(func=run_rules)
    e = cmds.add_parser("eval", help="evaluate the rules over a run directory",
                        description="Evaluate the rules over DIR: a `servetwin simulate "
                        "--out` directory (requests.jsonl, timeseries.csv, summary.json) or a "
                        "`servetwin live replay --out` directory (requests.jsonl, "
                        "metrics_*.prom, and metrics_series.jsonl when it was scraped). "
                        "Prints the alerts with start and end times and the metric windows.")
    e.add_argument("dir", type=Path, metavar="DIR")
    _rule_args(e)
    e.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="max_running_requests for batch_efficiency (default: from the run)")
    e.add_argument("--json", action="store_true", help="print JSON (alerts and windows)")
    e.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="also write the alerts as JSON lines to FILE")
    e.set_defaults(func=run_eval)


def _rule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rules", default=DEFAULT, metavar="FILE",
                   help="a YAML/JSON rules file (default: the built-in set)")
    p.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="the evaluation window and interval in seconds (default 60)")
    p.add_argument("--slo-ttft", type=float, default=1.5, metavar="S",
                   help="the built-in rules' TTFT target (default 1.5: the users' P99)")
    p.add_argument("--burn-scale", type=float, default=1.0, metavar="F",
                   help="multiply the built-in burn-rate windows (1 h/5 min, 6 h/30 min) by "
                   "F, e.g. 0.0833 for a run of minutes (default 1)")


def rules_from(spec: str, slo_ttft: float = 1.5, burn_scale: float = 1.0, window: float = 60.0,
               flag: str = "--rules"):
    from twin.alerts import default_rules, load_rules
    from twin.inputs import POSITIVE, check

    check("--window", window, POSITIVE)
    check("--slo-ttft", slo_ttft, POSITIVE)
    check("--burn-scale", burn_scale, POSITIVE)
    if spec == DEFAULT:
        return default_rules(slo_ttft, burn_scale)
    return load_rules(spec, flag)


def run_rules(ns: argparse.Namespace) -> int:
    from twin.alerts import prometheus_rules

    rules = rules_from(ns.rules, ns.slo_ttft, ns.burn_scale, ns.window)
    if ns.max_running is not None and ns.max_running < 1:
        raise ConfigError(f"--max-running {ns.max_running}: must be >= 1")
    sys.stdout.write(prometheus_rules(rules, ns.window, ns.max_running))
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    from runtime.live_metrics import load_run
    from twin.alerts import alerts_jsonl, evaluate, needs_series
    from twin.monitoring import metric_windows, windows_json
    from twin.outputs import atomic_write_text, check_out_file

    rules = rules_from(ns.rules, ns.slo_ttft, ns.burn_scale, ns.window)
    if ns.out:
        check_out_file(ns.out)
    run = load_run(ns.dir)
    max_running = ns.max_running or run.max_running
    usable = [r for r in rules if not needs_series(r) or r.metric in run.gauges]
    skipped = [r for r in rules if r not in usable]
    alerts = evaluate(usable, run.records, run.gauges, ns.window, max_running)
    if ns.out:
        atomic_write_text(ns.out, alerts_jsonl(alerts))
    windows = metric_windows(run.records, run.gauges, max_running, ns.window)
    if ns.json:
        print(json.dumps({"run": run.kind, "window_s": ns.window,
                          "alerts": [a.to_json() for a in alerts],
                          "skipped": [r.name for r in skipped],
                          "windows": windows_json(windows)}, indent=2))
        return 0
    print(f"{ns.dir}: {run.kind} run, {len(run.records)} records, windows of {ns.window:g} s")
    print(format_alerts(alerts))
    for r in skipped:
        print(f"not evaluated: {r.name} ({r.metric}: this run has no sampled {r.metric}"
              f"{'; SGLang exports none' if r.metric == 'kv_external_fragmentation' else ''})")
    print(format_windows(windows))
    return 0


def format_alerts(alerts) -> str:
    if not alerts:
        return "alerts: none"
    lines = ["alerts:"]
    for a in alerts:
        end = f"{a.end_s:.0f} s" if a.end_s is not None else "still firing at the end"
        act = f", action {a.action}" if a.action else ""
        lines.append(f"  {a.rule} [{a.severity}] {a.metric} > {a.threshold:g}: pending from "
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
                       "'defragment' rule sets --defrag-threshold when that is not given")
    group.add_argument("--alert-window", type=float, default=60.0, metavar="S",
                       help="the alert rules' window in simulated seconds (default 60)")


def simulate_rules(ns: argparse.Namespace) -> list:
    """The rules of `--alerts` (empty without it); a defragment rule over the KV
    fragmentation becomes `--defrag-threshold` when that was not given."""
    if not ns.alerts:
        return []
    rules = rules_from(ns.alerts, ns.slo_ttft, 1.0, ns.alert_window, "--alerts")
    for r in rules:
        if r.action == "defragment" and r.metric == "kv_external_fragmentation":
            if ns.defrag_threshold is None:
                ns.defrag_threshold = r.threshold
            elif ns.defrag_threshold != r.threshold:
                print(f"servetwin: note: --defrag-threshold {ns.defrag_threshold} compacts; "
                      f"alert rule {r.name} fires above {r.threshold}", file=sys.stderr)
    return rules


def attach_alerts(rules: list, result, window_s: float) -> list:
    """Evaluate `rules` over a finished simulation; the summary's `alerts` section."""
    from twin.alerts import evaluate
    from twin.metrics import SERIES_FIELDS
    from twin.monitoring import twin_gauges

    cap = result.capacity
    gauges = twin_gauges(result.series, SERIES_FIELDS, cap.max_total_num_tokens)
    alerts = evaluate(rules, result.records, gauges, window_s, cap.max_running_requests)
    log = result.compaction_log
    result.summary["alerts"] = {
        "window_s": window_s, "rules": [r.name for r in rules],
        "max_running_requests": cap.max_running_requests,
        "capacity_tokens": cap.max_total_num_tokens,
        "fired": [a.to_json() for a in alerts],
        "compactions": {"count": len(log), "by_cause": _by_cause(log),
                        "times_s": [t for t, _, _ in log]},
    }
    return alerts


def _by_cause(log: list) -> dict:
    out: dict[str, int] = {}
    for _, cause, _ in log:
        out[cause] = out.get(cause, 0) + 1
    return dict(sorted(out.items()))
