"""Alert rules as data, evaluated over a run's windowed metrics.

A rule is a frozen `Rule` read from YAML/JSON (`load_rules`) or the default set
(`default_rules`: the users' two rules and two SLO burn-rate rules). `evaluate` runs the
rules over a run's records (and its sampled series) and returns `Alert`s with the time
they fired and the time they resolved; `twin.prometheus_rules` writes the same rules as a
Prometheus rules file over SGLang's metric names, which `promtool check rules` accepts.

How the twin's evaluation maps onto Prometheus (docs/monitoring.md):
- a `threshold` rule reads one value per tumbling window of `window_s` (what a PromQL
  `rate(...[window])` evaluated every `window` gives); "over in N consecutive windows"
  fires at the end of the N-th, which is Prometheus' `for: (N - 1) x window` with the rule
  group's `interval: window`; the first window not over resolves it, an empty window (no
  observations: PromQL gives no value) included;
- a `burn_rate` rule (Google SRE's multi-window form) is evaluated at every window end t:
  the error ratio (share of observations over the SLO's threshold) over (t - long, t] and
  over (t - short, t], each divided by the error budget (1 - objective); it fires while
  both exceed `factor`.
Pure and deterministic: same inputs, same alerts, in rule order then time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from twin.errors import ConfigError
from twin.monitoring import (
    LATENCIES,
    Window,
    metric_windows,
    run_end,
    window_edges,
)

KINDS = ("threshold", "burn_rate")
SEVERITIES = ("info", "yellow", "warning", "page", "critical")
ACTIONS = ("defragment",)
GAUGE_METRICS = ("memory_pressure_score", "kv_eviction_rate", "kv_external_fragmentation",
                 "num_running_reqs", "num_queue_reqs")
RECORD_METRICS = tuple(f"{m}_p{q}" for m in LATENCIES for q in (50, 99)) + (
    "radix_sharing_ratio", "batch_efficiency")
METRICS = RECORD_METRICS + GAUGE_METRICS


@dataclass(frozen=True)
class Rule:
    """One alert rule. `threshold`: `metric` (a windowed metric: METRICS) above
    `threshold` in `windows` consecutive windows. `burn_rate`: the SLO "`objective` of
    `metric` observations (a latency: ttft, e2e, ...) at most `threshold` seconds" burning
    its error budget faster than `factor` over both `long_window_s` and `short_window_s`.
    `action`: what the twin does while it fires (`defragment`: compaction)."""

    name: str
    metric: str
    threshold: float
    kind: str = "threshold"
    windows: int = 1
    severity: str = "warning"
    action: str | None = None
    objective: float | None = None  # burn_rate: e.g. 0.99
    long_window_s: float | None = None
    short_window_s: float | None = None
    factor: float | None = None
    description: str = ""

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ConfigError(f"alert rule {self.name!r}: {problem}")


def _problem(r: Rule) -> str | None:
    if not r.name or not r.name.replace("_", "").isalnum():
        return "name: letters, digits and _ only"
    if r.kind not in KINDS:
        return f"kind {r.kind!r}: allowed values: {', '.join(KINDS)}"
    if r.severity not in SEVERITIES:
        return f"severity {r.severity!r}: allowed values: {', '.join(SEVERITIES)}"
    if r.action is not None and r.action not in ACTIONS:
        return f"action {r.action!r}: allowed values: {', '.join(ACTIONS)} (or null)"
    if not _finite(r.threshold):
        return f"threshold {r.threshold!r}: a finite number expected"
    if r.kind == "threshold":
        if r.metric not in METRICS:
            return f"metric {r.metric!r}: allowed values: {', '.join(METRICS)}"
        if not isinstance(r.windows, int) or isinstance(r.windows, bool) or r.windows < 1:
            return f"windows {r.windows!r}: an integer >= 1 expected"
        return None
    if r.metric not in LATENCIES:
        return f"metric {r.metric!r}: a burn_rate rule reads a latency: {', '.join(LATENCIES)}"
    if not (_finite(r.objective) and 0 < r.objective < 1):
        return f"objective {r.objective!r}: a number in (0, 1) expected, e.g. 0.99"
    for key in ("long_window_s", "short_window_s", "factor"):
        v = getattr(r, key)
        if not (_finite(v) and v > 0):
            return f"{key} {v!r}: a positive number expected"
    if r.short_window_s >= r.long_window_s:
        return "short_window_s must be shorter than long_window_s"
    return None


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def default_rules(slo_ttft_s: float = 1.5, burn_scale: float = 1.0) -> list[Rule]:
    """The users' two rules and Google SRE's two burn-rate rules on the TTFT SLO (99 % of
    requests within `slo_ttft_s`): fast 1 h / 5 min at 14.4x, slow 6 h / 30 min at 6x;
    `burn_scale` multiplies the four windows (e.g. 1/12 for a run of minutes)."""
    burn = dict(kind="burn_rate", metric="ttft", threshold=slo_ttft_s, objective=0.99)
    return [
        Rule("ttft_p99_three_windows", "ttft_p99", slo_ttft_s, windows=3, severity="yellow",
             description="the users' rule: P99 TTFT over the SLO three windows in a row"),
        Rule("kv_fragmentation_defragment", "kv_external_fragmentation", 0.25,
             severity="info", action="defragment",
             description="the users' rule: KV external fragmentation above 25 % -> "
             "defragment (in the twin: --defrag-threshold)"),
        Rule("ttft_slo_fast_burn", severity="page", long_window_s=3600 * burn_scale,
             short_window_s=300 * burn_scale, factor=14.4,
             description="2 % of a 30-day error budget in an hour", **burn),
        Rule("ttft_slo_slow_burn", severity="warning", long_window_s=21600 * burn_scale,
             short_window_s=1800 * burn_scale, factor=6.0,
             description="5 % of a 30-day error budget in six hours", **burn),
    ]


# ---- reading rules ----------------------------------------------------------------------
_KEYS = {f.name for f in fields(Rule)}


def load_rules(path: Path | str, flag: str = "--rules") -> list[Rule]:
    """Rules from a YAML or JSON file: `{"rules": [{name, metric, threshold, ...}, ...]}`
    (or the list itself). `ConfigError` naming the file, the line and the key."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        doc, lines = yaml.safe_load(text), _item_lines(yaml.compose(text))
    except OSError as exc:
        raise ConfigError(f"{flag} {p}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {p}: not YAML or JSON: {exc}") from None
    items = doc.get("rules") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"rules"}:
        raise ConfigError(f"{p}: unknown top-level key {sorted(set(doc) - {'rules'})[0]!r} "
                          "(allowed: rules)")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{p}: a non-empty list of rules expected under 'rules'")
    out, names = [], set()
    for i, item in enumerate(items):
        where = f"{p}:{lines[i] if i < len(lines) else '?'}: rule {i + 1}"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: a mapping expected, got {type(item).__name__}")
        unknown = sorted(set(item) - _KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: "
                              f"{', '.join(sorted(_KEYS))})")
        missing = [k for k in ("name", "metric", "threshold") if k not in item]
        if missing:
            raise ConfigError(f"{where}: missing key {missing[0]!r}")
        try:
            rule = Rule(**item)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if rule.name in names:
            raise ConfigError(f"{where}: duplicate rule name {rule.name!r}")
        names.add(rule.name)
        out.append(rule)
    return out


