"""Requests and workload generators.

A `Request` carries its prompt as segments `(segment_hash, n_tokens)`: two requests share a
prefix exactly when their segment lists share a leading run. Generators draw everything
from one `np.random.Generator` seeded by the caller, so a spec and a seed give the same
requests every time. Workload specs are `key=value` lists, e.g.

    arrival=poisson,rate=2,n=500,prompt=uniform:1000:4000,output=uniform:100:500

See `SPEC_HELP` for every key, and `PRESETS` for named workloads such as `finance-qa`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from twin.errors import ConfigError

Segment = tuple[int, int]  # (segment_hash, n_tokens)


@dataclass(frozen=True, slots=True)
class Request:
    rid: str
    arrival_s: float
    segments: tuple[Segment, ...]
    output_tokens: int
    priority: int = 0
    prompt_tokens: int = 0  # filled from segments by `make`

    @classmethod
    def make(cls, rid: str, arrival_s: float, segments: tuple[Segment, ...] | list[Segment],
             output_tokens: int, priority: int = 0) -> Request:
        segs = tuple((int(h), int(n)) for h, n in segments if n > 0)
        return cls(rid, float(arrival_s), segs, int(output_tokens), int(priority),
                   sum(n for _, n in segs))


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order. With `concurrency` set it is closed-loop: at most that
    many requests are in flight, each sent at the later of its arrival time and the moment
    a client slot frees (like `bench_serving --max-concurrency`)."""

    name: str
    requests: tuple[Request, ...]
    concurrency: int | None = None
    reference: Mapping[str, dict] = field(default_factory=dict)  # measured ttft/itls by rid
    description: str = ""


# ---- length distributions ---------------------------------------------------------------
class Lengths:
    """A token-length distribution parsed from `fixed:N`, `uniform:A:B`,
    `lognormal:MEDIAN:SIGMA` or `empirical:V1:V2:...` (drawn uniformly from the values)."""

    def __init__(self, spec: str, key: str) -> None:
        self.spec = spec
        kind, *vals = spec.split(":")
        try:
            nums = [float(v) for v in vals]
        except ValueError:
            raise ConfigError(f"workload key {key}={spec!r}: numbers expected after "
                              f"'{kind}:'") from None
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind in arity and len(nums) != arity[kind] or kind == "empirical" and not nums:
            raise ConfigError(f"workload key {key}={spec!r}: {kind} takes "
                              f"{arity.get(kind, 'one or more')} value(s)")
        if kind not in (*arity, "empirical"):
            raise ConfigError(f"workload key {key}={spec!r}: distribution must be one of "
                              "fixed, uniform, lognormal, empirical")
        if any(v <= 0 for v in nums) or kind == "uniform" and nums[0] > nums[1]:
            raise ConfigError(f"workload key {key}={spec!r}: values must be positive "
                              "(and A <= B for uniform)")
        self.kind, self.nums = kind, nums

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k, v = self.kind, self.nums
        if k == "fixed":
            out = np.full(n, v[0])
        elif k == "uniform":
            out = rng.integers(int(v[0]), int(v[1]) + 1, size=n)
        elif k == "lognormal":
            out = np.rint(v[0] * np.exp(v[1] * rng.standard_normal(n)))
        else:
            out = rng.choice(np.asarray(v), size=n)
        return np.maximum(out, 1).astype(np.int64)


