"""Scheduling policies shared by the simulator and the live SGLang engine.

Pure Python (the standard library and numpy): no simpy, no sglang, no clock. The contract
(`base`): a policy answers a frozen `Snapshot` with a `Plan` — an order question (SGLang's
`SchedulePolicy.calc_priority`) or a preempt question (`PrefillAdder.preempt_to_schedule`).
`registry` holds the one list of names and builds policies from specs; `check` holds the
contract check. Policies: SGLang 0.5.23's own (`sglang`: fcfs, lof, lpm, hrrn, dfs-weight,
shortest-prefill-first, random, priority), the users' `slices`, the menu rules
(`menu`), the deadline-aware admission policy (`deadline`), and `learned`.
"""

from twin.policy.base import (
    CLIP_MAX_NEW_TOKENS,
    PREFIX_MATCH_MAX_QUEUE,
    Plan,
    Policy,
    RequestView,
    Snapshot,
    reservation,
)
from twin.policy.registry import (
    PolicyError,
    PolicySpec,
    build_policy,
    policy_class,
    policy_names,
    read_spec,
    register,
    spec_from_dict,
)

__all__ = [
    "CLIP_MAX_NEW_TOKENS", "PREFIX_MATCH_MAX_QUEUE", "Plan", "Policy", "PolicyError",
    "PolicySpec", "RequestView", "Snapshot", "build_policy", "make_policy", "policy_class",
    "policy_names", "read_spec", "register", "reservation", "spec_from_dict",
]


def make_policy(name: str, *, priority_scheduling: bool = False, low_values_first: bool = False,
                preemption_threshold: int = 10) -> Policy:
    """A policy by name with the server arguments that SGLang's policies read."""
    return build_policy(name, priority_scheduling=priority_scheduling,
                        low_values_first=low_values_first,
                        preemption_threshold=preemption_threshold)
