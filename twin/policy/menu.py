"""A menu of queue orders a learned scheduler chooses from at each pass.

Each rule is a pure function of the snapshot and the SLO targets; the learned selector
(`twin.policy.learned`) picks one per pass, and the `menu` policy runs one rule alone (so
each can be compared as a fixed heuristic). Ties always fall back to queue entry, then the
queue index, so every order is a function of the snapshot.

- `fcfs`: oldest queue entry first.
- `spf`: fewest uncached prompt tokens first (shortest prefill first).
- `priority`: highest tier first, then oldest.
- `edf`: earliest TTFT deadline first (arrival + the request's TTFT target).

With `chunk_cap`, a policy also caps the running chunked prefill as SGLang's
shortest-prefill-first does (`ShortestPrefillFirst.chunk_limit`, over the queue in the
policy's order): room is left in the chunk budget for the shorter requests at the head of
the queue. Live, SGLang applies that cap itself on a server started with
`--schedule-policy shortest-prefill-first` (the plugin's order is the queue it reads).
"""

from __future__ import annotations

import numpy as np

from twin.policy.base import Policy, Snapshot
from twin.policy.features import SloTargets, waiting_targets
from twin.policy.registry import register
from twin.policy.sglang import ShortestPrefillFirst


def _by(snap: Snapshot, key) -> list[int]:
    w = snap.waiting
    return sorted(range(len(w)), key=lambda i: (key(i), w[i].queue_entry_s, i))


def fcfs(snap: Snapshot, t: SloTargets) -> list[int]:
    return _by(snap, lambda i: 0)


def spf(snap: Snapshot, t: SloTargets) -> list[int]:
    w = snap.waiting
    return _by(snap, lambda i: w[i].uncached)


def priority(snap: Snapshot, t: SloTargets) -> list[int]:
    w = snap.waiting
    return _by(snap, lambda i: -w[i].priority)


def edf(snap: Snapshot, t: SloTargets) -> list[int]:
    deadline = np.array([r.arrival_s for r in snap.waiting]) + waiting_targets(snap, t)
    return _by(snap, lambda i: float(deadline[i]))


RULES = {"fcfs": fcfs, "spf": spf, "priority": priority, "edf": edf}
MENU = tuple(RULES)


def targets_from(ttft_s: float, tpot_s: float | None, doc_tokens: int,
                 doc_ttft_s_per_token: float, tier_ttft_s: list | None) -> SloTargets:
    return SloTargets(ttft_s, tpot_s, doc_tokens, doc_ttft_s_per_token,
                      tuple((int(a), float(b)) for a, b in (tier_ttft_s or ())))


@register
class MenuPolicy(Policy):
    """One menu rule as a fixed policy (`rule`: fcfs, spf, priority, edf); the SLO params
    set the deadlines `edf` uses (docs/rl.md); `chunk_cap` adds SGLang's spf chunk cap."""

    name = "menu"

    def __init__(self, *, rule: str = "edf", ttft_s: float = 1.5, tpot_s: float = 0.1,
                 doc_tokens: int = 4096, doc_ttft_s_per_token: float = 5e-4,
                 tier_ttft_s: list | None = None, chunk_cap: bool = False) -> None:
        super().__init__()
        if chunk_cap:
            self.chunk_limit = ShortestPrefillFirst.chunk_limit
        if rule not in RULES:
            raise ValueError(f"rule {rule!r}: allowed values: {', '.join(RULES)}")
        self.rule = rule
        self.targets = targets_from(ttft_s, tpot_s, doc_tokens, doc_ttft_s_per_token,
                                    tier_ttft_s)

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return True  # spf and the features read fresh prefix matches

    def order(self, snap: Snapshot) -> list[int]:
        return RULES[self.rule](snap, self.targets)