# ---- arrival processes ------------------------------------------------------------------
def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Bursty arrivals: gamma inter-arrival gaps with mean 1/rate and the given CV."""
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))


def ramp_arrivals(rng: np.random.Generator, peak: float, fractions: list[float],
                  step_s: float) -> np.ndarray:
    """A stepped load ramp: Poisson at each fraction of the peak rate for `step_s` each."""
    times: list[float] = []
    for i, frac in enumerate(fractions):
        t, end = i * step_s, (i + 1) * step_s
        while True:
            t += rng.exponential(1.0 / (peak * frac))
            if t >= end:
                break
            times.append(t)
    return np.asarray(times)


# ---- spec parsing -----------------------------------------------------------------------
SPEC_KEYS: dict[str, str] = {
    "arrival": "poisson | gamma | closed | ramp (default poisson)",
    "rate": "requests per second (poisson, gamma; the peak for ramp)",
    "cv": "coefficient of variation of gamma inter-arrival gaps (default 2)",
    "n": "number of requests (not for ramp)",
    "concurrency": "clients for arrival=closed (each sends its next request when its last ends)",
    "steps": "ramp fractions of the peak, ':'-separated (default 0.25:0.5:1:1.5:2)",
    "step_s": "seconds per ramp step (default 60)",
    "prompt": "length of each request's own prompt part, after any system prompt and template (default uniform:1000:4000)",
    "output": "output length distribution (default uniform:100:500)",
    "templates": "number of shared-prefix templates K (default 0)",
    "template_len": "tokens per template L (default 512)",
    "share": "probability p that a request starts with a template (default 0.5)",
    "system_prompt": "tokens of one system prompt every request starts with (default 0)",
    "tiers": "priority tiers PRIORITY:WEIGHT separated by '/', e.g. 0:0.8/10:0.2",
}
SPEC_HELP = "workload spec keys: " + "; ".join(f"{k}: {v}" for k, v in SPEC_KEYS.items())


def parse_spec(spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise ConfigError(f"workload spec {spec!r}: bad item {part!r}; known keys: "
                              f"{', '.join(SPEC_KEYS)}")
        out[key] = value
    return out


def _num(opts: dict[str, str], key: str, default: float, *, positive: bool = True) -> float:
    try:
        value = float(opts.get(key, default))
    except ValueError:
        raise ConfigError(f"workload key {key}={opts[key]!r}: a number expected") from None
    if positive and value <= 0:
        raise ConfigError(f"workload key {key}={value:g}: must be > 0")
    return value


def _tiers(spec: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        pairs = [p.split(":") for p in spec.split("/")]
        prio = np.array([int(a) for a, _ in pairs])
        weight = np.array([float(b) for _, b in pairs])
    except ValueError:
        raise ConfigError(f"workload key tiers={spec!r}: expected PRIORITY:WEIGHT/...") from None
    if (weight < 0).any() or weight.sum() <= 0:
        raise ConfigError(f"workload key tiers={spec!r}: weights must be >= 0, not all 0")
    return prio, weight / weight.sum()


class SegmentIds:
    """Fresh segment hashes for one workload; shared templates get their own range."""

    UNIQUE_BASE = 1 << 40

    def __init__(self) -> None:
        self._next = self.UNIQUE_BASE

    def unique(self) -> int:
        self._next += 1
        return self._next


def from_spec(spec: str, seed: int, name: str | None = None) -> Workload:
    """Build a workload from a `key=value,...` spec (see `SPEC_HELP`)."""
    opts = parse_spec(spec)
    rng = np.random.default_rng(seed)
    arrival = opts.get("arrival", "poisson")
    n = int(_num(opts, "n", 100))
    concurrency = None
    if arrival == "poisson":
        times = poisson_arrivals(rng, n, _num(opts, "rate", 1.0))
    elif arrival == "gamma":
        times = gamma_arrivals(rng, n, _num(opts, "rate", 1.0), _num(opts, "cv", 2.0))
    elif arrival == "closed":
        concurrency = int(_num(opts, "concurrency", 8))
        times = np.zeros(n)
    elif arrival == "ramp":
        fractions = [float(x) for x in opts.get("steps", "0.25:0.5:1:1.5:2").split(":")]
        times = ramp_arrivals(rng, _num(opts, "rate", 1.0), fractions, _num(opts, "step_s", 60))
        n = len(times)
    else:
        raise ConfigError(f"workload key arrival={arrival!r}: allowed values: poisson, gamma, "
                          "closed, ramp")
    prompts = Lengths(opts.get("prompt", "uniform:1000:4000"), "prompt").sample(rng, n)
    outputs = Lengths(opts.get("output", "uniform:100:500"), "output").sample(rng, n)
    k = int(_num(opts, "templates", 0, positive=False))
    tlen = int(_num(opts, "template_len", 512))
    share = _num(opts, "share", 0.5, positive=False)
    system = int(_num(opts, "system_prompt", 0, positive=False))
    prio, weight = _tiers(opts.get("tiers", "0:1"))
    uses_template = rng.random(n) < share if k else np.zeros(n, dtype=bool)
    template = rng.integers(0, max(k, 1), size=n)
    tier = rng.choice(len(prio), size=n, p=weight)
    ids = SegmentIds()
    requests = []
    for i in range(n):
        segs: list[Segment] = [(1, system)] if system else []
        rest = int(prompts[i])
        if uses_template[i]:
            segs.append((1000 + int(template[i]), tlen))
        segs.append((ids.unique(), rest))
        requests.append(Request.make(f"r{i}", times[i], segs, int(outputs[i]),
                                     int(prio[tier[i]])))
    return Workload(name or spec, tuple(requests), concurrency, description=spec)


# ---- presets ----------------------------------------------------------------------------
def finance_qa(seed: int, n: int = 600, concurrency: int = 50) -> Workload:
    """The users' financial knowledge-base QA mix (docs/workloads.md gives the reasons):

    - closed loop, 50 concurrent clients ("50+ concurrent requests is the norm"), 600 requests;
    - every prompt starts with one shared 256-token system prompt;
    - 90% short questions: question lognormal (median 250, sigma 0.5) tokens (so 98.5% of
      short prompts stay under 1k with the system prompt), answer lognormal (median 150,
      sigma 0.5);
    - 8% documents of 10k-32k tokens (uniform), 2% long documents of 64k-128k (uniform),
      each answered in lognormal (median 300, sigma 0.5) tokens; 60% of documents open with
      one of 20 shared legal-clause templates of 2,048 tokens;
    - VIP tiers: priority 0 (80%), 10 (15%), 20 (5%; preempts tier 0 under SGLang's default
      threshold of 10 when priority scheduling is on).
    """
    rng = np.random.default_rng(seed)
    ids = SegmentIds()
    kind = rng.choice(3, size=n, p=[0.90, 0.08, 0.02])
    tiers = rng.choice(np.array([0, 10, 20]), size=n, p=[0.80, 0.15, 0.05])
    requests = []
    for i in range(n):
        segs: list[Segment] = [(1, 256)]
        if kind[i] == 0:
            body = int(max(8, round(250 * np.exp(0.5 * rng.standard_normal()))))
            out = int(max(8, round(150 * np.exp(0.5 * rng.standard_normal()))))
        else:
            lo, hi = (10_000, 32_000) if kind[i] == 1 else (64_000, 128_000)
            body = int(rng.integers(lo, hi + 1)) - 256
            out = int(max(8, round(300 * np.exp(0.5 * rng.standard_normal()))))
            if rng.random() < 0.6:
                segs.append((2000 + int(rng.integers(0, 20)), 2048))
                body -= 2048
        segs.append((ids.unique(), body))
        requests.append(Request.make(f"r{i}", 0.0, segs, out, int(tiers[i])))
    return Workload("finance-qa", tuple(requests), concurrency,
                    description=finance_qa.__doc__ or "")


PRESETS = {"finance-qa": finance_qa}


def get_workload(spec: str, seed: int) -> Workload:
    """A preset by name, or a `key=value,...` spec."""
    if spec in PRESETS:
        return PRESETS[spec](seed)
    if "=" not in spec:
        raise ConfigError(f"--workload {spec!r}: not a preset ({', '.join(PRESETS)}) and not "
                          f"a key=value spec; {SPEC_HELP}")
    return from_spec(spec, seed)
