"""What one streamed `/generate` call becomes: a record in the twin's schema.

`StreamLog` collects a request's streamed chunks as they arrive (client clock, seconds);
`StreamLog.record()` turns them into a `twin.metrics.RECORD_FIELDS` record. Pure: no I/O,
no clock, so the arithmetic is tested offline.

Timing comes from the client: TTFT is the first chunk carrying a token minus the send
time, E2E the last chunk minus the send time. SGLang's chunks carry a cumulative
`completion_tokens` and no per-token timestamps, so per-token gaps (`itl_s`) come from
chunk arrival: a chunk that brings k > 1 new tokens (the server's `--stream-interval`, or
a client that read two chunks in one go) contributes its gap to the previous chunk
followed by k - 1 zero gaps, which keeps `len(itl_s) == output_tokens - 1` and the sum of
the gaps equal to E2E - TTFT. `cached_tokens`, `queue_time` (-> `queue_s`) and
`num_retractions` (-> `retractions`) are the server's own, from the last `meta_info`.
SGLang reports no per-request preemption count: `preemptions` is 0 in live records
(priority preemptions that send a request back to the queue show up in `retractions`
only if SGLang counts them there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from twin.workload import Request


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


@dataclass
class StreamLog:
    """One request on the wire. Times are client-clock seconds (any monotonic origin)."""

    request: Request
    arrival_s: float  # send time relative to the start of the replay
    sent_at: float  # send time on the client clock
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    meta: dict = field(default_factory=dict)  # the last meta_info seen
    finished_at: float | None = None
    status: str | None = None  # set on failure or abort; None means "judge from the stream"
    error: str | None = None

    def on_chunk(self, t: float, meta: object) -> None:
        """A `data:` chunk arrived at `t`; its `meta_info` has the cumulative token count.
        `ValueError` (and the chunk ignored) when the meta_info is not what SGLang sends:
        see `meta_problem`."""
        problem = meta_problem(meta, len(self.token_times), self.request.output_tokens)
        if problem:
            raise ValueError(problem)
        assert isinstance(meta, dict)
        self.meta = meta
        done = meta.get("completion_tokens") or 0
        new = done - len(self.token_times)
        if new > 0:
            self.token_times.extend([t] * new)  # zero gaps after the first: see module doc
        self.finished_at = t

    @property
    def done(self) -> bool:
        return self.status is not None or bool(self.meta.get("finish_reason"))

    def fail(self, status: str, error: str) -> None:
        if self.status is None:
            self.status, self.error = status, error

    def outcome(self) -> tuple[str, str | None]:
        """(status, error): failures as set; otherwise judged from the finish reason."""
        if self.status is not None:
            return self.status, self.error
        reason = self.meta.get("finish_reason")
        if not self.token_times or reason is None:
            return "failed", "the stream ended without a finished response"
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return "aborted", f"aborted by the server: {reason.get('message') or reason}"
        wanted = self.request.output_tokens
        if len(self.token_times) != wanted:
            return "failed", f"{len(self.token_times)} output tokens, {wanted} requested"
        return "ok", None

    def record(self) -> dict:
        status, error = self.outcome()
        times = self.token_times
        ttft = times[0] - self.sent_at if times else None
        ok = status == "ok"
        e2e = (self.finished_at - self.sent_at) if ok and self.finished_at is not None else None
        n_out = len(times)
        meta = self.meta
        queue = meta.get("queue_time")
        rec = {
            "rid": self.request.rid,
            "arrival_s": _r(self.arrival_s),
            "prompt_tokens": int(meta.get("prompt_tokens") or self.request.prompt_tokens),
            "cached_tokens": int(meta.get("cached_tokens") or 0),
            "output_tokens": n_out,
            "priority": self.request.priority,
            "ttft_s": _r(ttft),
            "tpot_s": _r((e2e - ttft) / (n_out - 1)) if ok and e2e is not None and n_out > 1
            else None,
            "itl_s": [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)],
            "e2e_s": _r(e2e),
            "queue_s": _r(queue) if queue is not None else None,
            "retractions": int(meta.get("num_retractions") or 0),
            "preemptions": 0,
            "status": status,
            "error": error,
        }
        # Which replica served it, when the server labels itself: a servetwin fleet starts
        # each worker with `--weight-version replica-N`, which SGLang echoes in meta_info.
        # After the shared schema's fields, like the twin's own extras.
        replica = replica_label(meta.get("weight_version"))
        if replica is not None:
            rec["replica"] = replica
        return rec


# meta_info fields the record is built from: counts (integers >= 0) and seconds (finite, >= 0)
_COUNTS = ("completion_tokens", "prompt_tokens", "cached_tokens", "num_retractions")
_SECONDS = ("queue_time",)


def meta_problem(meta: object, have: int, wanted: int) -> str | None:
    """Why a chunk's `meta_info` cannot be SGLang's, or None: not an object, a count that
    is not a non-negative integer, a time that is not a finite non-negative number, a
    cumulative token count that goes down or beyond the `wanted` tokens (`ignore_eos`
    makes the output exactly `max_new_tokens`)."""
    if not isinstance(meta, dict):
        return f"meta_info is {_show(meta)}, not a JSON object"
    for key in _COUNTS:
        v = meta.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"meta_info.{key} is {_show(v)}, not a count"
    for key in _SECONDS:
        v = meta.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and math.isfinite(v) and v >= 0):
            return f"meta_info.{key} is {_show(v)}, not a time in seconds"
    done = meta.get("completion_tokens") or 0
    if done < have:
        return f"meta_info.completion_tokens went down from {have} to {done}"
    if done > wanted:
        return f"meta_info.completion_tokens {done} is more than the {wanted} requested"
    reason = meta.get("finish_reason")
    if reason is not None and not isinstance(reason, (dict, str)):
        return f"meta_info.finish_reason is {_show(reason)}"
    return None


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


REPLICA_LABEL = "replica-"


def replica_label(weight_version: object) -> str | None:
    """The replica name a fleet worker reports in `meta_info.weight_version`, else None."""
    if isinstance(weight_version, str) and weight_version.startswith(REPLICA_LABEL):
        return weight_version
    return None
