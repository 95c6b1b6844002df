"""benchmarks/decode_cuts.py: its wrappers only observe (the records are the same with and
without them) and it names a cause for every decode run."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode_cuts  # noqa: E402

from twin.config import ServerArgs  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import from_spec  # noqa: E402

CAUSES = {"a request finishing", "the KV pool", "an arrival", "the time-series sample",
          "the time-series sample, nothing waiting", "the overlap loop's one-step boundary",
          "a time slice", "the horizon", "a parked pass (one step)",
          "no step (the KV pool refused it: a retraction)", "a submit (a fleet's cut)"}


def run(instrumented: bool):
    wl = from_spec("arrival=poisson,rate=4,n=300,prompt=uniform:200:800,"
                   "output=uniform:20:120", seed=3)
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
    cfg = SimConfig(args=args, gpu="a100-sxm-80gb", step_time_backend="roofline",
                    sample_every_s=0.5)
    counts: collections.Counter = collections.Counter()
    restore = decode_cuts.instrument(counts) if instrumented else None
    try:
        res = simulate(wl, cfg)
    finally:
        if restore:
            restore()
    return list(res.records), res.counters, counts


def test_the_counts_name_every_run_and_leave_the_records_alone():
    plain, plain_counters, _ = run(False)
    seen, counters, counts = run(True)
    assert seen == plain and counters == plain_counters
    assert set(counts) <= CAUSES, set(counts) - CAUSES
    # every run advances at least one step but a refused one: the steps bound the runs
    assert 0 < sum(counts.values()) <= counters["decode_steps"] + counts[
        "no step (the KV pool refused it: a retraction)"]
    assert counts["a request finishing"] > 0 and counts["an arrival"] > 0
    assert counts["the time-series sample"] + counts[
        "the time-series sample, nothing waiting"] > 0
