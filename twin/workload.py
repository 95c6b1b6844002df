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
from dataclasses import dataclass, field, replace

import numpy as np

from twin.collector import paused
from twin.errors import ConfigError
from twin.inputs import (
    COUNT,
    MAX_REQUESTS,
    MAX_TIME_S,
    MAX_TOKENS,
    NON_NEGATIVE,
    POSITIVE,
    PRIORITY,
    PROBABILITY,
    SEED,
    TOKENS,
    Rule,
    check,
)

Segment = tuple[int, int]  # (segment_hash, n_tokens)


@dataclass(frozen=True, slots=True)
class Request:
    rid: str
    arrival_s: float
    segments: tuple[Segment, ...]
    output_tokens: int
    priority: int = 0
    prompt_tokens: int = 0  # filled from segments by `make`
    # SGLang's `sampling_params.ignore_eos`: True, the output runs to `output_tokens` and
    # admission reserves all of it; False, it may stop at EOS, so admission reserves
    # `new_token_ratio` of it; None, the run's setting (`--no-ignore-eos`; default True,
    # as servetwin's replay and bench_serving send). A trace reader sets it where the
    # format says (the jsonl reader's `ignore_eos` key, the twin's own records).
    ignore_eos: bool | None = None

    @classmethod
    def make(cls, rid: str, arrival_s: float, segments: tuple[Segment, ...] | list[Segment],
             output_tokens: int, priority: int = 0, ignore_eos: bool | None = None
             ) -> Request:
        segs = tuple([(int(h), int(n)) for h, n in segments if n > 0])
        prompt = segs[0][1] if len(segs) == 1 else sum([n for _, n in segs])
        return cls(rid, float(arrival_s), segs, int(output_tokens), int(priority), prompt,
                   None if ignore_eos is None else bool(ignore_eos))


# Whose closed-loop clients a workload models (`clients=`, arrival=closed only):
# - replay: servetwin's own replay client (runtime/client.py): the first requests are sent
#   together at 0, each next one when a slot frees;
# - bench: SGLang's `bench_serving --max-concurrency` (sglang.benchmark.serving.benchmark):
#   the same, after its warm-up: one copy of the first request (output capped at 32
#   tokens) is served first and left in the radix cache (no flush), then the clients
#   sleep 1 s and start; the warm-up is not measured (no record), as bench_serving's.
CLIENTS = ("replay", "bench")
BENCH_WARMUP_OUTPUT = 32  # bench_serving: output_len=min(test_request.output_len, 32)
BENCH_WARMUP_GAP_S = 1.0  # bench_serving: `await asyncio.sleep(1.0)` after the warm-up
WARMUP_RID = "warmup-"  # rid prefix of a warm-up request (no record)


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
    notes: tuple[str, ...] = ()  # what a reader changed on the way in (rows sorted, ...)
    clients: str = "replay"  # closed loop: whose clients (CLIENTS)

    def __post_init__(self) -> None:
        if self.concurrency is not None:  # 0 clients would never send anything
            check(f"workload {self.name}: concurrency", self.concurrency, COUNT)
        if self.clients not in CLIENTS:
            raise ConfigError(f"workload {self.name}: clients={self.clients!r}: allowed "
                              f"values: {', '.join(CLIENTS)}")
        if self.clients != "replay" and self.concurrency is None:
            raise ConfigError(f"workload {self.name}: clients={self.clients} is for a closed "
                              "loop (arrival=closed)")


# ---- length distributions ---------------------------------------------------------------
class Lengths:
    """A token-length distribution parsed from `fixed:N`, `uniform:A:B`,
    `lognormal:MEDIAN:SIGMA` or `empirical:V1:V2:...` (drawn uniformly from the values)."""

    def __init__(self, spec: str, key: str) -> None:
        self.spec = spec
        kind, *vals = spec.split(":")
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in (*arity, "empirical"):
            raise ConfigError(f"workload key {key}={spec!r}: distribution must be one of "
                              "fixed, uniform, lognormal, empirical")
        if kind in arity and len(vals) != arity[kind] or kind == "empirical" and not vals:
            raise ConfigError(f"workload key {key}={spec!r}: {kind} takes "
                              f"{arity.get(kind, 'one or more')} value(s)")
        rules = [TOKENS] * len(vals)
        if kind == "lognormal":  # MEDIAN:SIGMA; a sigma above 5 spans 10^10 in one sd
            rules = [Rule(lo=1, hi=MAX_TOKENS), Rule(lo=0, hi=5)]
        nums = [float(check(f"workload key {key}={spec!r}: value", v, r))
                for v, r in zip(vals, rules, strict=True)]
        if kind == "uniform" and nums[0] > nums[1]:
            raise ConfigError(f"workload key {key}={spec!r}: uniform needs A <= B")
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
        return np.clip(out, 1, MAX_TOKENS).astype(np.int64)


