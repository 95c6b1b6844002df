"""A replica in a fleet is woken by its own submits only (twin/decode_cut.py): its decode
runs do not end at other replicas' arrivals, a submit cuts a run at the first step end
after it, and the records are those of runs bounded by every arrival (the old way).

Step times are round (prefill 2 s, decode 1 s) so the timelines are exact."""

from __future__ import annotations

import json

import numpy as np
import simpy
from helpers import GPU, MODEL, req
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepmodels import FixedStepTime

from twin.cluster import Deployment
from twin.config import ServerArgs
from twin.fleet import run_deployment
from twin.routers import make_router
from twin.sim import SimConfig, make_replica
from twin.source import Source
from twin.workload import Workload

ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)


class ByName:
    """Requests whose id starts with "a" go to r0, the rest to r1."""

    def pick(self, request, workers, now):
        return 0 if request.rid.startswith("a") else 1

    def done(self, worker, request, now, ok):
        pass


def build(requests, router, n=2, allocator="token", step_time=ST, policy=None, chunk=None):
    env = simpy.Environment()
    dep = Deployment(env, Source(Workload("t", tuple(requests))), router)
    args = dict(model_path=MODEL, max_total_tokens=100_000)
    if chunk is not None:
        args["chunked_prefill_size"] = chunk
    for i in range(n):
        cfg = SimConfig(args=ServerArgs(**args), gpu=GPU, sample_every_s=1e9,
                        debug_checks=True, kv_allocator=allocator, policy=policy)
        rep, _ = make_replica(env, cfg, step_time)
        rep.step_log = []
        dep.add(rep, "default", f"r{i}")
    return dep


def run(requests, router=None, cuts=True, monkeypatch=None, **kw):
    if not cuts:
        monkeypatch.setattr(Deployment, "sends_known", lambda self: False)
    dep = build(requests, router or ByName(), **kw)
    res = run_deployment(dep)
    if not cuts:
        monkeypatch.undo()
    return res, [w.replica.step_log for w in dep.workers]


OTHERS = [req("a", 0.0, 10, 10), req("b1", 1.0, 10, 2), req("b2", 3.5, 10, 2),
          req("b3", 5.5, 10, 2)]


def test_other_replicas_arrivals_do_not_end_a_decode_run(monkeypatch):
    # a: prefill [0, 2] emits token 1; 9 decode steps end at 3..11. Bounded by every
    # arrival (the old way) r0's run ends at 4 (b2 came at 3.5) and 6 (b3 at 5.5)
    res, (r0, _) = run(OTHERS)
    assert r0 == [("prefill", 0.0, [("a", 10)], []), ("decode", 2.0, ["a"], 9)]
    old, (r0_old, _) = run(OTHERS, cuts=False, monkeypatch=monkeypatch)
    assert [(e[0], e[1], e[-1]) for e in r0_old] == [
        ("prefill", 0.0, []), ("decode", 2.0, 2), ("decode", 4.0, 2), ("decode", 6.0, 5)]
    assert res.records == old.records


def test_a_submit_cuts_the_run_at_the_first_step_end_after_it(monkeypatch):
    # a2 comes at 3.5 while a decodes (steps end at 3, 4, ...): a keeps the steps to 4,
    # gives back the rest (tokens, KV), a2 is prefilled at 4
    reqs = [req("a", 0.0, 10, 10), req("b", 1.0, 10, 2), req("a2", 3.5, 10, 3)]
    res, (r0, _) = run(reqs)
    assert r0[:3] == [("prefill", 0.0, [("a", 10)], []), ("decode", 2.0, ["a"], 2),
                      ("prefill", 4.0, [("a2", 10)], [])]
    recs = {r["rid"]: r for r in res.records}
    assert recs["a2"]["ttft_s"] == 2.5  # prefilled [4, 6]
    # a: tokens at 2, 3, 4, (paused by a2's prefill) 7, 8, then 9..13
    assert recs["a"]["output_tokens"] == 10 and recs["a"]["e2e_s"] == 13.0
    old, _ = run(reqs, cuts=False, monkeypatch=monkeypatch)
    assert res.records == old.records


def test_one_replica_or_a_block_allocator_keeps_the_old_bound(monkeypatch):
    _, (r0, _) = run(OTHERS, allocator="paged")
    assert [e[-1] for e in r0 if e[0] == "decode"] == [2, 2, 5]
    dep = build(OTHERS, make_router("round_robin"), n=1)
    dep.start(run_replicas=True)
    assert not dep.cuts_runs


