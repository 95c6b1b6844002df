"""The users' length-routed fleet against one SGLang pool on the same GPUs, and how fast a
fleet simulates.

Part 1 (`--part routing`): finance-qa (600 requests, closed loop) at 100 % of the users'
peak (50 clients) and 200 % (100 clients) through the presets `finance-hybrid` (the
users' design: SGLang pool for <= 32k tokens, vLLM pools for 32k-64k and > 64k),
`finance-sglang-pool` (5 SGLang replicas at TP 2 behind round_robin) and
`finance-sglang-cache-aware` (the same behind sglang-router's cache_aware), and
`finance-hybrid+rr` (the users' design with round_robin inside each pool); all 10 x
A100-80GB PCIe, DeepSeek-R1-Distill-Qwen-32B, opdb step times. P99 TTFT per request class
(short questions, 10k-32k documents, 64k-128k documents), SLO attainment (TTFT <= 1.5 s).

Part 2 (`--part speed`): fleets of 1, 4 and 16 SGLang replicas (Llama-3.1-8B on
A100-SXM-80GB, roofline) behind round_robin and cache_aware, Poisson 1.5 req/s per replica,
prompt U(1000, 4000), output U(100, 500), 1,000 requests per replica: simulated requests per
CPU-second (simulation, records and summary; start-up apart).

    python benchmarks/fleet.py [--part routing speed] [--n 600]
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np
import simpy

from calibration.profiles import machine
from twin.fleet import (
    Kinds,
    build_fleet,
    load_spec,
    parse_spec,
    run_deployment,
    simulate_fleet,
    with_router,
)
from twin.metrics import SLO
from twin.workload import finance_qa, from_spec

PRESETS = ("finance-hybrid", "finance-hybrid+rr", "finance-sglang-pool",
           "finance-sglang-cache-aware")
CLASSES = (("short (<10k)", 0, 10_000), ("doc 10k-32k", 10_000, 32_000),
           ("mid 32k-64k", 32_000, 64_000), ("long >64k", 64_000, 10**9))


def _p99(vals: list[float]) -> str:
    return f"{np.percentile(vals, 99):.2f}" if vals else "-"


def _spec(name: str):
    """A preset; `finance-hybrid+rr`: the users' design with round_robin in every pool."""
    if name != "finance-hybrid+rr":
        return load_spec(name)
    spec = load_spec("finance-hybrid")
    return with_router(spec, spec.router, {p: {"name": "round_robin"} for p in spec.pools})


def routing(n: int) -> None:
    kinds = Kinds()
    print(f"finance-qa, {n} requests, seed 0; SLO TTFT <= 1.5 s")
    head = ("| deployment | load | GPUs | requests per replica | " + " | ".join(f"P99 TTFT {c[0]} s" for c in CLASSES)
            + " | SLO attainment | per class (short/doc/long) | P99 TTFT all s |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for clients, label in ((50, "100 % (50 clients)"), (100, "200 % (100 clients)")):
        wl = finance_qa(0, n=n, concurrency=clients)
        for name in PRESETS:
            res = simulate_fleet(_spec(name), wl, SLO(1.5), kinds=kinds)
            recs = res.records
            cells, att = [], []
            for cname, lo, hi in CLASSES:
                mine = [r for r in recs if lo <= r["prompt_tokens"] < hi]
                cells.append(_p99([r["ttft_s"] for r in mine if r["status"] == "ok"]))
                if mine and cname != "mid 32k-64k":
                    ok = sum(1 for r in mine if r["status"] == "ok" and r["ttft_s"] <= 1.5)
                    att.append(f"{ok / len(mine):.0%}")
            s = res.summary
            split = "/".join(str(p["requests"]) for p in s["replicas"].values())
            print(f"| {name} | {label} | {s['gpus']} | {split} | " + " | ".join(cells)
                  + f" | {s['slo']['attainment']:.1%} | {'/'.join(att)} | "
                  f"{s['ttft_s']['p99']:.2f} |", flush=True)


def speed() -> None:
    print("Poisson 1.5 req/s per replica, prompt U(1000,4000), output U(100,500), "
          "1,000 requests per replica; Llama-3.1-8B on A100-SXM-80GB, roofline")
    print("| replicas | router | requests | start-up CPU s | simulate+records CPU s | "
          "requests / CPU-s | simulated s |")
    print("|---|---|---|---|---|---|---|")
    kinds = Kinds()
    for n_rep in (1, 4, 16):
        for router in ("round_robin", "cache_aware"):
            n = 1000 * n_rep
            wl = from_spec(f"arrival=poisson,rate={1.5 * n_rep},n={n},"
                           "prompt=uniform:1000:4000,output=uniform:100:500", seed=0)
            spec = parse_spec({"gpu": "a100-sxm-80gb", "router": router, "replicas": [
                {"name": "r", "count": n_rep, "step_time_backend": "roofline",
                 "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}, "<speed>")
            c0 = time.process_time()
            env = simpy.Environment()
            dep = build_fleet(env, spec, wl, kinds=kinds)
            c1 = time.process_time()
            run_deployment(dep)
            c2 = time.process_time()
            print(f"| {n_rep} | {router} | {n:,} | {c1 - c0:.2f} | {c2 - c1:.2f} | "
                  f"{n / (c2 - c1):,.0f} | {env.now:,.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", default=["routing", "speed"],
                    choices=["routing", "speed"])
    ap.add_argument("--n", type=int, default=600, help="finance-qa requests (routing)")
    ns = ap.parse_args()
    print(f"machine: {machine()}; date: {datetime.date.today().isoformat()}")
    if "routing" in ns.part:
        routing(ns.n)
    if "speed" in ns.part:
        speed()


if __name__ == "__main__":
    main()
