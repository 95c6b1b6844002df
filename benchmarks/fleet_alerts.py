"""What evaluating the alert rules per replica and fleet-wide costs next to the fleet run.

    python benchmarks/fleet_alerts.py [--deployment PRESET|FILE] [--workload SPEC] [--seed N]
                                      [--window S] [--repeat N]

Simulates the workload on the deployment once, then evaluates the built-in rules
(`twin.fleet_alerts.evaluate_fleet`: every rule per replica and for the fleet, burn-rate
windows scaled to the run) `--repeat` times, and prints, with the workload, machine and
date: the run's and the evaluation's CPU seconds (process time, both in this process, so
the ratio holds on a loaded machine), their ratio, and the alerts per scope.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from twin.alerts import auto_burn_scale, default_rules, scale_burn  # noqa: E402
from twin.fleet import simulate_fleet  # noqa: E402
from twin.fleet_alerts import evaluate_fleet, fleet_end, replica_views  # noqa: E402
from twin.metrics import SERIES_FIELDS  # noqa: E402
from twin.monitoring import twin_gauges  # noqa: E402
from twin.workload import get_workload  # noqa: E402

RAMP = ("arrival=ramp,rate=6,steps=0.25:0.5:1:1.5:2,step_s=120,prompt=lognormal:400:1.0,"
        "output=lognormal:150:0.5,templates=1,template_len=256,share=1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="finance-hybrid")
    ap.add_argument("--workload", default=RAMP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    wl = get_workload(ns.workload, ns.seed)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"deployment {ns.deployment}; workload {ns.workload} ({len(wl.requests)} requests), "
          f"seed {ns.seed}; windows {ns.window:g} s")
    t0 = time.process_time()
    res = simulate_fleet(ns.deployment, wl)
    run_s = time.process_time() - t0
    t0 = time.process_time()
    for _ in range(ns.repeat):
        views = replica_views(res.deployment,
                              lambda s, cap: twin_gauges(s, SERIES_FIELDS, cap))
        rules = default_rules()
        rules = scale_burn(rules, auto_burn_scale(rules, fleet_end(res.records, views)))
        alerts = evaluate_fleet(rules, res.records, views, ns.window)
    eval_s = (time.process_time() - t0) / ns.repeat
    print(f"simulate_fleet: {run_s:.2f} CPU-s; alerts (4 rules x {len(views)} replicas + "
          f"fleet): {eval_s:.3f} CPU-s, {eval_s / run_s:.1%} of the run")
    print("alerts per scope:", dict(sorted(Counter(a.replica for a in alerts).items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
