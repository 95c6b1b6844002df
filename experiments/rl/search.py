"""A clairvoyant rollout search over an episode: how far can the per-pass decisions go?

At every question of an episode (the environment's decision points: two or more waiting
and the menu's rules disagreeing) the search tries each menu rule whose plan differs, and
scores each by simulating the rest of the episode from an exact copy of the state: the
process forks (copy-on-write; SimPy's generators cannot be deep-copied), the child answers
with that rule, plays the base rule at every later question to the end, and reports the
episode's outcome counts through a pipe. The parent takes the best-scoring rule (ties: the
base rule, then the lower menu index) and goes on. The child simulates the real future
arrivals of the episode, so this is an oracle that knows the future: a one-step rollout
(Bertsekas) with the base rule as its heuristic. In a deterministic simulator its result
is never worse than the base rule's own episode (the rollout of "base now" at question
t + 1 is exactly the trajectory chosen at t), so it is an estimate from above of what a
causal policy choosing among the same rules can reach, and from below of what any
clairvoyant choice among them can.

Scores are lexicographic and keep the reward's no-starvation rule: fewer dropped requests
first (aborted or unserved at the episode's end), then the objective: `slo` (requests
within their SLO, the bar's metric) or `return` (the class-balanced reward the policy is
trained on). Nothing is pickled: the child writes JSON.

POSIX only (os.fork). The children run one at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from experiments.rl.config import EnvConfig
from experiments.rl.env import SchedulingEnv
from experiments.rl.episode import Episode, episode_stats
from twin.policy import Plan
from twin.policy.check import validate_plan

OBJECTIVES = ("slo", "return")
#: at most this many single-document answers are tried at a pass (shortest prefill first)
MAX_DOC_CANDIDATES = 6


@dataclass
class SearchResult:
    seed: int
    stats: dict
    decisions: int = 0
    searched: int = 0  # questions where two or more distinct plans were tried
    rollouts: int = 0
    deviations: int = 0  # questions where the search chose another rule than the base
    chosen: dict[str, int] = field(default_factory=dict)
    #: (observation, chosen action, scores of each tried action) per searched question
    trace: list[tuple[np.ndarray, str, dict[str, list[float]]]] = field(default_factory=list)


def outcome_score(ep: Episode, objective: str) -> list[float]:
    """[-dropped, objective] of a finished episode (higher is better)."""
    out = ep.ledger.outcome
    dropped = sum(v == "dropped" for v in out.values()) + (ep.n - len(out))
    if objective == "slo":
        value = sum(v == "met" for v in out.values()) / ep.n
    else:
        value = ep.ledger.total
    return [-float(dropped), float(value)]


def _play_base_to_end(ep: Episode, base: int) -> None:
    """Run the episode on after the pending question was answered: every later question
    is answered by `base` (the held choice stays with the answered rule until then)."""
    takes = ep.decider.takes

    def first_then_base(snap) -> bool:
        if takes(snap):
            ep.held.choice = base
            ep.decider.takes = lambda s: False
        return False

    ep.decider.takes = first_then_base
    if ep.advance()[0] is not None:  # no question is taken any more: one advance ends it
        raise RuntimeError("a question was posted after the search's base took over")


def rollout(ep: Episode, cand: Candidate, base: int, objective: str) -> list[float]:
    """The score of answering the pending question with `cand`, then `base` to the end,
    simulated in a forked copy of this process; the parent's episode is untouched."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: play it out, write the score, leave without cleanup
        code = 0
        try:
            os.close(r)
            apply(ep, cand)
            _play_base_to_end(ep, base)
            os.write(w, json.dumps(outcome_score(ep, objective)).encode())
        except BaseException:  # noqa: BLE001 - reported to the parent as no score
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not chunks:
        raise RuntimeError(f"rollout child for {cand.label} failed (status {status})")
    return json.loads(b"".join(chunks))


@dataclass(frozen=True)
class Candidate:
    """An answer to the pending question: a plan, and the menu rule that answers the
    passes the agent is not asked until its next question (`held`)."""

    label: str
    plan: Plan
    held: int


def apply(ep: Episode, cand: Candidate) -> None:
    """Answer the pending question with `cand` (as `Episode.answer` does for a rule)."""
    ep.held.choice = cand.held
    ep._last_t = ep.decider.pending.now
    ep.decisions += 1
    ep.decider.answer(cand.plan)