# ---- arrival processes ------------------------------------------------------------------
def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Bursty arrivals: gamma inter-arrival gaps with mean 1/rate and the given CV."""
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))


def ramp_arrivals(rng: np.random.Generator, peak: float, fractions: list[float],
                  step_s: float) -> np.ndarray:
    """A stepped load ramp: Poisson at each fraction of the peak rate for `step_s` each
    (per step a Poisson count of arrivals, placed uniformly: the same process, drawn in
    two vectorised calls)."""
    times = []
    for i, frac in enumerate(fractions):
        count = rng.poisson(peak * frac * step_s)  # a step at fraction 0 is idle
        times.append(np.sort(rng.uniform(i * step_s, (i + 1) * step_s, size=count)))
    return np.concatenate(times) if times else np.zeros(0)


# ---- spec parsing -----------------------------------------------------------------------
SPEC_KEYS: dict[str, str] = {
    "arrival": "poisson | gamma | closed | ramp (default poisson)",
    "rate": "requests per second (poisson, gamma; the peak for ramp)",
    "cv": "coefficient of variation of gamma inter-arrival gaps (default 2)",
    "n": "number of requests (not for ramp)",
    "concurrency": "clients for arrival=closed (each sends its next request when its last ends)",
    "clients": "arrival=closed: replay (servetwin's replay client, default) | bench (SGLang "
               "bench_serving's: a warm-up copy of the first request, 1 s, then the loop)",
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
SPEC_HELP = ("workload spec keys: " + "; ".join(f"{k}: {v}" for k, v in SPEC_KEYS.items())
             + ". A preset's name may be followed by arrival keys, which replace its closed "
             "loop and keep its shapes (n defaults to 600, concurrency to 50): "
             "finance-qa,n=20000 (50 clients, 20,000 requests); "
             "finance-qa,arrival=poisson,rate=0.4,n=100000; finance-qa,arrival=ramp,rate=0.9,"
             "steps=0.25:0.5:1:1.5:2,step_s=600 (a load test stepping up to twice 0.45 req/s)")


# Keys that mean something only for some arrival processes; any other is refused, so
# that a key with no effect (`rate=` on a closed loop) is never silently ignored.
ARRIVAL_KEYS = {
    "poisson": ("rate", "n"),
    "gamma": ("rate", "cv", "n"),
    "closed": ("concurrency", "n", "clients"),
    "ramp": ("rate", "steps", "step_s"),
}
COMMON_KEYS = ("arrival", "prompt", "output", "templates", "template_len", "share",
               "system_prompt", "tiers")


def parse_spec(spec: str, preset: str | None = None) -> dict[str, str]:
    """The spec's `key=value` items, checked. With `preset` (the items after a preset's
    name, `finance-qa,n=20000`) only the arrival keys are allowed, the preset fixing the
    shapes, and the arrival defaults to the preset's closed loop."""
    label = f"workload {preset},{spec}" if preset else f"workload spec {spec!r}"
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise ConfigError(f"{label}: bad item {part!r}; known keys: "
                              f"{', '.join(SPEC_KEYS)}")
        if key in out:
            raise ConfigError(f"{label}: key {key!r} given twice")
        out[key] = value.strip()
    if preset is not None:
        fixed = [k for k in out if k in COMMON_KEYS and k != "arrival"]
        if fixed:
            raise ConfigError(f"{label}: {', '.join(fixed)} cannot be set on "
                              f"the {preset} preset (it fixes the request shapes; its keys: "
                              f"arrival and the arrival's own: "
                              + "; ".join(f"{a}: {', '.join(k)}"
                                          for a, k in ARRIVAL_KEYS.items()) + ")")
    defaulted = preset is not None and "arrival" not in out
    if defaulted:
        out["arrival"] = "closed"
    arrival = out.get("arrival", "poisson")
    if arrival not in ARRIVAL_KEYS:
        raise ConfigError(f"workload key arrival={arrival!r}: allowed values: "
                          f"{', '.join(ARRIVAL_KEYS)}")
    unused = [k for k in out if k not in (*COMMON_KEYS, *ARRIVAL_KEYS[arrival])]
    if unused:
        default = " (the preset's default)" if defaulted else ""
        raise ConfigError(f"{label}: {', '.join(unused)} has no effect with "
                          f"arrival={arrival}{default} (it takes "
                          f"{', '.join(ARRIVAL_KEYS[arrival])})")
    return out


