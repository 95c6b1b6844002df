"""What a learned scheduler sees of one scheduling pass, and the SLO it is judged by.

`pass_features(snap, targets)` is a fixed-size vector computed from the `Snapshot` alone,
so the twin's training environment and the live engine (through the plugin) compute the
same numbers. Every entry is clipped to [-1, 1]; docs/rl.md lists them (`feature_names`).
Two feature sets (`FEATURE_SETS`), named in every exported weight file: `pass-v1` (the
queue, the running batch, the KV pool, the recent SLO state) and `pass-v2` (pass-v1 plus
`SLACK_FIELDS`: what the `deadline` rules see, i.e. the counts of kept / due / hopeless /
overdue documents, the smallest document slack and the head short question's wait, from
the deadline policy's own grouping with the file's prefill model).
`SloTargets` is the goal: a request meets its SLO when its TTFT is within its target (the
tier's base, plus an allowance per prompt token for documents) and its TPOT within the
TPOT target. Pure numpy; no clock, no engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from twin.policy.base import RequestView, Snapshot

#: waiting requests described one by one (the oldest by arrival); the rest in aggregates
K_SLOTS = 8
SLOT_FIELDS = ("present", "log_prompt", "log_uncached", "cached_share", "wait_over_target",
               "tier", "is_document")
QUEUE_FIELDS = ("log_waiting", "short_share", "log_uncached_total", "log_uncached_min",
                "max_wait_over_target", "late_share", "late_short_share", "log_documents")
RUN_FIELDS = ("log_running", "running_documents_share", "log_tokens_left", "kv_used",
              "kv_free", "kv_evictable", "reserved_share")
SLO_FIELDS = ("running_ttft_missed_share", "running_ttft_over_target", "running_tpot_missed_share")
#: pass-v2's additions: the deadline policy's view of the queue (twin/policy/deadline.py)
SLACK_FIELDS = ("log_kept_documents", "log_due_documents", "log_hopeless_documents",
                "log_overdue_documents", "min_document_slack", "min_kept_slack",
                "log_ok_short", "log_late_short", "head_short_wait_over_target",
                "short_running")
FEATURE_SETS = ("pass-v1", "pass-v2")
#: the slack scale (seconds): slack / SLACK_SCALE_S, clipped to [-1, 1]
SLACK_SCALE_S = 60.0


def check_feature_set(features: str) -> str:
    if features not in FEATURE_SETS:
        raise ValueError(f"feature set {features!r}: allowed values: {', '.join(FEATURE_SETS)}")
    return features


def feature_names(k: int = K_SLOTS, features: str = "pass-v1") -> tuple[str, ...]:
    slots = tuple(f"w{i}_{f}" for i in range(k) for f in SLOT_FIELDS)
    extra = SLACK_FIELDS if check_feature_set(features) == "pass-v2" else ()
    return slots + QUEUE_FIELDS + RUN_FIELDS + SLO_FIELDS + extra


@dataclass(frozen=True)
class SloTargets:
    """The SLO: TTFT <= `ttft_s` (or the tier's entry in `tier_ttft_s`, `[[tier, s], ...]`)
    plus `doc_ttft_s_per_token` x prompt tokens for prompts of `doc_tokens` or more; and
    TPOT <= `tpot_s` (None: no TPOT target)."""

    ttft_s: float = 1.5
    tpot_s: float | None = 0.1
    doc_tokens: int = 4096
    doc_ttft_s_per_token: float = 5e-4
    tier_ttft_s: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self) -> None:
        nums = [self.ttft_s, self.doc_ttft_s_per_token, *(s for _, s in self.tier_ttft_s)]
        if self.tpot_s is not None:
            nums.append(self.tpot_s)
        if not all(math.isfinite(x) and x >= 0 for x in nums) or self.ttft_s <= 0:
            raise ValueError(f"SLO targets {self}: times must be finite, >= 0 (ttft > 0)")
        if self.doc_tokens < 1:
            raise ValueError(f"SLO doc_tokens {self.doc_tokens}: must be >= 1")

    def base_ttft(self, priority: int) -> float:
        for tier, s in self.tier_ttft_s:
            if tier == priority:
                return s
        return self.ttft_s

    def ttft_target(self, prompt_tokens: int, priority: int) -> float:
        extra = prompt_tokens * self.doc_ttft_s_per_token if self.is_document(prompt_tokens) \
            else 0.0
        return self.base_ttft(priority) + extra

    def is_document(self, prompt_tokens: int) -> bool:
        return prompt_tokens >= self.doc_tokens

    def met(self, ttft_s: float | None, tpot_s: float | None, prompt_tokens: int,
            priority: int) -> bool:
        if ttft_s is None or ttft_s > self.ttft_target(prompt_tokens, priority):
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s

    def to_json(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "doc_tokens": self.doc_tokens,
                "doc_ttft_s_per_token": self.doc_ttft_s_per_token,
                "tier_ttft_s": [list(x) for x in self.tier_ttft_s]}

    @classmethod
    def from_json(cls, d: dict) -> SloTargets:
        d = dict(d)
        d["tier_ttft_s"] = tuple((int(t), float(s)) for t, s in d.get("tier_ttft_s", ()))
        return cls(**d)


def _log(x, scale: float):
    return np.log1p(np.maximum(x, 0)) / scale


def _arrays(views: tuple[RequestView, ...]) -> dict[str, np.ndarray]:
    # one pass over the views, one array; its columns (views of it) hold the same values
    cols = np.array([(r.arrival_s, r.prompt_tokens, r.prefix_len, r.priority)
                     for r in views], float).reshape(-1, 4).T
    return {"arrival": cols[0], "prompt": cols[1], "prefix": cols[2], "prio": cols[3]}


def _targets(t: SloTargets, prompt: np.ndarray, prio: np.ndarray) -> np.ndarray:
    base = np.full(len(prompt), t.ttft_s)
    for tier, s in t.tier_ttft_s:
        base[prio == tier] = s
    doc = prompt >= t.doc_tokens
    return base + np.where(doc, prompt * t.doc_ttft_s_per_token, 0.0)


def waiting_targets(snap: Snapshot, t: SloTargets) -> np.ndarray:
    """Each waiting request's TTFT target (seconds), in queue order."""
    a = _arrays(snap.waiting)
    return _targets(t, a["prompt"], a["prio"])


def pass_features(snap: Snapshot, t: SloTargets, k: int = K_SLOTS,
                  features: str = "pass-v1", prefill: dict | None = None) -> np.ndarray:
    """The observation of one pass (`feature_names(k, features)` says what each entry is);
    `prefill`: the deadline rules' prefill model (pass-v2; {} or None: its defaults)."""
    parts = [_waiting(snap, t, k), _running(snap, t)]
    if check_feature_set(features) == "pass-v2":
        parts.append(_slack(snap, t, prefill or {}))
    return np.clip(np.concatenate(parts), -1.0, 1.0)


def _slack(snap: Snapshot, t: SloTargets, prefill: dict) -> np.ndarray:
    """SLACK_FIELDS: the deadline policy's groups of the waiting queue (its `laxity`
    mode: `due` are the kept documents whose slack is down to its margin)."""
    from twin.policy.menu import deadline_policy  # menu and deadline import this module

    out = np.zeros(len(SLACK_FIELDS))
    pol = deadline_policy("laxity", t, prefill)
    running_short = any(not t.is_document(r.prompt_tokens) for r in snap.running)
    out[9] = float(running_short)
    if not snap.waiting:
        return out
    g = pol.groups(snap)
    slack = g["slack"]
    due = [i for i in g["kept"] if slack[i] <= pol.margin_s]
    out[0:4] = (_log(len(g["kept"]), 4), _log(len(due), 4), _log(len(g["hopeless"]), 4),
                _log(len(g["overdue"]), 4))
    docs = g["kept"] + g["hopeless"] + g["overdue"]
    if docs:
        out[4] = min(slack[i] for i in docs) / SLACK_SCALE_S
    if g["kept"]:
        out[5] = min(slack[i] for i in g["kept"]) / SLACK_SCALE_S
    out[6:8] = (_log(len(g["ok"]), 6), _log(len(g["late"]), 6))
    shorts = g["ok"] + g["late"]
    if shorts:
        w = snap.waiting
        head = min(shorts, key=lambda i: (w[i].arrival_s, i))
        target = t.ttft_target(w[head].prompt_tokens, w[head].priority)
        out[8] = min((snap.now - w[head].arrival_s) / target, 4.0) / 4
    return out


def _waiting(snap: Snapshot, t: SloTargets, k: int) -> np.ndarray:
    n = len(snap.waiting)
    slots = np.zeros((k, len(SLOT_FIELDS)))
    queue = np.zeros(len(QUEUE_FIELDS))
    queue[0] = _log(n, 6)
    if not n:
        return np.concatenate([slots.ravel(), queue])
    a = _arrays(snap.waiting)
    prompt, prefix = a["prompt"], np.minimum(a["prefix"], a["prompt"])
    uncached = prompt - prefix
    target = _targets(t, prompt, a["prio"])
    late = (snap.now - a["arrival"]) / target  # the wait so far in units of the TTFT target
    doc = prompt >= t.doc_tokens
    oldest = np.array(sorted(range(n), key=lambda i: (a["arrival"][i], i))[:k], dtype=np.intp)
    # the slots column by column: the same element-wise operations as one slot at a time
    # (max/min as np.maximum/np.minimum: the same values, NaN included)
    m = len(oldest)
    p_o = prompt[oldest]
    slots[:m, 0] = 1.0
    slots[:m, 1] = _log(p_o, 12)
    slots[:m, 2] = _log(uncached[oldest], 12)
    slots[:m, 3] = prefix[oldest] / np.maximum(p_o, 1.0)
    slots[:m, 4] = np.minimum(late[oldest], 8.0) / 8
    slots[:m, 5] = a["prio"][oldest] / 20
    slots[:m, 6] = doc[oldest]
    short = ~doc
    queue[1:] = (_share(short), _log(uncached.sum(), 14), _log(uncached.min(), 12),
                 min(late.max(), 8.0) / 8, _share(late > 1),
                 _share(late[short] > 1) if short.any() else 0.0, _log(doc.sum(), 4))
    return np.concatenate([slots.ravel(), queue])


def _share(mask: np.ndarray) -> float:
    """`mask.mean()` of a non-empty boolean array: its count over its length, the same
    float64 (a whole-number sum divided once)."""
    return np.count_nonzero(mask) / mask.size


def _running(snap: Snapshot, t: SloTargets) -> np.ndarray:
    cap = max(snap.kv_capacity, 1)
    r = snap.running
    n = len(r)
    run = np.zeros(len(RUN_FIELDS))
    slo = np.zeros(len(SLO_FIELDS))
    run[0] = _log(n, 6)
    used = cap - snap.kv_free - snap.kv_evictable
    run[3:6] = (used / cap, snap.kv_free / cap, snap.kv_evictable / cap)
    if not n:
        return np.concatenate([run, slo])
    # one pass over the views: arrival, prompt, priority, tokens left, first token, generated
    cols = np.array([(x.arrival_s, x.prompt_tokens, x.priority,
                      x.max_new_tokens - x.generated_tokens,
                      np.nan if x.first_token_s is None else x.first_token_s,
                      x.generated_tokens) for x in r], float).T
    a = {"arrival": cols[0], "prompt": cols[1], "prio": cols[2]}
    left, first, gen = cols[3], cols[4], cols[5]
    run[1] = _share(a["prompt"] >= t.doc_tokens)
    run[2] = _log(left.sum(), 12)
    run[6] = sum(x.reserved_tokens for x in r) / cap
    started = ~np.isnan(first)
    if started.any():
        ttft = (first - a["arrival"])[started]
        ratio = ttft / _targets(t, a["prompt"], a["prio"])[started]
        slo[0] = _share(ratio > 1)
        slo[1] = min(ratio.mean(), 4.0) / 4
    decoding = started & (gen > 1)
    if decoding.any() and t.tpot_s:
        tpot = (snap.now - first[decoding]) / (gen[decoding] - 1)
        slo[2] = _share(tpot > t.tpot_s)
    return np.concatenate([run, slo])
