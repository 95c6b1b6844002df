"""The live fleet's pure pieces, offline: router flags, the length router's rules and its
vLLM translation, the per-worker split from /metrics, replica labels, fleet CLI checks."""

from __future__ import annotations

import pytest

from runtime.length_router import (
    Pool,
    check_pools,
    choose_pool,
    parse_pool,
    prompt_length,
    sglang_chunk,
    vllm_completion_body,
)
from runtime.recording import StreamLog, replica_label
from runtime.router import RouterOptions, router_command
from runtime.worker_split import counters, worker_split
from servetwin.cli import main
from twin.workload import Request

pytestmark = pytest.mark.offline


def test_router_command_is_loopback_with_the_routers_own_flags():
    opts = RouterOptions(policy="cache_aware", cache_threshold=0.5, retry_max_retries=2,
                         disable_circuit_breaker=True, health_check_interval_secs=1)
    cmd = router_command("/py", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 30000, 29001, opts)
    assert cmd[:3] == ["/py", "-m", "sglang_router.launch_router"]
    text = " ".join(cmd)
    assert "--host 127.0.0.1 --port 30000" in text
    assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2" in text
    assert "--prometheus-host 127.0.0.1 --prometheus-port 29001" in text
    for part in ("--policy cache_aware", "--cache-threshold 0.5", "--retry-max-retries 2",
                 "--disable-circuit-breaker", "--health-check-interval-secs 1"):
        assert part in text
    assert "--disable-retries" not in text  # False switches are left out
    with pytest.raises(ValueError, match="router policy"):
        RouterOptions(policy="least_load")


def test_pools_and_the_length_rule_match_the_twins():
    from twin.routers import LengthRouter

    pools = [parse_pool("sglang=sglang:http://127.0.0.1:30000:32000"),
             parse_pool("medium=vllm:http://127.0.0.1:30001:64000"),
             parse_pool("large=vllm:http://127.0.0.1:30002")]
    assert pools[0] == Pool("sglang", "http://127.0.0.1:30000", "sglang", 32000)
    assert pools[2].max_prompt_tokens is None and pools[2].url == "http://127.0.0.1:30002"
    check_pools(pools)
    twin = LengthRouter(thresholds=[32000, 64000], pools=["sglang", "medium", "large"])
    for n in (1, 31999, 32000, 32001, 64000, 64001, 200000):
        req = Request.make("r", 0.0, [(1, n)], 1)
        assert choose_pool(pools, n).name == twin.pool_of(req), n
    with pytest.raises(ValueError, match="only the last pool"):
        check_pools([Pool("a", "u", "sglang", None), Pool("b", "u", "vllm", 10)])
    with pytest.raises(ValueError, match="increase"):
        check_pools([Pool("a", "u", "sglang", 10), Pool("b", "u", "vllm", 5), Pool("c", "u", "vllm", None)])
    with pytest.raises(ValueError, match="engine"):
        parse_pool("x=trt:http://127.0.0.1:1")
    assert prompt_length({"input_ids": [1, 2, 3]}) == 3
    assert prompt_length({"text": "abcdefgh"}) == 2  # 4 characters per token


