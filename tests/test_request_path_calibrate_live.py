"""`servetwin calibrate` against the real CPU SGLang server fits the tokenizer manager's
costs from its stamps, and `simulate --calibration` runs them (issue 10)."""

from __future__ import annotations

import json

import pytest

from servetwin.cli import main
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload

pytestmark = pytest.mark.live


def test_calibrate_fits_the_tokenizer_costs_and_simulate_uses_them(sglang_server, tmp_path):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--url", sglang_server.url, "--out", str(out),
                 "--budget-s", "20"]) == 0
    rp = json.loads(out.read_text())["request_path"]
    assert rp["tokenizer_samples"] >= 5, rp
    # a request's serial cost at the tokenizer manager: above zero, below a 2-core
    # machine's worst (benchmarks/request_path.py measured 0.2-5 ms under load)
    assert 0 < rp["per_request_s"] + 256 * rp["per_token_s"] < 0.05, rp
    cfg = SimConfig(calibration=str(out))
    path = cfg.path_for(None)
    assert (path.per_request_s, path.per_token_s) == (rp["per_request_s"], rp["per_token_s"])
    # eight requests sent together reach the scheduler one service apart: the last one's
    # queue is at least seven services behind the first's TTFT start
    wl = Workload("burst", tuple(Request.make(f"r{i}", 0.0, [(900 + i, 256)], 4)
                                 for i in range(8)))
    recs = {r["rid"]: r for r in simulate(wl, cfg).records}
    assert recs["r7"]["ttft_s"] >= 8 * path.service_s(256) + path.latency_s
