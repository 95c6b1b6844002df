"""The vLLM twin-vs-live arithmetic without a server: counters, the compared quantities,
the lone-prefill sample of the vLLM profile (experiments/vllm_live.py, calibration/vllm.py)."""

from __future__ import annotations

from calibration.vllm import VllmLimits, request_path_s, samples_of
from experiments import vllm_live as vl
from runtime.vllm_cpu.metrics import delta, parse_counters

METRICS = """# HELP vllm:num_preemptions_total preemptions
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 10.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 4.0
"""


def test_counters_are_summed_over_label_sets_and_differenced():
    c = parse_counters(METRICS + 'vllm:num_preemptions_total{engine="1"} 1.0\n')
    assert c["vllm:num_preemptions_total"] == 3.0
    assert c["vllm:iteration_tokens_total_count"] == 10.0
    assert c["vllm:prefix_cache_hits_total"] == 0.0  # absent: zero
    d = delta(parse_counters(""), c)
    assert d["vllm:request_queue_time_seconds_sum"] == 0.5


def rec(rid, arrival, ttft, itl, status="ok", cached=0):
    return {"rid": rid, "arrival_s": arrival, "ttft_s": ttft, "itl_s": itl,
            "e2e_s": ttft + sum(itl), "status": status, "cached_tokens": cached}


def test_chunk_steps_counts_the_long_gaps_between_arrival_and_first_token():
    # r0 decodes every 0.1 s; r1 arrives at 0.35 and its prefill takes three 0.5 s steps
    r0 = rec("r0", 0.0, 0.1, [0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.1, 0.1])
    r1 = rec("r1", 0.35, 1.9 - 0.35, [0.1])  # its first token in the step r0 emits at 1.9
    assert vl.chunk_steps([r0, r1]) == 3


def test_max_concurrency_and_fcfs():
    recs = [rec("a", 0.0, 1.0, [1.0]), rec("b", 0.1, 1.0, [1.0]), rec("c", 0.2, 1.5, [1.0])]
    assert vl.max_concurrency(recs) == 3  # c starts at 1.7, before a and b end (2.0, 2.1)
    assert vl.first_token_order(recs) == ["a", "b", "c"] == vl.arrival_order(recs)
    assert vl.fcfs(recs) and not vl.fcfs([rec("a", 0.0, 1.0, [1.0]), rec("b", 0.1, 0.5, [1.0])])
    row = vl.row("twin", "seqs", recs, 0, 5, 0.0, 0.0)
    assert row["fcfs"] and row["max_running"] == 3 and row["hits"] == 0


def test_a_lone_prefill_run_gives_an_engine_time_sample_and_the_request_path():
    trace = {"rid": "t-0", "sent": 10.0, "prompt": 1000, "token_times": [10.5],
             "meta": {"cached_tokens": 0}, "error": None, "tag": "prefill-n1000"}
    row = {"tag": "prefill-n1000", "kind": "prefill", "traces": [trace],
           "prefill_s": 0.4, "queue_s": 0.02}
    lim = VllmLimits(4, 512, 2944, 2048)
    lone = [s for s in samples_of(row, lim) if s["source"] == "vllm-prefill-time"]
    assert len(lone) == 1 and lone[0]["dur_s"] == 0.4
    assert lone[0]["kind"] == "chunked-prefill" and len(lone[0]["steps"]) == 2  # 512 + 488
    assert request_path_s([row]) == 0.08
