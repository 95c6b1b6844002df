"""The runs of a vLLM profile (calibration/vllm.py): one run on a reset prefix cache with
vLLM's `/metrics` read before and after, the samples of a run, and the resumable store of
runs (`PROFILE.runs.jsonl`)."""

from __future__ import annotations

import json
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration import vllm_derive as vd
from calibration.derive import Limits, Timeline, samples_from_timelines
from calibration.profile import (
    Run,
    ServerLimits,
    _drop_torn_tail,
    make_plan,
    read_runs,
    timelines,
    token_ids,
)
from calibration.session import CalibrationError, Trace, flush, run_group
from runtime.vllm_cpu import metrics

PREFILL, QUEUE = vd.PREFILL, vd.QUEUE
KEPT = tuple(f"{h}_{s}" for h in (vd.PREFILL, vd.DECODE, vd.QUEUE) for s in ("sum", "count")) \
    + ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_count")


@dataclass(frozen=True)
class VllmLimits:
    """The vLLM server's limits, by its own argument names."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # usable KV blocks x block_size (vLLM's null block excluded)
    max_model_len: int

    def server_limits(self) -> ServerLimits:
        return ServerLimits(self.max_num_seqs, self.kv_tokens, self.max_num_batched_tokens,
                            min(self.max_model_len, self.kv_tokens) - 1)

    def derive_limits(self) -> Limits:
        return Limits(self.max_num_batched_tokens, self.max_num_seqs)


def execute(front: str, engine: str, run: Run, vocab: int, seed: int = 0) -> dict:
    """One profiling run on a reset prefix cache: its traces and vLLM's counter delta
    over it (the warm-up request of a cached run is outside the delta)."""
    rng = np.random.default_rng([seed, sum(map(ord, run.tag)), len(run.tag)])
    flush(front)
    prefix = token_ids(rng, run.prefix, vocab)
    if run.prefix:
        run_group(front, [(f"{run.tag}-warm", prefix, 1, 0.0)], tag=run.tag)
    reqs = [(f"{run.tag}-{i}", prefix[:r.prefix] + token_ids(rng, r.new, vocab), r.output,
             r.offset_s) for i, r in enumerate(run.requests)]
    before = metrics.counters(engine)
    traces = run_group(front, reqs, tag=run.tag)
    d = metrics.delta(before, metrics.counters(engine))
    return {"tag": run.tag, "kind": run.kind, "traces": [t.to_json() for t in traces],
            "metrics": {k: d[k] for k in KEPT if k in d}}


def _delta(row: dict) -> dict:
    """The run's metric delta (rows of the first vLLM profiles kept only the lone
    request's prefill and queue time)."""
    if "metrics" in row:
        return row["metrics"]
    if row.get("prefill_s"):
        return {PREFILL + "_sum": row["prefill_s"], PREFILL + "_count": 1,
                QUEUE + "_sum": row.get("queue_s", 0.0), QUEUE + "_count": 1}
    return {}


def _lines(row: dict) -> tuple[list[Timeline], bool]:
    traces = [Trace.from_json(t) for t in row["traces"]]
    return timelines(traces), all(t.ok for t in traces)


def samples_of(row: dict, lim: VllmLimits) -> list[dict]:
    """The samples of one run under vLLM's rules (`calibration.vllm_derive`)."""
    lines, all_ok = _lines(row)
    out = vd.token_gap_samples(lines, lim.max_num_batched_tokens, lim.max_num_seqs)
    if all_ok:
        out += vd.engine_samples(lines, _delta(row), lim.max_num_batched_tokens, row["tag"])
    return out


def sglang_rule_samples(row: dict, lim: VllmLimits) -> list[dict]:
    """The first vLLM profiles' samples, kept to compare against (benchmarks/vllm_live.py):
    token gaps read under SGLang's rules (`calibration.derive`), plus the lone prefills."""
    lines, all_ok = _lines(row)
    out = samples_from_timelines(lines, lim.derive_limits())
    if all_ok and len(lines) == 1:
        out += [s for s in vd.engine_samples(lines, _delta(row), lim.max_num_batched_tokens,
                                             row["tag"]) if s["source"] == "vllm-prefill-time"]
    return out


def request_path_s(rows: list[dict]) -> float | None:
    """Median TTFT outside the engine over the lone-request runs."""
    paths = [p for row in rows if (p := vd.request_path(_lines(row)[0], _delta(row)))
             is not None]
    return round(float(np.median(paths)), 6) if paths else None


# ---- the store, resumable ---------------------------------------------------------------
def _check_traces(row: dict) -> bool:
    if not all(Trace.from_json(t) for t in row["traces"]):
        raise ValueError("traces")
    return True


@dataclass
class Store:
    """`PROFILE.runs.jsonl`: one row per run (raw traces, metric delta, the server's
    identity), appended as each run ends."""

    out: Path
    identity: dict
    rows: dict[str, dict] = field(default_factory=dict)

    @property
    def runs_path(self) -> Path:
        return self.out.with_suffix(".runs.jsonl")

    def load(self) -> None:
        if not self.runs_path.exists():
            return
        _drop_torn_tail(self.runs_path)
        for row, _ in read_runs(self.runs_path, self.identity, _check_traces,
                                "a vLLM profiling run (a JSON object with 'tag', 'traces' "
                                "and 'metrics')"):
            self.rows[row["tag"]] = row

    def append(self, row: dict) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        row = {**row, "server": self.identity}
        with self.runs_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        self.rows[row["tag"]] = row


def run_plan(front: str, engine: str, store: Store, lim: VllmLimits, vocab: int,
             budget_s: float, progress: Callable | None = None) -> dict:
    """Run the plan within `budget_s` seconds, skipping runs already stored; counts."""
    plan = make_plan(lim.server_limits())
    start = time.monotonic()
    counts = {"planned": len(plan), "resumed": len(store.rows), "ran": 0, "over_budget": 0,
              "failed_requests": 0}
    n = sum(len(samples_of(r, lim)) for r in store.rows.values())
    for run in plan:
        if run.tag in store.rows:
            continue
        if time.monotonic() - start + run.estimate_s() > budget_s:
            counts["over_budget"] += 1
            continue
        row = execute(front, engine, run, vocab)
        bad = sum(t["error"] is not None or not t["token_times"] for t in row["traces"])
        counts["failed_requests"] += bad
        if bad == len(row["traces"]):
            _check_alive(engine, store, row)
        store.append(row)
        counts["ran"] += 1
        n += len(samples_of(row, lim))
        if progress:
            progress(len(store.rows), time.monotonic() - start, n, run.tag)
    return counts


def _check_alive(engine: str, store: Store, row: dict) -> None:
    from runtime.server_api import _get, describe_url_error

    try:
        _get(engine + "/health", 30.0)
    except (OSError, urllib.error.URLError) as exc:
        raise CalibrationError(
            f"the vLLM server at {engine} stopped answering mid-profile (GET /health: "
            f"{describe_url_error(exc)}; the last run's requests failed: "
            f"{row['traces'][0]['error']}); {len(store.rows)} runs are kept in "
            f"{store.runs_path}: run the same command again to resume") from None
