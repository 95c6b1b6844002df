"""Start-up, fleet and environment speed, against a base commit measured side by side.

Three figures, each measured for this tree and for `--base` (a git worktree made for the
run), alternating between the two so that the machine's load falls on both alike; medians
of `--repeats` rounds, and the ratio current / base:

1. Start-up: the CPU time (user + system) of a whole `servetwin simulate` process that
   simulates one request (Llama-3.1-8B on one A100-SXM-80GB, the default step-time
   backend: opdb, after checking that aiconfigurator-core's data covers it), with a
   cold opdb table cache (an empty `SERVETWIN_CACHE_DIR`) and a warm one (the same
   directory again). Python's bytecode cache is on, in a directory of the run's own, and
   warmed before timing, as on an installed machine.
2. Fleet: fleets of 1, 4 and 16 SGLang replicas (Llama-3.1-8B on A100-SXM-80GB, roofline)
   behind round_robin and cache_aware, Poisson 1.5 req/s per replica, prompt U(1000,
   4000), output U(100, 500), 1,000 requests per replica (benchmarks/fleet.py's speed
   part): simulated requests per CPU-second of simulation, records and summary.
3. The environment (`servetwin/Scheduling-v0`, preset finance-qa, or each of
   `--env-presets`): decisions per CPU-second with seeded random actions over 4 episodes
   (step() only; tables built).

    python benchmarks/startup_speed.py [--base 6f0ad37] [--current HEAD|tree] [--repeats 3]
                                       [--parts startup fleet env]
                                       [--env-presets finance-qa finance-qa-chunks-v2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from calibration.profiles import machine  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from sim_speed import build_extension  # noqa: E402

ONE_REQUEST = ["simulate", "--workload", "arrival=poisson,rate=1.5,n=1,"
               "prompt=uniform:1000:4000,output=uniform:100:500",
               "--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "a100-sxm-80gb",
               "--tp-size", "1"]  # the default backend: opdb, whose data covers it
FLEET_CODE = """
import json, sys, time
import simpy
from twin.fleet import Kinds, build_fleet, parse_spec, run_deployment
from twin.workload import from_spec
n_rep, router = int(sys.argv[1]), sys.argv[2]
n = 1000 * n_rep
wl = from_spec(f"arrival=poisson,rate={1.5 * n_rep},n={n},"
               "prompt=uniform:1000:4000,output=uniform:100:500", seed=0)
