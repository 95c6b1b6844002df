"""Where a scheduling pass gets its decisions: a `Decider`.

The replica asks `decider.ask(snapshot)` and gets either a `Plan` at once (a policy object:
`PolicyDecider`) or a SimPy event that an outside agent completes with a `Plan` later
(`AgentDecider`: a gymnasium environment's `step` answers one pass). Asking is pure for a
policy decider; the answer is checked against the snapshot before the replica applies it.
"""

from __future__ import annotations

from typing import Protocol

import simpy

from twin.errors import ServetwinError
from twin.policy import Plan, Policy, Snapshot
from twin.policy.check import validate_plan


class Decider(Protocol):
    policy: Policy

    def ask(self, snap: Snapshot) -> Plan | simpy.Event: ...


class PolicyDecider:
    """Answers at once from a policy; a wrong answer is a bug in the policy: it raises."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.log: list[tuple[Snapshot, Plan]] | None = None  # set to a list to record

    def ask(self, snap: Snapshot) -> Plan:
        plan = self.policy.decide(snap)
        why = validate_plan(snap, plan)
        if why:
            raise ServetwinError(f"policy {self.policy.name!r} broke its contract at "
                                 f"t={snap.now:.6f}: {why}")
        if self.log is not None:
            self.log.append((snap, plan))
        return plan


class AgentDecider:
    """Answers from outside. `ask` posts the snapshot (`pending`) and returns an event;
    the agent reads `pending`, calls `answer(plan)`, and runs the simulation on. Questions
    the agent does not take (`takes(snap)` false) are answered by the fallback policy."""

    def __init__(self, env: simpy.Environment, fallback: Policy, takes=None) -> None:
        self.env, self.policy = env, fallback
        self.takes = takes or (lambda snap: True)
        self.pending: Snapshot | None = None
        self.asked = env.event()  # triggered whenever a question is posted
        self._answer: simpy.Event | None = None
        #: the typed core asking instead of the Python replica (twin/core.py `start`):
        #: a pending question is its (`run` returns), the answer goes to its `answer`
        self.core = None

    def ask(self, snap: Snapshot) -> Plan | simpy.Event | None:
        """The fallback's plan for a question the agent does not take; else the question
        is posted (`pending`) and the answer comes later: through the event returned
        (the Python replica waits on it), or to the typed core (None returned)."""
        if not self.takes(snap):
            return self.policy.decide(snap)
        # a question the agent takes may be kept (a log, a test's rollout): its running
        # views are built now, while the requests are as the snapshot saw them (those of a
        # snapshot built on demand, `RunningViews`, then last after the answer)
        tuple(snap.running)
        self.pending = snap
        if self.core is not None:
            return None
        self._answer = self.env.event()
        asked, self.asked = self.asked, self.env.event()
        asked.succeed(snap)
        return self._answer

    def answer(self, plan: Plan) -> None:
        if self.pending is None or (self._answer is None and self.core is None):
            raise RuntimeError("no question is pending")
        why = validate_plan(self.pending, plan)
        if why:
            raise ValueError(f"answer to the pending {self.pending.question} question: {why}")
        self.pending = None
        if self.core is not None:
            self.core.answer(plan)
            return
        ev, self._answer = self._answer, None
        ev.succeed(plan)
