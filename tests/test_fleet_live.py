"""A live fleet: 2 CPU SGLang servers behind the real sglang-router 0.3.2, against the twin.

One pair of servers per module (each start is about 20 s on an idle machine); each test
starts its own router over them (under a second), so every policy starts with a fresh
router state, and replays the same shared-prefix workload (experiments/fleet_live.py). The
failover test kills a server, so it runs last. `servetwin live fleet` itself (start, URL,
Ctrl-C, nothing left) is tested in test_fleet_cli_live.py.
"""

from __future__ import annotations

import os

import pytest

from experiments import fleet_live as fl
from runtime.router import RouterOptions

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if os.environ.get("SERVETWIN_NO_LIVE") == "1":
        pytest.skip("live tests switched off by SERVETWIN_NO_LIVE=1")
    from runtime.fleet import Fleet, FleetSpec

    spec = FleetSpec(replicas=2, router=RouterOptions(policy="round_robin"),
                     log_dir=tmp_path_factory.mktemp("fleet"))
    with Fleet(spec) as running:
        yield running


@pytest.fixture(scope="module")
def work():
    return fl.workload()


@pytest.fixture(scope="module")
def info(fleet):
    return fl.server_info(fleet.worker_urls[0])


@pytest.fixture(scope="module")
def runs(fleet, work):
    """The workload through a round_robin and a cache_aware router (live), once each."""
    return {policy: fl.replay_through_router(fleet, RouterOptions(policy=policy), work)
            for policy in ("round_robin", "cache_aware")}


def _check_complete(run, work, fleet) -> None:
    recs = run.records
    assert sorted(r["rid"] for r in recs) == sorted(r.rid for r in work.requests)
    assert all(r["status"] == "ok" for r in recs), [r["error"] for r in recs if r["error"]]
    # each record names its replica (meta_info.weight_version), and the per-request split
    # agrees with the split the workers' own /metrics counters give
    assert {r["replica"] for r in recs} <= {"replica-0", "replica-1"}
    by_metrics = {fleet.replica_of(row["worker"]): row["requests"] for row in run.result.workers}
    by_records = {k: v["requests"] for k, v in fl.split(recs).items()}
    assert by_metrics == by_records


def test_round_robin_alternates_and_the_twin_agrees(runs, work, fleet, info):
    run = runs["round_robin"]
    _check_complete(run, work, fleet)
    live = fl.split(run.records)
    assert max(fl.shares_sorted(live)) <= 0.5 + 2 / len(work.requests)
    twin_recs = fl.simulate(info, "round_robin", work)
    twin = fl.split(twin_recs)
    assert fl.shares_sorted(twin) == [0.5, 0.5]
    assert fl.shares_sorted(live) == pytest.approx(fl.shares_sorted(twin), abs=2 / 24)
    # each template's first request on each replica misses; the rest hit (some also miss
    # live when they arrive while the template's first prefill is still running)
    assert fl.cached_share(run.records) == pytest.approx(fl.cached_share(twin_recs), abs=0.1)


def test_cache_aware_keeps_templates_together_and_the_twin_agrees(runs, work, fleet, info):
    run = runs["cache_aware"]
    _check_complete(run, work, fleet)
    twin_recs = fl.simulate(info, "cache_aware", work)
    live_aff, twin_aff = fl.template_affinity(work, run.records), fl.template_affinity(work, twin_recs)
    assert live_aff >= 0.9 and twin_aff >= 0.9
    # keeping a template on one replica caches more than spreading it (round robin)
    assert fl.cached_share(run.records) > fl.cached_share(runs["round_robin"].records)
    assert fl.cached_share(run.records) == pytest.approx(fl.cached_share(twin_recs), abs=0.1)
    # (the request split itself differs: docs/fleet-live.md, "cache_aware: live vs twin")


def test_one_server_killed_mid_replay(fleet, info, runs):
    """Runs last (it kills replica 0). round_robin, the router's default failover flags."""
    work = fl.workload(spec=fl.FAILOVER_WORKLOAD)
    run = fl.replay_through_router(fleet, RouterOptions(policy="round_robin"), work,
                                   kill=(0, 8))
    kill_at = run.kill_at_s
    assert kill_at is not None
    recs = fl.with_attempts(run.records, run.router_log)
    assert sorted(r["rid"] for r in recs) == sorted(r.rid for r in work.requests)  # all once
    # a streamed request in flight on the killed server: its stream breaks, and the router
    # cannot retry it (it has answered 200 already); it was sent before the kill, and
    # served (its first chunk, if any, came) from the killed replica
    for r in recs:
        if r["status"] != "ok":
            assert r["status"] == "failed" and r["arrival_s"] <= kill_at + 0.05, r
            assert r.get("replica") in (None, "replica-0"), r
    # nothing sent after the kill fails: the router's attempts on the dead server are
    # refused, logged under the request's id, and retried on the other one
    late = [r for r in recs if r["arrival_s"] > kill_at + 0.5]
    assert late and all(r["status"] == "ok" and r["replica"] == "replica-1" for r in late)
    live = fl.failover_summary(recs, kill_at)
    assert live["retried"], run.router_log[-2000:]
    assert all(r["arrival_s"] > kill_at - 1.0 for r in recs if r["attempts"] > 1)
    # the twin with the crash at the measured time: the same rules
    fault = [{"kind": "crash", "replica": "replica-0", "at_s": round(kill_at, 3),
              "repair_s": 3600}]
    twin = fl.simulate(info, "round_robin", work, faults=fault)
    assert sorted(r["rid"] for r in twin) == sorted(r.rid for r in work.requests)
    assert all(r["arrival_s"] <= kill_at for r in twin if r["status"] != "ok")
    twin_late = [r for r in twin if r["arrival_s"] > kill_at + 0.5]
    assert all(r["status"] == "ok" and r["replica"] == "replica-1" for r in twin_late)
    predicted = fl.failover_summary(twin, kill_at)
    # round robin hands about every other request after the crash to the dead server until
    # its circuit opens (10 failures): the twin retries as many as the router did, give or
    # take the interleaving of concurrent requests
    assert abs(len(predicted["retried"]) - len(live["retried"])) <= 3, (live, predicted)
