"""The RL scheduler against the heuristics on the users' deployment (docs/rl.md).

finance-qa shapes (open loop, gamma arrivals with CV 2) at fixed loads of the measured
capacity, on benchmark seeds held out from training and from training's evaluation; every
heuristic of the registry and the learned policy run the same episodes on the deployed path
(`--policy`'s path: the policy asked at every pass). Prints SLO attainment (our SLO:
TTFT within 1.5 s, documents +0.5 ms per prompt token, TPOT <= 0.1 s), the users' flat
TTFT <= 1.5 s attainment, P99 TTFT of short questions and documents; then the
environment's speed (decisions per CPU-second with random actions) and the shipped
policy's training cost from its sidecar.

    python benchmarks/rl.py [--policy learned:finance-qa] [--episodes 8] [--loads 1.0 1.5]
        [--heuristics deadline:documents deadline:laxity shortest-prefill-first]

`--heuristics` restricts the comparison to those labels (a smaller, faster variant); for a
selector the benchmark also prints how often it chose each menu rule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from calibration.profiles import machine
from experiments.rl.config import preset
from experiments.rl.env import SchedulingEnv, capacity_of
from experiments.rl.evaluate import evaluate_policy, evaluate_spec, heuristic_specs, mean_stats
from twin.policy import build_policy, read_spec

BENCH_SEED_BASE = 2_000_000
COLS = ("slo_attainment", "slo_short", "slo_documents", "ttft_attainment_flat",
        "p99_ttft_short_s", "p99_ttft_documents_s", "return")


def compare(cfg, policy: str, load: float, seeds: list[int], cv: float,
            only: list[str] | None = None) -> tuple[dict[str, dict], Counter]:
    """Each policy's mean statistics, and how often the learned selector chose each rule."""
    opts = {"load": load, "burst_cv": cv}
    chosen: Counter = Counter()

    def counted():
        pol = build_policy(read_spec(policy))
        if getattr(pol, "kind", None) == "selector":
            pick = pol.choice

            def choice(snap):
                c = pick(snap)
                chosen[pol.menu[c]] += 1
                return c
            pol.choice = choice
        return pol

    rows = {"learned": mean_stats(evaluate_policy(cfg, counted, seeds, opts))}
    specs = heuristic_specs(cfg)
    unknown = sorted(set(only or ()) - set(specs))
    if unknown:
        raise SystemExit(f"--heuristics {' '.join(unknown)}: allowed values: "
                         f"{', '.join(specs)}")
    for label, spec in specs.items():
        if only is None or label in only:
            rows[label] = mean_stats(evaluate_spec(cfg, spec, seeds, opts))
    return rows, chosen


def table(rows: dict[str, dict]) -> str:
    head = "| policy | SLO attainment | short questions | documents | TTFT<=1.5 s (flat) | " \
           "P99 TTFT short (s) | P99 TTFT documents (s) | return |"
    lines = [head, "|" + "---|" * 8]
    for label, m in sorted(rows.items(), key=lambda kv: -kv[1]["slo_attainment"]):
        cells = ["-" if m[c] is None else f"{m[c]:.1%}" if "slo" in c or "attainment" in c
                 else f"{m[c]:.2f}" for c in COLS[:-1]]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {m['return']:+.4f} |")
    return "\n".join(lines)


