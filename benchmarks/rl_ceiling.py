"""The ceiling of the per-pass decisions (issue 11): a clairvoyant rollout search.

Is the issue's bar (+25 % SLO attainment over the best heuristic at 150 % load) reachable
at all with the decisions the environment's action takes? On held-out benchmark episodes
(the seeds `benchmarks/rl.py` uses) the rollout search of `experiments/rl/search.py` tries
every menu rule whose plan differs at each question, simulates each to the episode's end
from a forked copy of the state (knowing the future arrivals), playing the base rule
afterwards, and keeps the best (fewest dropped, then the objective). Prints, per seed and
in the mean, the base rule's SLO attainment and the search's, with the class attainments,
drops and return, and the bar.

    nice -n 19 python benchmarks/rl_ceiling.py [--env finance-qa-deadline-v2]
        [--base hold-documents] [--objective slo] [--documents] [--episodes 4] [--load 1.5]
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np

from calibration.profiles import machine
from experiments.rl.config import preset
from experiments.rl.env import capacity_of
from experiments.rl.search import OBJECTIVES, base_stats, search_episode

BENCH_SEED_BASE = 2_000_000  # benchmarks/rl.py's held-out seeds
COLS = ("slo_attainment", "slo_short", "slo_documents", "dropped_short", "dropped_documents",
        "return")


def row(label: str, s: dict) -> str:
    return (f"| {label} | {s['slo_attainment']:.1%} | {s['slo_short']:.1%} | "
            f"{s['slo_documents']:.1%} | {s['dropped_short'] + s['dropped_documents']} | "
            f"{s['return']:+.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="finance-qa-deadline-v2",
                    help="environment preset: its menu is the search's action set")
    ap.add_argument("--base", default="hold-documents",
                    help="the rule the rollouts play after the tried answer (a menu rule)")
    ap.add_argument("--objective", default="slo", choices=OBJECTIVES)
    ap.add_argument("--documents", action="store_true",
                    help="also try, where the base rule lets documents in, each waiting "
                         "document alone and no document (a richer action than the menu)")
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=BENCH_SEED_BASE)
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--burst-cv", type=float, default=2.0)
    ap.add_argument("--bar", type=float, default=0.685,
                    help="the SLO attainment the issue asks for (default: +25 %% over "
                         "deadline:documents' 54.8 %% at 150 %% load)")
    ns = ap.parse_args()
    cfg = preset(ns.env)
    if ns.base not in cfg.menu:
        raise SystemExit(f"--base {ns.base}: allowed values (menu of {ns.env}): "
                         f"{', '.join(cfg.menu)}")
    opts = {"load": ns.load, "burst_cv": ns.burst_cv}
    seeds = [ns.first_seed + i for i in range(ns.episodes)]
    print(f"date {datetime.date.today()}; machine {machine()}")
    print(f"env {ns.env} (menu {', '.join(cfg.menu)}); capacity {capacity_of(cfg):.4f} req/s; "
          f"load {ns.load:.0%}, burst CV {ns.burst_cv}; {cfg.family.n} requests per episode; "
          f"seeds {seeds[0]}..{seeds[-1]}; base {ns.base}; objective {ns.objective}; "
          f"single-document answers {'on' if ns.documents else 'off'}", flush=True)
    print("\n| episode | SLO attainment | short questions | documents | dropped | return |")
    print("|---|---|---|---|---|---|")
    base_rows, search_rows = [], []
    for seed in seeds:
        t0 = time.process_time()
        b = base_stats(cfg, seed, opts, ns.base)
        res = search_episode(cfg, seed, opts, ns.base, ns.objective, ns.documents,
                             log=lambda m: print("#", m, flush=True))
        cpu = time.process_time() - t0  # the parent's; the children's is on top
        base_rows.append(b)
        search_rows.append(res.stats)
        print(row(f"{seed} {ns.base}", b))
        print(row(f"{seed} search", res.stats))
        print(f"# seed {seed}: {res.decisions} decisions, {res.searched} searched, "
              f"{res.rollouts} rollouts, {res.deviations} deviations; chosen {res.chosen}; "
              f"parent CPU {cpu:.0f} s", flush=True)
    mb = {k: float(np.mean([r[k] for r in base_rows])) for k in COLS}
    ms = {k: float(np.mean([r[k] for r in search_rows])) for k in COLS}
    print("\nmeans:\n")
    print("| policy | SLO attainment | short questions | documents | dropped | return |")
    print("|---|---|---|---|---|---|")
    print(row(ns.base, mb))
    print(row("rollout search", ms))
    print(f"\nsearch vs {ns.base}: {ms['slo_attainment']:.1%} vs {mb['slo_attainment']:.1%} "
          f"({ms['slo_attainment'] / mb['slo_attainment'] - 1:+.1%}); the bar "
          f"{ns.bar:.1%}: {'reached' if ms['slo_attainment'] >= ns.bar else 'not reached'}")


if __name__ == "__main__":
    main()
