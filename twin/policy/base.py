"""The policy contract shared by the twin and the live SGLang engine.

A scheduling pass asks a policy one of two questions, each from a frozen `Snapshot`:

- *order* (`snap.candidate is None`): the order in which the waiting requests are offered
  for admission, as a permutation of `range(len(snap.waiting))` (SGLang's
  `SchedulePolicy.calc_priority`);
- *preempt* (`snap.candidate` is the index of a waiting request that found no request
  slot): which running requests to preempt for it, as distinct indices into
  `snap.running`, `()` for none (SGLang's `PrefillAdder.preempt_to_schedule`).

The answer is a `Plan`. A policy with `chunks = True` is also asked a third question,
*chunk*, once per chunk of a prompt prefilled in chunks, when that chunk is due
(`Policy.chunk`): how large the chunk may be and how many decode-only passes run first.
The answer is a `ChunkPlan` (SGLang: `SchedulePolicy.shortest_prefill_chunk_limit` for
the size; a parked chunk and a withheld queue for the decode-only passes). Requests are seen as `RequestView`s: immutable values that an
adapter on each side builds (`twin.views` from the twin's `SimRequest`, the runtime plugin
from SGLang's `Req`), holding only what both engines have. Nothing here knows a clock, a
process or an engine: a policy is a pure function of the snapshot and its own parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: SGLang's CLIP_MAX_NEW_TOKENS (schedule_policy.py): the future tokens a reservation counts
CLIP_MAX_NEW_TOKENS = 4096
#: SGLang's WAITING_QUEUE_PREFIX_MATCH_MAX: lpm and hrrn fall back to fcfs above this
PREFIX_MATCH_MAX_QUEUE = 128
#: IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD / _DEPRIORITIZE_THRESHOLD (both 32 by default)
IN_BATCH_CHECK_THRESHOLD = 32
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32


def reservation(max_new_tokens: int, generated_tokens: int, ignore_eos: bool,
                new_token_ratio: float) -> float:
    """The future KV tokens SGLang reserves for a running request
    (`PrefillAdder._get_running_request_total_token_offset`): its remaining tokens clipped
    at 4096, times 1.0 for an `ignore_eos` request (a fixed length cannot end early) and
    `new_token_ratio` otherwise."""
    ratio = 1.0 if ignore_eos else new_token_ratio
    return min(max_new_tokens - generated_tokens, CLIP_MAX_NEW_TOKENS) * ratio


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy may read of a request. Every field exists on SGLang's `Req` too.

    `prefix_len` is fresh for waiting requests only when the policy asks for prefix
    matching (`Policy.wants_prefix_match`), as in SGLang. `head` identifies the first 32
    tokens of the request's fill (prompt plus outputs) so that policies can tell waiting
    requests that share them (SGLang's in-batch prefix check); None when the fill is
    shorter. `prefix_path` is the chain of radix-cache node ids from the root to the node
    the request's prefix match ended on (dfs-weight); `()` when unmatched or unknown.
    """

    rid: str
    priority: int = 0
    arrival_s: float = 0.0  # when the scheduler received it
    queue_entry_s: float = 0.0  # when it (re-)entered the waiting queue
    prompt_tokens: int = 0
    prefix_len: int = 0  # tokens matched in the prefix cache
    max_new_tokens: int = 0
    generated_tokens: int = 0
    ignore_eos: bool = True
    reserved_tokens: float = 0.0  # running: `reservation(...)`; waiting: 0
    first_token_s: float | None = None  # when its first token came out
    round_start_s: float | None = None  # when it last entered the running batch (running)
    arrival_work: int = 0  # the pass's `processed_tokens` when it entered the queue (hrrn)
    head: int | None = None
    prefix_path: tuple[int, ...] = ()

    @property
    def fill_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def uncached(self) -> int:
        return max(0, self.prompt_tokens - self.prefix_len)


