"""Alert rules as a Prometheus rules file, over SGLang's metric names.

`prometheus_rules`: one server's rules (docs/monitoring.md, "The mapping to Prometheus"):
a windowed metric becomes PromQL over SGLang 0.5.23's histograms, counters and gauges
(the twin-only ones over the twin's `/metrics` names), "over in N consecutive windows"
becomes `for: (N - 1) x window` in a group evaluated every window, a burn-rate rule the
multi-window `and` of two error-ratio expressions (counting observations over the
smallest bucket bound at or above the SLO: SGLang has no 1.5 s bucket).
`prometheus_fleet_rules`: the same for a fleet scraped server by server: each rule
aggregated `by (instance)` (label `scope: replica`) and, where the metric has a fleet-wide
value (`twin.fleet_alerts.fleet_scoped`), summed over the instances (`scope: fleet`).
`promtool check rules` accepts both (tests/test_alerts.py, tests/test_alerts_fleet.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from twin.alerts import RECORD_METRICS, Rule
from twin.fleet_alerts import FLEET, fleet_scoped
from twin.monitoring import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    LATENCIES,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
)

# ---- one server ------------------------------------------------------------------
HISTOGRAMS = {"ttft": ("sglang:time_to_first_token_seconds", TTFT_BUCKETS),
               "e2e": ("sglang:e2e_request_latency_seconds", E2E_BUCKETS),
               "itl": ("sglang:inter_token_latency_seconds", ITL_BUCKETS),
               "tpot": ("sglang:request_time_per_output_token_seconds", ITL_BUCKETS),
               "queue": ("sglang:queue_time_seconds", QUEUE_BUCKETS)}


def duration(seconds: float) -> str:
    """A PromQL duration: whole seconds (Prometheus accepts e.g. 90s)."""
    s = max(1, round(seconds))
    return f"{s // 60}m" if s % 60 == 0 else f"{s}s"


def promql(metric: str, window_s: float, max_running: int | None = None) -> str:
    """The PromQL expression of a windowed metric over SGLang's (or the twin's) names."""
    w = duration(window_s)
    if metric in RECORD_METRICS[:len(LATENCIES) * 2]:
        base, q = metric.rsplit("_p", 1)
        name = HISTOGRAMS[base][0]
        return (f"histogram_quantile({int(q) / 100}, sum by (le) "
                f"(rate({name}_bucket[{w}])))")
    return {
        "radix_sharing_ratio": f"sum(rate(sglang:cached_tokens_total[{w}])) / "
                               f"sum(rate(sglang:prompt_tokens_total[{w}]))",
        "memory_pressure_score": f"1 - avg_over_time(sglang:kv_available_tokens[{w}]) / "
                                 "sglang:max_total_num_tokens",
        "batch_efficiency": (f"avg_over_time(sglang:num_running_reqs[{w}]) / {max_running}"
                             if max_running else f"avg_over_time(batch_efficiency[{w}])"),
        "kv_external_fragmentation": f"max_over_time(kv_external_fragmentation[{w}])",
        "kv_eviction_rate": f"avg_over_time(kv_eviction_rate[{w}])",
        "num_running_reqs": f"avg_over_time(sglang:num_running_reqs[{w}])",
        "num_queue_reqs": f"avg_over_time(sglang:num_queue_reqs[{w}])",
    }[metric]


def bucket_at_or_above(metric: str, threshold_s: float) -> float:
    """The smallest bucket bound of SGLang's histogram for `metric` >= `threshold_s` (a
    Prometheus rule can only count observations below a bucket bound)."""
    buckets = HISTOGRAMS[metric][1]
    return next((float(b) for b in buckets if b >= threshold_s), math.inf)


def burn_promql(rule: Rule, lookback_s: float) -> str:
    name = HISTOGRAMS[rule.metric][0]
    le = bucket_at_or_above(rule.metric, rule.threshold)
    le_s = "+Inf" if math.isinf(le) else repr(le)
    w = duration(lookback_s)
    return (f"(1 - sum(rate({name}_bucket{{le=\"{le_s}\"}}[{w}])) / "
            f"sum(rate({name}_count[{w}]))) / {round(1 - rule.objective, 6)}")


def prometheus_rules(rules: Sequence[Rule], window_s: float = 60.0,
                     max_running: int | None = None) -> str:
    """A Prometheus rules file (YAML) for `rules`, evaluated every `window_s`."""
    import yaml

    out = []
    for r in rules:
        ann = {"summary": r.description or r.name}
        if r.kind == "threshold":
            expr = f"{promql(r.metric, window_s, max_running)} > {r.threshold}"
            item = {"alert": r.name, "expr": expr}
            if r.windows > 1:
                item["for"] = duration((r.windows - 1) * window_s)
        else:
            expr = (f"({burn_promql(r, r.long_window_s)}) > {r.factor} and "
                    f"({burn_promql(r, r.short_window_s)}) > {r.factor}")
            item = {"alert": r.name, "expr": expr}
            le = bucket_at_or_above(r.metric, r.threshold)
            if le != r.threshold:
                ann["note"] = (f"SGLang's {r.metric} histogram has no {r.threshold} s bucket: "
                               f"the rule counts observations over {le} s")
        labels = {"severity": r.severity}
        if r.action:
            labels["action"] = r.action
        item.update(labels=labels, annotations=ann)
        out.append(item)
    doc = {"groups": [{"name": "servetwin", "interval": duration(window_s), "rules": out}]}
    return yaml.safe_dump(doc, sort_keys=False, width=10**6)


# ---- Prometheus: each rule by instance and over the fleet -------------------------------
RANK0 = '{tp_rank="0"}'  # SGLang exports its pool gauges once per TP rank


def fleet_promql(metric: str, window_s: float, by: str | None,
                 max_running: int | None = None) -> str | None:
    """A windowed metric's PromQL per `by` label (e.g. "instance") or, with `by=None`, over
    the whole fleet (None: the metric has no fleet-wide value in this form)."""
    w, agg = duration(window_s), (f"sum by ({by}) " if by else "sum ")
    if metric[:-4] in LATENCIES and metric[-4:-2] == "_p":
        name = HISTOGRAMS[metric[:-4]][0]
        lab = f"le, {by}" if by else "le"
        return (f"histogram_quantile({int(metric[-2:]) / 100}, sum by ({lab}) "
                f"(rate({name}_bucket[{w}])))")
    running = f"{agg}(avg_over_time(sglang:num_running_reqs{RANK0}[{w}]))"
    if metric == "batch_efficiency":
        if max_running and by:
            return f"{running} / {max_running}"
        if max_running:
            return f"{running} / ({max_running} * count(sglang:max_total_num_tokens{RANK0}))"
        return f"avg by ({by}) (avg_over_time(batch_efficiency[{w}]))" if by else None
    if metric == "kv_external_fragmentation":
        return f"max by ({by}) (max_over_time(kv_external_fragmentation[{w}]))" if by else None
    return {
        "radix_sharing_ratio": f"{agg}(rate(sglang:cached_tokens_total[{w}])) / "
                               f"{agg}(rate(sglang:prompt_tokens_total[{w}]))",
        "memory_pressure_score": f"1 - {agg}(avg_over_time(sglang:kv_available_tokens{RANK0}"
                                 f"[{w}])) / {agg}(sglang:max_total_num_tokens{RANK0})",
        "kv_eviction_rate": f"{agg}(avg_over_time(kv_eviction_rate[{w}]))",
        "num_running_reqs": running,
        "num_queue_reqs": f"{agg}(avg_over_time(sglang:num_queue_reqs{RANK0}[{w}]))",
    }[metric]


def _burn(rule: Rule, lookback_s: float, by: str | None) -> str:
    name = HISTOGRAMS[rule.metric][0]
    le = bucket_at_or_above(rule.metric, rule.threshold)
    le_s = "+Inf" if le == float("inf") else repr(le)
    w, agg = duration(lookback_s), (f"sum by ({by}) " if by else "sum ")
    return (f"(1 - {agg}(rate({name}_bucket{{le=\"{le_s}\"}}[{w}])) / "
            f"{agg}(rate({name}_count[{w}]))) / {round(1 - rule.objective, 6)}")


def _fleet_item(rule: Rule, window_s: float, by: str | None,
                max_running: int | None) -> dict | None:
    if rule.kind == "threshold":
        q = fleet_promql(rule.metric, window_s, by, max_running)
        if q is None:
            return None
        item = {"alert": rule.name, "expr": f"{q} > {rule.threshold}"}
        if rule.windows > 1:
            item["for"] = duration((rule.windows - 1) * window_s)
    else:
        item = {"alert": rule.name, "expr": f"({_burn(rule, rule.long_window_s, by)}) > "
                f"{rule.factor} and ({_burn(rule, rule.short_window_s, by)}) > {rule.factor}"}
    labels = {"severity": rule.severity, "scope": "replica" if by else FLEET}
    if rule.action:
        labels["action"] = rule.action
    what = f"on {{{{ $labels.{by} }}}}" if by else "over the fleet"
    ann = {"summary": f"{rule.description or rule.name} ({what})"}
    if rule.kind == "burn_rate" and bucket_at_or_above(rule.metric, rule.threshold) \
            != rule.threshold:
        ann["note"] = (f"SGLang's {rule.metric} histogram has no {rule.threshold} s bucket: "
                       f"the rule counts observations over "
                       f"{bucket_at_or_above(rule.metric, rule.threshold)} s")
    item.update(labels=labels, annotations=ann)
    return item


def prometheus_fleet_rules(rules: Sequence[Rule], window_s: float = 60.0,
                           max_running: int | None = None, by: str = "instance") -> str:
    """A Prometheus rules file for a fleet: every rule per `by` label and, where the metric
    has a fleet-wide value (`fleet_scoped`), over the fleet; `max_running` is one server's
    budget (the fleet's: that times the number of servers)."""
    import yaml

    out = []
    for r in rules:
        per = _fleet_item(r, window_s, by, max_running)
        if per is not None:
            out.append(per)
        whole = _fleet_item(r, window_s, None, max_running) if fleet_scoped(r) else None
        if whole is not None:
            out.append(whole)
    doc = {"groups": [{"name": "servetwin-fleet", "interval": duration(window_s), "rules": out}]}
    return yaml.safe_dump(doc, sort_keys=False, width=10**6)
