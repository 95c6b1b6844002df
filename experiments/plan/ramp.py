"""The users' load test: a stepped ramp to 200 % of the target load, on one candidate.

Poisson arrivals at 25, 50, ..., 200 % of the target rate, `step_s` seconds each
(`twin.workload.ramp_arrivals`), carrying fresh requests of the question's workload. Each
step reports its P99s and whether each SLO holds over the requests that arrived in it; the
first step where an SLO breaks is its `first_break`. The P99 TTFTs of the steps and the
windows are over the requests the first TTFT SLO covers (its tier and prompt range; all
requests when it has none), so they are read against its threshold. The alert rule "P99 TTFT above the SLO
three windows in a row" is evaluated over windows of `window_s` simulated seconds, each
window's P99 over the requests whose first token came in it (as a Prometheus histogram
of TTFT would see them): it fires at the end of the third window in a row above the
threshold and resolves at the end of the first window at or below it (a window with no
first token neither counts nor resets).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from experiments.plan.question import Question, WorkloadSource
from twin.workload import Workload, ramp_arrivals

PCTS = (25, 50, 75, 100, 125, 150, 175, 200)


def ramp_workload(q: Question, source: WorkloadSource, step_s: float,
                  pcts: tuple[int, ...] = PCTS) -> Workload:
    rng = np.random.default_rng(q.seed + 2)
    times = ramp_arrivals(rng, q.target_rps, [p / 100 for p in pcts], step_s)
    pool = source.requests(len(times)) if source.kind != "trace" else q.base
    reqs = list(pool.requests)
    # a trace shorter than the ramp is reused from its start (rids made unique)
    out = [replace(reqs[i % len(reqs)], rid=_rid(reqs[i % len(reqs)].rid, i // len(reqs)),
                   arrival_s=float(t)) for i, t in enumerate(times)]
    return Workload(f"{q.workload} ramp", tuple(out), None)


def _rid(rid: str, lap: int) -> str:
    return rid if lap == 0 else f"{rid}#{lap}"


def _p99(values: list[float]) -> float | None:
    """By nearest rank, as the SLOs are judged: within the threshold exactly when 99 % are."""
    return float(np.percentile(values, 99, method="inverted_cdf")) if values else None


def analyse(records, q: Question, step_s: float, window_s: float,
            pcts: tuple[int, ...] = PCTS) -> dict:
    recs = list(records)
    ttft = next((s for s in q.slos if s.metric == "ttft"), None)
    watched = [r for r in recs if ttft is None or ttft.covers(r)]
    steps = []
    for i, pct in enumerate(pcts):
        mine = [r for r in recs if i * step_s <= r["arrival_s"] < (i + 1) * step_s]
        ok = [r for r in mine if r["status"] == "ok"]
        ok_watched = [r for r in ok if ttft is None or ttft.covers(r)]
        meets = {}
        for s in q.slos:
            cov = [r for r in mine if s.covers(r)]
            share = sum(s.met_by(r) for r in cov) / len(cov) if cov else 1.0
            meets[s.name] = share >= s.share - 1e-12
        steps.append({"load_pct": pct, "rps": q.target_rps * pct / 100,
                      "requests": len(mine),
                      "ttft_p99_s": _p99([r["ttft_s"] for r in ok_watched]),
                      "ttft_p99_all_s": _p99([r["ttft_s"] for r in ok]),
                      "tpot_p99_s": _p99([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
                      "e2e_p99_s": _p99([r["e2e_s"] for r in ok]), "meets": meets})
    first = {s.name: next((st["load_pct"] for st in steps if not st["meets"][s.name]), None)
             for s in q.slos}
    slo_s = ttft.threshold_s if ttft else 1.5
    windows = window_p99(watched, window_s, len(pcts) * step_s)
    return {"slo_s": slo_s, "watched": ttft.name if ttft else "all requests",
            "step_s": step_s, "window_s": window_s, "steps": steps,
            "first_break": first, "windows": windows,
            "alerts": three_in_a_row(windows, slo_s, window_s)}


def window_p99(recs: list[dict], window_s: float, until_s: float) -> list[dict]:
    """P99 TTFT per window of first-token time, up to the last first token (or `until_s`)."""
    firsts = [(r["arrival_s"] + r["ttft_s"], r["ttft_s"]) for r in recs
              if r["status"] == "ok" and r["ttft_s"] is not None]
    end = max([until_s, *(t for t, _ in firsts)])
    n = int(np.ceil(end / window_s))
    buckets: list[list[float]] = [[] for _ in range(n)]
    for t, v in firsts:
        buckets[min(int(t // window_s), n - 1)].append(v)
    return [{"start_s": k * window_s, "end_s": (k + 1) * window_s, "requests": len(b),
             "ttft_p99_s": _p99(b)} for k, b in enumerate(buckets)]


def three_in_a_row(windows: list[dict], threshold_s: float, window_s: float,
                   runs: int = 3) -> list[dict]:
    """The users' yellow alert: P99 TTFT > threshold in `runs` windows in a row."""
    rule = f"ttft_p99 > {threshold_s:g} s in {runs} windows of {window_s:g} s in a row"
    alerts, above, start = [], 0, None
    for w in windows:
        if w["ttft_p99_s"] is None:  # no first token in the window: no evidence either way
            continue
        high = w["ttft_p99_s"] > threshold_s
        above = above + 1 if high else 0
        if start is None and above >= runs:
            start = w["end_s"]
            alerts.append({"rule": rule, "start_s": start, "end_s": None})
        elif start is not None and not high:
            alerts[-1]["end_s"], start = w["end_s"], None
    return alerts
