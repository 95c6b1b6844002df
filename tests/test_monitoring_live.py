"""The same replay measured live (the real CPU SGLang server, its scraped /metrics) and
simulated: the monitoring metrics under the same names agree where the twin agrees."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from test_monitoring import _samples, _value

from runtime.live_metrics import SERIES_FILE, load_run
from runtime.server_api import probe, twin_server_args
from servetwin.cli import main
from twin.config import derive_capacity
from twin.metrics import SERIES_FIELDS
from twin.monitoring import metric_windows, sglang_registry, twin_gauges
from twin.perf.cpu_guess import cpu_step_time
from twin.sim import SimConfig, simulate
from twin.workload import get_workload

pytestmark = pytest.mark.live

N = 20
# One client: requests one after another, most opening with one of two templates, so which
# prefix is cached when a request arrives does not depend on timing, and the twin's cache
# and SGLang's must hit the same tokens.
SPEC = (f"arrival=closed,concurrency=1,n={N},prompt=uniform:16:120,output=uniform:4:12,"
        "templates=2,template_len=256,share=0.8")


@pytest.fixture(scope="module")
def runs(sglang_server, tmp_path_factory):
    """`servetwin live replay --scrape-every` of SPEC, and the twin of the same server."""
    out = tmp_path_factory.mktemp("live-monitoring")
    assert main(["live", "replay", "--url", sglang_server.url, "--workload", SPEC,
                 "--out", str(out), "--scrape-every", "0.5",
                 "--max-lateness-ms", "60000"]) == 0
    facts = probe(sglang_server.url)
    args = twin_server_args(facts.info)
    cap = derive_capacity(args, "a100-pcie-80gb")
    sim = simulate(get_workload(SPEC, 0), SimConfig(args=args),
                   step_time=cpu_step_time(cap, args))
    return load_run(out), sim, cap, out


def test_counters_agree_under_sglang_names(runs):
    live, sim, cap, _ = runs
    assert all(r["status"] == "ok" for r in live.records)
    twin = _samples(generate_latest(sglang_registry(sim.records,
                                                    capacity_tokens=cap.max_total_num_tokens)
                                    ).decode())
    t = live.totals
    assert t["sglang:num_requests_total"] == N == _value(twin, "sglang:num_requests_total")
    prompt = sum(r["prompt_tokens"] for r in live.records)
    assert t["sglang:prompt_tokens_total"] == prompt == _value(twin, "sglang:prompt_tokens_total")
    assert t["sglang:generation_tokens_total"] == _value(twin, "sglang:generation_tokens_total")
    assert t["sglang:time_to_first_token_seconds_count"] == N
    # the pool the twin simulates is the server's own
    assert t["sglang:max_total_num_tokens"] == cap.max_total_num_tokens
    # cached tokens: the same prefixes hit (a random token id may coincide: +1 at most)
    cached_live = t["sglang:cached_tokens_total"]
    cached_twin = _value(twin, "sglang:cached_tokens_total")
    assert cached_twin > 0 and abs(cached_live - cached_twin) <= N


def test_radix_sharing_ratio_agrees_three_ways(runs):
    live, sim, _, _ = runs
    by_counters = live.totals["radix_sharing_ratio"]
    by_live_records = metric_windows(live.records, window_s=1e6)["radix_sharing_ratio"][0]
    by_twin = metric_windows(sim.records, window_s=1e6)["radix_sharing_ratio"][0]
    assert by_live_records.n == by_twin.n == N
    assert by_counters == pytest.approx(by_live_records.value, abs=1e-6)
    assert by_twin.value == pytest.approx(by_live_records.value, abs=0.01)
    assert by_twin.value > 0.3  # the workload does share


def test_sglang_cache_hit_rate_is_the_last_prefill_batch(runs):
    """SGLang 0.5.23's `sglang:cache_hit_rate` gauge is the hit ratio of the last prefill
    batch (one request at a time here: the last request's cached / prompt tokens)."""
    live, _, _, _ = runs
    last = max(live.records, key=lambda r: r["arrival_s"])
    assert live.totals["sglang:cache_hit_rate"] == pytest.approx(
        last["cached_tokens"] / last["prompt_tokens"], abs=1e-3)


def test_scraped_gauges_and_alert_eval_on_the_live_run(runs, capsys):
    live, sim, cap, out = runs
    rows = [json.loads(x) for x in (out / SERIES_FILE).read_text().splitlines()]
    assert len(rows) >= 3 and all("sglang:num_running_reqs" in r for r in rows)
    t, pressure = live.gauges["memory_pressure_score"]
    assert t == sorted(t) and all(0 <= p <= 1 for p in pressure)
    assert max(pressure) > 0  # the cache holds the prompts
    twin = twin_gauges(sim.series, SERIES_FIELDS, cap.max_total_num_tokens)
    live_w = metric_windows(live.records, live.gauges, live.max_running, window_s=1e6)
    twin_w = metric_windows(sim.records, twin, cap.max_running_requests, window_s=1e6)
    common = set(live_w) & set(twin_w)
    assert {"ttft_p99", "radix_sharing_ratio", "batch_efficiency",
            "memory_pressure_score"} <= common
    assert main(["alerts", "eval", str(out), "--window", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"] == "live"
    assert doc["skipped"] == ["kv_fragmentation_defragment"]  # SGLang exports none
    assert "memory_pressure_score" in doc["windows"]
