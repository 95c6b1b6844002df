"""Deadline-aware admission: serve what can still make its SLO, defer what cannot.

Each waiting request has a TTFT deadline (arrival + its target, `SloTargets`) and a
predicted prefill time from a three-coefficient model of the deployment's prefill steps,

    prefill_s(n new tokens after c cached) = s_per_chunk x ceil(n / chunk)
                                            + s_per_token x n + s_per_token_ctx x n x (c + n / 2)

(the last term is attention over the context; the defaults are fitted to the users'
deployment, 2x A100-80GB PCIe at TP 2 with DeepSeek-R1-Distill-Qwen-32B, within 5 % of the
twin's opdb step times for 256-8,192-token chunks after 0-110k cached tokens). Slack is
deadline - now - predicted prefill. The order:

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
"""

from __future__ import annotations

import math

from twin.policy.base import Plan, Policy, Snapshot
from twin.policy.features import SloTargets, waiting_targets
from twin.policy.registry import register
from twin.policy.sglang import ShortestPrefillFirst

#: prefill step model of the users' deployment (fitted to the twin's opdb step times)
S_PER_CHUNK = 0.01845
S_PER_TOKEN = 1.980e-4
S_PER_TOKEN_CTX = 3.515e-9
WITHHOLD = ("none", "hopeless", "documents", "laxity")


def prefill_s(new: int, cached: int, chunk: int, a: float, b: float, c: float) -> float:
    """Predicted prefill time of `new` tokens after `cached` ones (module docstring)."""
    if new <= 0:
        return 0.0
    return a * math.ceil(new / chunk) + b * new + c * new * (cached + new / 2)


def moore_hodgson(jobs: list[tuple[float, float, int]], start: float) -> tuple[list[int],
                                                                              list[int]]:
    """Jobs `(deadline, duration, key)` on one machine from `start`: the keys of a largest
    set that all meet their deadlines (in deadline order) and the keys of the rest."""
    kept: list[tuple[float, float, int]] = []
    late: list[int] = []
    t = start
    for job in sorted(jobs):
        kept.append(job)
        t += job[1]
        if t > job[0]:
            worst = max(range(len(kept)), key=lambda j: (kept[j][1], kept[j][2]))
            t -= kept[worst][1]
            late.append(kept.pop(worst)[2])
    return [k for _, _, k in kept], late


@register
class DeadlinePolicy(Policy):
    """Feasible-deadline-first admission with deferral (module docstring). SLO params as
    in `menu`; `s_per_chunk`, `s_per_token`, `s_per_token_ctx` and `chunk` the prefill
    model; `max_defer_s` the aging bound (0: none); `withhold` and `margin_s` what is held
    back."""

    name = "deadline"

    def __init__(self, *, ttft_s: float = 1.5, tpot_s: float = 0.1, doc_tokens: int = 4096,
                 doc_ttft_s_per_token: float = 5e-4, tier_ttft_s: list | None = None,
                 s_per_chunk: float = S_PER_CHUNK, s_per_token: float = S_PER_TOKEN,
                 s_per_token_ctx: float = S_PER_TOKEN_CTX, chunk: int = 8192,
                 max_defer_s: float = 600.0, withhold: str = "laxity", margin_s: float = 2.0,
                 chunk_cap: bool = False) -> None:
        super().__init__()
        from twin.policy.menu import targets_from

        self.targets: SloTargets = targets_from(ttft_s, tpot_s, doc_tokens,
                                                doc_ttft_s_per_token, tier_ttft_s)
        if min(s_per_chunk, s_per_token, s_per_token_ctx, max_defer_s) < 0 or chunk < 1:
            raise ValueError("prefill model coefficients and max_defer_s must be >= 0, "
                             "chunk >= 1")
        self.model = (chunk, s_per_chunk, s_per_token, s_per_token_ctx)
        self.max_defer_s = max_defer_s
        if withhold not in WITHHOLD:
            raise ValueError(f"withhold {withhold!r}: allowed values: {', '.join(WITHHOLD)}")
        self.withhold, self.margin_s = withhold, margin_s
        if chunk_cap:
            self.chunk_limit = ShortestPrefillFirst.chunk_limit

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return True  # the prefill model reads fresh prefix matches

    def prefill_s(self, r) -> float:
        return prefill_s(r.uncached, min(r.prefix_len, r.prompt_tokens), *self.model)

    def groups(self, snap: Snapshot) -> dict[str, list[int]]:
        """The waiting indices by group, each in its order (module docstring): `ok` and
        `late` short questions, `overdue` documents (deferred past `max_defer_s`), `kept`
        (documents that can make their deadline) and `hopeless` ones; and `slack`, each
        waiting request's deadline - now - predicted prefill (seconds)."""
        w, now = snap.waiting, snap.now
        deadline = [r.arrival_s + t for r, t in zip(w, waiting_targets(snap, self.targets),
                                                     strict=True)]
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