def test_sglang_generate_becomes_a_vllm_completion_and_back():
    body = {"rid": "r7", "input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0}}
    out = vllm_completion_body(body, "tiny-llama")
    assert out["model"] == "tiny-llama" and out["prompt"] == [5, 6, 7]
    assert (out["max_tokens"], out["temperature"], out["ignore_eos"]) == (4, 0.0, True)
    assert out["stream"] and out["stream_options"]["continuous_usage_stats"]
    pool = Pool("medium", "http://x", "vllm", None)
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    chunk = sglang_chunk({"choices": [{"text": "ab", "finish_reason": None}],
                          "usage": usage}, "r7", pool)
    meta = chunk["meta_info"]
    assert (meta["completion_tokens"], meta["cached_tokens"], meta["prompt_tokens"]) == (2, 0, 3)
    assert meta["weight_version"] == "replica-medium" and meta["finish_reason"] is None
    last = sglang_chunk({"choices": [{"text": "c", "finish_reason": "length"}],
                         "usage": usage | {"completion_tokens": 4}}, "r7", pool)
    assert last["meta_info"]["finish_reason"] == {"type": "length"}
    # the closing usage-only chunk brings vLLM's cached tokens and keeps the finish reason
    closing = sglang_chunk({"choices": [], "usage": usage | {
        "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 128}}},
        "r7", pool, previous=last)
    assert closing["meta_info"]["finish_reason"] == {"type": "length"}
    assert closing["meta_info"]["cached_tokens"] == 128
    assert sglang_chunk({"choices": [], "usage": usage}, "r7", pool) is None
    # what the replayer makes of the translated stream
    log = StreamLog(Request.make("r7", 0.0, [(1, 3)], 4), 0.0, 0.0)
    for t, k in ((0.1, 1), (0.2, 2), (0.3, 3)):
        log.on_chunk(t, {**meta, "completion_tokens": k})
    log.on_chunk(0.4, last["meta_info"])
    log.on_chunk(0.5, closing["meta_info"])
    rec = log.record()
    assert rec["status"] == "ok" and rec["replica"] == "replica-medium"
    assert rec["cached_tokens"] == 128 and rec["output_tokens"] == 4


SGLANG_BEFORE = """# TYPE sglang:num_requests_total counter
sglang:num_requests_total{is_streaming="false",model_name="m"} 1.0
sglang:num_requests_total{is_streaming="true",model_name="m"} 4.0
sglang:prompt_tokens_total{is_streaming="true"} 100.0
sglang:prefill_effective_tokens_total{mode="input"} 100.0
sglang:prefill_effective_tokens_total{mode="device_hit"} 10.0
sglang:generation_tokens_total{x="1"} 20.0
"""
SGLANG_AFTER = SGLANG_BEFORE.replace(" 4.0", " 10.0").replace(" 100.0", " 700.0").replace(
    'device_hit"} 10.0', 'device_hit"} 310.0').replace(" 20.0", " 68.0")
VLLM = """vllm:request_success_total{finished_reason="length"} 3.0
vllm:request_success_total{finished_reason="stop"} 1.0
vllm:prompt_tokens_total{engine="0"} 400.0
vllm:prompt_tokens_cached_total{engine="0"} 128.0
vllm:generation_tokens_total{engine="0"} 32.0
"""


def test_worker_split_from_metrics_counters():
    assert counters(SGLANG_BEFORE) == {"requests": 5.0, "prompt_tokens": 100.0,
                                       "cached_tokens": 10.0, "output_tokens": 20.0}
    assert counters(VLLM) == {"requests": 4.0, "prompt_tokens": 400.0, "cached_tokens": 128.0,
                              "output_tokens": 32.0}
    assert counters("# unavailable: GET /metrics: Connection refused\n") is None
    rows = worker_split({"a": SGLANG_BEFORE, "b": SGLANG_BEFORE, "dead": SGLANG_BEFORE},
                        {"a": SGLANG_AFTER, "b": SGLANG_BEFORE, "dead": "# unavailable\n"})
    a, b, dead = rows
    assert (a["requests"], a["prompt_tokens"], a["cached_tokens"], a["output_tokens"]) == (
        6, 600, 300, 48)
    assert a["request_share"] == 1.0 and a["cached_share"] == 0.5
    assert b["requests"] == 0 and b["cached_share"] == 0.0
    assert dead["requests"] is None and "after" in dead["note"]


def test_replica_labels():
    assert replica_label("replica-3") == "replica-3"
    assert replica_label("default") is None and replica_label(None) is None
    log = StreamLog(Request.make("r", 0.0, [(1, 3)], 1), 0.0, 0.0)
    log.on_chunk(0.1, {"completion_tokens": 1, "finish_reason": {"type": "length"},
                       "weight_version": "default"})
    assert "replica" not in log.record()  # a single server's records keep the exact schema


def test_fleet_spec_and_cli_checks(capsys):
    from runtime.fleet import FleetSpec

    with pytest.raises(ValueError, match="replicas"):
        FleetSpec(replicas=0)
    with pytest.raises(ValueError, match="per replica"):
        FleetSpec(server_args=("--port", "1"))
    assert main(["live", "fleet", "--vllm-replicas", "1"]) == 2
    assert "needs --length-thresholds" in capsys.readouterr().err
    assert main(["live", "fleet", "--vllm-replicas", "2", "--length-thresholds", "100"]) == 2
    assert "needs 2" in capsys.readouterr().err
    assert main(["live", "fleet", "--length-thresholds", "100"]) == 2
    assert "needs --vllm-replicas" in capsys.readouterr().err
