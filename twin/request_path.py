"""SGLang's request path outside the scheduler, as a client sees it.

On the way in, a request goes through the HTTP server and the tokenizer manager, one
process that handles requests one after another (tokenizing the prompt when it came as
text), then over ZMQ to the scheduler, which takes it in between forward steps. On the
way out, each step's tokens go through the detokenizer and the tokenizer manager to the
client's stream. So requests sent together reach the scheduler one by one, `service_s`
apart, and a closed-loop client sends its next request only when the last one's final
chunk has arrived, `egress_s` after the step that produced it.

`RequestPath` holds the costs; `Tokenizer` is the tokenizer manager's queue (first come,
first served, one at a time). The costs are CPU work on the server's host, measured on
the CPU harness (`benchmarks/request_path.py`); the twin uses them on every GPU unless a
calibration profile brings its own (`servetwin calibrate` fits them from SGLang's
tokenizer stamps: calibration/profiles.py `tokenizer_costs`; `from_profile`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twin.inputs import NON_NEGATIVE, check


@dataclass(frozen=True)
class RequestPath:
    """Seconds outside the scheduler. `per_request_s + per_token_s x prompt tokens` is the
    tokenizer manager's serial time per request; `latency_s` the rest of the way in
    (HTTP, ZMQ), not serial; `egress_s` from a step's end to the client."""

    per_request_s: float = 0.0
    per_token_s: float = 0.0
    latency_s: float = 0.0
    egress_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_token_s", "latency_s", "egress_s"):
            check(f"request path {name}", getattr(self, name), NON_NEGATIVE)

    @property
    def off(self) -> bool:
        return not (self.per_request_s or self.per_token_s or self.latency_s
                    or self.egress_s)

    def service_s(self, prompt_tokens: int) -> float:
        return self.per_request_s + self.per_token_s * prompt_tokens


OFF = RequestPath()
# Measured on the CPU harness (SGLang 0.5.23; benchmarks/request_path.py, docs/calibration.md),
# 2026-12-01 13:23 UTC under a load average of about 15 (other jobs): the tokenizer manager's
# gaps between dispatches of bursts of prompts sent as text, as bench_serving sends them
# (4.53 ms + 4.14 us per token; as input_ids 0.24 ms + 4.29 us); the rest of the way in
# (HTTP, ZMQ) is a lone request's ingress (3.2 ms: forward stamps of a calibration profile)
# less its service; egress is the fidelity profile's median (2.1 ms).
SGLANG_0_5_23 = RequestPath(per_request_s=4.53e-3, per_token_s=4.14e-6, latency_s=2.9e-3,
                            egress_s=2.1e-3)


COST_KEYS = ("per_request_s", "per_token_s", "latency_s")


def from_profile(profile: dict, where: str) -> RequestPath | None:
    """The request path a calibration profile measured (`servetwin calibrate`: its
    `request_path` section's tokenizer costs, latency and median egress), or None when
    it has no tokenizer costs (a profile of an older calibrate: the fitted step time then
    runs without a path, as before). `where` names the file in errors."""
    from twin.errors import ConfigError

    rp = profile.get("request_path")
    if not isinstance(rp, dict) or "per_request_s" not in rp:
        return None
    vals = {}
    for key in (*COST_KEYS, "egress_s"):
        v = rp.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 10:
            raise ConfigError(f"--calibration {where}: request_path.{key}={v!r}: must be "
                              "seconds in [0, 10)")
        vals[key] = float(v)
    return RequestPath(**vals)


class Tokenizer:
    """The tokenizer manager's queue: one request at a time, in the order they were sent."""

    def __init__(self, path: RequestPath) -> None:
        self.path = path
        self.free_at = 0.0

    def arrival(self, sent: float, prompt_tokens: int) -> float:
        """When a request sent at `sent` reaches the scheduler."""
        return self.arrivals((sent,), (prompt_tokens,))[0]

    def arrivals(self, sent: Sequence[float], prompt_tokens: Sequence[int]) -> list[float]:
        """`arrival` of each request in turn, in one loop (an open loop releases a day's
        requests at once)."""
        p, free, out = self.path, self.free_at, []
        add = out.append
        for s, n in zip(sent, prompt_tokens, strict=True):
            start = free if free > s else s  # max(s, free)
            free = start + (p.per_request_s + p.per_token_s * n)  # (service_s(n), inline)
            add(free + p.latency_s)
        self.free_at = free
        return out


def client_view(records: list[dict], path: RequestPath) -> list[dict]:
    """Records as the client sees them: every token `egress_s` later (TTFT and E2E grow by
    it; gaps between tokens do not change)."""
    if not path.egress_s:
        return records
    out = []
    for rec in records:
        rec = dict(rec)
        for key in ("ttft_s", "e2e_s"):
            if rec.get(key) is not None:
                rec[key] = round(rec[key] + path.egress_s, 6)
        out.append(rec)
    return out


