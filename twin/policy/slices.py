"""The users' scheduler: a priority score, a time slice and three preemption modes.

Score of a request at time `now` (higher runs first):

    score = w_tier * priority + w_wait * (now - arrival_s) - w_speed * tokens_per_s

where `priority` is the VIP tier, `now - arrival_s` the time since the request arrived, and
`tokens_per_s` its generation speed so far (generated tokens / time since its first token;
0 before). Weights default to (1, 1 per second, 0.1 per token/s).

Modes (`--preemption-mode`):
- `conservative`: never preempt running requests; the queue is reordered by score at every
  scheduling pass and at least every time slice.
- `moderate`: also preempt running requests whose score is lower than the candidate's by more
  than the threshold and that have run at least one time slice since they were admitted.
- `aggressive`: preempt any running request scoring below a waiting request that cannot
  otherwise be admitted (no threshold, no minimum run time).
Victims are taken lowest score first, as many as free the tokens the candidate needs (none
when they cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.policy.base import Policy, RequestView, Snapshot
from twin.policy.registry import register

MODES = ("conservative", "moderate", "aggressive")


@dataclass(frozen=True)
class ScoreWeights:
    tier: float = 1.0
    wait: float = 1.0
    speed: float = 0.1

    @classmethod
    def parse(cls, text: str) -> ScoreWeights:
        """'TIER,WAIT,SPEED', e.g. '1,1,0.1'."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(f"priority weights {text!r}: expected TIER,WAIT,SPEED")
        return cls(*(float(p) for p in parts))


@register
class SlicePolicy(Policy):
    """The users' scheduler (module docstring). Spec params: `mode`, `time_slice_ms`,
    `weights` ([tier, wait, speed]), `score_threshold`."""

    name = "slices"
    preempts_for_kv = True

    def __init__(self, *, mode: str = "moderate", time_slice_ms: float = 50.0,
                 weights: list | None = None, score_threshold: float = 10.0) -> None:
        if mode not in MODES:
            raise ValueError(f"preemption mode {mode!r}: allowed values: {', '.join(MODES)}")
        if not time_slice_ms > 0:
            raise ValueError(f"time_slice_ms {time_slice_ms}: must be > 0")
        super().__init__(priority_scheduling=False)
        self.mode = mode
        self.time_slice_s = time_slice_ms / 1000
        if weights is None:
            self.w = ScoreWeights()
        elif isinstance(weights, ScoreWeights):
            self.w = weights
        elif len(weights) == 3:
            self.w = ScoreWeights(*(float(x) for x in weights))
        else:
            raise ValueError(f"weights {weights!r}: expected [tier, wait, speed]")
        self.score_threshold = score_threshold

    @property
    def preempts(self) -> bool:
        return self.mode != "conservative"

    def score(self, r: RequestView, now: float) -> float:
        speed = 0.0
        if r.first_token_s is not None and now > r.first_token_s:
            speed = r.generated_tokens / (now - r.first_token_s)
        return (self.w.tier * r.priority + self.w.wait * (now - r.arrival_s)
                - self.w.speed * speed)

    def order(self, snap: Snapshot) -> list[int]:
        # `score` inlined (the same operations in the same order, so the same floats): the
        # plugin asks this at every pass, over every waiting request
        now = snap.now
        tier, wait, speed_w = self.w.tier, self.w.wait, self.w.speed
        keys = []
        for r in snap.waiting:
            first = r.first_token_s
            speed = r.generated_tokens / (now - first) \
                if first is not None and now > first else 0.0
            keys.append((-(tier * r.priority + wait * (now - r.arrival_s) - speed_w * speed),
                         r.queue_entry_s))
        return sorted(range(len(keys)), key=keys.__getitem__)

    def victims(self, snap: Snapshot) -> list[int]:
        if self.mode == "conservative" or snap.candidate is None:
            return []
        now, r = snap.now, snap.running
        cand = self.score(snap.waiting[snap.candidate], now)
        scores = [self.score(x, now) for x in r]
        gap = self.score_threshold if self.mode == "moderate" else 0.0
        chosen, need = [], snap.tokens_needed
        for i in sorted(range(len(r)), key=lambda i: (scores[i], -r[i].queue_entry_s)):
            if cand - scores[i] <= gap:
                break  # sorted ascending: nobody further qualifies
            if self.mode == "moderate" and (r[i].round_start_s is None or
                                            now - r[i].round_start_s < self.time_slice_s):
                continue
            chosen.append(i)
            need -= r[i].reserved_tokens
            if need <= 0:
                break
        return chosen if chosen and need <= 0 else []