def comparisons(rows: dict[str, dict]) -> list[str]:
    """The learned policy against the best heuristic by SLO attainment and by return (the
    class-balanced reward it is trained on), and the best of the earlier registry
    (SGLang's, the users', the menu rules) against the deadline policy's best."""
    heur = {k: v for k, v in rows.items() if k != "learned"}
    plain = {k: v for k, v in heur.items() if "+chunks" not in k and "+budget" not in k}
    old = {k: v for k, v in plain.items() if not k.startswith("deadline")}
    out = []
    pools = [("best heuristic", plain), ("best heuristic before deadline", old)]
    if len(plain) < len(heur):  # the same rules with the learned policy's chunk answer
        pools.insert(1, ("best heuristic with the chunk answer", heur))
    for what, pool in pools:
        if not pool:
            continue
        for metric in ("slo_attainment", "return"):
            best = max(pool, key=lambda k: pool[k][metric])
            a, b = rows["learned"][metric], pool[best][metric]
            fmt = "{:.1%}" if metric == "slo_attainment" else "{:+.4f}"
            out.append(f"learned vs {what} by {metric} ({best}): {fmt.format(a)} vs "
                       f"{fmt.format(b)} ({a / b - 1:+.1%} relative)")
    return out


def env_speed(cfg, episodes: int) -> tuple[float, int]:
    env = SchedulingEnv(cfg)
    rng = np.random.default_rng(0)
    steps, t0 = 0, time.process_time()
    for ep in range(episodes):
        env.reset(seed=BENCH_SEED_BASE + 10_000 + ep)
        done = False
        while not done:
            _, _, done, _, _ = env.step(int(rng.integers(env.action_space.n)))
            steps += 1
    return steps / (time.process_time() - t0), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="learned:finance-qa")
    ap.add_argument("--env", default="finance-qa")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.5])
    ap.add_argument("--burst-cv", type=float, default=2.0)
    ap.add_argument("--heuristics", nargs="+", default=None, metavar="LABEL",
                    help="compare against these heuristics only (labels as in the table; "
                         "default: every heuristic of the registry)")
    ap.add_argument("--no-speed", action="store_true",
                    help="skip the environment-speed measurement")
    ap.add_argument("--speed-envs", nargs="+", default=None, metavar="PRESET",
                    help="only the environment speed of these presets, side by side in this "
                         "run (e.g. finance-qa-deadline finance-qa-deadline-v2: the cost of "
                         "the pass-v2 features)")
    ap.add_argument("--live", action="store_true",
                    help="also the comparison on the CPU SGLang server and its calibrated "
                         "twin (experiments/rl/live.py)")
    ap.add_argument("--live-only", action="store_true", help="only the live comparison")
    ap.add_argument("--live-out", type=Path, default=Path("out/rl_live"))
    ap.add_argument("--live-load", type=float, default=1.5)
    ap.add_argument("--budget-s", type=float, default=60, help="calibration budget (live)")
    ap.add_argument("--plugin-tree", type=Path, default=None,
                    help="another source tree's plugin for the live servers (PYTHONPATH of the "
                         "live servers)")
    ap.add_argument("--live-policies", nargs="+", default=None,
                    help="run only these live (labels; the others are kept from --live-out)")
    ap.add_argument("--live-chunk-answer", default=None, metavar="TOKENSxPARK",
                    help="the chunk answer of the live deadline:MODE+chunks rules at the CPU "
                         "server's scale (default: the users' 256x4 scaled by the chunk "
                         "budgets: 32x4)")
    ap.add_argument("--live-chunk-budget", default=None, metavar="SECONDSxPARK",
                    help="the time-budget chunk answer of the live deadline:MODE+budget rules "
                         "at the CPU server's scale (default: the users' answer, "
                         "experiments/rl/evaluate.py BUDGET_ANSWER, scaled by a full chunk's "
                         "step)")
    ap.add_argument("--live-report", action="store_true",
                    help="print the live tables from --live-out's records, run nothing")
    ns = ap.parse_args()
    ns.live_only = ns.live_only or ns.live_report
    if ns.speed_envs:
        print(f"date {datetime.date.today()}; machine {machine()}")
        for name in ns.speed_envs:
            cfg = preset(name)
            speed, steps = env_speed(cfg, 4)
            print(f"{name} ({cfg.features}, menu {', '.join(cfg.menu)}): {speed:,.0f} "
                  f"decisions per CPU-second ({steps} decisions, 4 episodes, random actions)")
        return
    if not ns.live_only:
        twin_comparison(ns)
    if ns.live or ns.live_only:
        live_comparison(ns)


