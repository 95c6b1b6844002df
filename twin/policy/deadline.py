"""Deadline-aware admission: serve what can still make its SLO, defer what cannot.

Each waiting request has a TTFT deadline (arrival + its target, `SloTargets`) and a
predicted prefill time from a three-coefficient model of the deployment's prefill steps,

    prefill_s(n new tokens after c cached) = s_per_chunk x ceil(n / chunk)
                                            + s_per_token x n + s_per_token_ctx x n x (c + n / 2)

(the last term is attention over the context; the defaults are fitted to the users'
deployment, 2x A100-80GB PCIe at TP 2 with DeepSeek-R1-Distill-Qwen-32B, within 5 % of the
twin's opdb step times for 256-8,192-token chunks after 0-110k cached tokens), plus, where
the attention kernel computes each chunk's whole causal square whatever is cached (SGLang's
`torch_native` backend, the CPU harness's), `s_per_ctx_sq` x (c + n) ** 2 per chunk (0 by
default: not on a GPU). Slack is deadline - now - predicted prefill. The order:

1. short questions (prompts under `doc_tokens`): those with slack >= 0 by deadline, then
   the late ones by arrival (a fraction of a chunk each: served at once, never starved);
2. `overdue` documents, waiting longer than `max_defer_s` (aging: sustained overload
   cannot starve a document), oldest first;
3. `kept` documents, the ones a single prefill lane can still serve in time: Moore-Hodgson
   over the documents in deadline order (add each; when the running total overshoots the
   deadline of the one just added, drop the longest so far), which maximises how many meet
   their deadline; by deadline;
4. `hopeless` documents, oldest first.

Why withholding matters (docs/rl.md): SGLang runs a chunked prefill before any decode
step, so while a document prefills (seconds to a minute on this deployment) every running
short question stalls and misses its TPOT target, and every arriving one its TTFT target.
Order alone cannot keep a document out: the admission pass gives it whatever chunk budget
the requests ahead of it leave. `withhold` (`Plan.admit`) holds part of the order back
while something runs (an idle server always serves):

- `none`: order only;
- `hopeless`: hold the hopeless documents;
- `documents`: hold every document but the overdue ones while short questions wait or run;
- `laxity` (default): as `documents`, but a kept document starts once its slack is down to
  `margin_s` (just in time for its own deadline), and the hopeless wait for a pass with no
  short question around.

With `chunk_cap`, the running chunked prefill is capped as SGLang's shortest-prefill-first
caps it (room left for the short questions at the head of this order); live, SGLang
applies that cap itself on a server started with `--schedule-policy
shortest-prefill-first`, and the plugin's order is the queue it reads.

With `chunk_tokens` and `park_steps` the policy also answers the chunk question
(`ChunkPlan`, `short_question_chunks`): while short questions wait or run, a document's
next chunk is capped at `chunk_tokens` (so an arriving question waits for a short step,
and gets the rest of the pass's budget), and while short questions decode, `park_steps`
decode-only passes run before each such chunk (so their TPOT is an average over a chunk and
`park_steps` decode steps instead of a whole document's prefill). With neither around the
document runs SGLang's full chunks. With `rescue_s`, a document whose deadline can still be
met only at full chunks (its slack at full chunks between 0 and `rescue_s` seconds) gets
them. Live, the plugin applies both on any `--schedule-policy` (docs/plugin.md).

With `chunk_budget_s` instead of `chunk_tokens` the cap is a time, not a token count: the
largest page-aligned chunk the prefill model predicts to take at most `chunk_budget_s`
seconds after the chunked request's context (`budget_limit`). Where a chunk's cost grows
with its tokens (a GPU) that shrinks the chunk as the context deepens; where it does not
(the CPU harness past the first chunk: the square term), the chunk within the budget would
cost more in fixed work than in its tokens, or no chunk is within it, and a cap would only
multiply the chunks, so none is set and the document gets SGLang's full chunk
(`park_steps` still applies).
"""

from __future__ import annotations

