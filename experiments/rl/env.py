"""The scheduling environment: gymnasium's API over one simulated SGLang server.

`SchedulingEnv` (registered as `servetwin/Scheduling-v0` by `experiments.rl.register`)
draws an episode's workload from its family with the environment's one
`np.random.Generator` at `reset(seed=...)`; each `step(action)` answers the pending
scheduling pass with the menu rule `action` names (twin/policy/menu.py) and runs the twin
to the next pass where the choice matters (two or more waiting and the rules disagreeing)
or to the end. Observations are `twin.policy.features.pass_features` of the pass, the same
numbers the exported `learned` policy computes live; rewards are the `Ledger`'s
(experiments/rl/episode.py). docs/rl.md documents all of it.
"""

from __future__ import annotations

from functools import lru_cache

import gymnasium as gym
import numpy as np
import simpy

from experiments.rl.config import EnvConfig, draw_episode, draw_shapes, preset
from experiments.rl.episode import Episode, episode_stats, run_replica
from twin.config import derive_capacity
from twin.perf import StepTimeModel
from twin.policy.features import feature_names, pass_features
from twin.policy.menu import prefill_params
from twin.sim import build_replica
from twin.sim import step_time_for as sim_step_time
from twin.workload import Workload


@lru_cache(maxsize=8)
def step_time_for(cfg: EnvConfig) -> StepTimeModel:
    sim = cfg.deployment.sim_config()
    cap = derive_capacity(sim.args, sim.gpu)
    return sim_step_time(sim, cap)


@lru_cache(maxsize=8)
def capacity_of(cfg: EnvConfig) -> float:
    """Requests per second the deployment completes when saturated: the family's shapes
    (seed 0, at least 200 requests) from 50 closed-loop clients under fcfs."""
    if cfg.capacity_rps is not None:
        return cfg.capacity_rps
    from dataclasses import replace

    fam = replace(cfg.family, n=max(cfg.family.n, 200))
    wl = Workload("capacity", tuple(draw_shapes(fam, np.random.default_rng(0))),
                  concurrency=50)
    env = simpy.Environment()
    rep, _ = build_replica(env, wl, cfg.deployment.sim_config(), step_time_for(cfg))
    run_replica(rep)
    ok = [r for r in rep.finished if r.status == "ok"]
    return len(ok) / max(r.finish_s for r in ok)


class SchedulingEnv(gym.Env):
    """Observation: `pass_features` (float32 in [-1, 1]); action: a menu index."""

    metadata = {"render_modes": []}

    def __init__(self, config: EnvConfig | str = "tiny", **changes) -> None:
        self.cfg = preset(config, **changes) if isinstance(config, str) else config
        self.step_time = step_time_for(self.cfg)
        self.capacity = capacity_of(self.cfg)
        n_obs = len(feature_names(self.cfg.k_slots, self.cfg.features))
        self._prefill = prefill_params(self.cfg.prefill)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (n_obs,), np.float32)
        self.action_space = gym.spaces.Discrete(len(self.cfg.menu))
        self.episode: Episode | None = None
        self._carry = 0.0  # reward earned before the first question of an episode
        self._zero = np.zeros(n_obs, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """`options`: `load` and/or `burst_cv` fix that point of the family. A draw in
        which no pass ever has a choice is skipped (the next draw from the same generator
        replaces it; `info["skipped"]` counts them)."""
        super().reset(seed=seed)
        for skipped in range(100):
            wl, load, cv = draw_episode(self.cfg, self.capacity, self.np_random, options)
            self.episode = Episode(self.cfg, wl, self.step_time, self.capacity)
            snap, self._carry = self.episode.advance()  # paid with the first step
            if snap is not None:
                info = {"load": load, "burst_cv": cv, "requests": len(wl.requests),
                        "skipped": skipped}
                return self._obs(snap), info
        raise RuntimeError(f"{self.cfg.family}: 100 draws without a single choice")

    def _obs(self, snap) -> np.ndarray:
        if snap is None:
            return self._zero.copy()
        return pass_features(snap, self.cfg.targets, self.cfg.k_slots, self.cfg.features,
                             self._prefill).astype(np.float32)

    def step(self, action):
        ep = self.episode
        if ep is None or ep.decider.pending is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r}: expected an integer in "
                             f"[0, {self.action_space.n})")
        ep.answer(int(action))
        snap, reward = ep.advance()
        reward, self._carry = reward + self._carry, 0.0
        done = snap is None
        info = {"sim_time": float(ep.env.now), "decisions": ep.decisions}
        if done:
            info["episode_stats"] = episode_stats(ep.ledger, ep.records(), self.cfg.targets)
        return self._obs(snap), float(reward), done, False, info