def chunk_spec(tmp_path_factory, tokens=200, park=3) -> str:
    """`deadline` with the chunk answer (no withholding): documents from 1,000 tokens."""
    p = tmp_path_factory.mktemp("spec") / "deadline-chunks.json"
    p.write_text(json.dumps({"name": "deadline", "params": {
        "withhold": "none", "chunk_tokens": tokens, "park_steps": park,
        "doc_tokens": 1000}}))
    return str(p)


def test_a_submit_during_parked_passes_gives_back_the_rest_of_the_park(monkeypatch,
                                                                       tmp_path_factory):
    # r0: aq decodes while aD (2,000 tokens, 500-token chunks) prefills. aD's first chunk
    # is capped at 200 (aq runs) at 2-4; its next chunk is due at 4 and parks 3
    # decode-only passes: a run of 3 steps ending at 5, 6, 7. a2 comes at 4.5: the run
    # keeps the step to 5 and gives two back; the pass at 5 still owes the park two
    # passes, so a2 waits and aq decodes 5-7; at 7 aD's capped chunk and a2 run together.
    # Bounded by every arrival (the old way): the same timeline and the same records.
    spec = chunk_spec(tmp_path_factory)
    reqs = [req("aq", 0.0, 10, 12), req("aD", 0.1, 2000, 2), req("b", 1.0, 10, 2),
            req("a2", 4.5, 10, 3)]
    res, (r0, _) = run(reqs, policy=spec, chunk=500)
    old, (r0_old, _) = run(reqs, cuts=False, monkeypatch=monkeypatch, policy=spec,
                           chunk=500)
    assert r0[:6] == [("prefill", 0.0, [("aq", 10)], []),
                      ("prefill", 2.0, [("aD", 200)], []),
                      ("decode", 4.0, ["aq"], 1),  # cut at 5 by a2's submit
                      ("decode", 5.0, ["aq"], 2),  # the park's last two passes
                      ("prefill", 7.0, [("aD", 200), ("a2", 10)], []),
                      ("decode", 9.0, ["aq", "a2"], 2)]
    assert r0 == r0_old and res.records == old.records


def assert_same_records(new: list[dict], old: list[dict]) -> None:
    """The same decisions; times equal but for the last bit of a sum of step times (a run
    split at another's arrival adds its steps from a different start), which may turn
    the 6th decimal of a record: 1e-6 apart at most."""
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, list):
                assert len(x) == len(y) and np.allclose(x, y, rtol=0, atol=1.5e-6), k
            elif isinstance(x, float):
                assert abs(x - y) <= 1.5e-6, k
            else:
                assert x == y, k


class KvStep(FixedStepTime):
    """Decode steps lengthen with the batch's KV, so split runs add up differently."""

    def decode_times(self, batch_size, kv_sums):
        return 0.0100731 + 1.37e-6 * np.asarray(kv_sums, dtype=float) / max(batch_size, 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 4),
       router=st.sampled_from(["round_robin", "least_load", "cache_aware", "random"]))
def test_records_are_those_of_runs_bounded_by_every_arrival(monkeypatch, seed, n, router):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.05, 40))
    reqs = [req(f"q{i:02d}", float(t[i]), [(int(rng.integers(3)), 64),
                                           (1000 + i, int(rng.integers(10, 400)))],
                int(rng.integers(2, 60))) for i in range(40)]
    st_kv = KvStep(prefill_s=0.05)
    new, _ = run(reqs, make_router(router, seed=seed), n=n, step_time=st_kv)
    old, _ = run(reqs, make_router(router, seed=seed), cuts=False, monkeypatch=monkeypatch,
                 n=n, step_time=st_kv)
    assert_same_records(new.records, old.records)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 3),
       router=st.sampled_from(["round_robin", "least_load", "random"]))
def test_a_chunking_policy_s_records_are_those_of_runs_bounded_by_every_arrival(
        monkeypatch, tmp_path_factory, seed, n, router):
    # the chunk answer's parked passes and capped chunks, cut by submits and given back
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.08, 30))
    reqs = [req(f"q{i:02d}", float(t[i]), int(rng.choice([20, 60, 1200, 2500])),
                int(rng.integers(2, 40))) for i in range(30)]
    spec = chunk_spec(tmp_path_factory, tokens=128, park=2)
    kw = dict(n=n, step_time=KvStep(prefill_s=0.05), policy=spec, chunk=512)
    new, _ = run(reqs, make_router(router, seed=seed), **kw)
    old, _ = run(reqs, make_router(router, seed=seed), cuts=False, monkeypatch=monkeypatch,
                 **kw)
    assert len(new.records) == len(reqs)
    assert_same_records(new.records, old.records)
