"""How much a state-dependent chunk answer can add over a fixed one (docs/rl.md, "The first
chunk asked too").

`deadline:hopeless` answers every chunk question with one fixed `chunk_tokens x
park_steps`; here the answer switches per question between two, by the state a learned
selector would see: the short questions waiting, the tightest waiting question's slack
(seconds to its TTFT deadline), or the chunked document's own slack. If no such switch
beats the better fixed answer, a learned selector over the same answers has little room
either. On the training evaluation seeds (1,000,000 on), at each load.

    python benchmarks/chunk_switch.py [--env finance-qa-deadline-v2] [--loads 1.5 1.0]
        [--episodes 8] [--small 256x4] [--large 1024x8]
"""

from __future__ import annotations

import argparse
import datetime
import types
from dataclasses import replace

from calibration.profiles import machine
from experiments.rl.config import preset
from experiments.rl.env import capacity_of
from experiments.rl.evaluate import eval_seeds, evaluate_policy, heuristic_specs, mean_stats
from twin.policy.deadline import short_question_chunks
from twin.policy.menu import parse_chunk_answer
from twin.policy.registry import PolicySpec, build_policy


def shorts_waiting(pol, snap) -> int:
    return sum(not pol.targets.is_document(r.prompt_tokens) for r in snap.waiting)


def tightest_short_slack(pol, snap) -> float:
    slack = [r.arrival_s + pol.targets.ttft_target(r.prompt_tokens, r.priority) - snap.now
             for r in snap.waiting if not pol.targets.is_document(r.prompt_tokens)]
    return min(slack) if slack else float("inf")


def rules(small, large) -> dict:
    """name -> (policy, snap, chunked) -> the chunk answer for this question."""
    return {
        f"fixed {large[0]}x{large[1]}": lambda p, s, c: large,
        f"fixed {small[0]}x{small[1]}": lambda p, s, c: small,
        "small while >= 1 question waits": lambda p, s, c: (
            small if shorts_waiting(p, s) >= 1 else large),
        "small while >= 3 questions wait": lambda p, s, c: (
            small if shorts_waiting(p, s) >= 3 else large),
        "small while a waiting question has < 1 s slack": lambda p, s, c: (
            small if tightest_short_slack(p, s) < 1.0 else large),
        "small while a waiting question has < 0.5 s slack": lambda p, s, c: (
            small if tightest_short_slack(p, s) < 0.5 else large),
        "large while the document has 0-2 s slack": lambda p, s, c: (
            large if 0 <= p.slack(s, c) <= 2.0 else small),
    }


def switching(params: dict, rule):
    def factory():
        pol = build_policy(PolicySpec("deadline", params))

        def chunk(self, snap, chunked, budget, page_size):
            tokens, park = rule(self, snap, chunked)
            return short_question_chunks(self.targets, snap, tokens, park, page_size)

        pol.chunk = types.MethodType(chunk, pol)
        return pol
    return factory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="finance-qa-deadline-v2")
    ap.add_argument("--loads", nargs="+", type=float, default=[1.5, 1.0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--small", type=parse_chunk_answer, default=(256, 4))
    ap.add_argument("--large", type=parse_chunk_answer, default=(1024, 8))
    ns = ap.parse_args()
    cfg = preset(ns.env)
    cfg = replace(cfg, capacity_rps=capacity_of(cfg))
    base = {**heuristic_specs(cfg)["deadline:hopeless"].params, "chunk_tokens": ns.large[0],
            "park_steps": ns.large[1]}
    seeds = eval_seeds(ns.episodes)
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine {machine()}")
    print(f"env {ns.env}: capacity {cfg.capacity_rps:.4f} req/s; seeds {seeds[0]}.."
          f"{seeds[-1]}; deadline:hopeless, the chunk answer per question\n")
    print("| chunk answer | load | SLO attainment | short questions | documents | return |")
    print("|---|---|---|---|---|---|")
    for load in ns.loads:
        for name, rule in rules(ns.small, ns.large).items():
            m = mean_stats(evaluate_policy(cfg, switching(base, rule), seeds,
                                           {"load": load, "burst_cv": 2.0}))
            print(f"| {name} | {load:.0%} | {m['slo_attainment']:.1%} | {m['slo_short']:.1%} "
                  f"| {m['slo_documents']:.1%} | {m['return']:+.4f} |", flush=True)


if __name__ == "__main__":
    main()
