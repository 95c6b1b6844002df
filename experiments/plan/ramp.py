"""The users' load test: a stepped ramp to 200 % of the target load, on one candidate.

Poisson arrivals at 25, 50, ..., 200 % of the target rate, `step_s` seconds each
(`twin.workload.ramp_arrivals`), carrying fresh requests of the question's workload. Each
step reports its P99s and whether each SLO holds over the requests that arrived in it; the
first step where an SLO breaks is its `first_break`. The P99 TTFTs of the steps and the
windows are over the requests the first TTFT SLO covers (its tier and prompt range; all
requests when it has none), so they are read against its threshold. The alert rule "P99 TTFT above the SLO
three windows in a row" is the monitoring's own (`twin.alerts.default_rules()[0]` with the
SLO's threshold, over `twin.monitoring.windowed_p99`: one definition for the plan, a
simulate run, a live replay and the exported Prometheus rule): each window's P99 over the
requests whose first token came in it (as a Prometheus histogram of TTFT sees them); it
fires at the end of the third window in a row above the threshold and resolves at the end
of the first window not above it (an empty window, like Prometheus' NaN, is not above).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from experiments.plan.question import Question, WorkloadSource
from twin.alerts import default_rules, threshold_alerts
from twin.monitoring import Window, run_end, windowed_p99
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
    ramp_end = len(pcts) * step_s
    wins = windowed_p99(watched, "ttft", window_s, t_end=max(ramp_end, run_end(watched)))
    wins = [w for w in wins if w.start_s < ramp_end or w.n]  # no empty window after it
    windows = [{"start_s": w.start_s, "end_s": w.end_s, "requests": w.n,
                "ttft_p99_s": w.value} for w in wins]
    return {"slo_s": slo_s, "watched": ttft.name if ttft else "all requests",
            "step_s": step_s, "window_s": window_s, "steps": steps,
            "first_break": first, "windows": windows,
            "alerts": three_in_a_row(wins, slo_s)}


def three_in_a_row(windows: list[Window], threshold_s: float) -> list[dict]:
    """The users' yellow alert over per-window P99 TTFTs, by the monitoring's own rule."""
    alerts = threshold_alerts(default_rules(threshold_s)[0], windows)
    return [{"rule": a.rule, "since_s": a.since_s, "start_s": a.start_s, "end_s": a.end_s,
             "peak_s": a.peak} for a in alerts]
