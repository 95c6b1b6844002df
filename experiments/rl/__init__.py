"""Reinforcement learning of the scheduling policy in the twin (docs/rl.md).

`register()` registers the gymnasium environment `servetwin/Scheduling-v0`; it is called
when this package is imported (and is idempotent), so `import experiments.rl` is enough
before `gymnasium.make`. Nothing else here has import-time effects.
"""

from __future__ import annotations

ENV_ID = "servetwin/Scheduling-v0"


def register() -> None:
    import gymnasium as gym

    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="experiments.rl.env:SchedulingEnv")


try:
    register()
except ImportError:  # gymnasium is not installed: the environment is not available
    pass
