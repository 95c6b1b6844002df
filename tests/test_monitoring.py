"""The monitoring metrics on hand-computed records and series (twin.monitoring)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from twin.metrics import SERIES_FIELDS
from twin.monitoring import (
    batch_efficiency,
    metric_windows,
    observations,
    radix_sharing_ratio,
    sglang_registry,
    twin_gauges,
    windowed_p99,
)

pytestmark = pytest.mark.offline


def rec(rid: str, arrival: float, ttft: float, e2e: float, queue: float = 0.0,
        prompt: int = 100, cached: int = 0, out: int = 3, status: str = "ok") -> dict:
    gaps = [(e2e - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return {"rid": rid, "arrival_s": arrival, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": out, "priority": 0, "ttft_s": ttft, "tpot_s": None,
            "itl_s": gaps, "e2e_s": e2e, "queue_s": queue, "retractions": 0,
            "preemptions": 0, "status": status, "error": None}


def test_observations_land_where_prometheus_would_observe_them():
    r = rec("a", 5.0, 2.0, 4.0, queue=1.5, out=3)
    t, v = observations([r], "ttft")
    assert t.tolist() == [7.0] and v.tolist() == [2.0]  # at the first token
    t, v = observations([r], "e2e")
    assert t.tolist() == [9.0] and v.tolist() == [4.0]  # at the finish
    t, v = observations([r], "queue")
    assert t.tolist() == [6.5] and v.tolist() == [1.5]  # at the first scheduling
    t, v = observations([r], "itl")
    assert t.tolist() == [8.0, 9.0] and v.tolist() == [1.0, 1.0]  # at each token
    failed = rec("b", 1.0, 0.5, 1.0, status="failed")
    assert observations([failed], "ttft")[0].size == 0  # latencies of ok requests only
    with pytest.raises(ValueError, match="allowed values: ttft"):
        observations([r], "latency")


def test_windowed_p99_per_window_and_empty_windows():
    recs = [rec("a", 1, 0.5, 1), rec("b", 2, 1.0, 2), rec("c", 25, 3.0, 4)]
    w = windowed_p99(recs, "ttft", window_s=10)
    assert [(x.start_s, x.end_s) for x in w] == [(0, 10), (10, 20), (20, 30)]
    assert w[0].value == pytest.approx(0.5 + 0.99 * 0.5) and w[0].n == 2
    assert w[1].value is None and w[1].n == 0  # nothing observed: no value
    assert w[2].value == 3.0


def test_radix_sharing_ratio_counts_at_finish():
    recs = [rec("a", 0, 1, 2, prompt=100, cached=0),
            rec("b", 3, 1, 2, prompt=300, cached=200),  # finishes at 5
            rec("c", 9, 1, 2, prompt=50, cached=50),  # finishes at 11: next window
            rec("d", 1, 1, 2, prompt=1000, cached=1000, status="rejected")]
    w = radix_sharing_ratio(recs, window_s=10)
    assert w[0].value == pytest.approx(200 / 400) and w[0].n == 2
    assert w[1].value == 1.0 and w[1].n == 1


def test_batch_efficiency_is_the_time_average_batch_over_the_budget():
    recs = [rec("a", 0, 1, 10, queue=0),  # in the batch [0, 10)
            rec("b", 5, 1, 10, queue=0),  # [5, 15)
            rec("c", 0, 1, 1, queue=None)]  # never scheduled: not counted
    w = batch_efficiency(recs, max_running=2, window_s=10)
    assert w[0].value == pytest.approx((10 + 5) / 10 / 2)
    assert w[1].value == pytest.approx(5 / 5 / 2)  # the run ends at 15 s: half a window
    assert all(x.value is None for x in batch_efficiency(recs, None, 10))


def series_rows():
    # t, running, waiting, stored, allocated, largest free run, radix, ratio, int, ext frag
    return [(0.0, 1, 0, 100, 100, 900, 50, 0.7, 0.0, 0.0),
            (1.0, 2, 1, 500, 600, 300, 400, 0.7, 0.1, 0.2),
            (2.0, 2, 3, 400, 800, 100, 100, 0.7, 0.5, 0.6)]


def test_twin_gauges_memory_pressure_eviction_fragmentation():
    g = twin_gauges(series_rows(), SERIES_FIELDS, capacity_tokens=1000)
    t, p = g["memory_pressure_score"]
    assert t == [0.0, 1.0, 2.0] and p == [0.1, 0.6, 0.8]  # allocated / capacity
    assert g["kv_eviction_rate"][1] == [None, 0.0, 300.0]  # the radix cache shrank by 300
    assert g["kv_external_fragmentation"][1] == [0.0, 0.2, 0.6]
    w = metric_windows([], g, None, window_s=2.0)
    assert w["memory_pressure_score"][0].value == pytest.approx(0.35)  # mean of 0.1, 0.6
    assert w["memory_pressure_score"][1].value == 0.8
    assert w["kv_external_fragmentation"][0].value == 0.2  # the window's worst


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    got = [v for (n, lab), v in samples.items()
           if n == name and all(dict(lab).get(k) == x for k, x in labels.items())]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def test_sglang_registry_uses_sglang_names_buckets_and_counts():
    recs = [rec("a", 0, 0.15, 1.0, queue=0.004, prompt=100, cached=0),
            rec("b", 1, 1.5, 3.0, queue=0.3, prompt=300, cached=200),
            rec("c", 2, 9.0, 9.5, status="failed")]
    text = generate_latest(sglang_registry(recs, {"sglang:num_running_reqs": 1.0},
                                           capacity_tokens=1000, max_running=4)).decode()
    s = _samples(text)
    ttft = "sglang:time_to_first_token_seconds_bucket"
    assert _value(s, ttft, le="0.1") == 0 and _value(s, ttft, le="0.2") == 1
    assert _value(s, ttft, le="1.0") == 1 and _value(s, ttft, le="2.0") == 2
    assert _value(s, ttft, le="+Inf") == 2  # the failed request is not a TTFT sample
    assert _value(s, "sglang:time_to_first_token_seconds_sum") == pytest.approx(1.65)
    assert _value(s, "sglang:queue_time_seconds_bucket", le="0.005") == 2  # failed: queued
    assert _value(s, "sglang:num_requests_total") == 2
    assert _value(s, "sglang:prompt_tokens_total") == 400
    assert _value(s, "sglang:cached_tokens_total", cache_source="device") == 200
    assert _value(s, "sglang:generation_tokens_total") == 6
    assert _value(s, "sglang:max_total_num_tokens") == 1000
    assert _value(s, "sglang:num_running_reqs", tp_rank="0") == 1
    assert _value(s, "radix_sharing_ratio") == pytest.approx(0.5)
    assert "queue_duration_seconds_bucket" in text
    early = _samples(generate_latest(sglang_registry(recs, until_s=1.0)).decode())
    assert _value(early, "sglang:num_requests_total") == 1  # only "a" had finished by 1 s
    assert _value(early, ttft, le="+Inf") == 1


def test_metric_windows_are_deterministic():
    recs = [rec(f"r{i}", i * 0.7, 0.1 + (i % 5) * 0.4, 2.0 + i % 3, queue=0.05 * (i % 4),
                cached=(i % 2) * 50) for i in range(60)]
    g = twin_gauges(series_rows(), SERIES_FIELDS, 1000)
    a = metric_windows(recs, g, 8, window_s=7.5)
    b = metric_windows(list(reversed(recs)), g, 8, window_s=7.5)
    assert a == b  # record order does not matter


def test_live_side_reads_counters_and_gauges_from_exposition_text():
    from runtime.live_metrics import live_gauges, run_totals

    recs = [rec("a", 0, 0.15, 1.0, prompt=100, cached=0),
            rec("b", 1, 1.5, 3.0, prompt=300, cached=200)]
    gauges = {"sglang:kv_available_tokens": 750.0, "sglang:num_running_reqs": 1.0}
    before = generate_latest(sglang_registry(recs, until_s=1.0)).decode()
    after = generate_latest(sglang_registry(recs, gauges, capacity_tokens=1000)).decode()
    t = run_totals(before, after)
    assert t["sglang:num_requests_total"] == 1  # "b" finished during the interval
    assert t["sglang:prompt_tokens_total"] == 300 and t["sglang:cached_tokens_total"] == 200
    assert t["radix_sharing_ratio"] == pytest.approx(200 / 300)
    assert t["sglang:kv_available_tokens"] == 750 and t["sglang:max_total_num_tokens"] == 1000
    rows = [{"t_s": -0.2, "sglang:kv_available_tokens": 1000.0,
             "sglang:max_total_num_tokens": 1000.0},  # before the replay's origin: dropped
            {"t_s": 0.5, "sglang:kv_available_tokens": 900.0,
             "sglang:max_total_num_tokens": 1000.0, "sglang:num_running_reqs": 1.0}]
    g = live_gauges(rows)
    assert g["memory_pressure_score"] == ([0.5], [pytest.approx(0.1)])
    assert g["num_running_reqs"] == ([0.5], [1.0])