def _item_lines(node) -> list[int]:
    """1-based line of each rule in a composed YAML document."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "rules"), None)
    if not isinstance(node, yaml.SequenceNode):
        return []
    return [item.start_mark.line + 1 for item in node.value]


def rules_json(rules: Sequence[Rule]) -> dict:
    return {"rules": [{k: v for k, v in asdict(r).items() if v is not None} for r in rules]}


# ---- evaluation -------------------------------------------------------------------------
@dataclass(frozen=True)
class Alert:
    """A rule that fired: from `start_s` (the evaluation that fired it: a window's end) to
    `end_s` (the first evaluation that found it over no more; None: still firing when the
    run ended). `since_s`: when its
    condition first held (Prometheus' pending state); `peak`: its largest value meanwhile."""

    rule: str
    severity: str
    metric: str
    threshold: float
    since_s: float
    start_s: float
    end_s: float | None
    peak: float
    action: str | None = None
    replica: str | None = None  # a fleet's: the replica's name, or "fleet" (fleet-wide)
    pool: str | None = None  # a fleet's: the replica's pool (None for "fleet")

    def to_json(self) -> dict:
        """As JSON; a single server's alerts leave out the fleet's `replica` and `pool`."""
        d = asdict(self)
        if self.replica is None:
            del d["replica"], d["pool"]
        return d


def needs_series(rule: Rule) -> bool:
    return rule.kind == "threshold" and rule.metric in GAUGE_METRICS


def evaluate(rules: Sequence[Rule], records: Sequence[dict], series: dict | None = None,
             window_s: float = 60.0, max_running: int | None = None,
             t_end: float | None = None) -> list[Alert]:
    """The alerts `rules` raise over a run. `records`: the run's request records; `series`:
    its sampled gauges by name (`twin.monitoring.twin_gauges`, or the live scrape's);
    a rule over a gauge that is not given raises `ConfigError`. In rule order, then time."""
    missing = [r.name for r in rules if needs_series(r) and r.metric not in (series or {})]
    if missing:
        raise ConfigError(f"alert rules {', '.join(missing)} read a sampled series the run "
                          "does not have (give the run's timeseries or scraped metrics)")
    end = evaluation_end(records, series, t_end)
    windows = metric_windows(records, series, max_running, window_s, end, read_by(rules))
    return evaluate_windows(rules, windows, records, window_s, end)


def read_by(rules: Sequence[Rule]) -> set[str]:
    """The windowed metrics the threshold rules of `rules` read."""
    return {r.metric for r in rules if r.kind == "threshold"}


def evaluation_end(records: Sequence[dict], series: dict | None = None,
                   t_end: float | None = None) -> float:
    """Where `evaluate` ends a run: `t_end`, or the last record event, and no earlier than
    the last sample of `series`."""
    end = run_end(records) if t_end is None else t_end
    if series:
        end = max([end] + [ts[-1] for ts, _ in series.values() if ts])
    return end


def evaluate_windows(rules: Sequence[Rule], windows: dict[str, list[Window]],
                     records: Sequence[dict], window_s: float, t_end: float) -> list[Alert]:
    """`evaluate` over windows already computed (`metric_windows`, or a fleet's
    aggregate): threshold rules read `windows`, burn-rate rules the records."""
    out: list[Alert] = []
    for rule in rules:
        if rule.kind == "threshold":
            out += threshold_alerts(rule, windows[rule.metric])
        else:
            out += burn_alerts(rule, records, window_s, t_end)
    return out


# ---- burn-rate windows scaled to a run ------------------------------------------------
def scale_burn(rules: Sequence[Rule], factor: float) -> list[Rule]:
    """`rules` with every burn-rate rule's long and short windows multiplied by `factor`."""
    return [replace(r, long_window_s=r.long_window_s * factor,
                    short_window_s=r.short_window_s * factor)
            if r.kind == "burn_rate" and factor != 1 else r for r in rules]


def auto_burn_scale(rules: Sequence[Rule], run_s: float) -> float:
    """The scale at which the longest burn-rate window of `rules` spans a run of `run_s`
    seconds (4 significant digits, at most 1: a run of 6 h or more keeps SRE's windows);
    1 when no rule is a burn-rate rule."""
    longest = max((r.long_window_s for r in rules if r.kind == "burn_rate"), default=None)
    if not longest or run_s <= 0:
        return 1.0
    return min(1.0, float(f"{run_s / longest:.4g}"))


def burn_windows(rules: Sequence[Rule]) -> dict[str, list[float]]:
    """{rule: [long_window_s, short_window_s]} of the burn-rate rules (for the summary)."""
    return {r.name: [round(r.long_window_s, 6), round(r.short_window_s, 6)]
            for r in rules if r.kind == "burn_rate"}


def threshold_alerts(rule: Rule, windows: Sequence[Window]) -> list[Alert]:
    """Alerts of a threshold rule over one metric's windows (see the module doc)."""
    out, run, firing = [], [], False
    for w in windows:
        over = w.value is not None and w.value > rule.threshold
        if over:
            run.append(w)
            if len(run) == rule.windows and not firing:
                firing = True
        elif run:
            if firing:
                out.append(_alert(rule, run, w.end_s))
            run, firing = [], False
    if firing:
        out.append(_alert(rule, run, None))
    return out


def _alert(rule: Rule, run: list[Window], end_s: float | None) -> Alert:
    return Alert(rule.name, rule.severity, rule.metric, rule.threshold, run[0].start_s,
                 run[rule.windows - 1].end_s, end_s, max(w.value for w in run), rule.action)


def burn_alerts(rule: Rule, records: Sequence[dict], window_s: float,
                t_end: float) -> list[Alert]:
    """Alerts of a multi-window burn-rate rule evaluated at every window end."""
    budget = round(1 - rule.objective, 12)  # 1 - 0.9 is 0.0999...98 in binary
    edges = window_edges(t_end, window_s)[1:]
    long_r = _ratios(records, rule, rule.long_window_s, edges)
    short_r = _ratios(records, rule, rule.short_window_s, edges)
    out, since, peak = [], None, 0.0
    for t, lr, sr in zip(edges, long_r, short_r, strict=True):
        burn_l = None if lr is None else lr / budget
        on = burn_l is not None and sr is not None and min(burn_l, sr / budget) > rule.factor
        if on:
            since, peak = (float(t) if since is None else since), max(peak, burn_l)
        elif since is not None:
            out.append(Alert(rule.name, rule.severity, rule.metric, rule.factor, since, since,
                             float(t), round(peak, 6), rule.action))
            since, peak = None, 0.0
    if since is not None:
        out.append(Alert(rule.name, rule.severity, rule.metric, rule.factor, since, since,
                         None, round(peak, 6), rule.action))
    return out


def _ratios(records: Sequence[dict], rule: Rule, lookback_s: float,
            ends: Sequence[float]) -> list[float | None]:
    """The error ratio over (t - lookback_s, t] at each t of `ends` (None: no events)."""
    import numpy as np

    from twin.monitoring import observations

    ts, vs = observations(records, rule.metric)
    order = np.argsort(ts, kind="stable")
    ts, vs = ts[order], vs[order]
    bad = np.concatenate([[0], np.cumsum(vs > rule.threshold)])
    out: list[float | None] = []
    for t in ends:
        hi = int(np.searchsorted(ts, t, side="right"))
        lo = int(np.searchsorted(ts, t - lookback_s, side="right"))
        n = hi - lo
        out.append(round(float((bad[hi] - bad[lo]) / n), 6) if n else None)
    return out


def alerts_jsonl(alerts: Sequence[Alert]) -> str:
    return "".join(json.dumps(a.to_json(), sort_keys=False) + "\n" for a in alerts)
