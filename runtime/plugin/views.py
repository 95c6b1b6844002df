"""The plugin's adapter from SGLang 0.5.23's `Req` to the policy's frozen `RequestView`
(the twin's is `twin.views`). Duck-typed: it reads attributes and imports nothing of
SGLang, so the benchmark and tests can hand it any object with the same fields.

Clock: SGLang stamps `time_stats` with `time.perf_counter()` (on Linux the same clock as
`time.monotonic()`), so the plugin's `Snapshot.now` is `time.perf_counter()` too.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, itemgetter

from twin.policy.base import (
    CLIP_MAX_NEW_TOKENS,
    IN_BATCH_CHECK_THRESHOLD,
    RequestView,
    ViewSequence,
    reservation,
)


def head_of(req) -> int | None:
    """An id of the first 32 tokens of the request's fill (prompt plus outputs), as
    SGLang's in-batch prefix check compares them; None when the fill is shorter. Python's
    hash of a tuple of ints does not depend on PYTHONHASHSEED, so it is stable across
    processes (the decision log is replayed elsewhere)."""
    ids = req.origin_input_ids
    n = IN_BATCH_CHECK_THRESHOLD
    if len(ids) >= n:
        return hash(tuple(ids[:n]))
    out = req.output_ids
    if len(ids) + len(out) < n:
        return None
    return hash(tuple(ids) + tuple(out[:n - len(ids)]))


def req_view(req, running: bool, new_token_ratio: float) -> RequestView:
    ts = req.time_stats
    sp = req.sampling_params
    generated = len(req.output_ids)
    first = getattr(ts, "prefill_finished_time", 0.0)
    round_start = getattr(ts, "last_forward_entry_time", 0.0) if running else 0.0
    return RequestView(
        rid=req.rid,
        priority=req.priority or 0,
        arrival_s=getattr(ts, "scheduler_recv_time", 0.0) or getattr(ts, "created_time", 0.0),
        queue_entry_s=ts.wait_queue_entry_time,
        prompt_tokens=len(req.origin_input_ids),
        prefix_len=req.prefix_len,
        max_new_tokens=sp.max_new_tokens,
        generated_tokens=generated,
        ignore_eos=bool(sp.ignore_eos),
        reserved_tokens=reservation(sp.max_new_tokens, generated, bool(sp.ignore_eos),
                                    new_token_ratio) if running else 0.0,
        first_token_s=first or None,
        round_start_s=round_start or None,
        arrival_work=getattr(req, "arrival_processed_tokens", 0),
        head=None if running else head_of(req),  # only waiting requests are compared
    )


def views(reqs, running: bool, new_token_ratio: float) -> tuple[RequestView, ...]:
    return tuple(req_view(r, running, new_token_ratio) for r in reqs)


def tokens_needed(adder, req) -> float:
    """What SGLang 0.5.23's `PrefillAdder.preempt_to_schedule` must free for `req`
    (its `min_tokens_to_remove` before any victim is credited); may be negative."""
    return float(len(req.full_untruncated_fill_ids) - req.prefix_len
                 + min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                 + adder._request_slot_reserve_for_req(req) - adder.rem_total_tokens)


def preemptible_running(adder) -> list:
    """The running requests SGLang's `preempt_to_schedule` may take, in batch order: not
    already preempted in this pass and not finished (a finished one's KV is already
    freed; releasing it again would double-free)."""
    return [r for r in adder.running_batch.reqs
            if r not in adder.preempt_list and not r.finished()]


class LazyViews(ViewSequence):
    """An immutable sequence of the views of `reqs`, built on first use: an order question
    of most policies never reads the running batch, and 16 running views cost more than
    SGLang's whole sort of 256 waiting requests. Built within the pass that made it (the
    order question, its log line, this pass's preempt questions), before anything a view
    reads changes; compares equal to the tuple of its views."""

    __slots__ = ("_running", "_ratio", "_views", "_by_id")

    def __init__(self, reqs, running: bool, new_token_ratio: float) -> None:
        self._reqs = tuple(reqs)
        self._running, self._ratio = running, new_token_ratio
        self._views: tuple[RequestView, ...] | None = None
        self._by_id: dict[int, RequestView] | None = None

    def views(self) -> tuple[RequestView, ...]:
        if self._views is None:
            self._views = views(self._reqs, self._running, self._ratio)
        return self._views

    def view_of(self, req) -> RequestView | None:
        """The view of `req` (by identity), None when it is not one of these requests."""
        if self._by_id is None:  # ids are unique: self._reqs holds every request alive
            self._by_id = dict(zip(map(id, self._reqs), self.views(), strict=True))
        return self._by_id.get(id(req))


#: what a waiting request's view reads that can change while the same `Req` waits: its
#: prefix match and its queue entry. SGLang stamps `wait_queue_entry_time` with a fresh
#: `perf_counter()` at every (re-)entry (`_add_request_to_queue`, also for retracted and
#: preempted requests), and sets the priority, `arrival_processed_tokens` and (from a run)
#: the outputs only then, so the stamp covers them; each field more costs ~10 µs at 256.
_STALENESS = attrgetter("prefix_len", "time_stats.wait_queue_entry_time")
_STALE, _VIEW, _SORT_KEY = itemgetter(0), itemgetter(1), itemgetter(2)
_MISS = (None, None, None)  # (staleness, view, sort key) of a request not seen yet


class WaitingViews:
    """Views of waiting requests kept across passes (and, for a policy whose order is a
    sort key, each one's key), rebuilt only when a field they read can have changed.

    Two ways to know: *checked* reads `_STALENESS` of every waiting request at every pass
    (two attribute reads each, ~30 µs at 256); *tracked* trusts `forget`: in SGLang 0.5.23
    a waiting request's fields change only when the prefill loop examines it
    (`init_next_round_input`, then `PrefillAdder.add_one_req`, whose hook forgets it), when
    it leaves the queue and comes back (it was admitted by `add_one_req` first), or when
    `calc_priority` matches prefixes (a cache-aware policy or a fast-matching cache: those
    passes are checked). The runtime decides per pass which applies (`PluginRuntime`).

    The hot path is a few C-level passes over the queue (a dict lookup by `Req`, one
    membership test), not a Python loop. Holds the requests it has seen (the dict's keys),
    so an id is never reused while cached; ones no longer waiting are let go when the dict
    outgrows the queue."""

    def __init__(self, sort_key=None) -> None:
        self._known: dict = {}  # Req -> (staleness, view, sort key)
        self._sort_key = sort_key

    def forget(self, req) -> None:
        self._known.pop(req, None)

    def clear(self) -> None:
        self._known.clear()

    def entries(self, queue, checked: bool) -> list:
        """`(staleness, view, sort key)` of every request in `queue`, in its order."""
        got = list(map(self._known.get, queue, repeat(_MISS)))
        if checked:
            keys = list(map(_STALENESS, queue))
            if list(map(_STALE, got)) != keys:
                self._refresh(queue, got, keys)
        elif _MISS in got:
            self._refresh(queue, got, None)
        return got

    def of(self, queue, checked: bool = True) -> tuple[RequestView, ...]:
        """The views of `queue` (a waiting view reserves nothing: no `new_token_ratio`)."""
        return tuple(map(_VIEW, self.entries(queue, checked)))

    def _refresh(self, queue, got: list, keys: list | None) -> None:
        """Rebuild the entries that are stale (`keys` given: checked) or missing."""
        known, key = self._known, self._sort_key
        if keys is None:
            todo = [i for i, hit in enumerate(got) if hit is _MISS]
        else:
            todo = [i for i, (hit, k) in enumerate(zip(got, keys, strict=True))
                    if hit[0] != k]
        for i in todo:
            r = queue[i]
            view = req_view(r, False, 0.0)
            stale = keys[i] if keys is not None else _STALENESS(r)
            got[i] = known[r] = (stale, view, key(view) if key is not None else None)
        if len(known) > 2 * len(queue) + 64:  # let go of the ones no longer waiting
            self._known = dict(zip(queue, got, strict=True))


def sort_keys(entries: list) -> list:
    return list(map(_SORT_KEY, entries))


def entry_views(entries: list) -> tuple[RequestView, ...]:
    return tuple(map(_VIEW, entries))
