"""Profile a live SGLang server: run a plan of small experiments, keep every sample.

The plan (`make_plan`) is built to separate the step-time terms, within the server's own
limits from `/server_info` (max running requests, KV pool, chunk size, input length):

- `prefill` runs: one request with one output token, across prompt lengths (below, at and
  above the chunk size); the same with a cached prefix (a warm-up request with the prefix
  first fills the radix cache on purpose); small batches of prompts sent together.
- `decode` runs: N concurrent `ignore_eos` requests with fixed output lengths, across batch
  sizes up to max running requests and prompt (KV) lengths.
- `mixed` runs: a decode batch running while new prompts arrive, so prefill steps land
  between decode steps as they do under load.
- a `tokenizer` burst: requests with cached prompts of several lengths sent at once after
  a warm-up, early in the plan, so that every budget has requests queued at SGLang's
  tokenizer manager, whose dispatch stamps give its serial cost (calibration/derive.py
  `tokenizer_samples`); the cache keeps their prefill short.

The radix cache is flushed before every run. Runs are interleaved by kind, cheapest
first, so a small `--budget-s` still samples every term; a run that would not fit in
the remaining budget (by a pessimistic estimate) is skipped. Every run's raw traces are
appended to `PROFILE.runs.jsonl` and its samples to `PROFILE.samples.jsonl` as soon as it
ends; a later `servetwin calibrate` with the same `--out` resumes after the runs done.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration.derive import Limits, Timeline, samples_from_timelines
from calibration.session import CalibrationError, Trace, flush, health, run_group
from twin.outputs import atomic_write_text

OUTPUT_DECODE = 32  # tokens per request in decode runs


@dataclass(frozen=True)
class Req:
    new: int  # prompt tokens of its own
    output: int = 1
    offset_s: float = 0.0
    prefix: int = 0  # leading tokens shared with the run's warm-up request


@dataclass(frozen=True)
class Run:
    tag: str
    kind: str
    requests: tuple[Req, ...]
    prefix: int = 0  # a warm-up request of this many tokens fills the cache first

    def estimate_s(self) -> float:
        """A pessimistic duration (a few times a CPU server's), for the budget check."""
        tokens = sum(r.new + r.prefix for r in self.requests) + self.prefix
        ctx = sum((r.prefix + r.new) ** 2 for r in self.requests) + self.prefix ** 2
        steps = max(r.output + r.offset_s / 0.03 for r in self.requests)
        return 0.5 + 1.2e-3 * tokens + 3e-7 * ctx + 0.06 * steps


@dataclass(frozen=True)
class ServerLimits:
    max_running: int
    max_total_tokens: int
    chunk: int | None
    max_input: int

    @classmethod
    def from_info(cls, info: dict) -> ServerLimits:
        from runtime.server_api import positive_int  # garbage (not a positive integer): None

        def get(*keys: str) -> int | None:
            return next((n for n in (positive_int(info.get(k)) for k in keys) if n), None)

        total = get("max_total_num_tokens", "max_total_tokens") or 4096
        max_in = get("max_req_input_len", "context_length") or total
        return cls(get("max_running_requests") or 8, total, get("chunked_prefill_size"),
                   min(max_in, total - 1))

    def derive_limits(self) -> Limits:
        return Limits(self.chunk, self.max_running)


def _interleave(*lists: list[Run]) -> list[Run]:
    out, i = [], 0
    while any(i < len(lst) for lst in lists):
        out += [lst[i] for lst in lists if i < len(lst)]
        i += 1
    return out


def make_plan(lim: ServerLimits) -> list[Run]:
    """The profiling runs for a server with these limits, in the order they are run."""
    c = lim.chunk or 2048
    room = min(lim.max_input - OUTPUT_DECODE, lim.max_total_tokens // 2)
    fits = lambda n: 1 <= n <= room  # noqa: E731
    single = [Run(f"prefill-n{n}", "prefill", (Req(n),))
              for n in (64, c, 256, 16, 512, 2 * c, 128, c * 3 // 4, c * 3 // 2) if fits(n)]
    cached = [Run(f"prefill-n{n}-cached{p}", "prefill", (Req(n, prefix=p),), prefix=p)
              for p, n in ((512, 32), (c, 256), (2 * c, 32), (256, 256), (c, 32), (2 * c, 256),
                           (c // 2, 128)) if fits(p + n)]
    batched = [Run(f"prefill-{k}x{n}", "prefill", tuple(Req(n) for _ in range(k)))
               for k, n in ((4, 64), (2, c // 2), (8, max(c // 8, 16)), (4, c // 4))
               if k <= lim.max_running and fits(n)]
    decode = []
    for b, prompt in ((1, 64), (4, 256), (lim.max_running, 128), (2, 256), (8, 512),
                      (1, 512), (2, 1024), (lim.max_running, 512), (3, 128), (16, 64),
                      (1, 2048), (4, 1536)):
        b = min(b, lim.max_running)
        if b * (prompt + OUTPUT_DECODE) <= 0.8 * lim.max_total_tokens and fits(prompt):
            decode.append(Run(f"decode-b{b}-p{prompt}", "decode",
                              tuple(Req(prompt, OUTPUT_DECODE) for _ in range(b))))
    b = max(1, lim.max_running // 4)
    mixed = []
    for arrivals in ((64, 256, c * 3 // 4), (32, 128, 512), (c // 2, 16, c)):
        reqs = tuple(Req(256, 64) for _ in range(b)) + tuple(
            Req(n, 8, 0.4 + 0.35 * j) for j, n in enumerate(arrivals) if fits(n))
        mixed.append(Run(f"mixed-b{b}-" + "-".join(map(str, arrivals)), "mixed", reqs))
    return _dedupe(_interleave(single, decode, _tokenizer_burst(lim, fits), cached, mixed,
                               batched))


def _tokenizer_burst(lim: ServerLimits, fits: Callable[[int], bool]) -> list[Run]:
    """Up to 12 requests sent together, each 16 new tokens after a quarter, a half,
    three quarters or all of a cached prefix of up to 1024 tokens (several prompt lengths
    for the per-token fit)."""
    k = min(12, lim.max_running)
    p = min(1024, lim.chunk or 1024)
    while p > 64 and not fits(p + 16):
        p //= 2
    if k < 4 or not fits(p + 16):
        return []
    reqs = tuple(Req(16, prefix=p * (j % 4 + 1) // 4) for j in range(k))
    return [Run(f"tokenizer-{k}x16-cached{p}", "tokenizer", reqs, prefix=p)]


def _dedupe(runs: list[Run]) -> list[Run]:
    seen, out = set(), []
    for r in runs:
        if r.tag not in seen:
            seen.add(r.tag)
            out.append(r)
    return out


def token_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, min(vocab, 32_000), size=n).tolist()


def execute(url: str, run: Run, vocab: int, seed: int = 0) -> list[Trace]:
    """Run one profiling run on a flushed cache; its traces."""
    rng = np.random.default_rng([seed, sum(map(ord, run.tag)), len(run.tag)])
    flush(url)
    prefix = token_ids(rng, run.prefix, vocab)
    if run.prefix:
        warm = run_group(url, [(f"{run.tag}-warm", prefix, 1, 0.0)], tag=run.tag)
        if warm[0].error:
            return warm
    reqs = [(f"{run.tag}-{i}", prefix[:r.prefix] + token_ids(rng, r.new, vocab), r.output,
             r.offset_s) for i, r in enumerate(run.requests)]
    return run_group(url, reqs, tag=run.tag)


def timelines(traces: list[Trace]) -> list[Timeline]:
    return [Timeline(t.rid, t.sent, t.prompt, t.cached, tuple(t.token_times), t.meta, t.tag,
                     t.sent_wall or None) for t in traces if t.ok]


@dataclass
class Store:
    """`PROFILE.runs.jsonl` (raw traces per run, the source of truth) and
    `PROFILE.samples.jsonl` (the samples derived from each run), appended run by run."""

    out: Path
    identity: dict
    done: dict[str, list[Trace]] = field(default_factory=dict)

    @property
    def runs_path(self) -> Path:
        return self.out.with_suffix(".runs.jsonl")

    @property
    def samples_path(self) -> Path:
        return self.out.with_suffix(".samples.jsonl")

    def load(self) -> None:
        if not self.runs_path.exists():
            return
        for path in (self.runs_path, self.samples_path):
            _drop_torn_tail(path)
        for row, traces in read_runs(self.runs_path, self.identity, _traces_of,
                                     "a profiling run (a JSON object with 'tag' and "
                                     "'traces')"):
            self.done[row["tag"]] = traces

    def append(self, run: Run, traces: list[Trace], samples: list[dict]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with self.runs_path.open("a") as fh:
            fh.write(json.dumps({"tag": run.tag, "kind": run.kind, "server": self.identity,
                                 "traces": [t.to_json() for t in traces]}) + "\n")
        with self.samples_path.open("a") as fh:
            for s in samples:
                fh.write(json.dumps(s) + "\n")
        self.done[run.tag] = traces


def _traces_of(row: dict) -> list[Trace]:
    if not isinstance(row.get("traces"), list):
        raise TypeError("traces")
    return [Trace.from_json(t) for t in row["traces"]]


def read_runs(path: Path, identity: dict, parse: Callable[[dict], object],
              what: str) -> list[tuple[dict, object]]:
    """The rows of a resumable `PROFILE.runs.jsonl` with `parse(row)` of each, every row
    checked (a JSON object with a string 'tag', `parse` does not raise, profiled on the
    server `identity`); an error names the file and line."""
    out = []
    for line_no, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
            ok = isinstance(row, dict) and isinstance(row.get("tag"), str)
            value = parse(row) if ok else None
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise CalibrationError(f"{path}:{line_no}: not {what}; use another --out or "
                                   "delete the file to start over")
        if row.get("server") != identity:
            raise CalibrationError(
                f"{path}:{line_no} was profiled on another server ({row.get('server')}, "
                f"this one is {identity}); use another --out or delete the file to start "
                "over")
        out.append((row, value))
    return out


def _drop_torn_tail(path: Path) -> None:
    """A run cut off while it was being appended (Ctrl-C, a killed process) leaves a
    last line without its newline: drop it (that run is profiled again), so the next
    append does not glue onto it."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    keep = data[:data.rfind(b"\n") + 1]
    atomic_write_text(path, keep.decode("utf-8", errors="replace"))
    print(f"note: {path}: dropped an incomplete last line (cut off while it was written; "
          "a run without its line is profiled again)", file=sys.stderr)


class Bar:
    """A one-line progress bar on stderr (a line every 10 s when not a terminal)."""

    def __init__(self, total: int, budget_s: float, stream=None) -> None:
        self.total, self.budget, self.stream = total, budget_s, stream or sys.stderr
        self.tty, self.last = self.stream.isatty(), 0.0

    def __call__(self, done: int, elapsed: float, samples: int, tag: str = "") -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 10 and done < self.total:
            return
        self.last = now
        frac = min(done / max(self.total, 1), 1.0)
        text = (f"[{'#' * int(24 * frac):24s}] {done}/{self.total} runs  {elapsed:5.0f}/"
                f"{self.budget:.0f} s  {samples} samples  {tag}")
        print("\r" + text[:110].ljust(110) if self.tty else text, end="" if self.tty else "\n",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream)


def profile(url: str, store: Store, lim: ServerLimits, vocab: int, budget_s: float,
            progress: Callable | None = None) -> dict:
    """Run the plan within `budget_s` seconds, skipping runs already in the store.
    Returns counts: runs done now, before, skipped for the budget, failed requests."""
    plan = make_plan(lim)
    start = time.monotonic()
    counts = {"planned": len(plan), "resumed": len(store.done), "ran": 0, "over_budget": 0,
              "failed_requests": 0}
    n_samples = sum(1 for _ in _lines(store.samples_path))
    for run in plan:
        if run.tag in store.done:
            continue
        elapsed = time.monotonic() - start
        if elapsed + run.estimate_s() > budget_s:
            counts["over_budget"] += 1
            continue
        traces = execute(url, run, vocab)
        bad = [t for t in traces if not t.ok]
        counts["failed_requests"] += len(bad)
        if traces and len(bad) == len(traces):
            _check_alive(url, store, bad[0])
        samples = samples_from_timelines(timelines(traces), lim.derive_limits())
        store.append(run, traces, samples)
        counts["ran"] += 1
        n_samples += len(samples)
        if progress:
            progress(len(store.done), time.monotonic() - start, n_samples, run.tag)
    return counts


def _check_alive(url: str, store: Store, example: Trace) -> None:
    """A run whose every request failed: is the server still there? A dead or hung one
    ends profiling (the runs done are kept; the failed run is not)."""
    why = health(url)
    if why:
        raise CalibrationError(
            f"the SGLang server at {url} stopped answering mid-profile ({why}; the last run's "
            f"requests failed: {example.error}); {len(store.done)} runs are kept in "
            f"{store.runs_path}: run the same command again to resume")


def _lines(path: Path):
    if path.exists():
        yield from (line for line in path.read_text().splitlines() if line.strip())


def all_samples(store: Store, lim: ServerLimits) -> list[dict]:
    """Samples re-derived from every stored run (so a better derivation applies to old
    runs too)."""
    out = []
    for traces in store.done.values():
        out += samples_from_timelines(timelines(traces), lim.derive_limits())
    return out
