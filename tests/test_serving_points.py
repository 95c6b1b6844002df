"""benchmarks/serving_points.py's closed loops (issue 10): the burst start and the
de-synchronised diagnostic bound (`--clients uniform`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving_points as sp  # noqa: E402

pytestmark = pytest.mark.offline

ROW = sp.Row("t", "meta-llama/Llama-3.1-8B-Instruct", "h200_sxm", "fp8", "0.5.6", 1, 1000, 40,
             8, 0.0, 0.0, "fp8_block", "fp8_block", 1, 1)


def test_uniform_start_spreads_only_the_first_wave():
    wl = sp._closed(ROW, 2, 4.0)
    assert wl.concurrency == 8 and len(wl.requests) == 16
    assert [r.arrival_s for r in wl.requests[:8]] == [0.5 * i for i in range(8)]
    assert all(r.arrival_s == 0.0 for r in wl.requests[8:])
    assert len({r.segments for r in wl.requests}) == 16  # unique prompts: no cache hits


def test_burst_start_is_lock_step_and_the_uniform_start_is_not():
    st = sp.step_time(ROW, {}, {})
    burst = sp._run(sp._closed(ROW, 3, 0.0), ROW, {}, st)
    e2e = sorted(r["e2e_s"] for r in burst)
    assert e2e[-1] - e2e[0] < 0.02 * e2e[-1]  # about the same latency: the waves repeat
    lock_ttft, lock_tpot = sp._means(burst)
    ttft, tpot = sp.uniform_point(ROW, {}, 4, st)
    # de-synchronised, a request's prefill no longer waits for its wave's (lower TTFT)
    # and other requests' prefills land between its decode steps (higher TPOT)
    assert ttft < lock_ttft / 2 and tpot > lock_tpot
