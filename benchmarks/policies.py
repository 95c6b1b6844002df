"""Every scheduling policy in the twin on the users' finance-qa mix at 50 %, 100 % and
150 % of the deployment's capacity: P50/P99 TTFT of short questions and of documents
(prompts of 10k tokens and more), and SLO attainment (TTFT <= 1.5 s, the users' P99).

    python benchmarks/policies.py [--n 600] [--seeds 0] [--policies fcfs lpm ...]

Capacity is measured, not assumed: the request throughput of the users' closed loop (50
clients) on the same deployment. Each load then replays the same finance-qa requests with
Poisson arrivals at that fraction of capacity (open loop, so overload shows as queueing).
Deployment: the default run's (DeepSeek-R1-Distill-Qwen-32B on 2x A100-80GB PCIe, TP 2),
with `--enable-priority-scheduling` for the policies that use tiers (priority, slices).
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import replace

import numpy as np

from calibration.profiles import machine
from twin.config import ServerArgs
from twin.sim import SimConfig, simulate
from twin.workload import PRESETS, Workload

MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
GPU = "a100-pcie-80gb"
LOADS = (0.5, 1.0, 1.5)
DOC = 10_000
# (label, SimConfig overrides, ServerArgs overrides)
POLICIES = {
    "fcfs": ({}, {}),
    "lpm": ({}, {"schedule_policy": "lpm"}),
    "lof": ({}, {"schedule_policy": "lof"}),
    "hrrn": ({}, {"schedule_policy": "hrrn"}),
    "dfs-weight": ({}, {"schedule_policy": "dfs-weight"}),
    "shortest-prefill-first": ({}, {"schedule_policy": "shortest-prefill-first"}),
    "random": ({}, {"schedule_policy": "random"}),
    "priority": ({}, {"enable_priority_scheduling": True}),
    "slices-conservative": ({"policy": "slices", "preemption_mode": "off"}, {}),
    "slices-moderate": ({"preemption_mode": "moderate"}, {}),
    "slices-aggressive": ({"preemption_mode": "aggressive"}, {}),
}


def open_loop(w: Workload, rate: float, seed: int) -> Workload:
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=len(w.requests))
    times = np.cumsum(gaps) - gaps[0]
    reqs = tuple(replace(r, arrival_s=float(t)) for r, t in zip(w.requests, times, strict=True))
    return Workload(f"{w.name}@{rate:.3f}/s", reqs, None)


def cfg_for(label: str) -> SimConfig:
    sim_kw, args_kw = POLICIES[label]
    if label == "slices-conservative":
        sim_kw = {"preemption_mode": "conservative"}
    return SimConfig(args=ServerArgs(model_path=MODEL, tp_size=2, **args_kw), gpu=GPU, **sim_kw)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def row(records: list[dict]) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    short = [r["ttft_s"] for r in ok if r["prompt_tokens"] < DOC]
    docs = [r["ttft_s"] for r in ok if r["prompt_tokens"] >= DOC]
    met = sum(1 for r in records if r["status"] == "ok" and r["ttft_s"] <= 1.5)
    met_short = sum(1 for r in ok if r["prompt_tokens"] < DOC and r["ttft_s"] <= 1.5)
    n_short = sum(1 for r in records if r["prompt_tokens"] < DOC)
    return {"short_p50": percentile(short, 50), "short_p99": percentile(short, 99),
            "doc_p50": percentile(docs, 50), "doc_p99": percentile(docs, 99),
            "slo": met / len(records), "slo_short": met_short / max(n_short, 1),
            "not_ok": len(records) - len(ok)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=600, help="requests per run (default 600)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--loads", type=float, nargs="+", default=list(LOADS))
    ns = ap.parse_args()
    t0 = time.process_time()
    print(f"# policies on finance-qa, {MODEL} on 2x {GPU} TP 2, n={ns.n}, seeds {ns.seeds}")
    print(f"# {machine()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    base = PRESETS["finance-qa"](ns.seeds[0], n=ns.n)
    cap = simulate(base, cfg_for("fcfs")).summary["throughput"]["requests_per_s"]
    print(f"# capacity (closed loop, 50 clients, fcfs): {cap:.4f} req/s")
    print("| policy | load | short TTFT P50 (s) | short P99 | doc P50 | doc P99 | "
          "SLO all | SLO short | not ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for load in ns.loads:
        for label in ns.policies:
            rows = []
            for seed in ns.seeds:
                w = open_loop(PRESETS["finance-qa"](seed, n=ns.n), load * cap, seed)
                rows.append(row(simulate(w, cfg_for(label)).records))
            m = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            print(f"| {label} | {load:.0%} | {m['short_p50']:.2f} | {m['short_p99']:.2f} | "
                  f"{m['doc_p50']:.2f} | {m['doc_p99']:.2f} | {m['slo']:.1%} | "
                  f"{m['slo_short']:.1%} | {int(m['not_ok'])} |", flush=True)
    print(f"# {time.process_time() - t0:.0f} CPU-s")


if __name__ == "__main__":
    main()
