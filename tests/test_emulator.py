"""`servetwin emulate` offline: a real local HTTP server (the emulator on its own event loop
in a thread), real HTTP clients, no SGLang. The expected error answers are the CPU
harness's SGLang 0.5.23's own (status and JSON shape, captured 2026-12-01)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.emulator.protocol import text_ids
from runtime.emulator.server import Emulator, EmulatorThread
from runtime.server_api import probe, twin_server_args
from twin.config import ServerArgs, derive_capacity
from twin.metrics import SLO
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload

pytestmark = pytest.mark.offline

# Llama-3.1-8B on one H100 with the roofline backend: built in milliseconds
CFG = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B", tp_size=1,
                                context_length=8192),
                gpu="h100-sxm-80gb", step_time_backend="roofline")
SPEED = 20.0


@pytest.fixture(scope="module")
def em():
    with EmulatorThread(Emulator(CFG, SPEED)) as emulator:
        yield emulator


def call(url: str, body: object = None, *, raw: bytes | None = None, method: str | None = None,
         ctype: str = "application/json", timeout: float = 30.0) -> tuple[int, bytes]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data, {"Content-Type": ctype}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def events(payload: bytes) -> list:
    out = []
    for line in payload.decode().splitlines():
        if line.startswith("data: "):
            text = line[6:]
            out.append(text if text == "[DONE]" else json.loads(text))
    return out


def gen(em, **body) -> tuple[int, object]:
    status, payload = call(em.url + "/generate", body)
    return status, (events(payload) if body.get("stream") else json.loads(payload))


def test_generate_returns_sglangs_fields_and_the_requested_length(em):
    status, out = gen(em, input_ids=list(range(10, 110)),
                      sampling_params={"max_new_tokens": 7, "ignore_eos": True})
    assert status == 200
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 100 and meta["completion_tokens"] == 7
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert len(out["output_ids"]) == 7 and out["text"]
    for key in ("id", "weight_version", "num_retractions", "queue_time", "cached_tokens",
                "e2e_latency"):
        assert key in meta
    # a text prompt: one token per 4 bytes of UTF-8; ignore_eos false still gives all
    _, out = gen(em, text="x" * 41, sampling_params={"max_new_tokens": 3})
    assert out["meta_info"]["prompt_tokens"] == 11 == len(text_ids("x" * 41))
    assert out["meta_info"]["completion_tokens"] == 3


def test_streaming_sends_one_event_per_token_then_done(em):
    status, evs = gen(em, input_ids=[5] * 40, stream=True, rid="s1",
                      sampling_params={"max_new_tokens": 5})
    assert status == 200 and evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]  # cumulative, as SGLang
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert {c["meta_info"]["id"] for c in chunks} == {"s1"}


def test_a_lone_request_times_exactly_as_simulate_does(em):
    """The same model code on the wall clock: a request alone in the server gets the
    TTFT and E2E `servetwin simulate` gives it (simulated seconds, not wall-clock)."""
    call(em.url + "/flush_cache", method="POST", raw=b"")
    ids = list(range(1000, 1600))
    _, out = gen(em, input_ids=ids, sampling_params={"max_new_tokens": 20})
    req = Request.make("r0", 0.0, ((1, 600),), 20)
    sim = simulate(Workload("one", (req,)), CFG, SLO(1.5))
    rec = next(iter(sim.records))
    assert out["meta_info"]["first_token_latency"] == pytest.approx(rec["ttft_s"], abs=2e-6)
    assert out["meta_info"]["e2e_latency"] == pytest.approx(rec["e2e_s"], abs=2e-6)


def test_completions_non_streaming_and_streaming_with_usage(em):
    status, payload = call(em.url + "/v1/completions",
                           {"model": "m", "prompt": "hello world!", "max_tokens": 4})
    out = json.loads(payload)
    assert status == 200 and out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 4 and out["usage"]["prompt_tokens"] == 3
    status, payload = call(em.url + "/v1/completions",
                           {"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}})
    evs = events(payload)
    assert evs[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in evs[:3]]
    assert len(texts) == 3 and all(texts)  # deltas, one per token
    assert evs[2]["choices"][0]["finish_reason"] == "length"
    assert evs[3]["choices"] == [] and evs[3]["usage"]["completion_tokens"] == 3


def test_repeated_prompt_is_cached_until_the_cache_is_flushed(em):
    ids = list(range(2000, 2256))
    gen(em, input_ids=ids, sampling_params={"max_new_tokens": 2})
    _, again = gen(em, input_ids=ids, sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] >= 240  # 16-token blocks of the prompt
    assert call(em.url + "/flush_cache", method="POST", raw=b"")[0] == 200
    _, cold = gen(em, input_ids=ids, sampling_params={"max_new_tokens": 2})
    assert cold["meta_info"]["cached_tokens"] == 0


CTX = 8192
BAD = [  # (body or raw bytes, stream, expected status, expected JSON shape check)
    (b'{"text":"hello",', 400, lambda b: b["object"] == "error" and b["code"] == 400
     and "json_invalid" in b["message"]),
    (b"[1, 2]", 400, lambda b: b["type"] == "Bad Request" and "dataclass_type" in b["message"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1, "bogus": 2}}, 400,
     lambda b: b["error"].startswith("unknown field `bogus`, expected one of `max_new_tokens`")),
    ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, 400,
     lambda b: b["error"] == 'invalid type: string "x", expected i64'),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400,
     lambda b: b == {"error": {"message": "max_new_tokens must be at least 0, got -1."}}),
    ({"sampling_params": {"max_new_tokens": 1}}, 400, lambda b: b["error"]["message"] ==
     "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": [], "sampling_params": {"max_new_tokens": 1}}, 400,
     lambda b: b["error"]["message"] == "input_ids cannot be empty."),
    ({"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 1}}, 400,
     lambda b: b["error"]["message"] == "The input (9000 tokens) is longer than the model's "
     "context length (8192 tokens)."),
    ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100000}}, 400,
     lambda b: b["error"]["message"].startswith("Requested token count exceeds the model's "
                                                "maximum context length of 8192 tokens.")),
    ({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 1}}, 400,
     lambda b: "outside the vocabulary" in b["error"]["message"]),
]


@pytest.mark.parametrize("body,status,shape", BAD, ids=[
    "malformed-json", "not-an-object", "unknown-sampling-key", "wrong-type",
    "negative-max-tokens", "no-prompt", "empty-ids", "too-long-prompt", "too-long-total",
    "id-outside-vocab"])
def test_bad_input_gets_sglangs_error_and_the_server_stays_up(em, body, status, shape):
    got, payload = call(em.url + "/generate", raw=body if isinstance(body, bytes) else None,
                        body=None if isinstance(body, bytes) else body)
    assert got == status
    assert shape(json.loads(payload))
    assert call(em.url + "/health")[0] == 200
    assert gen(em, input_ids=[7, 8], sampling_params={"max_new_tokens": 1})[0] == 200


def test_tokenizer_errors_come_in_the_stream_when_streaming(em):
    status, evs = gen(em, text="hi", stream=True, sampling_params={"max_new_tokens": -1})
    assert status == 200 and evs[-1] == "[DONE]"
    assert evs[0]["error"] == {"message": "max_new_tokens must be at least 0, got -1.",
                               "type": "invalid_request_error", "code": 400,
                               "retryable": False}


def test_other_refusals(em):
    assert call(em.url + "/nope") == (404, b'{"detail":"Not Found"}')
    assert call(em.url + "/generate")[0] == 405
    status, payload = call(em.url + "/generate", raw=b'{"text": "a"}', ctype="text/plain")
    assert status == 400 and b"dataclass_type" in payload
    status, payload = call(em.url + "/v1/completions", {"prompt": "a", "max_tokens": -3})
    assert status == 400 and "max_tokens must be positive" in json.loads(payload)["message"]
    # unknown top-level fields are ignored, as SGLang's schema ignores them
    assert gen(em, text="a", bogus=1, sampling_params={"max_new_tokens": 1})[0] == 200


def test_a_client_that_disconnects_mid_stream_aborts_its_request(em, tmp_path):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", em.port, timeout=30)
    body = json.dumps({"input_ids": [3] * 64, "stream": True,
                       "sampling_params": {"max_new_tokens": 5000}})
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.read(20)
    assert first.startswith(b"data: ")
    conn.sock.close()  # gone mid-stream
    conn.close()
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if em.engine.counts["aborted"] >= 1 and not em.engine.rep.running:
            break
        time.sleep(0.05)
    assert em.engine.counts["aborted"] >= 1
    assert not em.engine.rep.running  # it left the batch
    assert gen(em, input_ids=[9], sampling_params={"max_new_tokens": 2})[0] == 200


def test_metrics_parse_with_prometheus_client_under_sglangs_names(em):
    before = _families(em)
    n = 3
    for i in range(n):
        gen(em, input_ids=[40 + i] * 30, sampling_params={"max_new_tokens": 4})
    fams = _families(em)
    for name, kind in [("sglang:num_requests", "counter"), ("sglang:prompt_tokens", "counter"),
                       ("sglang:generation_tokens", "counter"),
                       ("sglang:time_to_first_token_seconds", "histogram"),
                       ("sglang:e2e_request_latency_seconds", "histogram"),
                       ("sglang:inter_token_latency_seconds", "histogram"),
                       ("sglang:queue_time_seconds", "histogram"),
                       ("sglang:num_running_reqs", "gauge"), ("sglang:token_usage", "gauge"),
                       ("sglang:cache_hit_rate", "gauge"), ("sglang:gen_throughput", "gauge"),
                       ("sglang:max_total_num_tokens", "gauge")]:
        assert fams[name].type == kind, name
    assert _total(fams, "sglang:num_requests_total") - _total(
        before, "sglang:num_requests_total") == n
    assert _total(fams, "sglang:generation_tokens_total") - _total(
        before, "sglang:generation_tokens_total") == 4 * n
    text = call(em.url + "/metrics")[1].decode()
    assert "_created" not in text
    assert 'le="0.1"' in text and 'le="400.0"' in text  # SGLang's TTFT buckets


def _families(em) -> dict:
    text = call(em.url + "/metrics")[1].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(fams: dict, sample: str) -> float:
    fam = fams[sample.removesuffix("_total")]
    return sum(s.value for s in fam.samples if s.name == sample)


def test_server_info_reads_back_as_the_twins_server(em):
    facts = probe(em.url)
    assert facts.version == "0.5.23"
    assert facts.context_length == CTX
    # the replayer's view of "this server" is the emulated one, resolved as SGLang does
    read = derive_capacity(twin_server_args(facts.info), CFG.gpu)
    cap = derive_capacity(CFG.args, CFG.gpu)
    for key in ("max_total_num_tokens", "chunked_prefill_size", "max_running_requests",
                "context_len"):
        assert getattr(read, key) == getattr(cap, key), key
    status, payload = call(em.url + "/get_model_info")
    assert status == 200 and json.loads(payload)["model_path"] == CFG.args.model_path
    assert call(em.url + "/health_generate")[0] == 200
    assert em.host == "127.0.0.1"


@pytest.mark.parametrize("flags,msg", [
    (["--speed", "0"], "--speed"), (["--port", "70000"], "--port 70000"),
    (["--gpu", "tpu"], "invalid choice")])
def test_cli_refuses_bad_flags(flags, msg):
    res = subprocess.run([sys.executable, "-m", "servetwin", "emulate", *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and msg in res.stderr


def test_cli_serves_on_loopback_and_ctrl_c_stops_it():
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "servetwin", "emulate", "--port", "0",
                             "--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "1",
                             "--step-time-backend", "roofline"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        banner = [proc.stdout.readline(), proc.stdout.readline()]
        assert banner[1].startswith("ready: http://127.0.0.1:"), banner
        url = banner[1].split()[1]
        assert call(url + "/health")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_emulator_exports_what_the_twins_registry_exports(em):
    """One dashboard for both: every family `twin.monitoring.sglang_registry` gives a twin
    run, the emulator exports with the same type and label names."""
    from prometheus_client import generate_latest

    from twin.monitoring import sglang_registry
    from twin.workload import from_spec

    res = simulate(from_spec("arrival=poisson,rate=5,n=10,prompt=fixed:100,output=fixed:8", 0),
                   CFG, SLO(1.5))
    gauges = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0,
              "sglang:token_usage": 0.0, "memory_pressure_score": 0.0,
              "kv_external_fragmentation": 0.0}
    reg = sglang_registry(list(res.records), gauges, capacity_tokens=1000, max_running=10,
                          model_name=CFG.args.model_path)
    twin = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    gen(em, input_ids=[11] * 20, sampling_params={"max_new_tokens": 3})
    ours = _families(em)
    for name, fam in twin.items():
        assert name in ours, name
        assert ours[name].type == fam.type, name
        assert _labels(ours[name]) >= _labels(fam), name


def _labels(fam) -> set[str]:
    return {k for s in fam.samples for k in s.labels} - {"le"}


def test_a_full_batch_streams_every_token_of_its_longer_decode_runs():
    """With the batch full the replica plans decode runs of many steps at once (nothing
    could be admitted before one ends); the engine still streams each token at its own
    step end, and the third request runs when a slot frees."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B", tp_size=1,
                                    context_length=8192, max_running_requests=2),
                    gpu="h100-sxm-80gb", step_time_backend="roofline")
    n = 150  # ~1 s of decode at speed 2: the third request certainly arrives meanwhile
    with EmulatorThread(Emulator(cfg, 2.0)) as em2:
        em2.engine.rep.step_log = []  # before any request: the loop only appends to it

        def one(i: int) -> list:
            return gen(em2, input_ids=[20 + i] * 50, stream=True,
                       sampling_params={"max_new_tokens": n})[1]

        with ThreadPoolExecutor(3) as pool:
            streams = list(pool.map(one, range(3)))
        stamps = list(em2.engine.lateness_s)
        runs = [e[3] for e in em2.engine.rep.step_log if e[0] == "decode"]
        assert em2.engine.failed is None
    assert max(runs) > 1  # the path this test is about was taken
    for evs in streams:
        assert evs[-1] == "[DONE]"
        assert [e["meta_info"]["completion_tokens"] for e in evs[:-1]] == list(range(1, n + 1))
        assert evs[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(stamps) == 3 * n


def test_chat_completions_non_streaming_and_streaming(em):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, payload = call(em.url + "/v1/chat/completions",
                           {"model": "m", "messages": msgs, "max_completion_tokens": 5})
    out = json.loads(payload)
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] == 5
    status, payload = call(em.url + "/v1/chat/completions",
                           {"messages": msgs, "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}})
    evs = events(payload)
    assert status == 200 and evs[-1] == "[DONE]"
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert evs[2]["choices"][0]["finish_reason"] == "length"
    assert evs[3]["usage"]["completion_tokens"] == 3
    status, payload = call(em.url + "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and json.loads(payload)["type"] == "Bad Request"
