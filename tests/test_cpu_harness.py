"""Against a real SGLang 0.5.23 server on the CPU harness (the `sglang_server` fixture)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest

from runtime.cpu.install import harness_env
from runtime.cpu.model import DEFAULT_SPEC, FIRST_ORDINARY_ID, create_model_dir

pytestmark = pytest.mark.live


def get(server, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(server.url + path, timeout=30) as response:
        return response.status, response.read()


def generate_stream(server, body: dict) -> list[dict]:
    """POST a streamed /generate; the decoded `data:` chunks, in arrival order."""
    data = json.dumps(body | {"stream": True}).encode()
    request = urllib.request.Request(
        server.url + "/generate", data, {"Content-Type": "application/json"}
    )
    chunks = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data:") :]))
    return chunks


def prompt(seed: int, n: int) -> list[int]:
    span = DEFAULT_SPEC.vocab_size - FIRST_ORDINARY_ID
    return [FIRST_ORDINARY_ID + (seed * 7919 + i * 104729) % span for i in range(n)]


def test_health(sglang_server):
    status, _ = get(sglang_server, "/health")
    assert status == 200


def test_server_info_reports_capacity_and_args(sglang_server):
    _, body = get(sglang_server, "/server_info")
    info = json.loads(body)
    assert info["max_total_num_tokens"] > 0
    assert info["device"] == "cpu"
    assert info["load_format"] == "dummy"
    assert info["max_running_requests"] > 0
    assert info["chunked_prefill_size"] > 0


def test_streamed_generate_returns_exactly_the_requested_tokens(sglang_server):
    body = {
        "input_ids": prompt(1, 40),
        "rid": "harness-stream-1",
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0},
    }
    chunks = generate_stream(sglang_server, body)
    assert len(chunks) >= 2
    final = chunks[-1]["meta_info"]
    assert final["id"] == "harness-stream-1"
    assert final["prompt_tokens"] == 40
    assert final["completion_tokens"] == 12
    assert final["finish_reason"]["type"] == "length"
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)  # cumulative


def flush_cache(server) -> int:
    """POST /flush_cache; SGLang answers 400 while a request is still in flight (the last
    test's stream can end at the client before the scheduler is done with it): retry."""
    import time

    request = urllib.request.Request(server.url + "/flush_cache", b"", method="POST")
    for _ in range(20):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            if exc.code != 400:
                raise
            time.sleep(0.25)
    return 400


def test_repeated_prompt_hits_the_radix_cache(sglang_server):
    assert flush_cache(sglang_server) == 200
    ids = prompt(2, 200)
    params = {"max_new_tokens": 2, "ignore_eos": True}

    def cached(rid: str, input_ids: list[int]) -> int:
        body = {"input_ids": input_ids, "rid": rid, "sampling_params": params}
        return generate_stream(sglang_server, body)[-1]["meta_info"]["cached_tokens"]

    assert cached("harness-cache-1", ids) == 0
    assert cached("harness-cache-2", ids) == 199  # all but the last token, which is recomputed
    assert cached("harness-cache-3", ids[:100] + prompt(3, 50)) == 100


def test_metrics_expose_sglang_gauges(sglang_server):
    _, body = get(sglang_server, "/metrics")
    text = body.decode()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
        assert f"\n{name}" in text or text.startswith(name)
    assert "sglang:time_to_first_token_seconds_bucket" in text


def test_model_dir_is_deterministic_with_a_full_vocab(cpu_harness, tmp_path):
    fresh = create_model_dir(tmp_path / "model", python=cpu_harness.python)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (fresh / name).read_bytes() == (cpu_harness.model_dir / name).read_bytes()
    vocab = json.loads((fresh / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(DEFAULT_SPEC.vocab_size))


def test_shims_act_only_with_the_switch(cpu_harness):
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sgl_kernel') is None)"
    on = subprocess.run([cpu_harness.python, "-c", code], env=harness_env())
    off_env = {k: v for k, v in harness_env().items() if k != "SERVETWIN_CPU_HARNESS"}
    off = subprocess.run([cpu_harness.python, "-c", code], env=off_env)
    assert (on.returncode, off.returncode) == (0, 1)
