"""Where a fleet's and the RL environment's CPU goes, part by part (docs/perf.md, fourteenth
round): the figures behind the round's "what is left" paragraphs.

1. A 16-replica fleet (benchmarks/startup_speed.py's: Llama-3.1-8B on A100-SXM-80GB,
   roofline, Poisson 1.5 req/s per replica, prompt U(1000,4000), output U(100,500), 1,000
   requests per replica), run as `twin.fleet.run_deployment` runs it in memory, the
   collector off: the run, the records' dicts, the fleet's, pools' and replicas'
   summaries, each in CPU seconds.
2. Python's cyclic collector: building the records' dicts of one 20,000-request run with
   the collector on and off; and the cyclic garbage a fleet's run leaves (`gc.collect()`
   with the collector off and the deployment still alive), for the typed core and for
   `SERVETWIN_PYTHON_LOOP=1` (a child process each).
3. The environment (benchmarks/startup_speed.py's run: `servetwin/Scheduling-v0`,
   preset finance-qa, random actions, 4 episodes) under cProfile: the cumulative CPU of
   the observation features, of the episode's runs to each question (the typed core's
   loop, whose snapshots are built inside it, and the questions asked) and of the
   questions; with SERVETWIN_PYTHON_LOOP=1 the Python replica's loop and snapshots.

    python benchmarks/fleet_cost_split.py [--replicas 16] [--parts fleet gc env]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from calibration.profiles import machine  # noqa: E402

SPEED_WL = ("arrival=poisson,rate={rate},n={n},prompt=uniform:1000:4000,"
            "output=uniform:100:500")


def build(n_rep: int):
    import simpy

    from twin.fleet import Kinds, build_fleet, parse_spec
    from twin.workload import from_spec

    n = 1000 * n_rep
    wl = from_spec(SPEED_WL.format(rate=1.5 * n_rep, n=n), seed=0)
    spec = parse_spec({"gpu": "a100-sxm-80gb", "router": "round_robin", "replicas": [
        {"name": "r", "count": n_rep, "step_time_backend": "roofline",
         "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}, "<fleet_cost_split>")
    return build_fleet(simpy.Environment(), spec, wl, kinds=Kinds()), n


def fleet_parts(n_rep: int) -> None:
    import gc

    from twin.interrupt import run_interruptible
    from twin.record_sink_fleet import TicketSink

    dep, n = build(n_rep)
    sink = dep.done_tickets = TicketSink(dep, None, 1 << 62)  # as run_deployment in memory
    gc.disable()
    t0 = time.process_time()
    dep.start(run_replicas=True)
    run_interruptible(dep.env, dep.wait_in_events)
    dep.finalize()
    t1 = time.process_time()
    records = sink.finish()
    t2 = time.process_time()
    dep.summary(records, None)
    t3 = time.process_time()
    gc.enable()
    loops = sorted({str(w.loop) for w in dep.workers})
    print(f"| fleet of {n_rep}, {n:,} requests (loops: {', '.join(loops)}) | CPU s | us per "
          "request |\n|---|---|---|")
    for name, s in (("the run", t1 - t0), ("the records' dicts", t2 - t1),
                    ("the summaries (fleet, pool, each replica)", t3 - t2)):
        print(f"| {name} | {s:.3f} | {s / n * 1e6:.1f} |")


GARBAGE = """
import collections, gc, json, sys
sys.path.insert(0, sys.argv[2])
from fleet_cost_split import build
from twin.fleet import run_deployment
gc.disable()
dep, n = build(int(sys.argv[1]))
res = run_deployment(dep)
gc.set_debug(gc.DEBUG_SAVEALL)
found = gc.collect()
kinds = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(4)
print(json.dumps({"requests": n, "garbage": found, "kinds": kinds,
                  "loops": sorted({str(w.loop) for w in dep.workers})}))
"""


def gc_parts() -> None:
    import gc

    from twin.config import ServerArgs
    from twin.sim import SimConfig, simulate
    from twin.workload import from_spec

    wl = from_spec(SPEED_WL.format(rate=1.5, n=20000), seed=0)
    cfg = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B"),
                    gpu="a100-sxm-80gb", step_time_backend="roofline")
    table = simulate(wl, cfg).records
    print("| the records' dicts of 20,000 requests (list(RecordTable)) | collector on | "
          "collector off |\n|---|---|---|")
    for r in range(3):
        c0 = time.process_time()
        a = list(table)
        c1 = time.process_time()
        gc.disable()
        c2 = time.process_time()
        b = list(table)
        c3 = time.process_time()
        gc.enable()
        del a, b
        print(f"| round {r + 1} (CPU s) | {c1 - c0:.3f} | {c3 - c2:.3f} |")
    print("\n| a fleet of 4 (4,000 requests), run with the collector off | cyclic garbage "
          "found | kinds |\n|---|---|---|")
    for label, extra in (("typed core", {}), ("Python replica", {"SERVETWIN_PYTHON_LOOP": "1"})):
        env = {**os.environ, **extra, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", GARBAGE, "4", str(ROOT / "benchmarks")],
                             env=env, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {label} | {got['garbage']} | {got['kinds']} |")


def env_parts() -> None:
    import contextlib
    import cProfile
    import io
    import pstats

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup_speed import ENV_CODE  # the environment's speed run, profiled

    prof = cProfile.Profile()
    out = io.StringIO()
    argv, sys.argv = sys.argv, sys.argv[:1]  # (its preset: the default, finance-qa)
    try:
        with contextlib.redirect_stdout(out):
            prof.runctx(ENV_CODE, {}, {})
    finally:
        sys.argv = argv
    steps = json.loads(out.getvalue().strip().splitlines()[-1])["n"]
    stats = pstats.Stats(prof).stats
    wanted = {("replica.py", "snapshot"): "the policy's snapshots (views of the queue)",
              ("features.py", "pass_features"): "the observation features",
              ("replica.py", "run"): "the replica's loop (snapshots included)",
              ("episode.py", "advance"): "the episode run to each question (the loop, "
                                         "its snapshots, the questions)",
              ("decider.py", "ask"): "the questions asked (the agent's filter, the "
                                     "fallback's plans)",
              ("env.py", "step"): "env.step, all of it"}
    print(f"| the environment, {steps} decisions under cProfile | cumulative CPU s |\n|---|---|")
    for (file, _, func), row in sorted(stats.items(), key=lambda kv: -kv[1][3]):
        name = wanted.get((Path(file).name, func))
        if name:
            print(f"| {name} | {row[3]:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--parts", nargs="+", default=["fleet", "gc", "env"],
                    choices=["fleet", "gc", "env"])
    ns = ap.parse_args()
    print(f"# fleet_cost_split {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
          f"{machine()}")
    if "fleet" in ns.parts:
        fleet_parts(ns.replicas)
        print()
    if "gc" in ns.parts:
        gc_parts()
        print()
    if "env" in ns.parts:
        env_parts()


if __name__ == "__main__":
    main()
