"""The plugin's adapter from SGLang 0.5.23's `Req` to the policy's frozen `RequestView`
(the twin's is `twin.views`). Duck-typed: it reads attributes and imports nothing of
SGLang, so the benchmark and tests can hand it any object with the same fields.

Clock: SGLang stamps `time_stats` with `time.perf_counter()` (on Linux the same clock as
`time.monotonic()`), so the plugin's `Snapshot.now` is `time.perf_counter()` too.
"""

from __future__ import annotations

from twin.policy.base import CLIP_MAX_NEW_TOKENS, IN_BATCH_CHECK_THRESHOLD, RequestView, reservation


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


class WaitingViews:
    """Views of waiting requests kept across passes: a waiting request's view is rebuilt
    only when a field it reads can have changed (its prefix match, its queue entry, its
    outputs after a retraction, its priority). Holds only the requests of the last queue
    it was asked about, so finished requests are not kept alive."""

    def __init__(self) -> None:
        self._known: dict[int, tuple] = {}

    def of(self, queue, ratio: float) -> tuple[RequestView, ...]:
        known, fresh, out = self._known, {}, []
        for r in queue:
            key = (r.prefix_len, r.time_stats.wait_queue_entry_time, len(r.output_ids),
                   r.priority)
            hit = known.get(id(r))
            if hit is None or hit[0] is not r or hit[1] != key:
                hit = (r, key, req_view(r, False, ratio))
            fresh[id(r)] = hit
            out.append(hit[2])
        self._known = fresh
        return tuple(out)
