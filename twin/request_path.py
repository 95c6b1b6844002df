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
        start = max(sent, self.free_at)
        self.free_at = start + self.path.service_s(prompt_tokens)
        return self.free_at + self.path.latency_s


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