import math
from functools import lru_cache
from heapq import heappop, heappush
from typing import NamedTuple

from twin.policy.base import MAX_PARK, ChunkPlan, Plan, Policy, RequestView, Snapshot
from twin.policy.features import SloTargets, column_target
from twin.policy.registry import register
from twin.policy.sglang import ShortestPrefillFirst

#: prefill step model of the users' deployment (fitted to the twin's opdb step times)
S_PER_CHUNK = 0.01845
S_PER_TOKEN = 1.980e-4
S_PER_TOKEN_CTX = 3.515e-9
WITHHOLD = ("none", "hopeless", "documents", "laxity")


def short_questions_around(targets: SloTargets, snap: Snapshot) -> bool | None:
    """Whether a short question decodes (True) or only waits (False); None: neither."""
    short = targets.is_document
    if any(not short(r.prompt_tokens) for r in snap.running):
        return True
    return False if any(not short(r.prompt_tokens) for r in snap.waiting) else None


def short_question_chunks(targets: SloTargets, snap: Snapshot, chunk_tokens: int,
                          park_steps: int, page_size: int) -> ChunkPlan:
    """The chunk answer that shields short questions from a document's prefill: while one
    waits or runs, the chunk is capped at `chunk_tokens` (page-aligned; 0: no cap), and
    while one decodes, `park_steps` decode-only passes run first; otherwise SGLang's own
    chunk."""
    decoding = short_questions_around(targets, snap)
    if decoding is None:
        return ChunkPlan()
    page = max(page_size, 1)
    limit = max(page, chunk_tokens // page * page) if chunk_tokens else None
    return ChunkPlan(limit=limit, park=park_steps if decoding else 0)


def chunk_step_s(n: int, cached: int, a: float, b: float, c: float, d: float = 0.0) -> float:
    """Predicted time of one prefill chunk of `n` new tokens after `cached` (the module
    docstring's model for a single chunk)."""
    return a + b * n + c * n * (cached + n / 2) + d * (cached + n) ** 2


def budget_limit(budget_s: float, cached: int, most: int, page: int,
                 model: tuple) -> int | None:
    """The largest page-aligned chunk of at most `most` tokens whose predicted step after
    `cached` tokens (`model` = (chunk, a, b, c, d)) is within `budget_s`; None when `most`
    itself is within it (no cap needed), and None when that chunk's new tokens would cost
    less than the step's fixed part (its cost at zero new tokens: the per-chunk constant
    and the context's square): a cap cannot bring such a chunk under the budget, only
    multiply the chunks (on the CPU harness it would shrink a document's chunks towards
    one token as its context grows)."""
    _, a, b, c, d = model
    page = max(page, 1)
    if most <= page or chunk_step_s(most, cached, a, b, c, d) <= budget_s:
        return None
    if chunk_step_s(page, cached, a, b, c, d) > budget_s:
        return None
    lo, hi = 1, most // page  # pages: lo fits, hi does not (or is `most` rounded down)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_step_s(mid * page, cached, a, b, c, d) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    fixed = chunk_step_s(0, cached, a, b, c, d)
    if chunk_step_s(lo * page, cached, a, b, c, d) - fixed < fixed:
        return None  # mostly fixed cost: the chunk would carry too few tokens for its step
    return lo * page


class BudgetAnswer(NamedTuple):
    """A chunk answer as a time: the cap is the largest chunk the prefill model predicts
    within `seconds` (`budget_limit`), with `park` decode-only passes (menu entries
    `RULE@SECONDSsxPARK`)."""

    seconds: float
    park: int


def model_of(prefill: dict | None) -> tuple:
    """The prefill model `(chunk, a, b, c, d)` of `deadline`'s keyword arguments (the
    users' deployment's for those not given)."""
    p = prefill or {}
    return (int(p.get("chunk", 8192)), float(p.get("s_per_chunk", S_PER_CHUNK)),
            float(p.get("s_per_token", S_PER_TOKEN)),
            float(p.get("s_per_token_ctx", S_PER_TOKEN_CTX)), float(p.get("s_per_ctx_sq", 0.0)))


def budget_chunk(targets: SloTargets, snap: Snapshot, chunked: RequestView, seconds: float,
                 park_steps: int, budget: int, page_size: int, model: tuple) -> ChunkPlan:
    """`short_question_chunks` with the cap as a time: `budget_limit` after `chunked`'s
    context, at most the server's chunk `budget` (0: the rest of its prompt)."""
    decoding = short_questions_around(targets, snap)
    if decoding is None:
        return ChunkPlan()
    cached = min(chunked.prefix_len, chunked.prompt_tokens)
    most = min(chunked.prompt_tokens - cached, budget or chunked.prompt_tokens)
    return ChunkPlan(limit=budget_limit(seconds, cached, most, page_size, model),
                     park=park_steps if decoding else 0)


def answer_chunk(targets: SloTargets, snap: Snapshot,
                 answer: tuple[int, int] | BudgetAnswer | None, page_size: int,
                 chunked: RequestView | None = None, budget: int = 0,
                 model: tuple | None = None) -> ChunkPlan:
    """`short_question_chunks` with a chunk answer `(chunk_tokens, park_steps)`, or
    `budget_chunk` with a `BudgetAnswer` (then `chunked`, the server's chunk `budget` and
    the prefill `model` are needed); None: SGLang's own chunk."""
    if answer is None:
        return ChunkPlan()
    if isinstance(answer, BudgetAnswer):
        return budget_chunk(targets, snap, chunked, answer.seconds, answer.park, budget,
                            page_size, model or model_of(None))
    return short_question_chunks(targets, snap, *answer, page_size)


@lru_cache(maxsize=1 << 16)  # a waiting request's prediction, asked again every pass
def prefill_s(new: int, cached: int, chunk: int, a: float, b: float, c: float,
              d: float = 0.0) -> float:
    """Predicted prefill time of `new` tokens after `cached` ones (module docstring)."""
    if new <= 0:
        return 0.0
    t = a * math.ceil(new / chunk) + b * new + c * new * (cached + new / 2)
    if d:  # each chunk's causal square, its context included
        t += d * sum(min(end, cached + new) ** 2
                     for end in range(cached + chunk, cached + new + chunk, chunk))
    return t


def moore_hodgson(jobs: list[tuple[float, float, int]], start: float) -> tuple[list[int],
                                                                              list[int]]:
    """Jobs `(deadline, duration, key)` on one machine from `start`: the keys of a largest
    set that all meet their deadlines (in deadline order) and the keys of the rest."""
    # the kept jobs in a heap by (-duration, -key): the longest (then the largest key) on
    # top, the one a late job drops; the keys are distinct
    order = sorted(jobs)
    heap: list[tuple[float, int]] = []
    late: list[int] = []
    t = start
    for deadline, duration, key in order:
        heappush(heap, (-duration, -key))
        t += duration
        if t > deadline:
            d, k = heappop(heap)
            t -= -d
            late.append(-k)
    gone = set(late)
    return [k for _, _, k in order if k not in gone], late


#: (the snapshot, (targets, prefill model, max_defer_s), its groups) of the last
#: `DeadlinePolicy.groups` asked: the snapshot held, so `is` cannot meet a new one at its
#: address; one tuple, replaced whole
_LAST_GROUPS: tuple | None = None


@register
class DeadlinePolicy(Policy):
    """Feasible-deadline-first admission with deferral (module docstring). SLO params as
    in `menu`; `s_per_chunk`, `s_per_token`, `s_per_token_ctx`, `s_per_ctx_sq` and `chunk`
    the prefill model; `max_defer_s` the aging bound (0: none); `withhold` and `margin_s`
    what is held back; `chunk_tokens` or `chunk_budget_s`, `park_steps` and `rescue_s` the
    chunk answer."""

    name = "deadline"

    def __init__(self, *, ttft_s: float = 1.5, tpot_s: float = 0.1, doc_tokens: int = 4096,
                 doc_ttft_s_per_token: float = 5e-4, tier_ttft_s: list | None = None,
                 s_per_chunk: float = S_PER_CHUNK, s_per_token: float = S_PER_TOKEN,
                 s_per_token_ctx: float = S_PER_TOKEN_CTX, s_per_ctx_sq: float = 0.0,
                 chunk: int = 8192, max_defer_s: float = 600.0, withhold: str = "laxity",
                 margin_s: float = 2.0, chunk_cap: bool = False, chunk_tokens: int = 0,
                 chunk_budget_s: float = 0.0, park_steps: int = 0,
                 rescue_s: float | None = None) -> None:
        super().__init__()
        from twin.policy.menu import targets_from

        self.targets: SloTargets = targets_from(ttft_s, tpot_s, doc_tokens,
                                                doc_ttft_s_per_token, tier_ttft_s)
        if min(s_per_chunk, s_per_token, s_per_token_ctx, s_per_ctx_sq, max_defer_s) < 0 \
                or chunk < 1:
            raise ValueError("prefill model coefficients and max_defer_s must be >= 0, "
                             "chunk >= 1")
        self.model = (chunk, s_per_chunk, s_per_token, s_per_token_ctx, s_per_ctx_sq)
        self.max_defer_s = max_defer_s
        if withhold not in WITHHOLD:
            raise ValueError(f"withhold {withhold!r}: allowed values: {', '.join(WITHHOLD)}")
        self.withhold, self.margin_s = withhold, margin_s
        if chunk_cap:
            self.chunk_limit = ShortestPrefillFirst.chunk_limit
        if chunk_tokens < 0 or not 0 <= park_steps <= MAX_PARK:
            raise ValueError(f"chunk_tokens must be >= 0 (0: SGLang's chunk) and park_steps "
                             f"in 0..{MAX_PARK}")
        if not chunk_budget_s >= 0 or (chunk_budget_s and chunk_tokens):
            raise ValueError(f"chunk_budget_s {chunk_budget_s}: must be >= 0 seconds (0: off), "
                             f"and not together with chunk_tokens {chunk_tokens}: the cap is "
                             f"one or the other")
        self.chunk_tokens, self.park_steps = chunk_tokens, park_steps
        self.chunk_budget_s = float(chunk_budget_s)
        self.chunks = bool(chunk_tokens or park_steps or chunk_budget_s)
        if rescue_s is not None and not rescue_s >= 0:
            raise ValueError(f"rescue_s {rescue_s}: must be >= 0 seconds (None: off)")
        self.rescue_s = rescue_s

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return True  # the prefill model reads fresh prefix matches

    def chunk(self, snap: Snapshot, chunked: RequestView, budget: int,
              page_size: int) -> ChunkPlan:
        if self.rescue_s is not None and 0 <= self.slack(snap, chunked) <= self.rescue_s:
            return ChunkPlan()  # it makes its deadline only at full chunks: SGLang's own
        if self.chunk_budget_s:
            return budget_chunk(self.targets, snap, chunked, self.chunk_budget_s,
                                self.park_steps, budget, page_size, self.model)
        return short_question_chunks(self.targets, snap, self.chunk_tokens, self.park_steps,
                                     page_size)

    def slack(self, snap: Snapshot, r: RequestView) -> float:
        """Seconds to spare before `r`'s TTFT deadline if the rest of its prompt ran now at
        full chunks (the prefill model; `prefix_len` = its tokens computed or cached)."""
        deadline = r.arrival_s + self.targets.ttft_target(r.prompt_tokens, r.priority)
        return deadline - snap.now - prefill_s(r.uncached, min(r.prefix_len, r.prompt_tokens),
                                               *self.model)

    def prefill_s(self, r) -> float:
        return prefill_s(r.uncached, min(r.prefix_len, r.prompt_tokens), *self.model)

    def groups(self, snap: Snapshot) -> dict[str, list[int]]:
        """The waiting indices by group, each in its order (module docstring): `ok` and
        `late` short questions, `overdue` documents (deferred past `max_defer_s`), `kept`
        (documents that can make their deadline) and `hopeless` ones; and `slack`, each
        waiting request's deadline - now - predicted prefill (seconds). They read only the
        snapshot, the targets, the prefill model and `max_defer_s`: the last snapshot's
        are kept (`_LAST_GROUPS`) for the next policy asking of the same one (a menu's
        modes, the pass-v2 features), a fresh copy each time."""
        global _LAST_GROUPS
        key = (self.targets, self.model, self.max_defer_s)
        last = _LAST_GROUPS
        if last is not None and last[0] is snap and last[1] == key:
            g = last[2]
        else:
            g = self._groups(snap)
            _LAST_GROUPS = (snap, key, g)
        return {k: list(v) for k, v in g.items()}

    def _groups(self, snap: Snapshot) -> dict[str, list[int]]:
        w, now, t = snap.waiting, snap.now, self.targets
        tiers = dict(t.tier_ttft_s)  # (each target `waiting_targets`' float, in Python)
        deadline = [r.arrival_s + column_target(t, tiers, float(r.prompt_tokens),
                                                float(r.priority)) for r in w]
        cost = [self.prefill_s(r) for r in w]
        doc = [self.targets.is_document(r.prompt_tokens) for r in w]
        shorts = [i for i in range(len(w)) if not doc[i]]
        g = {"ok": sorted((i for i in shorts if now + cost[i] <= deadline[i]),
                          key=lambda i: (deadline[i], i)),
             "late": sorted((i for i in shorts if now + cost[i] > deadline[i]),
                            key=lambda i: (w[i].arrival_s, i))}
        docs = [i for i in range(len(w)) if doc[i]]
        g["overdue"] = sorted((i for i in docs if self.max_defer_s
                               and now - w[i].arrival_s > self.max_defer_s),
                              key=lambda i: (w[i].arrival_s, i))
        over = set(g["overdue"])
        start = now + sum(cost[i] for i in shorts)
        g["kept"], g["hopeless"] = moore_hodgson(
            [(deadline[i], cost[i], i) for i in docs if i not in over], start)
        g["hopeless"].sort(key=lambda i: (w[i].arrival_s, i))
        g["slack"] = [d - now - c for d, c in zip(deadline, cost, strict=True)]
        return g

    def order(self, snap: Snapshot) -> list[int]:
        return self.plan(snap)[0]

    def decide(self, snap: Snapshot) -> Plan:
        if snap.candidate is not None:
            return Plan(victims=())
        order, admit = self.plan(snap)
        return Plan(order=tuple(order), admit=admit)

    def plan(self, snap: Snapshot) -> tuple[list[int], int | None]:
        """The order and how many of it to admit this pass (None: all)."""
        if len(snap.waiting) < 2:
            return list(range(len(snap.waiting))), None
        g = self.groups(snap)
        if self.withhold == "laxity":  # the kept ones due to start now go first
            due = [i for i in g["kept"] if g["slack"][i] <= self.margin_s]
            g["due"] = len(due)
            g["kept"] = due + [i for i in g["kept"] if g["slack"][i] > self.margin_s]
        order = g["ok"] + g["late"] + g["overdue"] + g["kept"] + g["hopeless"]
        return order, self.admit(snap, g, len(order))

    def admit(self, snap: Snapshot, g: dict, n: int) -> int | None:
        if self.withhold == "none" or not snap.running:
            return None  # an idle server serves whatever waits
        head = len(g["ok"]) + len(g["late"]) + len(g["overdue"])
        if self.withhold == "hopeless":
            return n - len(g["hopeless"]) if g["hopeless"] else None
        t = self.targets
        busy = bool(g["ok"] or g["late"]) or any(not t.is_document(r.prompt_tokens)
                                                 for r in snap.running)
        if not busy:
            return None
        if self.withhold == "documents":
            return head
        # laxity: a document that can still make it starts when its slack runs out
        return head + g["due"] if g["due"] < len(g["kept"]) or g["hopeless"] else None
