"""A policy's effect live and in the twin, on the CPU harness (experiments/policy_effect.py).

    python benchmarks/policy_effect.py [--n 60] [--load 0.9] [--budget-s 60] [--out DIR]

Starts a CPU SGLang server (`--max-running-requests 2`, fcfs) with servetwin's plugin,
calibrates the twin on it, replays a tiered workload (70 % tier 0, 30 % tier 20, Poisson at
`--load` x the calibrated twin's capacity for the mix) with fcfs, then on fresh servers with each policy running inside SGLang through the
plugin (`slices` conservative: the users' score, VIP first; `hrrn`; `lof`), and simulates
every run in the calibrated twin with the same spec at the live send times. Prints the
mean queue time per tier, live and twin, and the change against fcfs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from experiments.policy_effect import PRIORITY_FLAGS, run, table  # noqa: E402
from twin.workload import from_spec  # noqa: E402

SPEC = "arrival=poisson,rate={rate},n={n},prompt=uniform:64:384,output=uniform:16:64," \
       "tiers=0:0.7/20:0.3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--budget-s", type=float, default=60)
    ap.add_argument("--out", type=Path, default=Path("out/policy_effect"))
    ap.add_argument("--policies", nargs="+", default=["slices-conservative", "hrrn", "lof"],
                    help="slices-conservative (with priority scheduling on), or any spec")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    slices = ns.out / "slices-conservative.json"
    slices.write_text(json.dumps({"name": "slices", "params": {"mode": "conservative"}}))

    def make(rate: float):
        return from_spec(SPEC.format(rate=round(rate, 4), n=ns.n), seed=3, name=f"tiers@{rate:.2f}/s")

    print(f"# {SPEC.format(rate='RATE', n=ns.n)}, load {ns.load:.0%} of the calibrated capacity")
    print(f"# {machine()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    policies = [(str(slices), PRIORITY_FLAGS) if p == "slices-conservative" else (p, [])
                for p in ns.policies]
    effects, w = run(policies, make, ns.load, ns.out, ns.budget_s,
                     log=lambda m: print("#", m, flush=True))
    print(f"# workload {w.name}")
    print(table(effects))


if __name__ == "__main__":
    main()
