"""Scheduling policies shared by the simulator and the live SGLang engine.

Pure Python: no simpy, no sglang, no clock. A policy sees requests through `RequestView`,
the attributes both the twin's requests and SGLang's `Req` (through the runtime plugin's
adapter) expose, and answers two questions:

- `order(snapshot)`: the order in which waiting requests are offered for admission
  (SGLang's `SchedulePolicy.calc_priority`);
- `victims(snapshot, candidate, tokens_needed)`: which running requests to preempt so that
  `candidate` can be admitted (SGLang's `PrefillAdder.preempt_to_schedule`); `[]` = none.

Policies are registered by name (`register`); `make_policy` builds one from the server
arguments. The SGLang policies implemented: `fcfs`, `lpm` (falls back to fcfs above 128
waiting requests), `lof`, and priority scheduling on top of fcfs/lof.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

LPM_FALLBACK_QUEUE_LEN = 128


class RequestView(Protocol):
    """What a policy may read of a request (all fields exist on SGLang's `Req` too)."""

    rid: str
    priority: int
    arrival_s: float  # when the server received it
    queue_entry_s: float  # when it (re-)entered the waiting queue
    prompt_tokens: int
    prefix_len: int  # tokens matched in the prefix cache (valid when the policy asks for it)
    max_new_tokens: int
    generated_tokens: int
    tokens_held: int  # KV tokens it holds plus its reserved future tokens (running only)
    first_token_s: float | None  # when its first token came out (None before)
    round_start_s: float | None  # when it last entered the running batch (running only)


@dataclass(frozen=True)
class Snapshot:
    now: float
    waiting: Sequence[RequestView]
    running: Sequence[RequestView]
    kv_free: int
    kv_capacity: int


class Policy:
    """Base policy: keep the queue as it is, never preempt."""

    name = "base"
    #: the replica fills `prefix_len` of waiting requests before `order` when this is true
    needs_prefix_match = False
    #: the scheduler re-evaluates at least this often (seconds), not only on events
    time_slice_s: float | None = None

    @property
    def preempts(self) -> bool:
        """Whether `victims` may ever name a running request."""
        return self.priority_scheduling

    def __init__(self, priority_scheduling: bool = False, low_values_first: bool = False,
                 preemption_threshold: int = 10) -> None:
        self.priority_scheduling = priority_scheduling
        self.sign = 1 if low_values_first else -1  # sort key multiplier: high first
        self.threshold = preemption_threshold

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return self.needs_prefix_match

    def order(self, snap: Snapshot) -> list[int]:
        if not self.priority_scheduling:
            return list(range(len(snap.waiting)))
        w = snap.waiting
        return sorted(range(len(w)), key=lambda i: (self.sign * w[i].priority,
                                                    w[i].queue_entry_s))

    def victims(self, snap: Snapshot, candidate: RequestView, tokens_needed: int) -> list[int]:
        """SGLang's priority preemption: running requests whose priority is lower than the
        candidate's by more than the threshold, lowest priority then newest first, as
        many as free `tokens_needed`; none if they cannot."""
        if not self.priority_scheduling:
            return []
        r = snap.running
        order = sorted(range(len(r)), key=lambda i: (-self.sign * r[i].priority,
                                                     -r[i].queue_entry_s))
        chosen, need = [], tokens_needed
        for i in order:
            if need <= 0:
                break
            gap = (candidate.priority - r[i].priority) * -self.sign
            if gap > self.threshold:
                chosen.append(i)
                need -= r[i].tokens_held
        return chosen if chosen and need <= 0 else []


PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


@register
class FCFS(Policy):
    """First come, first served (SGLang's default): the queue order is arrival order."""

    name = "fcfs"


@register
class LOF(Policy):
    """Longest output first: most `max_new_tokens` first."""

    name = "lof"

    def order(self, snap: Snapshot) -> list[int]:
        w = snap.waiting
        if self.priority_scheduling:
            return sorted(range(len(w)), key=lambda i: (self.sign * w[i].priority,
                                                        -w[i].max_new_tokens))
        return sorted(range(len(w)), key=lambda i: -w[i].max_new_tokens)


@register
class LPM(Policy):
    """Longest prefix match first; FCFS when more than 128 requests wait (as SGLang)."""

    name = "lpm"
    needs_prefix_match = True

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return n_waiting <= LPM_FALLBACK_QUEUE_LEN

    def order(self, snap: Snapshot) -> list[int]:
        w = snap.waiting
        if len(w) > LPM_FALLBACK_QUEUE_LEN:
            return list(range(len(w)))
        return sorted(range(len(w)), key=lambda i: -w[i].prefix_len)


@register
class Priority(FCFS):
    """FCFS with SGLang's `--enable-priority-scheduling` always on."""

    name = "priority"

    def __init__(self, priority_scheduling: bool = True, **kw) -> None:
        super().__init__(True, **kw)


def make_policy(name: str, *, priority_scheduling: bool = False, low_values_first: bool = False,
                preemption_threshold: int = 10) -> Policy:
    if name not in _REGISTRY:
        raise ValueError(f"policy {name!r}: allowed values: {', '.join(policy_names())}")
    return _REGISTRY[name](priority_scheduling=priority_scheduling,
                           low_values_first=low_values_first,
                           preemption_threshold=preemption_threshold)


from twin.policy import slices as _slices  # noqa: E402,F401  (registers "slices")
