"""The shipped learned policies (`learned:finance-qa`, pass-v1; `learned:finance-qa-v2`,
pass-v2, whose features the plugin computes with the deadline rules' grouping) inside the
real CPU SGLang server through the plugin: a burst of short and longer requests is served
with every request complete and no fallback to SGLang's own scheduling (docs/rl.md)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime.plugin.decisions import read_lines

pytestmark = pytest.mark.live

FLAGS = ["--schedule-policy", "fcfs", "--max-running-requests", "2"]
# (prompt tokens, max_new_tokens, priority) in send order, 30 ms apart
BURST = [(40, 24, 0), (600, 16, 0), (40, 8, 10), (300, 12, 0), (40, 20, 20), (900, 8, 0),
         (40, 16, 0), (120, 10, 10)]


@pytest.fixture(scope="module", params=["learned:finance-qa", "learned:finance-qa-v2"])
def learned_server(request, tmp_path_factory):
    if os.environ.get("SERVETWIN_NO_LIVE") == "1":
        pytest.skip("live SGLang tests switched off by SERVETWIN_NO_LIVE=1")
    from runtime.cpu.install import ensure_plugin, require_harness
    from runtime.cpu.serve import CpuServer
    from runtime.plugin.env import plugin_env

    ensure_plugin(require_harness(), log=lambda line: None)
    d = tmp_path_factory.mktemp("learned")
    log = d / "decisions.jsonl"
    env = plugin_env(request.param, log)
    with CpuServer(FLAGS, env=env, log_path=d / "server.log") as server:
        yield server, log


def send(url: str, tag: str) -> list[dict]:
    from runtime.cpu.serve import post_json

    def one(i: int) -> dict:
        time.sleep(i * 0.03)
        n_in, n_out, prio = BURST[i]
        body = {"input_ids": [3 + (11 * i + k) % 4000 for k in range(n_in)],
                "rid": f"{tag}-{i}", "priority": prio,
                "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True}}
        return post_json(url + "/generate", body, timeout=180)["meta_info"]

    with ThreadPoolExecutor(len(BURST)) as pool:
        return list(pool.map(one, range(len(BURST))))


def test_learned_policy_serves_every_request_without_fallbacks(learned_server):
    server, log = learned_server
    metas = send(server.url, "rl") + send(server.url, "rl2")
    assert [m["finish_reason"]["type"] for m in metas] == ["length"] * len(metas)
    assert [m["completion_tokens"] for m in metas] == [o for _, o, _ in BURST] * 2
    counters = json.loads(Path(str(log) + ".counters.json").read_text())
    assert counters["raised"] == 0 and counters["invalid"] == 0, counters
    assert counters["applied"] >= 1, counters  # the selector's order was applied
    lines = list(read_lines(log))
    assert lines[0]["kind"] == "header" and lines[0]["native"] is False
    log_text = server.log_path.read_text(errors="replace")
    assert "hooks in place" in log_text and "NOT in place" not in log_text
