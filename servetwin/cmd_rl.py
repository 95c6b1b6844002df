"""`servetwin rl train`: train the RL scheduler in the twin (docs/rl.md). Needs the `rl`
extra (stable-baselines3, torch); the policy it exports runs without them."""

from __future__ import annotations

import argparse
from pathlib import Path

#: experiments/rl/config.py's PRESETS, by name (not imported here: the CLI starts without
#: the RL stack; tests/test_chunk_budget.py checks the two agree)
ENV_PRESETS = ["finance-qa", "finance-qa-capped", "finance-qa-hold", "finance-qa-admit",
               "finance-qa-admit-v2", "finance-qa-deadline", "finance-qa-deadline-v2",
               "finance-qa-chunks", "finance-qa-chunks-v2", "finance-qa-budget-v2", "tiny",
               "tiny-hold", "tiny-v2", "tiny-chunks"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="train the reinforcement-learning scheduler in the twin",
                       description="Reinforcement learning of the scheduling policy in the "
                       "twin (docs/rl.md).")
    rl = p.add_subparsers(dest="rl_command", metavar="RL_COMMAND")
    t = rl.add_parser("train", help="PPO on servetwin/Scheduling-v0; resumable",
                      description="Train with PPO (stable-baselines3), evaluate the numpy "
                      "export on held-out seeds against every registry heuristic, write "
                      "checkpoints, the exported policy and report.html into --out. Run "
                      "again with the same --out to resume.")
    t.add_argument("--out", required=True, type=Path, help="output directory")
    t.add_argument("--env", default="finance-qa", choices=ENV_PRESETS,
                   help="environment preset (default finance-qa: the users' deployment; "
                        "*-chunks: the deadline menu with the chunk answer on top; "
                        "finance-qa-budget-v2: chunk answers as time budgets; "
                        "experiments/rl/config.py)")
    t.add_argument("--timesteps", type=int, default=20_000, help="total decisions to train")
    t.add_argument("--n-envs", type=int, default=2, help="environments per rollout")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=None,
                   help="timesteps between evals (default 5,000); es: generations (default 5)")
    t.add_argument("--eval-episodes", type=int, default=4, help="held-out episodes per eval")
    t.add_argument("--prior", default=None, metavar="RULE",
                   help="start the actor biased towards this menu rule (e.g. laxity)")
    t.add_argument("--prior-logit", type=float, default=3.0,
                   help="how far the prior rule's output bias is raised (default 3)")
    t.add_argument("--learning-rate", type=float, default=3e-4)
    t.add_argument("--ent-coef", type=float, default=0.01, help="entropy bonus")
    t.add_argument("--algo", default="ppo", choices=["ppo", "es"],
                   help="ppo (stable-baselines3, the default) or es: evolution strategies "
                        "over a linear selector, whole policies scored on common training "
                        "episodes (experiments/rl/es.py; gymnasium, no torch)")
    t.add_argument("--generations", type=int, default=20, help="es: generations")
    t.add_argument("--pairs", type=int, default=8,
                   help="es: antithetic pairs of candidates per generation")
    t.add_argument("--episodes", type=int, default=6,
                   help="es: training episodes per candidate (the same for a generation)")
    t.add_argument("--sigma", type=float, default=0.3, help="es: perturbation scale")
    t.set_defaults(func=run_train, _parser=t)
    p.set_defaults(func=lambda ns: (p.print_help(), 2)[1], _parser=p)


def run_train(ns: argparse.Namespace) -> int:
    from twin.errors import ConfigError

    if ns.algo == "es":
        return run_es(ns)
    try:
        from experiments.rl.train import TrainConfig, train
    except ModuleNotFoundError as exc:
        raise ConfigError(f"servetwin rl needs the rl extra ({exc.name} is missing): "
                          f"pip install torch==2.13.0 && pip install -e '.[rl]'") from None
    try:
        tc = TrainConfig(env=ns.env, timesteps=ns.timesteps, n_envs=ns.n_envs, seed=ns.seed,
                         eval_every=ns.eval_every or 5_000, eval_episodes=ns.eval_episodes,
                         prior_rule=ns.prior, prior_logit=ns.prior_logit,
                         learning_rate=ns.learning_rate,
                         ent_coef=ns.ent_coef)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        res = train(ns.out, tc, log=lambda line: print(line, flush=True))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    last = res["history"][-1]
    best = res["best_heuristic"]
    print(f"learned: return {last['return']:+.4f}, SLO {last['slo_attainment']:.1%}; best "
          f"heuristic {best}: return {res['heuristics'][best]['return']:+.4f}, SLO "
          f"{res['heuristics'][best]['slo_attainment']:.1%}")
    print(f"policy: {ns.out / 'policy-best.safetensors'} (--policy learned:FILE); "
          f"report: {ns.out / 'report.html'}")
    return 0


def run_es(ns: argparse.Namespace) -> int:
    from twin.errors import ConfigError

    try:
        from experiments.rl.es import EsConfig, train_es
    except ModuleNotFoundError as exc:
        raise ConfigError(f"servetwin rl train --algo es needs gymnasium ({exc.name} is "
                          f"missing): pip install -e '.[rl]'") from None

    try:
        ec = EsConfig(env=ns.env, generations=ns.generations, pairs=ns.pairs,
                      episodes=ns.episodes, sigma=ns.sigma, learning_rate=0.05,
                      prior_rule=ns.prior, prior_logit=ns.prior_logit, seed=ns.seed,
                      eval_every=ns.eval_every or 5, eval_episodes=ns.eval_episodes)
        res = train_es(ns.out, ec, log=lambda line: print(line, flush=True))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    best, h = res["best"], res["best_heuristic"]
    print(f"learned (es): return {best['return']:+.4f}, SLO {best['slo_attainment']:.1%} at "
          f"generation {best['generation']}; best heuristic {h}: return "
          f"{res['heuristics'][h]['return']:+.4f}, SLO "
          f"{res['heuristics'][h]['slo_attainment']:.1%}")
    print(f"policy: {ns.out / 'policy-best.safetensors'} (--policy learned:FILE)")
    return 0