def candidates(ep: Episode, base: int, documents: bool) -> list[Candidate]:
    """The menu rules whose plans (or chunk answers) for the pending question differ (the
    base rule first, then the first rule of each other plan), and with `documents` also, on a pass where
    the base rule lets documents in: each waiting document (up to `MAX_DOC_CANDIDATES`,
    shortest prefill first) alone after the short questions, and (when something runs)
    no document at all."""
    snap = ep.decider.pending
    out: list[Candidate] = []
    seen: set = set()

    def add(label: str, plan: Plan, held: int) -> None:
        # entries with the same order differ by their chunk answer (`RULE@TOKENSxPARK`)
        key = (plan.order, plan.admit, ep.held.chunk_answers[held])
        if key not in seen and not validate_plan(snap, plan):
            seen.add(key)
            out.append(Candidate(label, plan, held))

    bp = ep.held.rule_plan(snap, base)
    add(ep.cfg.menu[base], bp, base)
    for a, name in enumerate(ep.cfg.menu):
        add(name, ep.held.rule_plan(snap, a), a)
    if not documents:
        return out
    t = ep.cfg.targets
    order = list(bp.order)
    shorts = [i for i in order if not t.is_document(snap.waiting[i].prompt_tokens)]
    docs = [i for i in order if t.is_document(snap.waiting[i].prompt_tokens)]
    admitted = len(order) if bp.admit is None else bp.admit
    if not docs or admitted <= len(shorts):
        return out  # the base rule lets no document in: nothing to choose
    for d in sorted(docs, key=lambda i: (snap.waiting[i].uncached, i))[:MAX_DOC_CANDIDATES]:
        rest = [i for i in docs if i != d]
        add(f"doc:{snap.waiting[d].rid}", Plan(order=tuple(shorts + [d] + rest),
                                                admit=len(shorts) + 1), base)
    if snap.running:
        add("no-document", Plan(order=tuple(shorts + docs), admit=len(shorts)), base)
    return out


def search_episode(cfg: EnvConfig, seed: int, options: dict | None, base: str,
                   objective: str = "slo", documents: bool = False,
                   keep_trace: bool = False,
                   log: Callable[[str], None] | None = None) -> SearchResult:
    """The rollout search on the episode `reset(seed=seed, options=options)` draws;
    `documents` adds the single-document answers to the menu's (`candidates`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: allowed values: {', '.join(OBJECTIVES)}")
    if base not in cfg.menu:
        raise ValueError(f"base rule {base!r}: allowed values (the menu): "
                         f"{', '.join(cfg.menu)}")
    b = cfg.menu.index(base)
    env = SchedulingEnv(cfg)
    obs, _ = env.reset(seed=seed, options=options)
    ep = env.episode
    res = SearchResult(seed, {})
    chosen: dict[str, int] = {}
    snap = ep.decider.pending
    while snap is not None:
        cands = candidates(ep, b, documents)
        best = cands[0]  # the base rule's plan
        if len(cands) > 1:
            scores = {c.label: rollout(ep, c, b, objective) for c in cands}
            res.rollouts += len(cands)
            res.searched += 1
            top = max(scores.values())
            if scores[best.label] != top:
                best = next(c for c in cands if scores[c.label] == top)
                res.deviations += 1
            if keep_trace:
                res.trace.append((obs, best.label, scores))
        key = best.label.split(":")[0]
        chosen[key] = chosen.get(key, 0) + 1
        apply(ep, best)
        snap, _ = ep.advance()
        obs = env._obs(snap)
        res.decisions += 1
        if log and res.decisions % 100 == 0:
            log(f"seed {seed}: {res.decisions} decisions, {res.rollouts} rollouts, "
                f"{res.deviations} deviations from {base}, t={ep.env.now:.0f} s")
    res.stats = episode_stats(ep.ledger, ep.records(), cfg.targets)
    res.chosen = chosen
    return res


def base_stats(cfg: EnvConfig, seed: int, options: dict | None, base: str) -> dict:
    """The base rule's own episode in the environment (its every question answered by it)."""
    env = SchedulingEnv(cfg)
    env.reset(seed=seed, options=options)
    a, done = cfg.menu.index(base), False
    while not done:
        _, _, done, _, info = env.step(a)
    return info["episode_stats"]
