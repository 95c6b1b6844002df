"""`servetwin report` on a real live replay: the CPU SGLang server (the `sglang_server`
fixture) driven by `servetwin live replay --out`, whose directory has no timeseries.csv."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from test_report import figures

from servetwin.cli import main

pytestmark = pytest.mark.live


def test_report_of_a_live_replay(sglang_server, tmp_path):
    out = tmp_path / "live"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["live", "replay", "--url", sglang_server.url, "--workload",
                   "arrival=poisson,rate=4,n=12,prompt=uniform:20:200,output=uniform:4:16,"
                   "tiers=0:0.5/10:0.5", "--seed", "3", "--max-lateness-ms", "60000",
                   "--out", str(out)])
    assert rc == 0, err.getvalue()
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in recs if r["status"] == "ok"]
    assert len(recs) == 12 and ok
    assert "servetwin live replay report" in page and sglang_server.url in page
    figs = figures(page)
    assert sorted(figs) == ["cdf", "classes"] and "no timeseries.csv" in page
    ttft = next(t for t in figs["cdf"] if t["xaxis"] == "x")
    assert len(ttft["x"]) == len(ok)
