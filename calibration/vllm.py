"""A minimal step-time profile of a live vLLM V1 server (the CPU harness), fitted as
SGLang's is (calibration/fit.py), for the twin's vLLM replica.

vLLM's OpenAI API has no `/server_info`, no `--enable-metrics` meta_info stamps and no
`/generate`; the length router (runtime/length_router.py) in front of a vLLM pool speaks
SGLang's `/generate` and `/flush_cache` for it, so the SGLang profiling plan
(`calibration.profile.make_plan`, sized by the vLLM server's own limits) runs through it
unchanged. Samples:
- token gaps (`calibration.derive`), as for SGLang: decode steps, and prefill steps that
  land while a batch runs; vLLM's token budget is its `max_num_batched_tokens`;
- lone prefills (source `vllm-prefill-time`): a run of one request, nothing else in
  flight, gives its prefill's engine time from vLLM's own histogram
  `vllm:request_prefill_time_seconds` (scheduled to first token), read from `/metrics`
  before and after: the counterpart of SGLang's forward stamps. Its TTFT minus that and
  the queue time (`vllm:request_queue_time_seconds`) is the request path outside the
  engine (HTTP, the length router, tokenizer-free input processing, detokenizer).

The profile is the SGLang profile's shape (`servetwin_calibration: 1`) with `engine.name`
`vllm`, `server_args` by vLLM's names and `request_path.total_s`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calibration.derive import Limits, chunk_steps, samples_from_timelines
from calibration.fit import fit_step_time
from calibration.profile import Run, ServerLimits, make_plan, timelines, token_ids
from calibration.session import Trace, flush, run_group
from runtime.vllm_cpu import metrics

PREFILL = "vllm:request_prefill_time_seconds"
QUEUE = "vllm:request_queue_time_seconds"


@dataclass(frozen=True)
class VllmLimits:
    """The vLLM server's limits, by its own argument names."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # usable KV blocks x block_size
    max_model_len: int

    def server_limits(self) -> ServerLimits:
        return ServerLimits(self.max_num_seqs, self.kv_tokens, self.max_num_batched_tokens,
                            min(self.max_model_len, self.kv_tokens) - 1)

    def derive_limits(self) -> Limits:
        return Limits(self.max_num_batched_tokens, self.max_num_seqs)


def execute(front: str, engine: str, run: Run, vocab: int, seed: int = 0) -> dict:
    """One profiling run on a reset prefix cache: its traces and, for a run of one
    request, vLLM's own prefill and queue time of it."""
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
    row = {"tag": run.tag, "kind": run.kind, "traces": [t.to_json() for t in traces]}
    if len(reqs) == 1 and d[PREFILL + "_count"] == 1:
        row |= {"prefill_s": d[PREFILL + "_sum"], "queue_s": d[QUEUE + "_sum"]}
    return row


def samples_of(row: dict, lim: VllmLimits) -> list[dict]:
    traces = [Trace.from_json(t) for t in row["traces"]]
    out = samples_from_timelines(timelines(traces), lim.derive_limits())
    if row.get("prefill_s") and traces[0].ok:
        tr = traces[0]
        steps = chunk_steps(tr.prompt - tr.cached, tr.cached, lim.max_num_batched_tokens)
        out.append({"steps": steps, "dur_s": round(row["prefill_s"], 7),
                    "kind": "prefill" if len(steps) == 1 else "chunked-prefill",
                    "source": "vllm-prefill-time", "tag": row["tag"]})
    return out


def request_path_s(rows: list[dict]) -> float | None:
    """Median TTFT outside the engine over the lone-prefill runs."""
    paths = []
    for row in rows:
        tr = Trace.from_json(row["traces"][0])
        if row.get("prefill_s") and tr.ok:
            paths.append(tr.token_times[0] - tr.sent - row["prefill_s"] - row["queue_s"])
    return round(float(np.median(paths)), 6) if paths else None


def profile(front: str, engine: str, lim: VllmLimits, out: Path, budget_s: float,
            vocab: int, server_args: dict, log=print) -> dict:
    """Run the plan within `budget_s`, keep the raw runs in `out.runs.jsonl`, fit, write
    the profile to `out` and return it."""
    runs_path = out.with_suffix(".runs.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_path.unlink(missing_ok=True)
    start, rows = time.monotonic(), []
    for run in make_plan(lim.server_limits()):
        if time.monotonic() - start + run.estimate_s() > budget_s:
            continue
        row = execute(front, engine, run, vocab)
        rows.append(row)
        with runs_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        log(f"  {run.tag}: {len(samples_of(row, lim))} samples")
    prof = fit_profile(rows, lim, server_args)
    out.write_text(json.dumps(prof, indent=2) + "\n")
    return prof


def fit_profile(rows: list[dict], lim: VllmLimits, server_args: dict) -> dict:
    samples = [s for row in rows for s in samples_of(row, lim)]
    fitted = fit_step_time(samples, 1)
    return {"servetwin_calibration": 1, "engine": {"name": "vllm", "version": "0.32.0"},
            "device": {"kind": "cpu", "tp_size": 1}, "server_args": server_args,
            **fitted, "request_path": {"total_s": request_path_s(rows)},
            "runs": len(rows), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
