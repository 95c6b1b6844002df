"""One episode in the twin: a workload through one simulated server, asked or not.

`Episode` wires a replica to an `AgentDecider` and steps it question by question (the
gymnasium environment drives it); `run_policy` runs the same workload under a fixed
policy. Both account for every request with the same `Ledger`, so a trained network and a
heuristic are scored alike.

The reward (docs/rl.md): each request is worth `1 / (n_class x classes)` where its class
is short question or document (`SloTargets.doc_tokens`); it earns its worth when it
finishes within its SLO, nothing when it finishes late, and loses its worth when it is
aborted (dropped, or still unserved at the episode's end). An episode's return is thus the
mean over classes of SLO attainment minus the share dropped: starving a class to serve the
other cannot gain more than that class's half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from experiments.rl.config import EnvConfig
from twin.core import run as run_core
from twin.core import start as start_core
from twin.core import why_not
from twin.decider import AgentDecider, PolicyDecider
from twin.metrics import twin_records
from twin.perf import StepTimeModel
from twin.policy import Plan, Policy, Snapshot
from twin.policy.base import ChunkPlan
from twin.policy.deadline import answer_chunk, model_of
from twin.policy.features import SloTargets
from twin.policy.menu import entry_chunk_answers, prefill_params, rule_plan
from twin.policy.sglang import ShortestPrefillFirst
from twin.replica import Replica
from twin.sim import build_replica
from twin.workload import Workload


@dataclass
class Ledger:
    """Each request's worth and what it earned; `settle` takes the requests that left."""

    targets: SloTargets
    weight: dict[str, float]
    earned: dict[str, float] = field(default_factory=dict)
    outcome: dict[str, str] = field(default_factory=dict)  # met, late, dropped, rejected

    @classmethod
    def for_workload(cls, wl: Workload, targets: SloTargets) -> Ledger:
        doc = [targets.is_document(r.prompt_tokens) for r in wl.requests]
        counts = {c: doc.count(c) for c in (False, True) if doc.count(c)}
        w = {r.rid: 1.0 / (counts[d] * len(counts)) for r, d in zip(wl.requests, doc,
                                                                   strict=True)}
        return cls(targets, w)

    def settle(self, reqs) -> float:
        total = 0.0
        for r in reqs:
            kind = self.judge(r)
            self.outcome[r.rid] = kind
            gain = {"met": 1.0, "late": 0.0, "rejected": 0.0, "dropped": -1.0}[kind]
            self.earned[r.rid] = gain * self.weight[r.rid]
            total += self.earned[r.rid]
        return total

    def judge(self, r) -> str:
        if r.status == "rejected":
            return "rejected"  # SGLang refuses it on arrival, whatever the policy
        if r.status != "ok":
            return "dropped"
        ttft = r.first_token_s - r.arrival_s
        tpot = (r.finish_s - r.first_token_s) / (r.generated_tokens - 1) \
            if r.generated_tokens > 1 else None
        return "met" if self.targets.met(ttft, tpot, r.prompt_tokens, r.priority) else "late"

    @property
    def total(self) -> float:
        return float(sum(self.earned.values()))


