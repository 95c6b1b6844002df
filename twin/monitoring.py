"""The users' monitoring metrics, one definition for the twin and the live engine.

Pure: records (the shared schema of `twin.metrics.RECORD_FIELDS`) and sampled series in,
windowed values out; no clock, no I/O. The live side (`runtime.live_metrics`) feeds the
same functions with a replay's records and scraped `/metrics` samples, so a metric means
the same on both sides. docs/monitoring.md has every formula, unit and window.

Windows are tumbling, `[k w, (k + 1) w)` from time 0 of the run (the first arrival is at
about 0 on both sides). A request's observation lands in the window of the moment a
Prometheus histogram would observe it: its first token (TTFT), its first scheduling
(queue time), its finish (E2E, token counts), each token (ITL). That is what `rate()` over
SGLang's histograms sees, so a windowed value here is what the exported PromQL computes
at the window's end (up to the histogram's bucket interpolation: here quantiles are exact).

`sglang_registry` builds a prometheus-client registry with SGLang 0.5.23's metric names,
types and buckets (`sglang/srt/observability/metrics_collector.py`) plus ours, from a
run's records and its last sample: the twin's `/metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# SGLang 0.5.23's histogram buckets (metrics_collector.py), seconds.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
QUEUE_BUCKETS = (0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15,
                 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900,
                 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)

# Latency observations a record gives: metric -> the record field (seconds).
LATENCIES = ("ttft", "e2e", "queue", "itl", "tpot")
OURS = ("queue_duration_seconds", "memory_pressure_score", "kv_eviction_rate",
        "radix_sharing_ratio", "batch_efficiency", "kv_external_fragmentation")


@dataclass(frozen=True)
class Window:
    """One window's value of a metric; `value` is None when the window saw nothing."""

    start_s: float
    end_s: float
    value: float | None
    n: int  # observations (requests, tokens or samples) behind the value


