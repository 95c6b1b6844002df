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
    `prefill`: the deadline rules' prefill model (pass-v2; {} or None: its defaults).

    The entries are computed in Python floats, each with the operations numpy did on its
    column (elementwise IEEE arithmetic; sums of whole token counts, exact in any order;
    numpy's own mean where the values are not whole), and every log at once in one
    `np.log1p` over an array (`_Logs`): numpy's log1p may differ from `math.log1p` (its
    SIMD loops) but not from itself over another array's length. tests/test_rl.py holds
    them to the slot-by-slot numbers."""
    out: list[float] = []
    logs = _Logs()
    _waiting(snap, t, k, out, logs)
    _running(snap, t, out, logs)
    if check_feature_set(features) == "pass-v2":
        _slack(snap, t, prefill or {}, out, logs)
    vec = np.array(out, dtype=float)
    logs.fill(vec)
    return np.clip(vec, -1.0, 1.0)


class _Logs:
    """A pass's `_log(x, scale)` entries, computed together (`fill`): their places in
    the output, their arguments and their scales."""

    __slots__ = ("at", "x", "scale")

    def __init__(self) -> None:
        self.at: list[int] = []
        self.x: list[float] = []
        self.scale: list[float] = []

    def put(self, at: int, x, scale: float) -> None:
        self.at.append(at)
        self.x.append(x)
        self.scale.append(scale)

    def fill(self, vec: np.ndarray) -> None:
        if self.at:
            x = np.array(self.x, dtype=float)
            vec[self.at] = np.log1p(np.maximum(x, 0)) / np.array(self.scale, dtype=float)


def _div(x: float, y: float) -> float:
    """x / y as numpy divides: inf or NaN (with numpy's warning) where y is zero (a tier
    whose TTFT target is 0 s)."""
    return x / y if y else float(np.float64(x) / np.float64(y))


def column_target(t: SloTargets, tiers: dict, prompt: float, prio) -> float:
    """`_targets` (`waiting_targets`) for one request, the same float (`tiers`:
    `dict(t.tier_ttft_s)`): its tier's base (a later entry for a tier wins, as
    there), else `ttft_s`; plus, for a document, its per-token allowance."""
    base = tiers.get(prio, t.ttft_s) if tiers else t.ttft_s
    return base + (prompt * t.doc_ttft_s_per_token if prompt >= t.doc_tokens else 0.0)


def _slack(snap: Snapshot, t: SloTargets, prefill: dict, out: list, logs: _Logs) -> None:
    """SLACK_FIELDS: the deadline policy's groups of the waiting queue (its `laxity`
    mode: `due` are the kept documents whose slack is down to its margin)."""
    from twin.policy.menu import deadline_policy  # menu and deadline import this module

    base = len(out)
    part = [0.0] * len(SLACK_FIELDS)
    pol = deadline_policy("laxity", t, prefill)
    running_short = any(not t.is_document(r.prompt_tokens) for r in snap.running)
    part[9] = float(running_short)
    if snap.waiting:
        g = pol.groups(snap)
        slack = g["slack"]
        due = [i for i in g["kept"] if slack[i] <= pol.margin_s]
        for j, n in enumerate((len(g["kept"]), len(due), len(g["hopeless"]),
                               len(g["overdue"]))):
            logs.put(base + j, n, 4)
        docs = g["kept"] + g["hopeless"] + g["overdue"]
        if docs:
            part[4] = min(slack[i] for i in docs) / SLACK_SCALE_S
        if g["kept"]:
            part[5] = min(slack[i] for i in g["kept"]) / SLACK_SCALE_S
        logs.put(base + 6, len(g["ok"]), 6)
        logs.put(base + 7, len(g["late"]), 6)
        shorts = g["ok"] + g["late"]
        if shorts:
            w = snap.waiting
            head = min(shorts, key=lambda i: (w[i].arrival_s, i))
            target = t.ttft_target(w[head].prompt_tokens, w[head].priority)
            part[8] = min((snap.now - w[head].arrival_s) / target, 4.0) / 4
    out.extend(part)


def _waiting(snap: Snapshot, t: SloTargets, k: int, out: list, logs: _Logs) -> None:
    """SLOT_FIELDS for the k oldest waiting (by arrival, then place), then QUEUE_FIELDS."""
    w = snap.waiting
    n = len(w)
    nf = len(SLOT_FIELDS)
    base = len(out)
    slots = [0.0] * (k * nf)
    queue = [0.0] * len(QUEUE_FIELDS)
    q0 = base + k * nf
    logs.put(q0, n, 6)
    if n:
        tiers = dict(t.tier_ttft_s)
        now, doc_tokens = snap.now, t.doc_tokens
        arrival = [float(r.arrival_s) for r in w]
        prompt = [float(r.prompt_tokens) for r in w]
        prefix = [min(float(r.prefix_len), p) for r, p in zip(w, prompt, strict=True)]
        prio = [float(r.priority) for r in w]
        uncached = [p - c for p, c in zip(prompt, prefix, strict=True)]
        late = [_div(now - a, column_target(t, tiers, p, pr))
                for a, p, pr in zip(arrival, prompt, prio, strict=True)]
        doc = [p >= doc_tokens for p in prompt]
        oldest = sorted(range(n), key=lambda i: (arrival[i], i))[:k]
        for s, i in enumerate(oldest):
            at = s * nf
            p = prompt[i]
            slots[at] = 1.0
            logs.put(base + at + 1, p, 12)
            logs.put(base + at + 2, uncached[i], 12)
            slots[at + 3] = prefix[i] / (p if p > 1.0 else 1.0)
            x = late[i]
            slots[at + 4] = (8.0 if 8.0 < x else x) / 8  # (np.minimum: NaN stays)
            slots[at + 5] = prio[i] / 20
            slots[at + 6] = 1.0 if doc[i] else 0.0
        n_doc = sum(doc)
        n_short = n - n_doc
        top = max(late)
        if top == 0.0 or any(x != x for x in late):  # numpy's max: of equal zeros maybe
            top = np.array(late).max()  # the -0.0 (Python's: the first); NaN wins anywhere
        queue[1] = n_short / n
        logs.put(q0 + 2, sum(uncached), 14)
        logs.put(q0 + 3, min(uncached), 12)
        queue[4] = min(top, 8.0) / 8
        queue[5] = sum(x > 1 for x in late) / n
        queue[6] = (sum(x > 1 for x, d in zip(late, doc, strict=True) if not d) / n_short
                    if n_short else 0.0)
        logs.put(q0 + 7, n_doc, 4)
    out.extend(slots)
    out.extend(queue)


def _running(snap: Snapshot, t: SloTargets, out: list, logs: _Logs) -> None:
    """RUN_FIELDS, then SLO_FIELDS."""
    cap = max(snap.kv_capacity, 1)
    r = snap.running
    n = len(r)
    base = len(out)
    run = [0.0] * len(RUN_FIELDS)
    slo = [0.0] * len(SLO_FIELDS)
    logs.put(base, n, 6)
    used = cap - snap.kv_free - snap.kv_evictable
    run[3], run[4], run[5] = used / cap, snap.kv_free / cap, snap.kv_evictable / cap
    if n:
        tiers = dict(t.tier_ttft_s)
        now, doc_tokens = snap.now, t.doc_tokens
        n_doc = left = 0
        ratios = []
        n_tpot = n_slow = 0
        tpot_s = t.tpot_s
        for x in r:
            p = float(x.prompt_tokens)
            n_doc += p >= doc_tokens
            left += x.max_new_tokens - x.generated_tokens
            first = x.first_token_s
            if first is not None and first == first:  # (NaN: not started, as isnan says)
                ratios.append(_div(first - x.arrival_s,
                                   column_target(t, tiers, p, float(x.priority))))
                if x.generated_tokens > 1 and tpot_s:
                    n_tpot += 1
                    n_slow += (now - first) / (x.generated_tokens - 1) > tpot_s
        run[1] = n_doc / n
        logs.put(base + 2, left, 12)
        run[6] = sum(x.reserved_tokens for x in r) / cap
        if ratios:
            slo[0] = sum(x > 1 for x in ratios) / len(ratios)
            mean = np.array(ratios).mean()  # numpy's own pairwise sum
            slo[1] = min(mean, 4.0) / 4
        if n_tpot:
            slo[2] = n_slow / n_tpot
    out.extend(run)
    out.extend(slo)
