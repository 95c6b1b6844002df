"""Faults and the router's failover machinery, as sglang-router 0.3.2 does it.

Faults (a schedule): `crash` (the server dies at `at_s`, its requests are lost, it is
back `repair_s` later with an empty cache), `slow` (every step takes `factor` x as long
for `duration_s`), `hang` (it stops answering health checks for `duration_s` but still
serves).

Failover (`Failover`, sglang-router's flags and defaults from `router_args.py`):
- health checks every `health_check_interval_secs` (60) with a timeout of
  `health_check_timeout_secs` (5); `health_failure_threshold` (3) consecutive failures mark
  a worker unhealthy, `health_success_threshold` (2) successes healthy again; a crashed
  server refuses the connection at once, a hung one times out;
- retries: up to `retry_max_retries` (5) attempts in all (`disable_retries` = 1), waiting
  `initial_backoff_ms` (50) x `backoff_multiplier` (1.5)^(n-1), at most `max_backoff_ms`
  (30,000), times 1 + U(-`jitter_factor`, +`jitter_factor`) (0.2); retried: connection
  refused, no healthy worker (503), and — only when responses are not streamed — a
  server lost mid-request. A streamed response (how servetwin's replay and
  bench_serving talk) has already started (HTTP 200) when the server dies, so the
  router cannot retry it: it fails;
- circuit breaker per worker: `cb_failure_threshold` (10) consecutive failures open it; after
  `cb_timeout_duration_secs` (60) it is half-open (requests pass); `cb_success_threshold`
  (3) successes close it, a failure re-opens it. (`cb_window_duration_secs` is accepted
  and not used by the breaker's decision in the twin.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from twin.errors import ConfigError

FAULT_KINDS = ("crash", "slow", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    replica: str
    at_s: float
    repair_s: float = 60.0  # crash: down for this long
    duration_s: float = 60.0  # slow, hang
    factor: float = 2.0  # slow

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind {self.kind!r}: allowed values: {', '.join(FAULT_KINDS)}")
        for key in ("at_s", "repair_s", "duration_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and np.isfinite(v)
                                           and v >= 0):
                raise ConfigError(f"fault {self.kind} on {self.replica}: {key} {v!r}: must be "
                                  "a finite number >= 0")
        f = self.factor
        if isinstance(f, bool) or not (isinstance(f, (int, float)) and np.isfinite(f) and f > 0):
            raise ConfigError(f"fault slow on {self.replica}: factor {f!r}: must be a finite "
                              "number > 0")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """`KIND:REPLICA:AT_S[:ARG]` — crash:r0:100:60 (repair 60 s), slow:r1:50:3:120 (x3 for
        120 s), hang:r0:10:300 (no health answers for 300 s)."""
        parts = text.split(":")
        if len(parts) < 3 or parts[0] not in FAULT_KINDS:
            raise ConfigError(f"--fault {text!r}: expected KIND:REPLICA:AT_S[:...] with KIND one "
                              f"of {', '.join(FAULT_KINDS)} (crash:r0:100:60, slow:r1:50:3:120, "
                              f"hang:r0:10:300)")
        try:
            nums = [float(x) for x in parts[2:]]
        except ValueError:
            raise ConfigError(f"--fault {text!r}: times and factors must be numbers") from None
        kind, rep, at = parts[0], parts[1], nums[0]
        most = {"crash": 2, "slow": 3, "hang": 2}[kind]
        if len(nums) > most:
            raise ConfigError(f"--fault {text!r}: {kind} takes at most {most} numbers after the "
                              "replica (crash:r0:100:60, slow:r1:50:3:120, hang:r0:10:300)")
        if kind == "crash":
            return cls(kind, rep, at, repair_s=nums[1] if len(nums) > 1 else 60.0)
        if kind == "slow":
            return cls(kind, rep, at, factor=nums[1] if len(nums) > 1 else 2.0,
                       duration_s=nums[2] if len(nums) > 2 else 60.0)
        return cls(kind, rep, at, duration_s=nums[1] if len(nums) > 1 else 60.0)


@dataclass(frozen=True)
class Failover:
    """sglang-router's reliability settings by their flag names (without `--`)."""

    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30_000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: float = 5.0
    health_check_interval_secs: float = 60.0
    disable_health_check: bool = False
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    disable_circuit_breaker: bool = False
    streaming: bool = True  # clients stream (a started response cannot be retried)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(v, bool):
                    raise ConfigError(f"failover {f.name}: {v!r}: must be true or false")
                continue
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and np.isfinite(v)
                                           and v >= 0):
                raise ConfigError(f"failover {f.name}: {v!r}: must be a number >= 0")
        for key in ("retry_max_retries", "health_failure_threshold", "health_success_threshold",
                    "cb_failure_threshold", "cb_success_threshold"):
            if getattr(self, key) < 1 or int(getattr(self, key)) != getattr(self, key):
                raise ConfigError(f"failover {key}: {getattr(self, key)!r}: must be an integer >= 1")
        if self.health_check_interval_secs <= 0:
            raise ConfigError("failover health_check_interval_secs: must be > 0")

    @property
    def max_attempts(self) -> int:
        return 1 if self.disable_retries else int(self.retry_max_retries)

    def backoff_s(self, failures: int, rng: np.random.Generator) -> float:
        """Wait before attempt `failures` + 1."""
        d = min(self.retry_initial_backoff_ms * self.retry_backoff_multiplier ** (failures - 1),
                self.retry_max_backoff_ms)
        j = self.retry_jitter_factor
        return max(d * (1.0 + rng.uniform(-j, j)), 0.0) / 1e3


@dataclass
class Breaker:
    """One worker's circuit breaker."""

    cfg: Failover
    state: str = "closed"  # closed | open | half_open
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    opens: int = 0

    def allows(self, now: float) -> bool:
        if self.cfg.disable_circuit_breaker:
            return True
        if self.state == "open" and now - self.opened_at >= self.cfg.cb_timeout_duration_secs:
            self.state, self.successes = "half_open", 0
        return self.state != "open"

    def record(self, ok: bool, now: float) -> None:
        if self.cfg.disable_circuit_breaker:
            return
        if ok:
            self.failures = 0
            if self.state == "half_open":
                self.successes += 1
                if self.successes >= self.cfg.cb_success_threshold:
                    self.state = "closed"
            return
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.cfg.cb_failure_threshold:
            if self.state != "open":
                self.opens += 1
            self.state, self.opened_at, self.successes = "open", now, 0


@dataclass
class Health:
    """One worker's health as the router's checker sees it."""

    healthy: bool = True
    fails: int = 0
    oks: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)  # (time, healthy|unhealthy)

    def result(self, ok: bool, now: float, cfg: Failover) -> None:
        if ok:
            self.oks, self.fails = self.oks + 1, 0
            if not self.healthy and self.oks >= cfg.health_success_threshold:
                self.healthy = True
                self.events.append((round(now, 6), "healthy"))
        else:
            self.fails, self.oks = self.fails + 1, 0
            if self.healthy and self.fails >= cfg.health_failure_threshold:
                self.healthy = False
                self.events.append((round(now, 6), "unhealthy"))


def failover_from(d: dict | None, where: str = "failover") -> Failover:
    known = {f.name for f in fields(Failover)}
    d = dict(d or {})
    bad = sorted(set(d) - known)
    if bad:
        raise ConfigError(f"{where}: unknown key {bad[0]!r}; allowed: {', '.join(sorted(known))}")
    return Failover(**d)
