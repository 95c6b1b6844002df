"""A burst-started closed loop on the real CPU SGLang server stays in lock-step, as in the
twin (issue 10; benchmarks/desync_live.py runs the larger cases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from desync_live import spreads  # noqa: E402

from runtime.client import ReplayConfig, replay  # noqa: E402
from runtime.server_api import probe, twin_server_args  # noqa: E402
from twin.config import derive_capacity  # noqa: E402
from twin.perf.cpu_guess import cpu_step_time  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import get_workload  # noqa: E402

pytestmark = pytest.mark.live


def test_burst_closed_loop_finishes_wave_by_wave_live_and_in_the_twin(sglang_server):
    c = 8
    wl = get_workload(f"arrival=closed,concurrency={c},n={3 * c},prompt=fixed:128,"
                      "output=fixed:16", 0)
    facts = probe(sglang_server.url)
    live = replay(wl, ReplayConfig(url=sglang_server.url, seed=0), facts=facts)
    assert all(r["status"] == "ok" for r in live.records)
    args = twin_server_args(facts.info)
    twin = simulate(wl, SimConfig(args=args),
                    step_time=cpu_step_time(derive_capacity(args, "a100-pcie-80gb"), args))
    _, live_spread = spreads(live.records, c)
    _, twin_spread = spreads(twin.records, c)
    assert twin_spread == [0.0, 0.0, 0.0]  # every wave ends in one step
    # live: a wave's requests end within a few percent of a request's latency of each
    # other (one decode step is about 1/16 of it here), never spread over the cycle
    assert len(live_spread) == 3 and max(live_spread) < 0.1, live_spread
