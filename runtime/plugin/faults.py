"""Fault-injection policies for testing the plugin's fallbacks; registered only on demand
(`register_all`, which the plugin calls when `SERVETWIN_FAULT_POLICIES=1`).

- `fault-raise`: every decision raises;
- `fault-nonperm`: the order is not a permutation (one index too many);
- `fault-victims`: fcfs order; a preempt question gets out-of-range, repeated victims;
- `fault-slow`: fcfs after sleeping `sleep_ms` (default 20, four times the default budget);
- `fault-mix`: one server, every kind in turn: order decisions cycle raise, non-permutation,
  slow, valid (fcfs); every preempt question gets bogus victims. The cycle counts the
  policy's own calls, so unlike a real policy it is not a function of the snapshot.
"""

from __future__ import annotations

import time

from twin.policy.base import Policy, Snapshot


class FaultRaise(Policy):
    name = "fault-raise"

    def order(self, snap: Snapshot) -> list[int]:
        raise RuntimeError("fault-raise: injected failure")

    def victims(self, snap: Snapshot) -> list[int]:
        raise RuntimeError("fault-raise: injected failure")


class FaultNonPermutation(Policy):
    name = "fault-nonperm"

    def order(self, snap: Snapshot) -> list[int]:
        return [*range(len(snap.waiting)), 0]


class FaultVictims(Policy):
    name = "fault-victims"

    @property
    def preempts(self) -> bool:
        return True

    def victims(self, snap: Snapshot) -> list[int]:
        n = len(snap.running)
        return [n + 3, n + 3, -1]


class FaultSlow(Policy):
    name = "fault-slow"

    def __init__(self, *, sleep_ms: float = 20.0, **kw) -> None:
        super().__init__(**kw)
        self.sleep_s = sleep_ms / 1000

    def order(self, snap: Snapshot) -> list[int]:
        time.sleep(self.sleep_s)
        return list(range(len(snap.waiting)))


class FaultMix(Policy):
    name = "fault-mix"

    def __init__(self, *, sleep_ms: float = 20.0, **kw) -> None:
        super().__init__(**kw)
        self.sleep_s = sleep_ms / 1000
        self.calls = 0

    def order(self, snap: Snapshot) -> list[int]:
        self.calls += 1
        n = len(snap.waiting)
        kind = self.calls % 4
        if kind == 1:
            raise RuntimeError("fault-mix: injected failure")
        if kind == 2:
            return [*range(n), 0]
        if kind == 3:
            time.sleep(self.sleep_s)
        return list(range(n))

    def victims(self, snap: Snapshot) -> list[int]:
        return [len(snap.running) + 3, -1]


FAULT_POLICIES = (FaultRaise, FaultNonPermutation, FaultVictims, FaultSlow, FaultMix)


def register_all() -> None:
    """Register the fault policies (idempotent)."""
    from twin.policy.registry import policy_names, register

    known = set(policy_names())
    for cls in FAULT_POLICIES:
        if cls.name not in known:
            register(cls)