def live_comparison(ns) -> None:
    from experiments.rl.live import gains, run
    from experiments.rl.live import table as live_table

    print(f"\n## live: the CPU SGLang server vs the twin calibrated on it "
          f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {machine()})\n")
    if ns.live_report:  # the tables again from the records a run kept
        from experiments.rl.live import rebuild

        res = rebuild(ns.live_out)
    else:
        from twin.policy.menu import parse_budget_answer, parse_chunk_answer

        answer = None
        if ns.live_chunk_answer:
            try:
                answer = parse_chunk_answer(ns.live_chunk_answer)
            except ValueError as exc:
                raise SystemExit(f"--live-chunk-answer: {exc}") from None
        budget = None
        if ns.live_chunk_budget:
            try:
                budget = tuple(parse_budget_answer(ns.live_chunk_budget))
            except ValueError as exc:
                raise SystemExit(f"--live-chunk-budget: {exc}") from None
        res = run(ns.live_out, ns.live_load, ns.budget_s, ns.policy, ns.plugin_tree,
                  ns.live_policies, log=lambda m: print("#", m, flush=True),
                  chunk_answer=answer, budget=budget)
    print(f"\nworkload {res['workload']} at {res['load']:.0%} of the calibrated capacity "
          f"({res['capacity_rps']:.3f} req/s); SLO {res['targets']}\n")
    print("at the targets above, the twin as calibrated:\n")
    print(live_table(res))
    print()
    for line in gains(res):
        print(line)
    print("\nat the targets scaled by each run's drift (its steps over the profile's), the "
          "twin's steps too:\n")
    print(live_table(res, "live_k", "twin_k"))
    print()
    for line in gains(res, live="live_k", twin="twin_k"):
        print(line)


def twin_comparison(ns) -> None:
    cfg = preset(ns.env)
    seeds = [BENCH_SEED_BASE + i for i in range(ns.episodes)]
    cap = capacity_of(cfg)
    d = cfg.deployment
    print(f"date {datetime.date.today()}; machine {machine()}")
    print(f"deployment {d.model_path} on {d.gpu} x TP {d.tp_size}; capacity {cap:.4f} req/s "
          f"(saturated closed loop, fcfs)")
    print(f"workload: finance-qa shapes, {cfg.family.n} requests per episode, gamma arrivals "
          f"CV {ns.burst_cv}; {ns.episodes} episodes per load (seeds {seeds[0]}..{seeds[-1]})")
    print(f"SLO: {cfg.targets.to_json()}; policy {ns.policy}")
    for load in ns.loads:
        rows, chosen = compare(cfg, ns.policy, load, seeds, ns.burst_cv, ns.heuristics)
        print(f"\n## load {load:.0%} of capacity\n\n{table(rows)}\n")
        if chosen:
            total = sum(chosen.values())
            print("learned policy's choices: " + ", ".join(
                f"{r} {n} ({n / total:.1%})" for r, n in chosen.most_common()) + "\n")
        for line in comparisons(rows):
            print(line)
    if not ns.no_speed:
        speed, steps = env_speed(cfg, 4)
        print(f"\nenvironment speed: {speed:,.0f} decisions per CPU-second ({steps} "
              f"decisions, 4 episodes, random actions)")
    spec = read_spec(ns.policy)
    sidecar = Path(spec.params.get("weights", "")).with_suffix(".json")
    if sidecar.is_file():
        about = json.loads(sidecar.read_text())
        ev = about.get("evaluation", {})
        print(f"training: {about['train']['timesteps']} timesteps planned; the shipped "
              f"weights are from {ev.get('timesteps')} steps after {ev.get('cpu_s')} CPU-s "
              f"of training (PPO, {about['train']['n_envs']} envs)")


if __name__ == "__main__":
    main()
