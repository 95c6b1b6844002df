"""Why a closed loop stays in lock-step or not (issue 10), pinned by hand-worked timelines.

SGLang's overlap loop (`Scheduler.event_loop_overlap`) schedules the next step while the
one in flight runs, so a request that arrives during a step is received at the top of the
next iteration and scheduled one pass later than in the plain loop.
"""

from __future__ import annotations

import pytest
import simpy
from helpers import GPU, MODEL, req
from stepmodels import FixedStepTime

from twin.cluster import Deployment
from twin.config import ServerArgs
from twin.metrics import twin_records
from twin.overlap import FreedLater
from twin.request_path import OFF
from twin.sim import SimConfig, make_replica
from twin.source import Source
from twin.workload import Workload

pytestmark = pytest.mark.offline


def run(reqs, overlap: bool):
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=10_000), gpu=GPU,
                    sample_every_s=1e9, debug_checks=True, request_path=OFF)
    env = simpy.Environment()
    rep, _ = make_replica(env, cfg, FixedStepTime(2.0, 1.0))
    if overlap:  # the fixed step model is not a GPU backend: switch the loop on here
        rep.freed_later = FreedLater()
    dep = Deployment(env, Source(Workload("t", tuple(reqs), None)))
    dep.add(rep)
    dep.start()
    rep.step_log = []
    env.process(rep.run())
    env.run()
    return rep, {r["rid"]: r for r in twin_records(rep.finished, rep.step_end)}


def test_an_arrival_during_a_step_is_scheduled_one_pass_later_under_overlap():
    # A (3 outputs) prefills 0-2; B arrives at 0.5, while that step runs. The plain loop
    # takes B in at 2 and prefills it 2-4 (TTFT 3.5, queue 0). Under the overlap loop
    # the step starting at 2 was scheduled at 0, when B had not arrived: A decodes alone
    # 2-3 and B, received at 2, is prefilled 3-5 (TTFT 4.5, queue 1.0: from 2 to 3).
    reqs = [req("A", 0.0, 10, 3), req("B", 0.5, 10, 1)]
    rep, recs = run(reqs, overlap=False)
    assert rep.step_log[:2] == [("prefill", 0.0, [("A", 10)], []),
                                ("prefill", 2.0, [("B", 10)], [])]
    assert (recs["B"]["ttft_s"], recs["B"]["queue_s"]) == (3.5, 0.0)
    rep, recs = run(reqs, overlap=True)
    assert rep.step_log[:3] == [("prefill", 0.0, [("A", 10)], []),
                                ("decode", 2.0, ["A"], 1),
                                ("prefill", 3.0, [("B", 10)], [])]
    assert (recs["B"]["ttft_s"], recs["B"]["queue_s"]) == (4.5, 1.0)
    assert recs["A"]["ttft_s"] == 2.0


def test_an_idle_overlap_scheduler_takes_an_arrival_at_once():
    # nothing in flight when C arrives at 10 (A finished at 3): no pass to wait for
    reqs = [req("A", 0.0, 10, 2), req("C", 10.0, 10, 1)]
    for overlap in (False, True):
        rep, recs = run(reqs, overlap)
        assert ("prefill", 10.0, [("C", 10)], []) in rep.step_log
        assert recs["C"]["ttft_s"] == 2.0 and recs["C"]["queue_s"] == 0.0


def test_arrivals_in_consecutive_steps_each_wait_one_pass():
    # B at 0.5 (during A's prefill 0-2), D at 2.5 (during the decode 2-3 that B waits
    # out): B is taken at 3 (prefill 3-5), D, received at 3, at 5 (prefill 5-7)
    reqs = [req("A", 0.0, 10, 8), req("B", 0.5, 10, 1), req("D", 2.5, 10, 1)]
    rep, recs = run(reqs, overlap=True)
    assert rep.step_log[:4] == [("prefill", 0.0, [("A", 10)], []),
                                ("decode", 2.0, ["A"], 1),
                                ("prefill", 3.0, [("B", 10)], []),
                                ("prefill", 5.0, [("D", 10)], [])]
    assert recs["D"]["ttft_s"] == 7.0 - 2.5 and recs["D"]["queue_s"] == 2.0


def closed(starts: list[float], out: int, n: int) -> Workload:
    c = len(starts)
    reqs = tuple(req(f"r{i}", starts[i] if i < c else 0.0, 10, out) for i in range(n))
    return Workload("closed", reqs, concurrency=c)


def run_closed(wl: Workload):
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=10_000), gpu=GPU,
                    sample_every_s=1e9, debug_checks=True, request_path=OFF)
    env = simpy.Environment()
    rep, _ = make_replica(env, cfg, FixedStepTime(2.0, 1.0))
    dep = Deployment(env, Source(wl))
    dep.add(rep)
    dep.start()
    env.process(rep.run())
    env.run()
    return {r["rid"]: r for r in twin_records(rep.finished, rep.step_end)}


def test_fixed_lengths_keep_the_clients_phases_burst_or_spread():
    # Two clients, 3 output tokens each (prefill 2 s, decode 1 s). Sent together, they
    # prefill in one batch and finish together at 4, 8, 12: lock-step (every E2E 4 s).
    recs = run_closed(closed([0.0, 0.0], 3, 6))
    assert [recs[f"r{i}"]["arrival_s"] + recs[f"r{i}"]["e2e_s"] for i in range(6)] == [
        4.0, 4.0, 8.0, 8.0, 12.0, 12.0]
    # The second client starts at 3: r0 prefills 0-2 and decodes 2-3, r1 prefills 3-5
    # (prefill first), both decode 5-6, r0 finishes at 6 and its client's r2 prefills 6-8
    # while r1 waits, ... The 3 s offset is kept for good: r0, r2, r4 end at 6, 12, 18,
    # r1, r3, r5 at 9, 15, 21 (nothing in SGLang's loop pulls the clients together again
    # unless one arrives while the other's prefill is still queued).
    recs = run_closed(closed([0.0, 3.0], 3, 8))  # (r6, r7 only keep the loop going)
    ends = [round(recs[f"r{i}"]["arrival_s"] + recs[f"r{i}"]["e2e_s"], 6) for i in range(6)]
    assert ends == [6.0, 9.0, 12.0, 15.0, 18.0, 21.0]
    assert [recs[f"r{i}"]["ttft_s"] for i in range(6)] == [2.0] * 6