class HeldChoice(Policy):
    """The environment's fallback: the agent's last menu choice, for the passes it is not
    asked (fewer than two waiting, every rule agreeing, or within `min_gap_s`)."""

    name = "held-choice"

    def __init__(self, menu: tuple[str, ...], targets: SloTargets,
                 chunk_cap: bool = False, prefill: list | None = None,
                 chunk_answer: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.menu, self.targets, self.choice = menu, targets, 0
        self.prefill = prefill_params(prefill)
        self.model = model_of(self.prefill)  # for budget chunk answers
        if chunk_cap:
            self.chunk_limit = ShortestPrefillFirst.chunk_limit
        #: each entry's chunk answer: its own (`RULE@TOKENSxPARK`), else `chunk_answer`
        self.chunk_answers = entry_chunk_answers(menu, chunk_answer)
        self.chunks = any(a is not None for a in self.chunk_answers)
        #: whether the entries differ in their chunk answers (then the choice matters
        #: while a document prefills, even where the orders agree)
        self.chunk_choice = len(set(self.chunk_answers)) > 1

    def chunk(self, snap: Snapshot, chunked, budget: int, page_size: int) -> ChunkPlan:
        return answer_chunk(self.targets, snap, self.chunk_answers[self.choice], page_size,
                            chunked, budget, self.model)

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return True

    def decide(self, snap: Snapshot) -> Plan:
        if snap.candidate is not None:
            return Plan(victims=())
        return self.rule_plan(snap, self.choice)

    def rule_plan(self, snap: Snapshot, choice: int) -> Plan:
        return rule_plan(self.menu[choice], snap, self.targets, self.prefill)


def horizon(cfg: EnvConfig, wl: Workload, capacity_rps: float) -> float:
    last = wl.requests[-1].arrival_s if wl.requests else 0.0
    return last + cfg.drain_factor * len(wl.requests) / capacity_rps


class Episode:
    """A workload in the twin with an agent answering its order questions."""

    def __init__(self, cfg: EnvConfig, wl: Workload, step_time: StepTimeModel,
                 capacity_rps: float) -> None:
        self.cfg = cfg
        self.env = simpy.Environment()
        self.held = HeldChoice(cfg.menu, cfg.targets, cfg.chunk_cap, cfg.prefill,
                               cfg.chunk_answer)
        self.decider = AgentDecider(self.env, self.held, takes=self._takes)
        sim = cfg.deployment.sim_config(horizon(cfg, wl, capacity_rps))
        self.rep, _ = build_replica(self.env, wl, sim, step_time, decider=self.decider)
        # the typed core where the replica is inside its coverage (twin/core.py); else
        # the Python replica, a SimPy process
        self.core = start_core(self.rep) if why_not(self.rep) is None else None
        self.proc = None if self.core is not None else self.env.process(self.rep.run())
        self.ledger = Ledger.for_workload(wl, cfg.targets)
        self.n = len(wl.requests)
        self._settled = 0
        self._last_t: float | None = None
        self.decisions = 0

    def _takes(self, snap: Snapshot) -> bool:
        if snap.candidate is not None or len(snap.waiting) < 2:
            return False
        if self._last_t is not None and snap.now - self._last_t < self.cfg.min_gap_s:
            return False
        if self.held.chunk_choice and (self._chunked() or any(
                self.cfg.targets.is_document(r.prompt_tokens) for r in snap.waiting)):
            return True  # the entries' chunk answers differ and a document is about
        first = self.held.rule_plan(snap, 0)
        return any(self.held.rule_plan(snap, c) != first for c in range(1, len(self.cfg.menu)))

    def _chunked(self) -> bool:
        """Whether a prompt is being prefilled in chunks (the core's or the replica's)."""
        if self.core is not None:
            return self.core.has_chunked
        return self.rep.chunked is not None

    def advance(self) -> tuple[Snapshot | None, float]:
        """Run to the next question (or the end); the question and the reward since."""
        if self.core is not None:
            if not self.core.ended:
                self.core.run()
        elif not self.proc.triggered:
            self.env.run(until=self.env.any_of([self.decider.asked, self.proc]))
        fin = self.rep.finished
        reward = self.ledger.settle(fin[self._settled:])
        self._settled = len(fin)
        return self.decider.pending, reward

    def answer(self, action: int) -> None:
        snap = self.decider.pending
        self.held.choice = int(action)
        self._last_t = snap.now
        self.decisions += 1
        self.decider.answer(self.held.rule_plan(snap, int(action)))

    def records(self) -> list[dict]:
        return twin_records(self.rep.finished, self.rep.step_end)


def run_policy(cfg: EnvConfig, wl: Workload, step_time: StepTimeModel, capacity_rps: float,
               policy: Policy) -> tuple[Ledger, list[dict], Replica]:
    """The workload under a fixed policy (every pass asks it: the deployed path)."""
    env = simpy.Environment()
    sim = cfg.deployment.sim_config(horizon(cfg, wl, capacity_rps))
    rep, _ = build_replica(env, wl, sim, step_time, decider=PolicyDecider(policy))
    run_replica(rep)
    ledger = Ledger.for_workload(wl, cfg.targets)
    ledger.settle(rep.finished)
    return ledger, twin_records(rep.finished, rep.step_end), rep


def run_replica(rep: Replica) -> None:
    """`rep` (fed alone, not yet run) to its end: on the typed core where it is inside
    its coverage (twin/core.py), else the Python replica as a SimPy process."""
    if why_not(rep) is None:
        if run_core(rep):  # stopped by Ctrl-C between passes: not a whole run
            raise KeyboardInterrupt
    else:
        rep.env.run(until=rep.env.process(rep.run()))


def episode_stats(ledger: Ledger, records: list[dict], targets: SloTargets) -> dict:
    """Return, SLO attainment (ours and the users' flat TTFT <= ttft_s), P99 TTFT by class."""
    short = [r for r in records if not targets.is_document(r["prompt_tokens"])]
    docs = [r for r in records if targets.is_document(r["prompt_tokens"])]
    out = {"return": round(ledger.total, 6), "requests": len(records)}
    met = [ledger.outcome[r["rid"]] == "met" for r in records]
    out["slo_attainment"] = round(float(np.mean(met)), 6) if met else None
    flat = [r["status"] == "ok" and r["ttft_s"] <= targets.ttft_s for r in records]
    out["ttft_attainment_flat"] = round(float(np.mean(flat)), 6) if flat else None
    for name, rs in (("short", short), ("documents", docs)):
        ttft = [r["ttft_s"] for r in rs if r["status"] == "ok"]
        out[f"p99_ttft_{name}_s"] = round(float(np.percentile(ttft, 99)), 6) if ttft else None
        out[f"slo_{name}"] = round(float(np.mean([ledger.outcome[r["rid"]] == "met"
                                                  for r in rs])), 6) if rs else None
        out[f"dropped_{name}"] = sum(ledger.outcome[r["rid"]] == "dropped" for r in rs)
    return out
