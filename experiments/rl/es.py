"""Evolution strategies for the selector (`servetwin rl train --algo es`).

PPO attributes an episode's return to ~150-600 decisions and its samples are too noisy to
move a selector off a good prior (docs/rl.md "What did not work"). Evolution strategies
(Salimans et al. 2017, "Evolution Strategies as a Scalable Alternative to Reinforcement
Learning") score whole policies instead: each generation perturbs the parameters in
`pairs` antithetic directions, plays every perturbed policy on the same few training
episodes (common random numbers, so two candidates differ by their decisions only), and
steps along the return-weighted directions (centred ranks; Adam). The policy is the
selector the `learned` policy evaluates: a linear layer from the pass features
(`pass_features`, the preset's feature set) to one output per menu entry, started at the
prior entry (its bias raised by `prior_logit`). The deployed path is the one scored: a
`LearnedPolicy` asked at every pass, the chunk questions included.

Deterministic: one `np.random.Generator` from the seed draws the directions and the
training episodes (seeds below the evaluation seeds); the held-out evaluation is the
same as PPO's (`eval_seeds`).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from experiments.rl.config import preset
from experiments.rl.env import capacity_of
from experiments.rl.evaluate import (
    EVAL_SEED_BASE,
    eval_seeds,
    evaluate_policy,
    evaluate_spec,
    heuristic_specs,
    mean_stats,
)
from experiments.rl.export import export_selector, selector_meta
from twin.policy.features import feature_names
from twin.policy.learned import LearnedPolicy


@dataclass(frozen=True)
class EsConfig:
    env: str = "finance-qa-chunks-v2"
    generations: int = 20
    pairs: int = 8  # antithetic pairs per generation (2 x pairs candidates)
    episodes: int = 6  # training episodes per candidate (the same for all of a generation)
    sigma: float = 0.1
    learning_rate: float = 0.05
    prior_rule: str | None = None
    prior_logit: float = 3.0
    seed: int = 0
    eval_every: int = 5  # generations between held-out evaluations
    eval_episodes: int = 8

    def __post_init__(self) -> None:
        for name in ("generations", "pairs", "episodes", "eval_every", "eval_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")
        if not (self.sigma > 0 and self.learning_rate > 0):
            raise ValueError(f"sigma {self.sigma} and learning_rate {self.learning_rate}: "
                             f"must be > 0")


class Selector:
    """A linear selector over the preset's features as a flat parameter vector."""

    def __init__(self, cfg, tmp: Path) -> None:
        self.cfg = cfg
        self.n_in = len(feature_names(cfg.k_slots, cfg.features))
        self.n_out = len(cfg.menu)
        path = tmp / "template.json"
        path.write_text(json.dumps({"meta": selector_meta(cfg), "layers": [
            {"w": np.zeros((self.n_out, self.n_in)).tolist(), "b": [0.0] * self.n_out}]}))
        self.template = LearnedPolicy(weights=str(path))

    @property
    def dim(self) -> int:
        return self.n_out * (self.n_in + 1)

    def layers(self, theta: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        w = theta[: self.n_out * self.n_in].reshape(self.n_out, self.n_in)
        return [(w.copy(), theta[self.n_out * self.n_in:].copy())]

    def policy(self, theta: np.ndarray) -> LearnedPolicy:
        pol = copy.copy(self.template)
        pol.layers = self.layers(theta)
        return pol


def centred_ranks(x: np.ndarray) -> np.ndarray:
    ranks = np.empty(len(x))
    ranks[np.argsort(x, kind="stable")] = np.arange(len(x))
    return ranks / max(len(x) - 1, 1) - 0.5


def train_es(out: Path, ec: EsConfig, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = preset(ec.env)
    cfg = replace(cfg, capacity_rps=capacity_of(cfg))
    sel = Selector(cfg, out)
    theta = np.zeros(sel.dim)
    if ec.prior_rule is not None:
        if ec.prior_rule not in cfg.menu:
            raise ValueError(f"prior {ec.prior_rule!r}: not on the menu of {ec.env} "
                             f"({', '.join(cfg.menu)})")
        theta[sel.n_out * sel.n_in + cfg.menu.index(ec.prior_rule)] = ec.prior_logit
    rng = np.random.default_rng(ec.seed)
    held_out = eval_seeds(ec.eval_episodes)
    log(f"ES on {ec.env}: {sel.dim} parameters (linear, {sel.n_in} features x "
        f"{sel.n_out} entries: {', '.join(cfg.menu)}); {ec.generations} generations of "
        f"{2 * ec.pairs} candidates x {ec.episodes} episodes")
    heur = {label: mean_stats(evaluate_spec(cfg, spec, held_out))
            for label, spec in heuristic_specs(cfg).items()}
    for label, m in heur.items():
        log(f"  heuristic {label:38s} return {m['return']:+.4f}  SLO {m['slo_attainment']:.1%}")
    m_adam, v_adam = np.zeros(sel.dim), np.zeros(sel.dim)
    history, best = [], None
    t0 = time.process_time()

    def evaluate(gen: int) -> dict:
        nonlocal best
        m = mean_stats(evaluate_policy(cfg, lambda: sel.policy(theta), held_out))
        row = {"generation": gen, "return": m["return"],
               "slo_attainment": m["slo_attainment"], "cpu_s": round(time.process_time() - t0, 1)}
        history.append(row)
        about = {"algo": "es", "config": ec.__dict__, "evaluation": row}
        export_selector(sel.layers(theta), cfg, out / "policy-latest.safetensors", about)
        if best is None or row["return"] > best["return"]:
            best = row
            export_selector(sel.layers(theta), cfg, out / "policy-best.safetensors", about)
        log(f"eval @ generation {gen:3d}: return {row['return']:+.4f}  SLO "
            f"{row['slo_attainment']:.1%}  (best {best['return']:+.4f}; {row['cpu_s']} CPU-s)")
        return row

    evaluate(0)
    for gen in range(1, ec.generations + 1):
        seeds = [int(s) for s in rng.integers(0, EVAL_SEED_BASE, ec.episodes)]
        eps = rng.standard_normal((ec.pairs, sel.dim))
        cands = np.concatenate([theta + ec.sigma * eps, theta - ec.sigma * eps])
        fit = np.array([mean_stats(evaluate_policy(cfg, lambda c=c: sel.policy(c), seeds))
                        ["return"] for c in cands])
        r = centred_ranks(fit)
        grad = ((r[:ec.pairs] - r[ec.pairs:]) @ eps) / (2 * ec.pairs * ec.sigma)
        m_adam = 0.9 * m_adam + 0.1 * grad
        v_adam = 0.999 * v_adam + 0.001 * grad * grad
        step = ec.learning_rate * (m_adam / (1 - 0.9 ** gen)) / (
            np.sqrt(v_adam / (1 - 0.999 ** gen)) + 1e-8)
        theta = theta + step
        log(f"[generation {gen:3d}/{ec.generations}] training return mean "
            f"{fit.mean():+.4f} (best candidate {fit.max():+.4f}); "
            f"{time.process_time() - t0:.0f} CPU-s")
        if gen % ec.eval_every == 0 or gen == ec.generations:
            evaluate(gen)
    best_h = max(heur, key=lambda k: heur[k]["return"])
    res = {"history": history, "best": best, "heuristics": heur, "best_heuristic": best_h}
    (out / "es.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return res
