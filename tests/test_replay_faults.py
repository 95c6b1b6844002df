"""Faults while replaying live, against a misbehaving fake SGLang (tests/fake_sglang.py,
real HTTP on loopback): a server that answers garbage, one that dies mid-replay, one that
stalls (accepts connections, never answers). Every request of the workload is recorded
exactly once; sent ones that did not finish are `failed` with the reason, unsent ones
`aborted`; a dead or stalled server ends the replay after one liveness check, not after
a timeout per request. The same against the real CPU server: tests/test_replay_live.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_sglang import FakeSglang

from runtime.client import ReplayConfig, replay
from servetwin.cli import main
from twin.metrics import read_records
from twin.workload import Request, Workload

pytestmark = pytest.mark.offline
LOOSE = 60.0  # no lateness bound: these tests check records, not the machine's load
SMALL_SPEC = "arrival=poisson,rate=20,n=5,prompt=fixed:20,output=fixed:4"


def _workload(rids: list[str], out: int = 4, gap: float = 0.01) -> Workload:
    reqs = [Request.make(rid, i * gap, [(7, 16), (100 + i, 8)], out)
            for i, rid in enumerate(rids)]
    return Workload("fake", tuple(reqs))


def _once_each(res, rids: list[str]) -> dict[str, dict]:
    assert sorted(r["rid"] for r in res.records) == sorted(rids)  # each exactly once
    for rec in res.records:
        assert (rec["status"] == "ok") == (rec["error"] is None), rec
    return {r["rid"]: r for r in res.records}


GARBAGE = {  # rid -> what the record's error says
    "badjson0": "unreadable stream",
    "list1": "not a JSON object",
    "strcount2": "completion_tokens is 'x', not a count",
    "negative3": "completion_tokens is -1",
    "toomany4": "more than the 4 requested",
    "nanqueue5": "queue_time is nan",
    "metalist6": "meta_info is [1], not a JSON object",
    "binary7": "unreadable stream",
    "down8": "went down from 2 to 1",
    "html9": "the stream ended without a finished response",
    "http500x": "HTTP 500",
}


def test_garbage_answers_fail_their_request_only():
    rids = [*GARBAGE, "ok10", "cut11", "ok12"]
    with FakeSglang() as fake:
        res = replay(_workload(rids, out=4), ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    res.check()  # the server is alive: garbage is the requests' fault, the run goes on
    recs = _once_each(res, rids)
    for rid, why in GARBAGE.items():
        assert recs[rid]["status"] == "failed" and why in recs[rid]["error"], recs[rid]
    assert recs["cut11"]["status"] == "failed"
    assert "connection error" in recs["cut11"]["error"]
    assert recs["ok10"]["status"] == recs["ok12"]["status"] == "ok"
    assert res.meta["sent"] == len(rids) and res.stop_reason is None


def test_garbage_server_info_is_not_believed(tmp_path, capsys):
    """Limits that are not token counts are ignored, a priority flag that is not true is
    off; the replay runs (a --vocab-size that leaves no token ids is refused)."""
    bad = {"context_length": "abc", "max_req_input_len": -1,
           "enable_priority_scheduling": "yes", "model_path": ["x"]}
    with FakeSglang(info=bad) as fake:
        code = main(["live", "replay", "--url", fake.url, "--workload", SMALL_SPEC, "--out",
                     str(tmp_path / "r"), "--max-lateness-ms", "60000"])
        assert code == 0, capsys.readouterr().err
        assert all(r["status"] == "ok" for r in read_records(tmp_path / "r" / "requests.jsonl"))
        assert "priority" not in fake.bodies[0]
        code = main(["live", "replay", "--url", fake.url, "--workload", SMALL_SPEC, "--out",
                     str(tmp_path / "v"), "--vocab-size", "3"])
    assert code == 2 and "--vocab-size 3: must be an integer >= 5" in capsys.readouterr().err


def test_a_stream_without_progress_a_dribbled_line_and_a_silent_request_time_out():
    rids = ["junk0", "hang1", "ok2", "drip3"]
    with FakeSglang() as fake:
        res = replay(_workload(rids), ReplayConfig(url=fake.url, request_timeout_s=1.0,
                                                   max_lateness_s=LOOSE))
    res.check()  # /health_generate answers: only the two requests fail
    recs = _once_each(res, rids)
    assert "no new token" in recs["junk0"]["error"]
    assert "no new token" in recs["drip3"]["error"]  # bytes, but never a line
    assert "--request-timeout" in recs["hang1"]["error"]
    assert recs["ok2"]["status"] == "ok"


def test_a_server_that_dies_mid_replay():
    rids = [f"d{i}" for i in range(30)]
    with FakeSglang(token_delay=0.02, die_after=8) as fake:
        res = replay(_workload(rids, out=10, gap=0.05),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    recs = _once_each(res, rids)
    assert "stopped answering mid-run" in res.stop_reason
    m = res.meta
    assert 8 <= m["sent"] < 30 and m["sent"] + m["not_sent"] == 30
    sent = [r for r in res.records if r["error"] is None or "not sent" not in r["error"]]
    assert len(sent) == m["sent"]
    assert {r["status"] for r in sent} <= {"ok", "failed"}
    assert sum(r["status"] == "failed" for r in sent) >= 1
    unsent = [r for r in recs.values() if r["error"] and r["error"].startswith("not sent")]
    assert len(unsent) == m["not_sent"] and all(r["status"] == "aborted" for r in unsent)
    with pytest.raises(Exception, match="the 2[0-9] never sent as aborted|never sent"):
        res.check()


def test_a_stalled_server_costs_one_liveness_check_not_a_timeout_per_request():
    """From the 6th request on nothing answers (connections still accepted). With a
    60 s request timeout, the replay ends once the whole server has been quiet for
    `stall_s` and failed /health_generate: well before even one request timeout."""
    rids = [f"s{i}" for i in range(20)]
    with FakeSglang(token_delay=0.05, stall_after=6) as fake:
        t0 = time.monotonic()
        res = replay(_workload(rids, out=40, gap=0.05),
                     ReplayConfig(url=fake.url, request_timeout_s=60.0, stall_s=0.5,
                                  health_timeout_s=0.5, max_lateness_s=LOOSE))
        took = time.monotonic() - t0
    assert took < 60.0  # not N x 60 s, not even one request timeout
    recs = _once_each(res, rids)
    assert "no data on any of the" in res.stop_reason
    assert "GET /health_generate: no answer in 0.5 s" in res.stop_reason
    sent = [r for r in recs.values() if not (r["error"] or "").startswith("not sent")]
    assert len(sent) == res.meta["sent"] >= 6
    assert all(r["status"] == "failed" and "stopped answering" in r["error"] for r in sent)
    assert all(r["status"] == "aborted" for r in recs.values() if r not in sent)


@pytest.mark.parametrize("fault", [{"die_after": 7}, {"stall_after": 7}])
def test_a_closed_loop_stops_whole_when_the_server_goes(fault):
    """4 clients, 30 requests: the clients waiting on a dead or hung server are released
    (their requests failed with the reason), the rest never sent are aborted."""
    rids = [f"c{i}" for i in range(30)]
    work = Workload("fake", _workload(rids, out=10, gap=0.0).requests, 4)
    with FakeSglang(token_delay=0.02, **fault) as fake:
        res = replay(work, ReplayConfig(url=fake.url, request_timeout_s=60.0, stall_s=0.5,
                                        health_timeout_s=0.5, max_lateness_s=LOOSE))
    recs = _once_each(res, rids)
    assert "stopped answering mid-run" in res.stop_reason
    sent = [r for r in recs.values() if not (r["error"] or "").startswith("not sent")]
    assert 7 <= len(sent) == res.meta["sent"] < 30
    assert {r["status"] for r in sent} <= {"ok", "failed"}
    assert sum(r["status"] == "aborted" for r in recs.values()) == res.meta["not_sent"]


def test_cli_records_every_request_when_the_server_dies(tmp_path, capsys):
    out = tmp_path / "died"
    with FakeSglang(token_delay=0.02, die_after=5) as fake:
        code = main(["live", "replay", "--url", fake.url, "--workload",
                     "arrival=poisson,rate=50,n=40,prompt=fixed:20,output=fixed:10",
                     "--out", str(out), "--max-lateness-ms", "60000"])
    assert code == 2
    err = capsys.readouterr().err
    assert "stopped answering mid-run" in err and "never sent as aborted" in err
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == len({r["rid"] for r in recs}) == 40
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 40 and "stopped answering" in summary["partial"][
        "stop_reason"]


def test_ctrl_c_mid_replay_writes_every_request_and_exits_130(tmp_path):
    out = tmp_path / "interrupted"
    with FakeSglang(token_delay=0.05) as fake:
        proc = replay_process(fake.url, out, "arrival=poisson,rate=20,n=2000,"
                               "prompt=fixed:20,output=fixed:30")
        wait_for_line(proc, "sent ")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C)" in err and "summary.json is marked partial" in err
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == len({r["rid"] for r in recs}) == 2000
    meta = json.loads((out / "replay.json").read_text())
    assert 0 < meta["sent"] < 2000
    statuses = [r["status"] for r in recs]
    assert statuses.count("aborted") >= meta["not_sent"] > 0
    assert set(statuses) <= {"ok", "aborted"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"]["stop_reason"] == "interrupted (Ctrl-C)"


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120.0,
                  stream: str = "stderr") -> str:
    """Read the process's stderr (or stdout) until a line containing `text` (its
    progress line)."""
    deadline = time.monotonic() + timeout
    pipe = getattr(proc, stream)
    assert pipe is not None
    while time.monotonic() < deadline:
        line = pipe.readline()
        if text in line:
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"the process ended (code {proc.returncode}) before "
                                 f"printing {text!r}")
    raise AssertionError(f"no line with {text!r} in {timeout} s")


def replay_process(url: str, out: Path, spec: str) -> subprocess.Popen:
    """`servetwin live replay` in a subprocess that reacts to SIGINT even when this one
    was started with SIGINT ignored (a background job)."""
    return subprocess.Popen(
        [sys.executable, "-m", "servetwin", "live", "replay", "--url", url, "--workload", spec,
         "--out", str(out), "--max-lateness-ms", "60000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
