"""Planner speed: candidates per minute for 10k-request evaluations, serial and parallel side
by side in one run, and the wall time of the users' plan (`servetwin plan --out DIR` with
no space: finance-qa at its peak, P99 TTFT <= 1.5 s, every GPU, TP 1/2/4/8, 1-8 replicas,
then the registry's policies on the best hardware), the bar being 100 candidates in under
5 minutes on this machine.

    python benchmarks/plan_speed.py [--requests 10000] [--jobs 2] [--skip-users]
        [--users-slo 'ttft:p99:1.5'] [--base COMMIT [--rounds 1]]

Part 1 runs the same 8 candidates (H100 and H200 at TP 4 and 8, 1 and 2 replicas) twice,
`--jobs 1` and `--jobs N`, each into a fresh directory, and checks that the two plan.json
are byte-identical (paths aside). Part 2 runs the users' plan at its default (2000
requests per evaluation). Times are wall-clock on a shared machine: compare the two
columns of one run, not runs of different days. With `--base COMMIT`, part 2 also runs
on that commit (a git worktree with its compiled modules built, run with PYTHONPATH on
it), alternating with this tree `--rounds` times, and says whether the two plan.json are
byte-identical (paths aside).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPACE = {"gpus": ["h100-sxm-80gb", "h200-sxm-141gb"], "tp": [4, 8], "replicas": [1, 2]}


def plan(out: Path, args: list[str], tree: Path = ROOT) -> tuple[float, float, dict]:
    """(wall s, CPU s of the plan and its workers, plan.json) of one `servetwin plan` of
    source tree `tree`."""
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "servetwin.cli", "plan", "--out", str(out),
                             "--quiet", *args], cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    stdout, _ = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"servetwin plan failed ({proc.returncode}):\n{stdout}")
    cpu = sum(float(json.loads(p.read_text()).get("cpu_s", 0.0))
              for p in (out / "candidates").glob("*.json"))
    return wall, cpu, json.loads((out / "plan.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--skip-users", action="store_true", help="skip part 2")
    ap.add_argument("--users-slo", default="ttft:p99:1.5")
    ap.add_argument("--base", default=None,
                    help="a previous commit: part 2 runs on it too, side by side")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --base: alternating rounds of part 2 (each side's fastest)")
    ns = ap.parse_args()
    from calibration.profiles import machine

    print(f"# benchmarks/plan_speed.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
          f"UTC; {machine()}; load average {os.getloadavg()[0]:.1f} at start")
    tmp = Path(tempfile.mkdtemp(prefix="plan_speed_"))
    space = tmp / "space.json"
    space.write_text(json.dumps(SPACE))
    common = ["--space", str(space), "--requests", str(ns.requests), "--no-ramp"]
    print(f"## part 1: 8 candidates {SPACE}, finance-qa, {ns.requests} requests per "
          "evaluation, SLO ttft:p99:1.5:prompt<10000")
    rows = []
    for jobs in (1, ns.jobs):
        out = tmp / f"jobs{jobs}"
        wall, cpu, p = plan(out, [*common, "--jobs", str(jobs), "--slo",
                                  "ttft:p99:1.5:prompt<10000"])
        evals = sum(len(r["evaluations"]) for r in p["candidates"])
        rows.append((jobs, wall, cpu, evals, out))
        print(f"jobs {jobs}: {wall:.1f} s wall, {cpu:.1f} CPU-s in the searches, {evals} "
              f"evaluations, {8 / wall * 60:.2f} candidates/min, "
              f"{evals * ns.requests / cpu:,.0f} simulated requests per CPU-s")
    a = (rows[0][4] / "plan.json").read_text().replace(str(rows[0][4]), "DIR")
    b = (rows[1][4] / "plan.json").read_text().replace(str(rows[1][4]), "DIR")
    print(f"serial vs parallel plan.json byte-identical: {a == b}; speed-up "
          f"{rows[0][1] / rows[1][1]:.2f}x")
    if ns.skip_users:
        return
    print(f"## part 2: the users' plan (no --space), default requests, --slo {ns.users_slo}")
    args = ["--jobs", str(ns.jobs), "--slo", ns.users_slo]
    if ns.base is None:
        out = tmp / "users"
        wall, cpu, p = plan(out, args)
        n = len(p["candidates"])
        print(f"{n} candidates ({p['counts']}) in {wall:.1f} s wall ({wall / n * 100 / 60:.2f} "
              f"min per 100 candidates), {cpu:.1f} CPU-s in the searches; winner "
              f"{p['winner']}, closest {p['closest']}")
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_speed import base_tree, drop_tree

    base = base_tree(ns.base, "plan-speed-base")
    try:
        best: dict[str, tuple[float, float, str]] = {}
        for r in range(ns.rounds):
            for label, tree in (("current", ROOT), (ns.base, base)):
                out = tmp / f"users-{r}-{label}"
                wall, cpu, p = plan(out, args, tree)
                text = (out / "plan.json").read_text().replace(str(out), "DIR")
                if label not in best or wall < best[label][0]:
                    best[label] = (wall, cpu, text)
                print(f"round {r + 1}, {label}: {len(p['candidates'])} candidates "
                      f"({p['counts']}) in {wall:.1f} s wall, {cpu:.1f} CPU-s in the searches")
        (w1, c1, t1), (w0, c0, t0) = best["current"], best[ns.base]
        print(f"current {w1:.1f} s wall / {c1:.1f} CPU-s; {ns.base} {w0:.1f} s / {c0:.1f} "
              f"CPU-s; {w0 / w1:.2f}x wall, {c0 / c1:.2f}x CPU; plan.json byte-identical: "
              f"{t1 == t0}")
    finally:
        drop_tree(base)


if __name__ == "__main__":
    main()
