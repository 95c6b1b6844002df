"""SGLang 0.5.23's policies in the twin, each pinned by a hand-worked timeline.

Prefill steps take 2 s, decode steps 1 s (tests/stepmodels.py). A request with one output
token finishes with its prefill step."""

import json

import pytest
from helpers import req, run_replica
from stepmodels import FixedStepTime

from twin.errors import ConfigError

pytestmark = pytest.mark.offline
ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)


def prefills(rep):
    return [(s[1], [rid for rid, _ in s[2]]) for s in rep.step_log if s[0] != "decode"]


def test_hrrn_ages_by_prefill_tokens_over_uncached_length():
    # A runs (one of two slots); b, d, f arrive while A prefills and enter the queue at
    # t=2 with processed_tokens 10. At t=2 they have all waited 0 tokens: ties go by rid,
    # b first (1000 tokens, 2->4). At t=4 d and f have waited 1000 tokens: d's ratio grows
    # by 1000/500 = 2, f's by 1000/100 = 10: f first. fcfs takes d first.
    # (--max-prefill-tokens 500: one of them per pass)
    reqs = [req("A", 0.0, 10, 30), req("b", 1.0, 1000, 1), req("d", 1.5, 500, 1),
            req("f", 1.6, 100, 1)]
    kw = dict(max_prefill_tokens=500, max_total_tokens=10_000)
    rep, recs = run_replica(reqs, ST, schedule_policy="hrrn", **kw)
    assert prefills(rep)[:4] == [(0.0, ["A"]), (2.0, ["b"]), (4.0, ["f"]), (6.0, ["d"])]
    rep, _ = run_replica(reqs, ST, schedule_policy="fcfs", **kw)
    assert prefills(rep)[:4] == [(0.0, ["A"]), (2.0, ["b"]), (4.0, ["d"]), (6.0, ["f"])]


def test_dfs_weight_serves_the_heavier_cached_subtree_first():
    # P1 and P2 cache templates T1 and T2 (64 tokens each); B holds the only slot from 7
    # to 20 while x (T2), y1 and y2 (T1) queue. At t=20 T1's subtree holds two waiting
    # requests, T2's one: y1 first; then T1 and T2 weigh one each: the older node (T1),
    # y2, then x. fcfs: x, y1, y2.
    t1, t2 = (11, 64), (12, 64)
    reqs = [req("P1", 0.0, [t1, (101, 8)], 2), req("P2", 0.1, [t2, (102, 8)], 2),
            req("B", 7.0, 10, 12), req("x", 8.0, [t2, (201, 8)], 2),
            req("y1", 8.1, [t1, (202, 8)], 2), req("y2", 8.2, [t1, (203, 8)], 2)]
    kw = dict(max_running_requests=1, max_total_tokens=10_000)
    rep, recs = run_replica(reqs, ST, schedule_policy="dfs-weight", **kw)
    assert [p[1][0] for p in prefills(rep)] == ["P1", "P2", "B", "y1", "y2", "x"]
    assert recs["y1"]["cached_tokens"] == 64
    rep, _ = run_replica(reqs, ST, schedule_policy="fcfs", **kw)
    assert [p[1][0] for p in prefills(rep)] == ["P1", "P2", "B", "x", "y1", "y2"]


def test_lpm_defers_a_duplicate_prefix_within_the_queue():
    # A holds one of three slots; a, b, c queue by t=2 with nothing cached. a and b share
    # their first 32 tokens (template T, 40 tokens) and match at most 32 cached tokens: b
    # is deferred behind c, so a and c take the two free slots at t=2, and b, admitted
    # when a leaves (a decodes 4->5; the next pass is at 6), finds T cached. fcfs admits
    # a and b together: both compute T.
    tmpl = (21, 40)
    reqs = [req("A", 0.0, 10, 10), req("a", 0.5, [tmpl, (301, 8)], 2),
            req("b", 0.6, [tmpl, (302, 8)], 2), req("c", 0.7, 30, 2)]
    kw = dict(max_running_requests=3, max_total_tokens=10_000)
    rep, recs = run_replica(reqs, ST, schedule_policy="lpm", **kw)
    assert prefills(rep) == [(0.0, ["A"]), (2.0, ["a", "c"]), (5.0, ["b"])]
    assert recs["b"]["cached_tokens"] == 40
    rep, recs = run_replica(reqs, ST, schedule_policy="fcfs", **kw)
    assert prefills(rep)[:2] == [(0.0, ["A"]), (2.0, ["a", "b"])]
    assert recs["b"]["cached_tokens"] == 0


