"""Simulator speed: simulated requests per CPU-second and simulated seconds per wall second.

Workload (as Vidur was measured in ../docs, anchors): Poisson 1.5 req/s, prompt U(1000, 4000),
output U(100, 500), Llama-3.1-8B on one A100-SXM-80GB. Start-up (backend tables) and the
simulation itself (including building the records and the summary) are timed apart.

    python benchmarks/sim_speed.py [--sizes 10000 100000] [--backends roofline opdb]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import simpy

from twin.config import ServerArgs, derive_capacity
from twin.metrics import summarize, twin_records
from twin.perf import make_step_time
from twin.sim import SimConfig, build_replica
from twin.workload import from_spec

SPEC = "arrival=poisson,rate=1.5,n={n},prompt=uniform:1000:4000,output=uniform:100:500"
# variant -> (SGLang server args, twin SimConfig fields)
EXTRA = {
    "default": ({}, {}),
    "mixed-chunk+lpm": ({"enable_mixed_chunk": True, "schedule_policy": "lpm"}, {}),
    "buddy+slices50ms": ({}, {"kv_allocator": "buddy", "preemption_mode": "moderate",
                             "time_slice_ms": 50.0}),
}


def one(n: int, backend: str, extra: tuple[dict, dict]) -> dict:
    workload = from_spec(SPEC.format(n=n), seed=0)
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", **extra[0])
    cfg = SimConfig(args=args, gpu="a100-sxm-80gb", step_time_backend=backend, **extra[1])
    t0 = time.process_time()
    st = make_step_time(backend, derive_capacity(args, cfg.gpu), args)
    startup = time.process_time() - t0
    env = simpy.Environment()
    w0, c0 = time.perf_counter(), time.process_time()
    rep, _ = build_replica(env, workload, cfg, st)
    env.process(rep.run())
    env.run()
    c_sim = time.process_time() - c0
    records = twin_records(rep.finished, rep.step_end)
    summarize(records)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"n": n, "backend": backend, "startup_cpu_s": startup, "sim_cpu_s": c_sim,
            "cpu_s": cpu, "req_per_cpu_s": n / cpu, "sim_s": env.now,
            "sim_s_per_wall_s": env.now / wall, "steps": rep.counters.decode_steps
            + rep.counters.prefill_steps + rep.counters.mixed_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--backends", nargs="+", default=["roofline", "opdb"])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(EXTRA))
    ns = ap.parse_args()
    print(f"# sim_speed {datetime.date.today()} on {platform.node()} "
          f"({platform.processor() or platform.machine()}, Python {platform.python_version()})")
    print(f"# workload: {SPEC.format(n='N')}; Llama-3.1-8B, 1x a100-sxm-80gb")
    print("| requests | backend | variant | start-up CPU s | simulate+records CPU s | "
          "requests / CPU-s | simulated s / wall s | steps |")
    print("|---|---|---|---|---|---|---|---|")
    for variant in ns.variants:
        for backend in ns.backends:
            for n in ns.sizes:
                r = one(n, backend, EXTRA[variant])
                print(f"| {n:,} | {backend} | {variant} | {r['startup_cpu_s']:.2f} | "
                      f"{r['cpu_s']:.2f} | {r['req_per_cpu_s']:,.0f} | "
                      f"{r['sim_s_per_wall_s']:,.0f} | {r['steps']:,} |", flush=True)


if __name__ == "__main__":
    main()
