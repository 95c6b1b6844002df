"""A menu of queue orders a learned scheduler chooses from at each pass.

Each rule is a pure function of the snapshot and the SLO targets; the learned selector
(`twin.policy.learned`) picks one per pass, and the `menu` policy runs one rule alone (so
each can be compared as a fixed heuristic). Ties always fall back to queue entry, then the
queue index, so every order is a function of the snapshot.

- `fcfs`: oldest queue entry first.
- `spf`: fewest uncached prompt tokens first (shortest prefill first).
- `priority`: highest tier first, then oldest.
- `edf`: earliest TTFT deadline first (arrival + the request's TTFT target).

Rules that also withhold admission (`Plan.admit`), each the `deadline` policy
(twin/policy/deadline.py) in one of its modes, with the prefill model given as
`prefill` (`{"s_per_chunk", "s_per_token", "s_per_token_ctx", "chunk"}`; None: the users'
deployment's):

- `deadline`: feasible-deadline-first order, nothing held;
- `hold-hopeless`: the same order, documents that cannot make their deadline held;
- `laxity`: documents held while short questions wait or run, each started when its
  slack runs out;
- `hold-documents`: every document held while short questions wait or run.

`rule_plan(name, snap, targets, prefill)` answers an order question with any of them.

A menu entry may carry a chunk answer: `RULE@TOKENSxPARK` (for example
`hold-hopeless@256x4`) is RULE's order with the chunk question answered as `deadline`'s
`chunk_tokens=TOKENS, park_steps=PARK` (`short_question_chunks`), so a selector chooses how
a document's prefill is cut per pass as well as the order (`menu_entry`);
`RULE@SECONDSsxPARK` (for example `hold-hopeless@0.3sx8`) answers it as `deadline`'s
`chunk_budget_s=SECONDS, park_steps=PARK` on the selector's prefill model
(`BudgetAnswer`, `budget_chunk`).

With `chunk_cap`, a policy also caps the running chunked prefill as SGLang's
shortest-prefill-first does (`ShortestPrefillFirst.chunk_limit`, over the queue in the
policy's order): room is left in the chunk budget for the shorter requests at the head of
the queue. Live, SGLang applies that cap itself on a server started with
`--schedule-policy shortest-prefill-first` (the plugin's order is the queue it reads).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from twin.policy.base import MAX_PARK, Plan, Policy, Snapshot
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
#: rules that answer with a whole plan: the `deadline` policy's withholding modes
PLAN_RULES = {"deadline": "none", "hold-hopeless": "hopeless", "laxity": "laxity",
              "hold-documents": "documents"}
ALL_RULES = (*RULES, *PLAN_RULES)


@lru_cache(maxsize=64)
def _deadline(mode: str, targets: SloTargets, prefill: tuple) -> Policy:
    from twin.policy.deadline import DeadlinePolicy

    t = targets.to_json()
    return DeadlinePolicy(withhold=mode, **t, **dict(prefill))


def deadline_policy(mode: str, targets: SloTargets, prefill: dict | None = None) -> Policy:
    """The `deadline` policy in withholding `mode` with these targets and prefill model
    (its keyword arguments, `prefill_params`), built once per distinct set."""
    return _deadline(mode, targets, tuple(sorted((prefill or {}).items())))


PREFILL_KEYS = ("s_per_chunk", "s_per_token", "s_per_token_ctx", "chunk")


def prefill_params(values: list | tuple | None) -> dict:
    """The prefill model `[s_per_chunk, s_per_token, s_per_token_ctx, chunk]` (and
    optionally `s_per_ctx_sq`) as the `deadline` policy's keyword arguments ({} for None:
    its defaults)."""
    if values is None:
        return {}
    keys = (*PREFILL_KEYS, "s_per_ctx_sq")  # the square term optional (docs/rl.md)
    if len(values) not in (len(PREFILL_KEYS), len(keys)):
        raise ValueError(f"prefill {values!r}: expected [{', '.join(PREFILL_KEYS)}] or "
                         f"[{', '.join(keys)}]")
    return {k: (int(v) if k == "chunk" else float(v)) for k, v in zip(keys[:len(values)], values, strict=True)}


def check_chunk_answer(answer, where: str = "chunk answer") -> tuple[int, int]:
    """`answer` as `(chunk_tokens, park_steps)`: integers, tokens >= 0 (0: no cap) and park
    in 0..MAX_PARK; ValueError naming `where` otherwise."""
    try:
        tokens, park = answer
    except (TypeError, ValueError):
        tokens = park = None
    if type(tokens) is not int or type(park) is not int or tokens < 0 \
            or not 0 <= park <= MAX_PARK:
        raise ValueError(f"{where} {answer!r}: (chunk_tokens >= 0, park_steps in "
                         f"0..{MAX_PARK})")
    return tokens, park


def parse_budget_answer(text: str, form: str = "SECONDSxPARK", example: str = "0.3x8",
                        shown: str | None = None):
    """`SECONDSxPARK` (e.g. `0.3x8`, the benchmarks' spelling) as a `BudgetAnswer(seconds,
    park)`; ValueError naming `form`, `example` and `shown` (the text as the user wrote
    it)."""
    from twin.policy.deadline import BudgetAnswer

    b, x, park = text.partition("x")
    try:
        seconds = float(b)
    except ValueError:
        seconds = -1.0
    if not (x and park.isdigit() and int(park) <= MAX_PARK and seconds > 0
            and np.isfinite(seconds)):
        raise ValueError(f"a budget chunk answer is {form} with SECONDS > 0 and an integer "
                         f"PARK in 0..{MAX_PARK} (e.g. {example}), not {shown or text!r}")
    return BudgetAnswer(seconds, int(park))


def parse_chunk_answer(text: str):
    """`TOKENSxPARK` (e.g. `256x4`) as `(chunk_tokens, park_steps)`; `SECONDSsxPARK` (e.g.
    `0.3sx8`) as a `BudgetAnswer(seconds, park)`."""
    tokens, x, park = text.partition("x")
    if tokens.endswith("s"):
        return parse_budget_answer(tokens[:-1] + x + park, "SECONDSsxPARK", "0.3sx8",
                                   repr(text))
    if not (x and tokens.isdigit() and park.isdigit()) or int(park) > MAX_PARK:
        raise ValueError(f"a chunk answer is TOKENSxPARK with integers TOKENS >= 0 and "
                         f"PARK in 0..{MAX_PARK} (e.g. 256x4), not {text!r}")
    return int(tokens), int(park)


def menu_entry(entry: str) -> tuple[str, tuple | None]:
    """`(rule, chunk answer)` of a menu entry `RULE`, `RULE@TOKENSxPARK` or
    `RULE@SECONDSsxPARK` (module docstring); ValueError naming the allowed forms."""
    rule, at, answer = entry.partition("@")
    if rule not in ALL_RULES:
        raise ValueError(f"menu entry {entry!r}: the rule must be one of {', '.join(ALL_RULES)}")
    if not at:
        return rule, None
    try:
        return rule, parse_chunk_answer(answer)
    except ValueError as exc:
        raise ValueError(f"menu entry {entry!r}: {exc}") from None


def entry_chunk_answers(menu, default: tuple[int, int] | None) -> list:
    """Each entry's chunk answer: its own (`RULE@TOKENSxPARK`), else `default`."""
    return [menu_entry(m)[1] or default for m in menu]


def check_menu(menu) -> tuple[str, ...]:
    """The menu as a tuple, every entry checked (`menu_entry`)."""
    menu = tuple(menu)
    if not menu:
        raise ValueError("menu: at least one entry")
    for entry in menu:
        menu_entry(entry)
    return menu


def rule_plan(name: str, snap: Snapshot, t: SloTargets, prefill: dict | None = None) -> Plan:
    """The answer of menu rule `name` (an entry: its chunk answer is not an order's
    business) to an order question."""
    if "@" in name:
        name = name.partition("@")[0]
    if name in RULES:
        if len(snap.waiting) < 2:
            return Plan(order=tuple(range(len(snap.waiting))))
        return Plan(order=tuple(RULES[name](snap, t)))
    if name not in PLAN_RULES:
        raise ValueError(f"menu rule {name!r}: allowed values: {', '.join(ALL_RULES)}")
    return deadline_policy(PLAN_RULES[name], t, prefill).decide(snap)


def targets_from(ttft_s: float, tpot_s: float | None, doc_tokens: int,
                 doc_ttft_s_per_token: float, tier_ttft_s: list | None) -> SloTargets:
    return SloTargets(ttft_s, tpot_s, doc_tokens, doc_ttft_s_per_token,
                      tuple((int(a), float(b)) for a, b in (tier_ttft_s or ())))


@register
class MenuPolicy(Policy):
    """One menu rule as a fixed policy (`rule`: any of `ALL_RULES`); the SLO params set
    the deadlines `edf` and the plan rules use (docs/rl.md); `chunk_cap` adds SGLang's spf
    chunk cap; `prefill` the plan rules' prefill model as `[s_per_chunk, s_per_token,
    s_per_token_ctx, chunk]` (None: the users' deployment's)."""

    name = "menu"

    def __init__(self, *, rule: str = "edf", ttft_s: float = 1.5, tpot_s: float = 0.1,
                 doc_tokens: int = 4096, doc_ttft_s_per_token: float = 5e-4,
                 tier_ttft_s: list | None = None, chunk_cap: bool = False,
                 prefill: list | None = None) -> None:
        super().__init__()
        if chunk_cap:
            self.chunk_limit = ShortestPrefillFirst.chunk_limit
        if rule not in ALL_RULES:
            raise ValueError(f"rule {rule!r}: allowed values: {', '.join(ALL_RULES)}")
        self.rule, self.prefill = rule, prefill_params(prefill)
        self.targets = targets_from(ttft_s, tpot_s, doc_tokens, doc_ttft_s_per_token,
                                    tier_ttft_s)

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return True  # spf and the features read fresh prefix matches

    def decide(self, snap: Snapshot) -> Plan:
        if snap.candidate is not None:
            return Plan(victims=())
        return rule_plan(self.rule, snap, self.targets, self.prefill)

    def order(self, snap: Snapshot) -> list[int]:
        return list(self.decide(snap).order)