def _num(opts: dict[str, str], key: str, default: float, rule: Rule = POSITIVE) -> float:
    value = opts.get(key, default)
    try:
        return rule.parse(value)
    except ValueError:
        raise ConfigError(f"workload key {key}={value}: must be {rule.describe()}") from None


def _tiers(spec: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [p.split(":") for p in spec.split("/")]
    if any(len(p) != 2 for p in pairs):
        raise ConfigError(f"workload key tiers={spec!r}: expected PRIORITY:WEIGHT/...")
    label = f"workload key tiers={spec!r}:"
    prio = np.array([check(f"{label} priority", a, PRIORITY) for a, _ in pairs], dtype=np.int64)
    weight = np.array([check(f"{label} weight", b, NON_NEGATIVE) for _, b in pairs], dtype=float)
    if weight.sum() <= 0:
        raise ConfigError(f"{label} weights must not all be 0")
    return prio, weight / weight.sum()


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(check("--seed", seed, SEED))


class SegmentIds:
    """Fresh segment hashes for one workload; shared templates get their own range."""

    UNIQUE_BASE = 1 << 40

    def __init__(self) -> None:
        self._next = self.UNIQUE_BASE

    def unique(self) -> int:
        self._next += 1
        return self._next


def split_preset(spec: str) -> tuple[str | None, str]:
    """(preset name, the rest) for `PRESET[,key=value...]`; (None, spec) for a plain spec."""
    head, _, rest = spec.partition(",")
    head = head.strip()
    return (head, rest) if head in PRESETS else (None, spec)


def from_spec(spec: str, seed: int, name: str | None = None) -> Workload:
    """Build a workload from a `key=value,...` spec (see `SPEC_HELP`), or from a preset's
    name followed by arrival keys (`finance-qa,arrival=poisson,rate=0.4,n=100000`)."""
    preset, rest = split_preset(spec)
    if preset is not None:
        return replace(PRESETS[preset](seed, arrivals=parse_spec(rest, preset)),
                       name=name or spec)
    opts = parse_spec(spec)
    rng = _rng(seed)
    times, concurrency = _arrivals(opts, rng)
    n = len(times)
    prompts = Lengths(opts.get("prompt", "uniform:1000:4000"), "prompt").sample(rng, n)
    outputs = Lengths(opts.get("output", "uniform:100:500"), "output").sample(rng, n)
    k = int(_num(opts, "templates", 0, Rule(integer=True, lo=0, hi=1_000_000)))
    tlen = int(_num(opts, "template_len", 512, TOKENS))
    share = _num(opts, "share", 0.5, PROBABILITY)
    system = int(_num(opts, "system_prompt", 0, Rule(integer=True, lo=0, hi=MAX_TOKENS)))
    prio, weight = _tiers(opts.get("tiers", "0:1"))
    uses_template = rng.random(n) < share if k else np.zeros(n, dtype=bool)
    template = rng.integers(0, max(k, 1), size=n)
    tier = rng.choice(len(prio), size=n, p=weight)
    # Python numbers up front: a numpy scalar read per field per request costs more than
    # the request (int() and float() of them are the numbers make() would take)
    columns = (np.asarray(times, dtype=float).tolist(),
               np.asarray(prompts).astype(np.int64).tolist(),
               np.asarray(outputs).astype(np.int64).tolist(), uses_template.tolist(),
               template.tolist(), prio[tier].astype(np.int64).tolist())
    with paused():  # (a day's requests: collections that would find nothing)
        requests = _requests(columns, system, k, tlen)
    clients = opts.get("clients", "replay")
    if clients not in CLIENTS:
        raise ConfigError(f"workload key clients={clients!r}: allowed values: "
                          f"{', '.join(CLIENTS)}")
    return Workload(name or spec, tuple(requests), concurrency, description=spec,
                    clients=clients)


def _requests(columns: tuple, system: int, k: int, tlen: int) -> list[Request]:
    """`from_spec`'s requests from its drawn columns (Python numbers)."""
    requests = []
    ids = SegmentIds()
    if not system and not k:
        # one fresh segment each: the requests `make` would build, without its checks
        # (the numbers are Python ints and floats already; `Lengths.sample` clips every
        # length to 1 or more, so `make` would drop no segment)
        uid = ids.UNIQUE_BASE
        new = Request
        for i, (at, rest, out, p) in enumerate(zip(columns[0], columns[1], columns[2],
                                                   columns[5], strict=True), 1):
            requests.append(new(f"r{i - 1}", at, ((uid + i, rest),), out, p, rest))
        return requests
    for i, (at, rest, out, templated, tmpl, p) in enumerate(zip(*columns, strict=True)):
        segs: list[Segment] = [(1, system)] if system else []
        if templated:
            segs.append((1000 + tmpl, tlen))
        segs.append((ids.unique(), rest))
        requests.append(Request.make(f"r{i}", at, segs, out, p))
    return requests


def with_count(spec: str, n: int) -> str:
    """`spec` asking for `n` requests (a ramp's count is its draw's: unchanged)."""
    preset, rest = split_preset(spec)
    opts = parse_spec(rest, preset)
    if opts.get("arrival", "poisson") == "ramp":
        return spec
    opts = {**opts, "n": str(n)}
    return ",".join([*([preset] if preset else []), *(f"{k}={v}" for k, v in opts.items())])


def _arrivals(opts: dict[str, str], rng: np.random.Generator, n: int = 100,
              concurrency: int = 8) -> tuple[np.ndarray, int | None]:
    """Arrival times (and the client count of a closed loop) for a parsed spec; `n` and
    `concurrency` are the defaults of the keys (a preset passes its own). A closed loop
    draws nothing from `rng`."""
    arrival = opts.get("arrival", "poisson")
    if arrival == "ramp":
        steps = opts.get("steps", "0.25:0.5:1:1.5:2")
        fractions = [check(f"workload key steps={steps!r}: fraction", x, NON_NEGATIVE)
                     for x in steps.split(":")]
        rate, step_s = _num(opts, "rate", 1.0), _num(opts, "step_s", 60)
        expected = rate * step_s * sum(fractions)
        if not 0 < expected <= MAX_REQUESTS or step_s * len(fractions) > MAX_TIME_S:
            raise ConfigError(f"workload ramp rate={rate:g}, steps={steps}, "
                              f"step_s={step_s:g}: expects {expected:.3g} requests over "
                              f"{step_s * len(fractions):.3g} s; allowed: more than 0 and at "
                              f"most {MAX_REQUESTS} requests, at most {MAX_TIME_S:g} s")
        times = ramp_arrivals(rng, rate, fractions, step_s)
        if not len(times):
            raise ConfigError(f"workload ramp rate={rate:g}, step_s={step_s:g}: the draw gave "
                              "no request; raise the rate or the step length")
        return times, None
    n = int(_num(opts, "n", n, Rule(integer=True, lo=1, hi=MAX_REQUESTS)))
    if arrival == "closed":
        return np.zeros(n), int(_num(opts, "concurrency", concurrency, COUNT))
    rate = _num(opts, "rate", 1.0)
    if n / rate > MAX_TIME_S:
        raise ConfigError(f"workload key rate={rate:g}: {n} requests would span about "
                          f"{n / rate:.3g} s; at most {MAX_TIME_S:g} s")
    if arrival == "gamma":
        return gamma_arrivals(rng, n, rate, _num(opts, "cv", 2.0, Rule(lo=0.01, hi=100))), None
    return poisson_arrivals(rng, n, rate), None


# ---- presets ----------------------------------------------------------------------------
def finance_qa(seed: int, n: int = 600, concurrency: int = 50,
               arrivals: dict[str, str] | None = None) -> Workload:
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

    `arrivals` (parsed spec keys: `arrival`, `rate`, `n`, ...) replaces the closed loop by
    that arrival process (`finance-qa,arrival=ramp,rate=0.9` steps the load up as the
    users' load tests do); `n` and `concurrency` are its keys' defaults. Its times are
    drawn first (a ramp's draw sets the count); a closed loop draws none, so
    `arrival=closed` gives the same requests as the bare preset for the same n.
    """
    rng = _rng(seed)
    arrivals = {"arrival": "closed"} if arrivals is None else arrivals
    times, concurrency = _arrivals(arrivals, rng, n, concurrency)  # before the shapes
    n = len(times)
    kind = rng.choice(3, size=n, p=[0.90, 0.08, 0.02])
    tiers = rng.choice(np.array([0, 10, 20]), size=n, p=[0.80, 0.15, 0.05])
    with paused():  # (a day's requests: collections that would find nothing)
        requests = _finance_requests(rng, np.asarray(times, dtype=float).tolist(),
                                     kind.tolist(), tiers.tolist())
    return Workload("finance-qa", tuple(requests), concurrency,  # checks `clients`
                    description=finance_qa.__doc__ or "",
                    clients=arrivals.get("clients", "replay"))


def _finance_requests(rng: np.random.Generator, times: list[float], kinds: list[int],
                      tiers: list[int]) -> list[Request]:
    """`finance_qa`'s requests, drawn request by request in this order: a question, its
    body's and its answer's normal; a document, its length, its answer's normal, whether
    it opens with a template and which. A run of questions draws its normals in one call
    (the generator fills an array with the draws a call each would make, in order); all
    questions' normals are scaled at the end, as one array (the same float operations,
    element by element)."""
    n = len(kinds)
    zs: list[np.ndarray] = []
    docs: list[tuple[int, int, int]] = []  # (body, answer, template or -1), in order
    i = 0
    while i < n:
        if kinds[i] == 0:
            j = i + 1
            while j < n and kinds[j] == 0:
                j += 1
            zs.append(rng.standard_normal(2 * (j - i)))
            i = j
            continue
        lo, hi = (10_000, 32_000) if kinds[i] == 1 else (64_000, 128_000)
        body = int(rng.integers(lo, hi + 1)) - 256
        out = int(max(8, round(300 * np.exp(0.5 * rng.standard_normal()))))
        tmpl = 2000 + int(rng.integers(0, 20)) if rng.random() < 0.6 else -1
        docs.append((body, out, tmpl))
        i += 1
    z = np.concatenate(zs) if zs else np.empty(0)
    scale = np.resize(np.array([250, 150], dtype=float), len(z))
    short = iter(np.maximum(8, np.rint(scale * np.exp(0.5 * z))).astype(np.int64).tolist())
    doc = iter(docs)
    ids = SegmentIds()
    requests = []
    for k, kind in enumerate(kinds):
        if kind == 0:
            body, out = next(short), next(short)
            requests.append(Request(f"r{k}", times[k], ((1, 256), (ids.unique(), body)),
                                    out, tiers[k], 256 + body))
            continue
        body, out, tmpl = next(doc)
        segs: list[Segment] = [(1, 256)]
        if tmpl >= 0:
            segs.append((tmpl, 2048))
            body -= 2048
        segs.append((ids.unique(), body))
        requests.append(Request.make(f"r{k}", times[k], segs, out, tiers[k]))
    return requests


PRESETS = {"finance-qa": finance_qa}


def get_workload(spec: str, seed: int) -> Workload:
    """A preset by name, or a `key=value,...` spec."""
    if spec in PRESETS:
        return PRESETS[spec](seed)
    if "=" not in spec:
        raise ConfigError(f"--workload {spec!r}: not a preset ({', '.join(PRESETS)}) and not "
                          f"a key=value spec; {SPEC_HELP}")
    return from_spec(spec, seed)