@dataclass(frozen=True)
class OutputPath:
    """SGLang's way out as two single servers in a row, each taking one message per
    scheduler step (the step's requests that got a token) first come, first served: the
    detokenizer (`event_loop`: one `BatchTokenIDOutput` at a time) and the tokenizer
    manager (`handle_loop` -> `_handle_batch_output`, which walks the message request by
    request and every `batch_notify_size` = 16 requests wakes their stream handlers and
    yields to them, so each handler writes its chunk while the message is handled: from 16
    requests on, a tokenizer manager slower than the step does not coalesce steps, it
    falls behind; below 16 nothing yields between queued messages and the handlers take
    two or more steps a chunk, measured live, which is not modelled: the cost there is
    small). Seconds per message and per request in it; the client sees a message's tokens
    when the tokenizer manager reaches the message's mean request. Not in the twin's
    default run: a post-process of records (`through_output_path`), for the question of
    docs/calibration.md `serving-points:output-path`."""

    detok_per_message_s: float = 0.0
    detok_per_request_s: float = 0.0
    tm_per_message_s: float = 0.0
    tm_per_request_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("detok_per_message_s", "detok_per_request_s", "tm_per_message_s",
                     "tm_per_request_s"):
            check(f"output path {name}", getattr(self, name), NON_NEGATIVE)

    def visible(self, sent: list[float], counts: list[int]) -> tuple[list[float], float]:
        """When the client sees the tokens of each message (`sent`: the step ends, in
        order; `counts`: requests in each), and the tokenizer manager's busy seconds."""
        free_d = free_t = busy = 0.0
        out = []
        for t, n in zip(sent, counts, strict=True):
            free_d = max(t, free_d) + self.detok_per_message_s + self.detok_per_request_s * n
            start = max(free_d, free_t)
            cost = self.tm_per_message_s + self.tm_per_request_s * n
            free_t, busy = start + cost, busy + cost
            out.append(start + self.tm_per_message_s + self.tm_per_request_s * (n + 1) / 2)
        return out, busy


def token_times(rec: dict) -> list[float]:
    """A record's token times on the server's clock (arrival + TTFT, then the gaps)."""
    if rec.get("ttft_s") is None:
        return []
    times = [rec["arrival_s"] + rec["ttft_s"]]
    for gap in rec.get("itl_s") or ():
        times.append(times[-1] + gap)
    return times


def steps_of(records: list[dict], gap_s: float = 1e-4) -> tuple[list[float], list[int],
                                                                  list[list[int]]]:
    """The scheduler steps the records' tokens came from: token times (rounded in the
    records) closer than `gap_s` are one step. Returns each step's time and request count
    and, per record, the step index of each of its tokens."""
    per = [token_times(rec) for rec in records]
    flat = sorted((t, i, k) for i, ts in enumerate(per) for k, t in enumerate(ts))
    times: list[float] = []
    counts: list[int] = []
    index = [[0] * len(ts) for ts in per]
    last = None
    for t, i, k in flat:
        if last is None or t - last > gap_s:
            times.append(t)
            counts.append(0)
        last = t
        counts[-1] += 1
        index[i][k] = len(times) - 1
    return times, counts, index


def through_output_path(records: list[dict], path: OutputPath) -> tuple[list[dict], float]:
    """Records as the client sees them behind `path` (every token at its message's
    `visible` time; TTFT, ITL, TPOT and E2E from those), and the tokenizer manager's
    utilisation (busy seconds over the span from the first step to the last). The
    requests' send times do not move: a post-process, so a closed loop's next request is
    not held back by a late final chunk (when the utilisation reaches 1 the backlog grows
    without the clients' feedback, an upper bound)."""
    times, counts, index = steps_of(records)
    if not times:
        return list(records), 0.0
    seen, busy = path.visible(times, counts)
    span = max(seen[-1], times[-1]) - times[0]
    out = []
    for rec, idx in zip(records, index, strict=True):
        rec = dict(rec)
        if idx:
            vis = [seen[j] for j in idx]
            ttft = vis[0] - rec["arrival_s"]
            rec["ttft_s"] = round(ttft, 6)
            rec["itl_s"] = [round(b - a, 6) for a, b in zip(vis, vis[1:], strict=False)]
            if rec.get("e2e_s") is not None:
                e2e = vis[-1] - rec["arrival_s"]
                rec["e2e_s"] = round(e2e, 6)
                if len(vis) > 1:
                    rec["tpot_s"] = round((e2e - ttft) / (len(vis) - 1), 6)
        out.append(rec)
    return out, busy / span if span > 0 else 0.0


# Measured on the CPU harness (SGLang 0.5.23; `python benchmarks/output_path_cost.py`,
# 2026-12-01 23:13 UTC, load average 1.6-4.9; docs/calibration.md `serving-points:output-path`):
# per decode step's message, the detokenizer's thread CPU and the tokenizer manager's process
# CPU (/proc), fitted a + b x requests over bursts of 16-512 streamed requests (an earlier run
# at 16 and 64: 1.70 ms + 92.3 us). Not in the twin's default run (see the docs section).
SGLANG_0_5_23_OUT = OutputPath(detok_per_message_s=0.221e-3, detok_per_request_s=8.28e-6,
                               tm_per_message_s=0.642e-3, tm_per_request_s=92.9e-6)
