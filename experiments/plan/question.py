"""The planner's question: a workload at a target load, and the SLOs every candidate must meet.

A workload is evaluated open loop at a load multiplier `scale`: the same requests (same
seed) with their arrival times divided by `scale`, so that every load of a search sees the
same prompts and the same arrival pattern, only denser or sparser (the twin is deterministic:
one candidate at one scale always gives the same records). A closed-loop workload (the
`finance-qa` preset: 50 clients) has no rate of its own: its peak is the request rate its
clients drive on the reference deployment (what `servetwin simulate` runs by default, the
users' 2x A100-80GB PCIe at TP 2), measured once by one simulation, and its requests then
arrive as a Poisson process at that rate (as benchmarks/policies.py does).

An SLO `METRIC:STAT:THRESHOLD_S[:TARGET][:tier=N][:prompt<N]`:
`ttft:p99:1.5` holds when at least 99 % of the requests it covers finished `ok` with a TTFT
of at most 1.5 s (a request that was rejected or aborted counts as a miss);
`ttft:attainment:1.5:0.95` when at least 95 % did; `tier=10` restricts it to priority 10,
`prompt<10000` to prompts shorter than 10,000 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from twin.errors import ConfigError
from twin.inputs import POSITIVE, PRIORITY, TOKENS, Rule, check
from twin.workload import Workload

METRICS = ("ttft", "tpot", "e2e")
STATS = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "attainment": None}
SLO_HELP = ("METRIC:STAT:THRESHOLD_S[:TARGET][:tier=N][:prompt<N], METRIC one of "
            f"{', '.join(METRICS)}, STAT one of {', '.join(STATS)} (attainment takes TARGET, "
            "the share of requests that must meet the threshold, e.g. ttft:attainment:1.5:0.99)")


@dataclass(frozen=True)
class Slo:
    metric: str
    stat: str
    threshold_s: float
    target: float | None = None  # the share of covered requests that must meet threshold_s
    tier: int | None = None
    max_prompt_tokens: int | None = None  # covers prompts shorter than this

    @property
    def share(self) -> float:
        return STATS[self.stat] if self.target is None else self.target

    @property
    def name(self) -> str:
        parts = [self.metric, self.stat, f"{self.threshold_s:g}"]
        if self.stat == "attainment":
            parts.append(f"{self.target:g}")
        if self.tier is not None:
            parts.append(f"tier={self.tier}")
        if self.max_prompt_tokens is not None:
            parts.append(f"prompt<{self.max_prompt_tokens}")
        return ":".join(parts)

    def covers(self, rec: dict) -> bool:
        return (self.tier is None or rec["priority"] == self.tier) and (
            self.max_prompt_tokens is None or rec["prompt_tokens"] < self.max_prompt_tokens)

    def met_by(self, rec: dict) -> bool:
        value = rec[f"{self.metric}_s"]
        if rec["status"] != "ok":
            return False
        return value is None or value <= self.threshold_s  # one output token: no TPOT

    def to_json(self) -> dict:
        return {"metric": self.metric, "stat": self.stat, "threshold_s": self.threshold_s,
                "target": self.target, "tier": self.tier,
                "max_prompt_tokens": self.max_prompt_tokens}


def parse_slo(text: str) -> Slo:
    """`ttft:p99:1.5`, `ttft:attainment:1.5:0.99`, `...:tier=10`, `...:prompt<10000`."""
    parts = text.split(":")
    if len(parts) < 3:
        raise ConfigError(f"--slo {text!r}: expected {SLO_HELP}")
    metric, stat, thr, *rest = parts
    if metric not in METRICS:
        raise ConfigError(f"--slo {text!r}: metric {metric!r}: allowed values: "
                          f"{', '.join(METRICS)}")
    if stat not in STATS:
        raise ConfigError(f"--slo {text!r}: stat {stat!r}: allowed values: {', '.join(STATS)}")
    threshold = float(check(f"--slo {text!r}: threshold", thr, POSITIVE))
    target = tier = prompt = None
    if stat == "attainment":
        if not rest or "=" in rest[0] or "<" in rest[0]:
            raise ConfigError(f"--slo {text!r}: attainment needs a TARGET share after the "
                              "threshold, e.g. ttft:attainment:1.5:0.99")
        target = float(check(f"--slo {text!r}: target", rest.pop(0),
                             Rule(lo=0, hi=1, lo_open=True)))
    for part in rest:
        if part.startswith("tier="):
            tier = int(check(f"--slo {text!r}: tier", part[5:], PRIORITY))
        elif part.startswith("prompt<"):
            prompt = int(check(f"--slo {text!r}: prompt<", part[7:], TOKENS))
        else:
            raise ConfigError(f"--slo {text!r}: {part!r}: allowed qualifiers: tier=N, "
                              "prompt<N")
    return Slo(metric, stat, threshold, target, tier, prompt)


@dataclass(frozen=True)
class Question:
    """What every candidate is measured against."""

    workload: str  # its name as given (a preset, a spec or a trace path)
    base: Workload  # open loop at scale 1.0 (the target is `target_scale` times it)
    base_rps: float  # the request rate of `base`
    target_kind: str  # "scale" | "rps"
    target_value: float
    slos: tuple[Slo, ...]
    precision: float
    seed: int
    peak_from: str  # how base_rps was found

    @property
    def target_scale(self) -> float:
        return self.target_value if self.target_kind == "scale" else \
            self.target_value / self.base_rps

    @property
    def target_rps(self) -> float:
        return self.base_rps * self.target_scale

    def at(self, scale: float) -> Workload:
        """The workload at `scale` times the base rate."""
        return scaled(self.base, scale)

    def to_json(self) -> dict:
        return {"workload": self.workload,
                "target": {"kind": self.target_kind, "value": self.target_value,
                           "rps": self.target_rps},
                "base_rps": self.base_rps, "peak_from": self.peak_from,
                "requests": len(self.base.requests),
                "slos": [s.to_json() for s in self.slos], "slo_names": [s.name for s in
                                                                       self.slos],
                "precision": self.precision, "seed": self.seed}


def scaled(w: Workload, scale: float) -> Workload:
    reqs = tuple(replace(r, arrival_s=r.arrival_s / scale) for r in w.requests)
    return Workload(f"{w.name}@x{scale:.6g}", reqs, None, description=w.description)


def open_loop(w: Workload, rate: float, seed: int) -> Workload:
    """`w`'s requests as a Poisson process at `rate` (the first at 0)."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=len(w.requests))
    times = np.cumsum(gaps) - gaps[0]
    reqs = tuple(replace(r, arrival_s=float(t)) for r, t in zip(w.requests, times, strict=True))
    return Workload(w.name, reqs, None, description=w.description)