class ViewSequence(Sequence):
    """A snapshot's waiting or running views built on their first read (an engine's
    `Snapshot.waiting`/`.running` may be one): a subclass holds the requests in `_reqs`
    and builds their views in `views()`. Its length needs no view; it compares and hashes
    as the tuple of its views, so a policy sees a tuple."""

    __slots__ = ("_reqs",)

    def views(self) -> tuple[RequestView, ...]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):
        return self.views()[i]

    def __iter__(self):
        return iter(self.views())

    def __eq__(self, other) -> bool:
        return self.views() == (other.views() if isinstance(other, ViewSequence) else other)

    def __hash__(self) -> int:
        return hash(self.views())

    def __repr__(self) -> str:
        return repr(self.views())


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The server as one scheduling pass sees it. `now` is in seconds on the engine's
    scheduling clock (simulated time in the twin; the plugin's clock live);
    `processed_tokens` counts prefill tokens computed so far (SGLang's
    `processed_tokens_counter`, hrrn's clock). For a *preempt* question, `candidate` is the
    waiting index of the request that needs room and `tokens_needed` what SGLang's
    `preempt_to_schedule` must free for it (<= 0 when only a request slot is missing: one
    victim is then enough)."""

    now: float
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    kv_free: int = 0
    kv_evictable: int = 0
    kv_capacity: int = 0
    new_token_ratio: float = 0.7
    max_running_requests: int = 0
    processed_tokens: int = 0
    candidate: int | None = None
    tokens_needed: float = 0.0

    @property
    def question(self) -> str:
        return "order" if self.candidate is None else "preempt"


@dataclass(frozen=True, slots=True)
class Plan:
    """A policy's answer: `order` for an order question, `victims` for a preempt one.
    `admit` (order questions only) withholds admission: at most the first `admit`
    requests of the order may be admitted in this pass, the rest wait for a later pass
    (None: no limit, SGLang's own behaviour). A plan must not withhold everything from a
    server with nothing running (`admit` >= 1 then), so that an idle server always
    serves."""

    order: tuple[int, ...] | None = None
    victims: tuple[int, ...] = field(default=())
    admit: int | None = None


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """A policy's answer to a chunk question. `limit` caps the chunk's new tokens (None:
    SGLang's own budget; otherwise at least one page). `park` asks for that many
    decode-only passes before the chunk runs: in each, the chunked request sits out and no
    waiting request is admitted, so the running requests decode one step (as SGLang does
    when a pass builds no prefill batch); honoured only while something is decoding, so a
    chunk is never held on an idle server. The chunk then runs with `limit`, and the next
    chunk is a new question."""

    limit: int | None = None
    park: int = 0


#: the most decode-only passes one chunk question may ask for
MAX_PARK = 256


class Policy:
    """Base policy: keep the queue as it is, never preempt.

    Subclasses override `order` and/or `victims`; parameters are keyword arguments of
    `__init__` with defaults (the spec loader checks names and types against them)."""

    name = "base"
    #: the SGLang `--schedule-policy` this one reproduces (the live engine runs it natively)
    sglang_name: str | None = None
    #: the scheduler re-evaluates at least this often (seconds), not only on events
    time_slice_s: float | None = None
    #: also asked for victims when a request finds no KV room (SGLang asks only when
    #: request slots run out; the users' design preempts for memory too)
    preempts_for_kv = False
    #: asked `chunk` questions (twin and plugin); the base answers SGLang's own chunk
    chunks = False

    def __init__(self, *, priority_scheduling: bool = False, low_values_first: bool = False,
                 preemption_threshold: int = 10) -> None:
        self.priority_scheduling = priority_scheduling
        self.low_values_first = low_values_first
        self.sign = 1 if low_values_first else -1  # sort key multiplier: high first
        self.threshold = preemption_threshold

    @property
    def preempts(self) -> bool:
        """Whether `victims` may ever name a running request."""
        return self.priority_scheduling

    def wants_prefix_match(self, n_waiting: int) -> bool:
        """Whether the engine must refresh waiting requests' `prefix_len` before `order`."""
        return False

    def decide(self, snap: Snapshot) -> Plan:
        if snap.candidate is None:
            return Plan(order=tuple(self.order(snap)))
        return Plan(victims=tuple(self.victims(snap)))

    def chunk(self, snap: Snapshot, chunked: RequestView, budget: int,
              page_size: int) -> ChunkPlan:
        """The chunk question (`chunks = True` only): `snap` is the pass as an order
        question sees it (its waiting queue and its running batch),
        `chunked` the request whose next chunk is due (`prefix_len` = its tokens computed
        so far; in neither tuple), `budget` the server's chunked prefill size. Also asked
        of a prompt's first chunk, when admission would cut a waiting request: then
        `chunked` is still in `snap.waiting` (`prefix_len` its cached prefix) and only
        `limit` applies (the pass ends with that chunk; `park` is ignored). The base:
        SGLang's own chunk, no parking."""
        return ChunkPlan()

    def keeps_queue_order(self) -> bool:
        """Whether every answer to an order question is the queue as it is, with no
        admission limit: the base's `order` and `decide` without priority scheduling
        (SGLang's fcfs, whose `calc_priority` returns at once). An engine may then skip
        the question, and the snapshot it would be asked from: the answer is the same."""
        cls = type(self)
        return (not self.priority_scheduling and cls.order is Policy.order
                and cls.decide is Policy.decide)

    def sort_key(self) -> Callable[[RequestView], Any] | None:
        """The policy's order as a key over one request's view, when its order is a stable
        sort of the queue by such a key (it reads the request alone, not the pass's time
        or the rest of the queue); None otherwise. Then `order` is `keyed_order` with it,
        and the plugin may keep each waiting request's key across passes instead of
        asking `order` (the same code, the same answer; docs/plugin.md)."""
        if self.priority_scheduling and type(self).order is Policy.order:
            return self._priority_key()
        return None

    def _priority_key(self) -> Callable[[RequestView], Any]:
        sign = self.sign
        return lambda r: (sign * r.priority, r.queue_entry_s)

    def order(self, snap: Snapshot) -> list[int]:
        if not self.priority_scheduling:
            return list(range(len(snap.waiting)))
        return keyed_order(snap.waiting, self._priority_key())

    def victims(self, snap: Snapshot) -> list[int]:
        """SGLang 0.5.23's priority preemption: running requests by lowest priority, then
        newest queue entry; each whose priority is lower than the candidate's by more than
        the threshold is taken and credited with its future reservation, until the
        candidate's need is met; the first one that does not qualify ends the search.
        None if they cannot free enough."""
        if not self.priority_scheduling or snap.candidate is None:
            return []
        return priority_victims(snap, self.sign, self.threshold)


def keyed_order(waiting, key: Callable[[RequestView], Any]) -> list[int]:
    """Indices of `waiting` sorted (stably) by `key` of each view."""
    keys = list(map(key, waiting))
    return sorted(range(len(keys)), key=keys.__getitem__)


def priority_victims(snap: Snapshot, sign: int, threshold: float) -> list[int]:
    cand = snap.waiting[snap.candidate]
    r = snap.running
    order = sorted(range(len(r)), key=lambda i: (-sign * r[i].priority, -r[i].queue_entry_s))
    chosen, need = [], snap.tokens_needed
    for i in order:
        if (cand.priority - r[i].priority) * -sign > threshold:
            chosen.append(i)
            need -= r[i].reserved_tokens
            if need <= 0:
                break
        else:
            break
    return chosen if chosen and need <= 0 else []