def observations(records: Iterable[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of one latency metric over `records`: `ttft`, `e2e`, `tpot` (at the
    request's first token / finish; `ok` requests), `queue` (the record's `queue_s` at
    its first scheduling, arrival + queue_s), `itl` (every token gap at its token)."""
    if metric not in LATENCIES:
        raise ValueError(f"metric {metric!r}: allowed values: {', '.join(LATENCIES)}")
    ts: list[float] = []
    vs: list[float] = []
    for r in records:
        if r.get("status") != "ok" and metric != "queue":
            continue
        a = r["arrival_s"]
        if metric == "itl":
            gaps = r.get("itl_s")
            if not isinstance(gaps, list) or r.get("ttft_s") is None:
                continue
            at = a + r["ttft_s"] + np.cumsum(gaps)
            ts.extend(at.tolist())
            vs.extend(gaps)
            continue
        v = r.get(f"{metric}_s")
        if v is None:
            continue
        when = {"ttft": v, "queue": v}.get(metric, r.get("e2e_s"))
        if when is None:
            continue
        ts.append(a + when)
        vs.append(v)
    return np.asarray(ts, dtype=float), np.asarray(vs, dtype=float)


def window_edges(t_end: float, window_s: float) -> np.ndarray:
    """Window boundaries 0, w, 2w, ... covering [0, t_end] (at least one window)."""
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"window_s {window_s}: must be a positive number of seconds")
    n = max(1, math.ceil(max(t_end, 0.0) / window_s + 1e-12))
    if n * window_s <= t_end:
        n += 1
    return np.arange(n + 1) * window_s


def run_end(records: Sequence[dict], series: Sequence[tuple] | None = None) -> float:
    """The last moment anything happened: a finish, a first token, a queue exit, a sample."""
    end = 0.0
    for r in records:
        for k in ("e2e_s", "ttft_s", "queue_s"):
            if r.get(k) is not None:
                end = max(end, r["arrival_s"] + r[k])
        end = max(end, r["arrival_s"])
    if series:
        end = max(end, float(series[-1][0]))
    return end


def _by_window(times: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.searchsorted(edges, times, side="right") - 1


def windowed_quantile(records: Sequence[dict], metric: str, q: float, window_s: float = 60.0,
                      t_end: float | None = None) -> list[Window]:
    """The q-quantile (0..1, numpy's linear interpolation) of `metric` per window."""
    ts, vs = observations(records, metric)
    edges = window_edges(run_end(records) if t_end is None else t_end, window_s)
    idx = _by_window(ts, edges)
    out = []
    for k in range(len(edges) - 1):
        sel = vs[idx == k]
        val = round(float(np.percentile(sel, 100 * q)), 6) if sel.size else None
        out.append(Window(float(edges[k]), float(edges[k + 1]), val, int(sel.size)))
    return out


def windowed_p99(records: Sequence[dict], metric: str = "ttft", window_s: float = 60.0,
                 t_end: float | None = None) -> list[Window]:
    """P99 of `metric` (`ttft`, `e2e`, `queue`, `itl`, `tpot`) per window: what the users'
    "P99 > 1.5 s three windows in a row" rule reads."""
    return windowed_quantile(records, metric, 0.99, window_s, t_end)


def windowed_error_ratio(records: Sequence[dict], metric: str, threshold_s: float,
                         window_s: float, t_end: float) -> list[Window]:
    """Per window, the share of `metric`'s observations above `threshold_s` (an SLO's bad
    events over all events: the error ratio a burn rate divides by the budget)."""
    ts, vs = observations(records, metric)
    edges = window_edges(t_end, window_s)
    idx = _by_window(ts, edges)
    out = []
    for k in range(len(edges) - 1):
        sel = vs[idx == k]
        val = round(float((sel > threshold_s).mean()), 6) if sel.size else None
        out.append(Window(float(edges[k]), float(edges[k + 1]), val, int(sel.size)))
    return out


def radix_sharing_ratio(records: Sequence[dict], window_s: float = 60.0,
                        t_end: float | None = None) -> list[Window]:
    """sum(cached_tokens) / sum(prompt_tokens) of the `ok` requests finishing in each window
    (SGLang counts `sglang:cached_tokens_total` and `sglang:prompt_tokens_total` at finish)."""
    edges = window_edges(run_end(records) if t_end is None else t_end, window_s)
    cached = np.zeros(len(edges) - 1)
    prompt = np.zeros(len(edges) - 1)
    n = np.zeros(len(edges) - 1, dtype=int)
    for r in records:
        if r.get("status") != "ok" or r.get("e2e_s") is None:
            continue
        k = int(_by_window(np.asarray([r["arrival_s"] + r["e2e_s"]]), edges)[0])
        if not 0 <= k < len(n):
            continue  # finished after t_end
        cached[k] += r["cached_tokens"]
        prompt[k] += r["prompt_tokens"]
        n[k] += 1
    return [Window(float(edges[k]), float(edges[k + 1]),
                   round(float(cached[k] / prompt[k]), 6) if prompt[k] else None, int(n[k]))
            for k in range(len(edges) - 1)]


def _in_batch(records: Sequence[dict]) -> list[tuple[float, float]]:
    """[scheduled, finished) of every request that was scheduled: arrival + queue_s to the
    finish (or the first token for a request that failed after it)."""
    spans = []
    for r in records:
        q = r.get("queue_s")
        end = r.get("e2e_s") if r.get("e2e_s") is not None else r.get("ttft_s")
        if q is None or end is None:
            continue
        spans.append((r["arrival_s"] + q, r["arrival_s"] + max(end, q)))
    return spans


def batch_efficiency(records: Sequence[dict], max_running: int | None, window_s: float = 60.0,
                     t_end: float | None = None) -> list[Window]:
    """Time-average number of requests in the running batch over each window, divided by
    the server's request budget `max_running` (SGLang's `max_running_requests`, as the
    server derived it). A request is in the batch from its first scheduling (arrival +
    queue_s) to its finish. The last window counts only up to the run's end (`t_end`), as a
    sampled gauge's average would. None everywhere when `max_running` is unknown."""
    edges = window_edges(run_end(records) if t_end is None else t_end, window_s)
    busy = np.zeros(len(edges) - 1)
    n = np.zeros(len(edges) - 1, dtype=int)
    for s, e in _in_batch(records):
        lo, hi = np.maximum(edges[:-1], s), np.minimum(edges[1:], e)
        overlap = np.clip(hi - lo, 0.0, None)
        busy += overlap
        n += overlap > 0
    end = run_end(records) if t_end is None else t_end
    span = np.clip(np.minimum(edges[1:], end) - edges[:-1], 0.0, None)  # the run's part
    return [Window(float(edges[k]), float(edges[k + 1]),
                   round(float(busy[k] / span[k] / max_running), 6)
                   if max_running and span[k] > 0 else None, int(n[k]))
            for k in range(len(edges) - 1)]


def series_windows(times: Sequence[float], values: Sequence[float | None], window_s: float,
                   t_end: float, how: str = "mean") -> list[Window]:
    """A sampled gauge per window: the `mean` (or `max`) of the samples in it."""
    edges = window_edges(t_end, window_s)
    t = np.asarray(times, dtype=float)
    v = np.asarray([np.nan if x is None else x for x in values], dtype=float)
    idx = _by_window(t, edges)
    out = []
    for k in range(len(edges) - 1):
        sel = v[(idx == k) & ~np.isnan(v)]
        val = None
        if sel.size:
            val = round(float(sel.mean() if how == "mean" else sel.max()), 6)
        out.append(Window(float(edges[k]), float(edges[k + 1]), val, int(sel.size)))
    return out


def twin_gauges(series: Sequence[tuple], fields: Sequence[str],
                capacity_tokens: int) -> dict[str, tuple[list[float], list[float | None]]]:
    """The twin's `timeseries.csv` rows as sampled gauges by metric name: memory pressure
    (allocated KV over capacity), the eviction rate (net decrease of the radix cache's
    tokens per second between samples; a lower bound: what is evicted and re-inserted
    within one sample interval is not seen), external fragmentation (None where the
    replica has none: a vLLM replica's cells), running requests."""
    col = {f: [row[i] if i < len(row) else None for row in series]  # vLLM's rows are short
           for i, f in enumerate(fields)}
    t = [float(x) for x in col["t_s"]]
    alloc = col["kv_allocated_tokens"]
    cached = col["radix_cached_tokens"]
    evict: list[float | None] = [None]
    for i in range(1, len(t)):
        dt = t[i] - t[i - 1]
        evict.append(max(0.0, cached[i - 1] - cached[i]) / dt if dt > 0 else None)
    return {
        "memory_pressure_score": (t, [a / capacity_tokens for a in alloc]),
        "kv_eviction_rate": (t, evict),
        "kv_external_fragmentation": (t, [_num(x) for x in col["kv_external_fragmentation"]]),
        "num_running_reqs": (t, [float(x) for x in col["running"]]),
        "num_queue_reqs": (t, [float(x) for x in col["waiting"]]),
    }


def _num(x) -> float | None:
    """A series cell as a number; None where the replica has no such column (vLLM's
    fragmentation)."""
    return None if x is None or x == "" else float(x)


def metric_windows(records: Sequence[dict], gauges: dict | None = None,
                   max_running: int | None = None, window_s: float = 60.0,
                   t_end: float | None = None,
                   only: Iterable[str] | None = None) -> dict[str, list[Window]]:
    """Every windowed metric of a run by name: the latency quantiles (`ttft_p99`, ...),
    `radix_sharing_ratio`, `batch_efficiency`, and the sampled gauges given (`gauges`:
    name -> (times, values), from `twin_gauges` or the live scrape); `only`: just these
    names (the same values, less work: what a set of rules reads)."""
    end = run_end(records) if t_end is None else t_end
    if gauges:
        end = max([end] + [ts[-1] for ts, _ in gauges.values() if ts])
    wanted = None if only is None else set(only)

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    out: dict[str, list[Window]] = {}
    for m in LATENCIES:
        for q in (50, 99):
            if want(f"{m}_p{q}"):
                out[f"{m}_p{q}"] = windowed_quantile(records, m, q / 100, window_s, end)
    if want("radix_sharing_ratio"):
        out["radix_sharing_ratio"] = radix_sharing_ratio(records, window_s, end)
    if want("batch_efficiency"):
        out["batch_efficiency"] = batch_efficiency(records, max_running, window_s, end)
    for name, (ts, vs) in sorted((gauges or {}).items()):
        if want(name):
            how = "max" if name == "kv_external_fragmentation" else "mean"
            out[name] = series_windows(ts, vs, window_s, end, how)
    return out


def windows_json(windows: dict[str, list[Window]]) -> dict:
    """`metric_windows` as plain JSON: {"window_s", "start_s": [...], name: [values]}."""
    first = next(iter(windows.values()))
    return {"start_s": [w.start_s for w in first],
            **{k: [w.value for w in ws] for k, ws in windows.items()}}


# ---- exposition: SGLang's names and ours through prometheus-client ---------------------
SCHED_LABELS = {"moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}


def _families(records: Sequence[dict], until_s: float | None, labels: dict) -> list:
    """SGLang's request histograms and counters over the records observed by `until_s`."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    stream = {**labels, "is_streaming": "true"}
    sched = {**labels, **SCHED_LABELS}
    fams = []
    for name, metric, buckets, lab, doc in (
            ("sglang:time_to_first_token_seconds", "ttft", TTFT_BUCKETS, stream,
             "Histogram of time to first token in seconds."),
            ("sglang:e2e_request_latency_seconds", "e2e", E2E_BUCKETS, stream,
             "Histogram of End-to-end request latency in seconds"),
            ("sglang:inter_token_latency_seconds", "itl", ITL_BUCKETS, labels,
             "Histogram of inter-token latency in seconds."),
            ("sglang:queue_time_seconds", "queue", QUEUE_BUCKETS, sched,
             "Histogram of queueing time in seconds."),
            ("queue_duration_seconds", "queue", QUEUE_BUCKETS, labels,
             "servetwin: time in the waiting queue (every round), seconds.")):
        ts, vs = observations(records, metric)
        if until_s is not None:
            vs = vs[ts <= until_s]
        fams.append(_histogram(HistogramMetricFamily, name, doc, lab, buckets, vs))
    done = [r for r in records if r.get("status") == "ok" and r.get("e2e_s") is not None
            and (until_s is None or r["arrival_s"] + r["e2e_s"] <= until_s)]
    for name, value, lab, doc in (
            ("sglang:num_requests", len(done), stream, "Number of requests processed."),
            ("sglang:prompt_tokens", sum(r["prompt_tokens"] for r in done), stream,
             "Number of prefill tokens processed."),
            ("sglang:generation_tokens", sum(r["output_tokens"] for r in done), stream,
             "Number of generation tokens processed."),
            ("sglang:cached_tokens", sum(r["cached_tokens"] for r in done),
             {**labels, "cache_source": "device"},
             "Number of cached prompt tokens by source (device/host/storage).")):
        fam = CounterMetricFamily(name, doc, labels=list(lab))
        fam.add_metric(list(lab.values()), float(value))
        fams.append(fam)
    return fams


def _histogram(cls, name: str, doc: str, labels: dict, buckets: Sequence[float],
               values: np.ndarray):
    fam = cls(name, doc, labels=list(labels))
    counts = [int((values <= b).sum()) for b in buckets]
    pairs = [(_le(b), float(c)) for b, c in zip(buckets, counts, strict=True)]
    pairs.append(("+Inf", float(values.size)))
    fam.add_metric(list(labels.values()), pairs, sum_value=float(values.sum()))
    return fam


def _le(b: float) -> str:
    return repr(float(b))


def _last_window(records: Sequence[dict], now: float, window_s: float) -> tuple[float, float]:
    """(cache hit rate, generation tokens/s) of the requests whose first token (hit rate)
    or finish (tokens) fell in (now - window_s, now]."""
    hit = total = out = 0
    for r in records:
        if r.get("status") != "ok" or r.get("ttft_s") is None:
            continue
        if now - window_s < r["arrival_s"] + r["ttft_s"] <= now:
            hit, total = hit + r["cached_tokens"], total + r["prompt_tokens"]
        if r.get("e2e_s") is not None and now - window_s < r["arrival_s"] + r["e2e_s"] <= now:
            out += r["output_tokens"]
    return (hit / total if total else 0.0), out / window_s


def sglang_registry(records: Sequence[dict], gauges: dict[str, float] | None = None, *,
                    until_s: float | None = None, capacity_tokens: int | None = None,
                    max_running: int | None = None, model_name: str = "servetwin",
                    window_s: float = 60.0):
    """A `prometheus_client.CollectorRegistry` of a run (or of its state at `until_s`):
    SGLang 0.5.23's request histograms and counters (`sglang:time_to_first_token_seconds`,
    `..._e2e_request_latency_seconds`, `..._inter_token_latency_seconds`,
    `..._queue_time_seconds`, `sglang:num_requests_total`, `..._prompt_tokens_total`,
    `..._generation_tokens_total`, `..._cached_tokens_total`) from `records`; its gauges
    (`sglang:num_running_reqs`, `num_queue_reqs`, `token_usage`, `cache_hit_rate`,
    `gen_throughput`, `max_total_num_tokens`) and ours (`memory_pressure_score`,
    `kv_external_fragmentation`, ...) from `gauges` (name -> current value; a name left
    out is not exported); `cache_hit_rate` and `gen_throughput` over the records' last
    `window_s` unless given, `radix_sharing_ratio` and `batch_efficiency` over the run so
    far. Render with `prometheus_client.generate_latest(registry)`."""
    labels = {"engine_type": "unified", "model_name": model_name}
    return _registry(_server_families(records, gauges, until_s, capacity_tokens, max_running,
                                      labels, window_s))


@dataclass(frozen=True)
class ReplicaMetrics:
    """One replica of a fleet for `fleet_registry`: its name, its records, its current
    gauges (as `sglang_registry`'s), its pool's capacity and its request budget."""

    name: str
    records: Sequence[dict]
    gauges: dict | None = None
    capacity_tokens: int | None = None
    max_running: int | None = None


def fleet_registry(replicas: Sequence[ReplicaMetrics], *, until_s: float | None = None,
                   model_name: str = "servetwin", window_s: float = 60.0):
    """One registry for a fleet: every replica's `sglang_registry` metrics under a
    `replica` label (what a Prometheus scraping each server sees with the server as a
    target label), one family per metric name. Sum over `replica` for the fleet."""
    merged: dict[str, object] = {}
    for rep in replicas:
        labels = {"engine_type": "unified", "model_name": model_name, "replica": rep.name}
        for fam in _server_families(rep.records, rep.gauges, until_s, rep.capacity_tokens,
                                    rep.max_running, labels, window_s):
            if fam.name in merged:
                merged[fam.name].samples.extend(fam.samples)
            else:
                merged[fam.name] = fam
    return _registry(list(merged.values()))


def _registry(families: list):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Fixed(families))
    return reg


def _server_families(records: Sequence[dict], gauges: dict[str, float] | None,
                     until_s: float | None, capacity_tokens: int | None,
                     max_running: int | None, labels: dict, window_s: float) -> list:
    """The metric families of one server (see `sglang_registry`), labelled `labels`."""
    from prometheus_client.core import GaugeMetricFamily

    now = run_end(records) if until_s is None else until_s
    fams = _families(records, until_s, labels)
    hit, gen = _last_window(records, now, window_s)
    g = {"sglang:cache_hit_rate": hit, "sglang:gen_throughput": gen, **(gauges or {})}
    if capacity_tokens:
        g.setdefault("sglang:max_total_num_tokens", float(capacity_tokens))
    seen = [r for r in records if until_s is None or r["arrival_s"] <= until_s]
    done = [r for r in seen if r.get("status") == "ok" and r.get("e2e_s") is not None
            and r["arrival_s"] + r["e2e_s"] <= now]
    prompt = sum(r["prompt_tokens"] for r in done)
    share = sum(r["cached_tokens"] for r in done) / prompt if prompt else 0.0
    eff = batch_efficiency(seen, max_running, max(now, 1e-9), now)[0].value
    g.setdefault("radix_sharing_ratio", share)
    if eff is not None:
        g.setdefault("batch_efficiency", eff)
    for name in sorted(g):
        lab = {**labels, **SCHED_LABELS} if name.startswith("sglang:") else labels
        fam = GaugeMetricFamily(name, _GAUGE_DOCS.get(name, name), labels=list(lab))
        fam.add_metric(list(lab.values()), float(g[name]))
        fams.append(fam)
    return fams


_GAUGE_DOCS = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:token_usage": "The token usage.",
    "sglang:cache_hit_rate": "The prefix cache hit rate.",
    "sglang:gen_throughput": "The generation throughput (token/s).",
    "sglang:max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "memory_pressure_score": "servetwin: allocated KV tokens over the pool's capacity.",
    "kv_external_fragmentation": "servetwin: 1 - largest free run / free KV tokens.",
    "radix_sharing_ratio": "servetwin: cached prompt tokens over prompt tokens.",
    "batch_efficiency": "servetwin: mean running requests over max_running_requests.",
}


class _Fixed:
    """A collector that yields metric families built once (prometheus-client's custom
    collector protocol: `collect()`)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