def rate_of(w: Workload) -> float:
    """Requests per second of an open-loop workload: its spec's rate where it names one,
    else the count over the arrival span (n - 1 gaps)."""
    from twin.workload import parse_spec

    if "=" in w.description:
        try:
            opts = parse_spec(w.description)
        except ConfigError:
            opts = {}
        if "rate" in opts and opts.get("arrival", "poisson") in ("poisson", "gamma"):
            return float(opts["rate"])
    times = [r.arrival_s for r in w.requests]
    span = max(times) - min(times)
    if len(times) < 2 or span <= 0:
        raise ConfigError(f"workload {w.name}: all {len(times)} requests arrive at once; "
                          "give --target-rps to set its rate")
    return (len(times) - 1) / span


# ---- building the question ------------------------------------------------------------
REFERENCE = ("a100-pcie-80gb", 2)  # the users' deployment, `servetwin simulate`'s default


@dataclass(frozen=True)
class WorkloadSource:
    """Where the requests come from, to draw more of them (the ramp needs its own count)."""

    kind: str  # "preset" | "spec" | "trace"
    name: str
    seed: int
    trace_format: str | None = None
    time_scale: float = 1.0
    offset_s: float = 0.0

    def requests(self, n: int | None) -> Workload:
        from twin.workload import PRESETS, from_spec, with_count

        if self.kind == "preset":
            return PRESETS[self.name](self.seed, **({} if n is None else {"n": n}))
        if self.kind == "spec":
            spec = self.name if n is None else with_count(self.name, n)
            return from_spec(spec, self.seed, name=self.name)
        from twin.traces import load_trace

        return load_trace(self.name, self.trace_format or "jsonl", time_scale=self.time_scale,
                          offset_s=self.offset_s, limit=n)


def reference_rate(w: Workload) -> tuple[float, str]:
    """A closed loop's request rate on the reference deployment (one simulation)."""
    from twin.config import ServerArgs
    from twin.sim import SimConfig, simulate

    gpu, tp = REFERENCE
    res = simulate(w, SimConfig(args=ServerArgs(tp_size=tp), gpu=gpu))
    rate = res.summary["throughput"]["requests_per_s"]
    return rate, (f"closed loop of {w.concurrency} clients ({len(w.requests)} requests) on "
                  f"{tp}x {gpu} TP{tp} with SGLang defaults (servetwin simulate's default "
                  f"deployment): {rate:.6g} requests/s, then Poisson arrivals at that rate")


def build_question(source: WorkloadSource, requests: int | None, target_kind: str,
                   target_value: float, slos: tuple[Slo, ...], precision: float) -> Question:
    w = source.requests(requests)
    if source.kind == "trace" and requests is not None:
        w = Workload(w.name, w.requests[:requests], w.concurrency, description=w.description)
    if w.concurrency is not None:
        rate, how = reference_rate(w)
        base = open_loop(w, rate, source.seed)
    else:
        base = Workload(w.name, w.requests, None, description=w.description)
        rate = rate_of(base)
        how = f"the workload's own rate: {rate:.6g} requests/s"
    if target_kind not in ("scale", "rps"):
        raise ConfigError(f"target kind {target_kind!r}: allowed values: scale, rps")
    check(f"--target-{target_kind}", target_value, POSITIVE)
    check("--precision", precision, Rule(lo=0.001, hi=1))
    name = source.name if source.kind != "trace" else f"trace {source.name}"
    return Question(name, base, rate, target_kind, float(target_value), slos, precision,
                    source.seed, how)