def test_a_freed_slot_is_used_at_the_next_pass_not_after_the_decode_run():
    # A and a hold both slots; a leaves at 5. SGLang filters the running batch at the top
    # of every pass and a smaller batch clears batch_is_full, so b is admitted at 5, not
    # when A ends (13).
    reqs = [req("A", 0.0, 10, 10), req("a", 0.5, 48, 2), req("b", 0.6, 8, 2)]
    rep, _ = run_replica(reqs, ST, max_running_requests=2, max_total_tokens=10_000)
    assert prefills(rep) == [(0.0, ["A"]), (2.0, ["a"]), (5.0, ["b"])]
    assert rep.step_log[2] == ("decode", 4.0, ["A", "a"], 1)


def test_a_request_finishing_in_its_prefill_frees_its_slot():
    # one slot: each request has one output token and leaves with its prefill step; the
    # filtered prefill batch clears batch_is_full, so the next one is admitted at once
    reqs = [req("A", 0.0, 10, 30), req("x", 0.5, 10, 1), req("y", 0.6, 10, 1)]
    rep, _ = run_replica(reqs, ST, max_running_requests=2, max_total_tokens=10_000)
    assert prefills(rep) == [(0.0, ["A"]), (2.0, ["x"]), (4.0, ["y"])]


def test_shortest_prefill_first_orders_and_caps_the_running_chunk():
    # L (300 tokens) is chunked at 100 per pass. s (20 tokens) arrives at 1: at t=2 the
    # chunk is capped to leave room for s (100 - 20 = 80) and s joins the same step.
    reqs = [req("L", 0.0, 300, 1), req("s", 1.0, 20, 1)]
    rep, recs = run_replica(reqs, ST, schedule_policy="shortest-prefill-first",
                            chunked_prefill_size=100, max_total_tokens=10_000)
    assert rep.step_log[:2] == [("prefill", 0.0, [("L", 100)], []),
                                ("prefill", 2.0, [("L", 80), ("s", 20)], [])]
    rep, _ = run_replica(reqs, ST, schedule_policy="fcfs", chunked_prefill_size=100,
                         max_total_tokens=10_000)
    assert rep.step_log[1] == ("prefill", 2.0, [("L", 100)], [])


def test_random_is_seeded_and_repeatable():
    reqs = [req("A", 0.0, 10, 2)] + [req(f"w{i}", 0.5, 10, 2) for i in range(6)]
    kw = dict(max_running_requests=1, max_total_tokens=10_000)
    a, _ = run_replica(reqs, ST, schedule_policy="random", **kw)
    b, _ = run_replica(reqs, ST, schedule_policy="random", **kw)
    order = [p[1][0] for p in prefills(a)]
    assert order == [p[1][0] for p in prefills(b)]
    assert sorted(order) == sorted(r.rid for r in reqs)
    assert order[1:] != [f"w{i}" for i in range(6)]  # this seed does reorder


def test_priority_preemption_only_when_slots_run_out_newest_low_first():
    # L1 (t=0) and L2 (t=0.5) run in the two slots; V (priority 20) arrives at 5.5 and
    # finds no slot: the newest lowest-priority running request, L2, is preempted (its
    # reservation of 16 future tokens is credited) and re-queued; V prefills at 6.
    reqs = [req("L1", 0.0, 10, 20, prio=0), req("L2", 0.5, 10, 20, prio=0),
            req("V", 5.5, 10, 2, prio=20)]
    rep, recs = run_replica(reqs, ST, max_running_requests=2, max_total_tokens=10_000,
                            enable_priority_scheduling=True)
    assert (6.0, ["V"]) in prefills(rep)
    assert recs["L2"]["preemptions"] == 1 and recs["L1"]["preemptions"] == 0
    # with a free slot there is no preemption, even for a VIP
    rep, recs = run_replica(reqs, ST, max_running_requests=3, max_total_tokens=10_000,
                            enable_priority_scheduling=True)
    assert all(r["preemptions"] == 0 for r in recs.values())


def test_policy_spec_file_drives_the_replica(tmp_path):
    reqs = [req("low", 0.0, 20, 10, prio=0), req("vip", 3.5, 20, 2, prio=20)]
    spec = tmp_path / "p.json"
    spec.write_text(json.dumps({"name": "slices", "params": {"mode": "aggressive",
                                                             "time_slice_ms": 1000}}))
    rep, recs = run_replica(reqs, ST, policy=str(spec), max_running_requests=1,
                            max_total_tokens=10_000)
    assert recs["low"]["preemptions"] == 1
    spec.write_text(json.dumps({"name": "slices", "params": {"mode": "sometimes"}}))
    with pytest.raises(ConfigError, match="--policy: .*allowed values: conservative"):
        run_replica(reqs, ST, policy=str(spec))
