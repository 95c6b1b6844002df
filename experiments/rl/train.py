"""`servetwin rl train`: PPO (stable-baselines3) on the scheduling environment.

Everything a run writes lives in its output directory, and nothing is pickled:

- `config.json`: the training and environment configuration (a resumed run must match);
- `heuristics.json`: every registry heuristic on the held-out evaluation seeds;
- `checkpoint.safetensors` (+ `checkpoint.json`): policy and optimizer tensors, timesteps,
  evaluation history; a run started again on the same directory resumes from it;
- `policy-best.safetensors` / `policy-final.safetensors` (+ `.json` sidecars): the actor
  network exported for the numpy `learned` policy (`--policy learned:FILE`);
- `report.html`: the learning curve against the heuristics, and the final comparison.

A resumed run continues from the checkpoint's weights, optimizer state and step count with
freshly seeded environments; it is not bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.rl.config import preset
from experiments.rl.evaluate import (
    eval_seeds,
    evaluate_policy,
    evaluate_spec,
    heuristic_specs,
    mean_stats,
)
from experiments.rl.export import (
    actor_layers,
    export_selector,
    load_state,
    optimizer_from_flat,
    optimizer_to_flat,
    save_state,
)
from twin.outputs import atomic_write_text


@dataclass(frozen=True)
class TrainConfig:
    env: str = "finance-qa"  # an environment preset (experiments/rl/config.py)
    timesteps: int = 20_000
    n_envs: int = 2
    seed: int = 0
    eval_every: int = 5_000
    eval_episodes: int = 4
    n_steps: int = 256  # per environment and rollout
    batch_size: int = 64
    n_epochs: int = 5
    learning_rate: float = 3e-4
    ent_coef: float = 0.01
    gamma: float = 0.99
    hidden: tuple[int, ...] = (64, 64)
    #: a menu rule the actor starts biased towards (its output's bias raised by
    #: `prior_logit`): PPO then learns when to deviate from it; None: no prior
    prior_rule: str | None = None
    prior_logit: float = 3.0

    def __post_init__(self) -> None:
        for k in ("timesteps", "n_envs", "eval_every", "eval_episodes", "n_steps",
                  "batch_size", "n_epochs"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} {getattr(self, k)}: must be >= 1")


def _json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class Trainer:
    def __init__(self, out: Path, tc: TrainConfig, log=print) -> None:
        import torch

        torch.set_num_threads(1)  # reproducible and polite on a shared machine
        self.out, self.tc, self.log = out, tc, log
        self.cfg = preset(tc.env)
        self.seeds = eval_seeds(tc.eval_episodes)
        out.mkdir(parents=True, exist_ok=True)
        self._check_config()
        self.history: list[dict] = []
        self.best = -float("inf")
        self.model = self._build()
        self._resume()

    def _check_config(self) -> None:
        want = {"train": asdict(self.tc), "env": self.cfg.to_json()}
        want = json.loads(json.dumps(want))
        path = self.out / "config.json"
        if path.is_file():
            have = json.loads(path.read_text())
            if have != want:
                raise ValueError(f"{path}: a run with another configuration is there; use "
                                 f"another --out or the same settings")
        else:
            _json(path, want)

    def _envs(self, seed: int):
        from stable_baselines3.common.vec_env import DummyVecEnv

        from experiments.rl.env import SchedulingEnv

        venv = DummyVecEnv([lambda: SchedulingEnv(self.cfg) for _ in range(self.tc.n_envs)])
        venv.seed(seed)
        return venv

    def _build(self):
        import torch.nn as nn
        from stable_baselines3 import PPO

        tc = self.tc
        kw = dict(net_arch=dict(pi=list(tc.hidden), vf=list(tc.hidden)),
                  activation_fn=nn.ReLU)
        model = PPO("MlpPolicy", self._envs(tc.seed), n_steps=tc.n_steps,
                    batch_size=tc.batch_size, n_epochs=tc.n_epochs,
                    learning_rate=tc.learning_rate, ent_coef=tc.ent_coef, gamma=tc.gamma,
                    policy_kwargs=kw, seed=tc.seed, device="cpu", verbose=0)
        if tc.prior_rule is not None:
            self._add_prior(model)
        return model

    def _add_prior(self, model) -> None:
        import torch

        if self.tc.prior_rule not in self.cfg.menu:
            raise ValueError(f"prior_rule {self.tc.prior_rule!r}: not on the menu "
                             f"{', '.join(self.cfg.menu)}")
        with torch.no_grad():
            model.policy.action_net.bias[self.cfg.menu.index(self.tc.prior_rule)] += \
                self.tc.prior_logit

    # ---- checkpoints ----------------------------------------------------------------
    def _resume(self) -> None:
        path = self.out / "checkpoint.safetensors"
        if not path.is_file():
            return
        import torch

        tensors, meta = load_state(path)
        pol = {k[len("policy."):]: torch.tensor(v, dtype=torch.float32)
               for k, v in tensors.items() if k.startswith("policy.")}
        self.model.policy.load_state_dict(pol)
        self.model.policy.optimizer.load_state_dict(
            optimizer_from_flat(tensors, meta["param_groups"]))
        state = json.loads((self.out / "checkpoint.json").read_text())
        self.model.num_timesteps = state["num_timesteps"]
        self.model._n_updates = state["n_updates"]
        self.history, self.best = state["history"], state["best"]
        self.model.set_env(self._envs(self.tc.seed + 7919 * self.model.num_timesteps))
        self.log(f"resumed from {path} at {self.model.num_timesteps} steps")

    def checkpoint(self, partial: dict | None = None) -> None:
        """Weights and optimizer, then the step count: each file replaced whole (an
        interrupted write leaves the previous checkpoint)."""
        flat, groups = optimizer_to_flat(self.model.policy.optimizer.state_dict())
        state = {f"policy.{k}": v for k, v in self.model.policy.state_dict().items()}
        tmp = self.out / ".checkpoint.safetensors.tmp"
        save_state(tmp, {**state, **flat}, groups)
        os.replace(tmp, self.out / "checkpoint.safetensors")
        _json(self.out / "checkpoint.json", {
            "num_timesteps": self.model.num_timesteps, "n_updates": self.model._n_updates,
            "history": self.history, "best": self.best} | ({"partial": partial} if partial
                                                            else {}))

    def interrupted(self) -> None:
        """Ctrl-C while training: keep the steps done in the checkpoint, and say so."""
        done, total = self.model.num_timesteps, self.tc.timesteps
        self.checkpoint({"stop_reason": "interrupted (Ctrl-C)", "timesteps": done,
                         "of": total})
        self.log(f"interrupted (Ctrl-C) at {done} of {total} steps: kept in "
                 f"{self.out / 'checkpoint.safetensors'} and checkpoint.json (marked partial, "
                 f"{len(self.history)} evaluations); run the same command again to resume")

    # ---- evaluation -----------------------------------------------------------------
    def heuristics(self) -> dict[str, dict]:
        path = self.out / "heuristics.json"
        if path.is_file():
            return json.loads(path.read_text())
        res = {}
        for label, spec in heuristic_specs(self.cfg).items():
            res[label] = mean_stats(evaluate_spec(self.cfg, spec, self.seeds))
            self.log(f"  heuristic {label:24s} return {res[label]['return']:+.4f}  "
                     f"SLO {res[label]['slo_attainment']:.1%}")
        _json(path, res)
        return res

    def export(self, name: str, about: dict) -> Path:
        return export_selector(actor_layers(self.model.policy), self.cfg,
                               self.out / f"{name}.safetensors", about)

    def evaluate(self, elapsed_s: float) -> dict:
        from twin.policy.learned import LearnedPolicy

        path = self.export("policy-latest", self._about({}))
        stats = mean_stats(evaluate_policy(self.cfg, LearnedPolicy(weights=str(path)),
                                           self.seeds))
        row = {"timesteps": self.model.num_timesteps, "cpu_s": round(elapsed_s, 3), **stats}
        self.history.append(row)
        if stats["return"] > self.best:
            self.best = stats["return"]
            self.export("policy-best", self._about(row))
        self.log(f"eval @ {row['timesteps']:>7d} steps: return {stats['return']:+.4f}  "
                 f"SLO {stats['slo_attainment']:.1%}  (best {self.best:+.4f})")
        return row

    def _about(self, row: dict) -> dict:
        return {"trained_with": "servetwin rl train (stable-baselines3 PPO)",
                "train": asdict(self.tc), "env": self.cfg.to_json(),
                "capacity_rps": self._capacity(), "eval_seeds": self.seeds,
                "evaluation": row}

    def _capacity(self) -> float:
        from experiments.rl.env import capacity_of

        return round(capacity_of(self.cfg), 6)

    # ---- the run --------------------------------------------------------------------
    def run(self) -> dict:
        heur = self.heuristics()
        best_h = max(heur, key=lambda k: heur[k]["return"])
        self.log(f"best heuristic on the evaluation seeds: {best_h} "
                 f"(return {heur[best_h]['return']:+.4f})")
        left = self.tc.timesteps - self.model.num_timesteps
        t0 = time.process_time()
        if not self.history and self.tc.prior_rule is not None:
            self.evaluate(0.0)  # the prior alone: the checkpoint to beat
        if left > 0:
            try:
                self.model.learn(left, callback=self._callback(t0), reset_num_timesteps=False)
            except KeyboardInterrupt:
                self.interrupted()
                raise
        if not self.history or self.history[-1]["timesteps"] != self.model.num_timesteps:
            self.evaluate(time.process_time() - t0)
        self.checkpoint()
        self.export("policy-final", self._about(self.history[-1]))
        from experiments.rl.report import write_report

        write_report(self.out / "report.html", self.history, heur, self.tc, self.cfg)
        return {"history": self.history, "heuristics": heur, "best_heuristic": best_h}

    def _callback(self, t0: float):
        from stable_baselines3.common.callbacks import BaseCallback

        trainer = self

        class Progress(BaseCallback):
            def __init__(self) -> None:
                super().__init__()
                self.returns: list[float] = []
                self.next_eval = (trainer.model.num_timesteps // trainer.tc.eval_every + 1) \
                    * trainer.tc.eval_every

            def _on_step(self) -> bool:
                for info in self.locals["infos"]:
                    if "episode_stats" in info:
                        self.returns.append(info["episode_stats"]["return"])
                if self.num_timesteps >= self.next_eval:
                    self.next_eval += trainer.tc.eval_every
                    trainer.evaluate(time.process_time() - t0)
                    trainer.checkpoint()
                return True

            def _on_rollout_end(self) -> None:
                recent = self.returns[-20:]
                mean = sum(recent) / len(recent) if recent else float("nan")
                done = self.num_timesteps / trainer.tc.timesteps
                trainer.log(f"[{done:6.1%}] {self.num_timesteps} steps, "
                            f"{len(self.returns)} episodes, recent return {mean:+.4f}, "
                            f"{time.process_time() - t0:.0f} CPU-s")

        return Progress()


def train(out: Path, tc: TrainConfig, log=print) -> dict:
    return Trainer(out, tc, log).run()
