"""Scoring policies on held-out episodes: the heuristics of the registry and a learned one.

An evaluation episode is the environment's first draw for a seed (`reset(seed=...)`
draws the same one), optionally at a fixed load; each policy runs it on the deployed
path (a `PolicyDecider` asked at every pass, as `servetwin simulate --policy` and the
plugin ask it) and is scored by the environment's `Ledger`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gymnasium.utils import seeding

from experiments.rl.config import EnvConfig, draw_episode
from experiments.rl.env import capacity_of, step_time_for
from experiments.rl.episode import episode_stats, run_policy
from twin.policy import Policy, PolicySpec, build_policy
from twin.policy.deadline import WITHHOLD, BudgetAnswer
from twin.policy.menu import PLAN_RULES, menu_entry, prefill_params
from twin.workload import Workload

#: held-out evaluation seeds start here (training draws its episodes from seeds below)
EVAL_SEED_BASE = 1_000_000


def eval_seeds(n: int) -> list[int]:
    return [EVAL_SEED_BASE + i for i in range(n)]


#: the chunk answer as a time budget (seconds, decode-only passes) on the users' deployment,
#: chosen on the training evaluation seeds by SLO attainment at 150 % load (`python
#: benchmarks/chunk_answers.py --env finance-qa-chunks-v2 --budgets ...`, docs/rl.md)
BUDGET_ANSWER = (0.3, 8)


def episode_workload(cfg: EnvConfig, seed: int, options: dict | None = None) -> Workload:
    rng, _ = seeding.np_random(seed)
    return draw_episode(cfg, capacity_of(cfg), rng, options)[0]


def heuristic_specs(cfg: EnvConfig) -> dict[str, PolicySpec]:
    """Every heuristic in the registry by a label: SGLang's policies, `priority`, the
    users' `slices` in each mode, `deadline` in each withholding mode (with the chunk
    cap: live, a server started with --schedule-policy shortest-prefill-first), and each
    menu rule alone (`menu:RULE`, with the SLO
    targets of `cfg`; also `menu:RULE+cap` when `cfg.chunk_cap`); with `cfg.chunk_answer`
    also each deadline mode with that chunk answer (`deadline:MODE+chunks`), the learned
    policy's own setting; with a chunk answer anywhere (that or the menu's entries) also
    `deadline:MODE+budgetSECONDSxPARK` (`BUDGET_ANSWER`: the cap as a time); and each menu
    entry `RULE@TOKENSxPARK` of a deadline rule alone
    (`deadline:MODE+chunksTOKENSxPARK`)."""
    specs = {n: PolicySpec(n) for n in ("fcfs", "lof", "lpm", "hrrn", "dfs-weight",
                                        "shortest-prefill-first", "random", "priority")}
    for mode in ("conservative", "moderate", "aggressive"):
        specs[f"slices:{mode}"] = PolicySpec("slices", {"mode": mode})
    t = cfg.targets.to_json()
    for mode in WITHHOLD:  # deadline-aware admission, with SGLang's spf chunk cap
        specs[f"deadline:{mode}"] = PolicySpec("deadline", {"withhold": mode, **t,
                                                            **prefill_params(cfg.prefill),
                                                            "chunk_cap": True})
    if cfg.chunk_answer is not None:
        tokens, park = cfg.chunk_answer
        for mode in WITHHOLD:
            spec = specs[f"deadline:{mode}"]
            specs[f"deadline:{mode}+chunks"] = PolicySpec(
                "deadline", {**spec.params, "chunk_tokens": tokens, "park_steps": park})
    def with_answer(mode: str, answer) -> None:  # deadline:MODE with a chunk answer
        params = specs[f"deadline:{mode}"].params
        if isinstance(answer, BudgetAnswer):
            specs[f"deadline:{mode}+budget{answer.seconds:g}x{answer.park}"] = PolicySpec(
                "deadline", {**params, "chunk_budget_s": answer.seconds,
                             "park_steps": answer.park})
        else:
            specs[f"deadline:{mode}+chunks{answer[0]}x{answer[1]}"] = PolicySpec(
                "deadline", {**params, "chunk_tokens": answer[0], "park_steps": answer[1]})

    if cfg.chunk_answer is not None or any("@" in m for m in cfg.menu):
        for mode in WITHHOLD:  # the chunk answer as a time (BUDGET_ANSWER)
            with_answer(mode, BudgetAnswer(*BUDGET_ANSWER))
    for entry in cfg.menu:  # entries with a chunk answer: that deadline rule with it
        rule, answer = menu_entry(entry)
        if answer is not None and rule in PLAN_RULES:
            with_answer(PLAN_RULES[rule], answer)
    for rule in (r for r in cfg.menu if r not in PLAN_RULES and "@" not in r):
        specs[f"menu:{rule}"] = PolicySpec("menu", {"rule": rule, **t})
        if cfg.chunk_cap:  # the learned policy's own setting, for each rule alone
            specs[f"menu:{rule}+cap"] = PolicySpec("menu", {"rule": rule, **t,
                                                            "chunk_cap": True})
    return specs


def evaluate_policy(cfg: EnvConfig, policy: Policy | Callable[[], Policy], seeds: list[int],
                    options: dict | None = None) -> list[dict]:
    """Episode statistics (`episode_stats`) of `policy` on each seed's episode."""
    out = []
    for seed in seeds:
        pol = policy if isinstance(policy, Policy) else policy()
        wl = episode_workload(cfg, seed, options)
        ledger, records, _ = run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg), pol)
        out.append({"seed": seed, **episode_stats(ledger, records, cfg.targets)})
    return out


def evaluate_spec(cfg: EnvConfig, spec: PolicySpec, seeds: list[int],
                  options: dict | None = None) -> list[dict]:
    return evaluate_policy(cfg, lambda: build_policy(spec), seeds, options)


def mean_stats(rows: list[dict]) -> dict:
    """Means over episodes of every numeric statistic (None where no episode has it)."""
    keys = [k for k in rows[0] if k != "seed"]
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r[k] is not None]
        out[k] = round(float(np.mean(vals)), 6) if vals else None
    return out