spec = parse_spec({"gpu": "a100-sxm-80gb", "router": router, "replicas": [
    {"name": "r", "count": n_rep, "step_time_backend": "roofline",
     "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}, "<speed>")
env = simpy.Environment()
dep = build_fleet(env, spec, wl, kinds=Kinds())
c0 = time.process_time()
res = run_deployment(dep)
print(json.dumps({"rate": n / (time.process_time() - c0), "n": n}))
"""
ENV_CODE = """
import json, sys, time
import numpy as np
from experiments.rl.config import preset
from experiments.rl.env import SchedulingEnv
env = SchedulingEnv(preset(sys.argv[1] if len(sys.argv) > 1 else "finance-qa"))
rng = np.random.default_rng(0)
steps, c0 = 0, time.process_time()
for ep in range(4):
    env.reset(seed=2_010_000 + ep)
    done = False
    while not done:
        _, _, done, _, _ = env.step(int(rng.integers(env.action_space.n)))
        steps += 1
print(json.dumps({"rate": steps / (time.process_time() - c0), "n": steps}))
"""


class Tree:
    """A source tree to measure: its path on PYTHONPATH, its own bytecode and table
    caches."""

    def __init__(self, label: str, path: Path, scratch: Path) -> None:
        self.label, self.path = label, path
        self.pyc = scratch / f"pyc-{label}"
        self.scratch = scratch

    def environ(self, cache_dir: Path | None = None) -> dict:
        env = dict(os.environ, PYTHONPATH=str(self.path), PYTHONPYCACHEPREFIX=str(self.pyc))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env[("SERVETWIN_CACHE_DIR")] = str(cache_dir or self.scratch / f"cache-{self.label}")
        return env


def child_cpu(argv: list[str], env: dict) -> float:
    """CPU seconds (user + system) of one child process."""
    before = os.times()
    subprocess.run(argv, env=env, cwd=str(env["PYTHONPATH"]), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = os.times()
    return (after.children_user - before.children_user
            + after.children_system - before.children_system)


def json_child(code: str, args: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, check=True,
                         cwd=str(env["PYTHONPATH"]), capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup(trees: list[Tree], repeats: int) -> list[tuple[str, dict]]:
    cli = [sys.executable, "-m", "servetwin.cli", *ONE_REQUEST]
    for t in trees:  # warm the bytecode cache (and nothing else)
        child_cpu(cli, t.environ(t.scratch / f"warmup-{t.label}"))
    got: dict[str, dict[str, list[float]]] = {t.label: {"cold": [], "warm": []}
                                              for t in trees}
    for k in range(repeats):
        for t in trees:
            fresh = Path(tempfile.mkdtemp(prefix=f"cache-{t.label}-{k}-", dir=t.scratch))
            got[t.label]["cold"].append(child_cpu(cli, t.environ(fresh)))
            got[t.label]["warm"].append(child_cpu(cli, t.environ(fresh)))
    rows = []
    for state in ("cold", "warm"):
        rows.append((f"start-up CPU s, {state} table cache",
                     {t.label: statistics.median(got[t.label][state]) for t in trees}))
    return rows


def rates(trees: list[Tree], repeats: int, code: str, args: list[str]) -> dict[str, float]:
    got: dict[str, list[float]] = {t.label: [] for t in trees}
    for _ in range(repeats):
        for t in trees:
            got[t.label].append(json_child(code, args, t.environ())["rate"])
    return {label: statistics.median(v) for label, v in got.items()}


def worktree(rev: str, scratch: Path, name: str) -> Path:
    path = scratch / name
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path),
                    rev], check=True, capture_output=True)
    build_extension(path, rev)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="6f0ad37",
                    help="the commit to compare with (default: before issue 14's start-up "
                    "and fleet work)")
    ap.add_argument("--current", default="HEAD",
                    help="the commit to measure (default HEAD: committed work only); "
                    "'tree' measures the working tree with its uncommitted changes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", nargs="+", default=["startup", "fleet", "env"],
                    choices=["startup", "fleet", "env"])
    ap.add_argument("--env-presets", nargs="+", default=["finance-qa"], metavar="PRESET",
                    help="the environment's presets to measure (experiments/rl/config.py "
                    "PRESETS; default: finance-qa)")
    ns = ap.parse_args()
    def short(rev: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                              capture_output=True, text=True, check=True).stdout.strip()

    current = ("the working tree at " + short("HEAD") if ns.current == "tree"
               else short(ns.current))
    print(f"# startup_speed {datetime.date.today()}; {machine()}")
    print(f"# current: {current}; base: {short(ns.base)}; medians of {ns.repeats} rounds, "
          "alternating current and base")
    with tempfile.TemporaryDirectory(prefix="servetwin-speed-") as tmp:
        scratch = Path(tmp)
        made = [worktree(ns.base, scratch, "base")]
        if ns.current != "tree":
            made.append(worktree(ns.current, scratch, "current"))
        trees = [Tree("current", ROOT if ns.current == "tree" else made[1], scratch),
                 Tree("base", made[0], scratch)]
        try:
            report(ns, trees)
        finally:
            for path in made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(path)], capture_output=True)


def report(ns: argparse.Namespace, trees: list[Tree]) -> None:
    print("| measure | current | base | current / base |")
    print("|---|---|---|---|")

    def row(name: str, v: dict[str, float], fmt: str, better: str) -> None:
        ratio = v["current"] / v["base"]
        print(f"| {name} | {v['current']:{fmt}} | {v['base']:{fmt}} | {ratio:.2f}x "
              f"({better}) |", flush=True)

    if "startup" in ns.parts:
        print("| _start-up: `servetwin simulate` of 1 request, Llama-3.1-8B, 1x "
              "a100-sxm-80gb, default backend (opdb); whole process_ | | | |")
        for name, v in startup(trees, ns.repeats):
            row(name, v, ".2f", "lower is better")
    if "fleet" in ns.parts:
        print("| _fleet: Poisson 1.5 req/s per replica, prompt U(1000,4000), output "
              "U(100,500), 1,000 requests per replica, Llama-3.1-8B on a100-sxm-80gb, "
              "roofline; simulation + records + summary_ | | | |")
        for n_rep in (1, 4, 16):
            for router in ("round_robin", "cache_aware"):
                v = rates(trees, ns.repeats, FLEET_CODE, [str(n_rep), router])
                row(f"fleet of {n_rep}, {router}: requests / CPU-s", v, ",.0f",
                    "higher is better")
    if "env" in ns.parts:
        print("| _environment: servetwin/Scheduling-v0, random actions, 4 episodes_ "
              "| | | |")
        for name in ns.env_presets:
            v = rates(trees, ns.repeats, ENV_CODE, [name])
            row(f"env {name}: decisions / CPU-s", v, ",.0f", "higher is better")


if __name__ == "__main__":
    main()
