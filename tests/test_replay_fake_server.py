"""The replay client against a small fake SGLang (tests/fake_sglang.py): the protocol
details that a real server produces only rarely. Its faults: tests/test_replay_faults.py."""

from __future__ import annotations

import pytest
from fake_sglang import FakeSglang

from runtime.client import ReplayConfig, replay
from runtime.token_ids import SegmentTokens
from twin.workload import Request, Workload

pytestmark = pytest.mark.offline
# Tests of behaviour, not of speed: the machine may be busy (a live server, other jobs).
LOOSE = 60.0  # these tests check records, not how loaded the machine is


def _workload(rids: list[str], out: int = 4, gap: float = 0.01, conc: int | None = None):
    reqs = [Request.make(rid, i * gap, [(7, 16), (100 + i, 8)], out, priority=i % 3)
            for i, rid in enumerate(rids)]
    return Workload("fake", tuple(reqs), conc)


def test_bodies_priority_and_records():
    with FakeSglang(priority=True) as fake:
        res = replay(_workload(["a0", "pairs1", "a2"]),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    res.check()
    assert res.meta["vocab_source"].startswith("fallback 32000")
    tokens = SegmentTokens(32_000)
    # the server sees RID.SUFFIX, one suffix per replay (runtime/server_api.py
    # fresh_rid_suffix); the records keep the workload's ids
    suffix = res.meta["server_rid_suffix"]
    assert len(suffix) == 6 and {b["rid"].rsplit(".", 1)[1] for b in fake.bodies} == {suffix}
    by_rid = {b["rid"].rsplit(".", 1)[0]: b for b in fake.bodies}
    assert by_rid["a0"]["input_ids"][:16] == by_rid["a2"]["input_ids"][:16] == list(
        tokens.segment(7, 16))
    assert [by_rid[r]["priority"] for r in ("a0", "pairs1", "a2")] == [0, 1, 2]
    recs = {r["rid"]: r for r in res.records}
    assert all(r["status"] == "ok" and r["output_tokens"] == 4 for r in recs.values())
    assert recs["pairs1"]["itl_s"][0] == 0.0 and recs["pairs1"]["itl_s"][2] == 0.0


def test_priority_left_out_when_the_server_has_it_off():
    with FakeSglang(priority=False) as fake:
        replay(_workload(["a0"]), ReplayConfig(url=fake.url, max_lateness_s=LOOSE)).check()
    assert "priority" not in fake.bodies[0]


def test_errors_become_records():
    with FakeSglang() as fake:
        res = replay(_workload(["http500x", "toolong1", "stall2", "ok3"]),
                     ReplayConfig(url=fake.url, request_timeout_s=1.0, max_lateness_s=LOOSE))
    res.check()  # failures are records, the run itself is fine
    recs = {r["rid"]: r for r in res.records}
    assert recs["http500x"]["status"] == "failed" and "HTTP 500" in recs["http500x"]["error"]
    assert recs["toolong1"]["status"] == "rejected"
    assert "context length" in recs["toolong1"]["error"]
    assert recs["stall2"]["status"] == "failed" and "--request-timeout" in recs["stall2"]["error"]
    assert recs["ok3"]["status"] == "ok"
    assert len(res.records) == 4


def test_closed_loop_keeps_at_most_n_in_flight():
    rids = [f"c{i}" for i in range(12)]
    with FakeSglang(token_delay=0.05) as fake:
        res = replay(_workload(rids, out=5, gap=0.0, conc=3),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    res.check()
    assert 2 <= fake.max_in_flight <= 3
    assert sorted(r["rid"] for r in res.records) == sorted(rids)


def test_a_fast_open_loop_is_sent_and_recorded_whole():
    """400 requests at 200/s: all sent once, all recorded, lateness measured for each.
    (No time bound here: the client's speed is measured, not tested; docs/live.md.)"""
    rids = [f"f{i}" for i in range(400)]
    with FakeSglang(token_delay=0.001) as fake:
        res = replay(_workload(rids, out=8, gap=0.005),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    assert sorted(r["rid"] for r in res.records) == sorted(rids)
    assert all(r["status"] == "ok" for r in res.records)
    assert res.lateness["n"] == 400 and len(fake.bodies) == 400
