"""The chunk answer's settings, swept in the twin (docs/rl.md, "The chunk answer").

A `deadline` rule with `chunk_tokens=T, park_steps=K` (or `chunk_budget_s=B`: the cap as
a time, `--budgets BxK`; and optionally `rescue_s=R`) on
the users' deployment (the RL environment's finance-qa episodes) at each load, on the
training evaluation seeds (1,000,000 on: the settings are chosen here, and the benchmark
seeds of `benchmarks/rl.py` stay held out). Prints SLO attainment by class and the
class-balanced return per setting.

    python benchmarks/chunk_answers.py [--rule deadline:hopeless] [--answers 0x0 256x4 ...]
        [--budgets 0.25x8 ...] [--rescue none 0.25 ...] [--loads 1.0 1.5] [--episodes 8]
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import replace

from calibration.profiles import machine
from experiments.rl.config import preset
from experiments.rl.env import capacity_of
from experiments.rl.evaluate import eval_seeds, evaluate_spec, heuristic_specs, mean_stats
from twin.policy.menu import parse_budget_answer, parse_chunk_answer
from twin.policy.registry import PolicySpec


def parse_answer(text: str) -> tuple[int, int]:
    try:
        return parse_chunk_answer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_budget(text: str) -> tuple[float, int]:
    """`SECONDSxPARK` (e.g. `0.25x8`) as `(chunk_budget_s, park_steps)`."""
    try:
        return tuple(parse_budget_answer(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="finance-qa-deadline-v2")
    ap.add_argument("--rule", default="deadline:hopeless",
                    help="a deadline heuristic's label (benchmarks/rl.py's table)")
    ap.add_argument("--answers", nargs="+", type=parse_answer,
                    default=[(0, 0), (256, 4), (512, 4), (512, 8), (1024, 8)])
    ap.add_argument("--budgets", nargs="*", type=parse_budget, default=[],
                    help="chunk answers as a time budget, SECONDSxPARK (after --answers)")
    ap.add_argument("--rescue", nargs="+", default=["none"],
                    help="rescue_s values (seconds, or none)")
    ap.add_argument("--loads", nargs="+", type=float, default=[1.0, 1.5])
    ap.add_argument("--episodes", type=int, default=8)
    ns = ap.parse_args()
    cfg = preset(ns.env)
    cfg = replace(cfg, capacity_rps=capacity_of(cfg))
    specs = heuristic_specs(cfg)
    if ns.rule not in specs or specs[ns.rule].name != "deadline":
        raise SystemExit(f"--rule {ns.rule}: allowed values: "
                         f"{', '.join(k for k, v in specs.items() if v.name == 'deadline')}")
    seeds = eval_seeds(ns.episodes)
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine {machine()}")
    print(f"env {ns.env}: capacity {cfg.capacity_rps:.4f} req/s, {cfg.family.n} requests per "
          f"episode, burst CV 2; seeds {seeds[0]}..{seeds[-1]}; rule {ns.rule}\n")
    print("| chunk answer | rescue_s | load | SLO attainment | short questions | documents "
          "| return |")
    print("|---|---|---|---|---|---|---|")
    answers = [(f"{t} x {k}", {"chunk_tokens": t, "park_steps": k}) for t, k in ns.answers]
    answers += [(f"{b:g} s x {k}", {"chunk_tokens": 0, "chunk_budget_s": b, "park_steps": k})
                for b, k in ns.budgets]
    for label, answer in answers:
        for rescue in ns.rescue:
            params = {**specs[ns.rule].params, **answer}
            if rescue != "none":
                params["rescue_s"] = float(rescue)
            for load in ns.loads:
                m = mean_stats(evaluate_spec(cfg, PolicySpec("deadline", params), seeds,
                                             {"load": load, "burst_cv": 2.0}))
                print(f"| {label} | {rescue} | {load:.0%} | "
                      f"{m['slo_attainment']:.1%} | {m['slo_short']:.1%} | "
                      f"{m['slo_documents']:.1%} | {m['return']:+.4f} |", flush=True)


if __name__ == "__main__":
    main()
