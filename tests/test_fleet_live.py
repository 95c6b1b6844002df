"""A live fleet: 2 CPU SGLang servers behind the real sglang-router 0.3.2, against the twin
calibrated on one of them.

One pair of servers per module (each start is about 20 s on an idle machine, a minute on
a loaded one); replica-0 is calibrated once (`fl.TEST_BUDGET_S` seconds of profiling, the
machinery of `servetwin calibrate`) and every twin replica takes the profile. Each test
starts its own router over the servers (under a second), so every policy starts with a
fresh router state, and replays the same shared-prefix workload (experiments/fleet_live.py);
the twin replays the requests at their live send times, in the router's worker order.
The failover test kills a server, so it runs last. `servetwin live fleet` itself (start,
URL, Ctrl-C, nothing left) is tested in test_fleet_cli_live.py. The offline tests run the
calibrated twin side on a profile fitted from a real bench_serving file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from experiments import fleet_live as fl
from runtime.router import RouterOptions

DATA = Path(__file__).parent / "data"
MODEL = "tiny-llama-l6-h512-v4096"
KILL_AT = 2.8


# ---- the calibrated twin side, offline -------------------------------------------------
@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """(server_info, profile path) of the CPU harness server a real bench_serving file
    recorded, the profile fitted from it (`servetwin calibrate --from-bench-serving`)."""
    from runtime.cpu.model import write_config
    from servetwin.cli import main

    d = tmp_path_factory.mktemp("fleetcal")
    bench = DATA / "bench_serving_cpu.jsonl"
    assert main(["calibrate", "--from-bench-serving", str(bench), "--out",
                 str(d / "profile.json")]) == 0
    (d / MODEL).mkdir()
    write_config(d / MODEL)
    info = json.loads(bench.read_text().splitlines()[0])["server_info"]
    return info | {"model_path": str(d / MODEL)}, d / "profile.json"


def _crash(at: float = KILL_AT) -> list[dict]:
    return [{"kind": "crash", "replica": "replica-0", "at_s": at, "repair_s": 3600}]


@pytest.mark.offline
def test_the_calibrated_twin_adds_the_request_path_and_keeps_the_send_times(offline):
    info, prof = offline
    work = fl.workload()
    spec = fl.twin_spec(info, "round_robin", profile=prof)
    assert [r["calibration"] for r in spec["replicas"]] == [str(prof.resolve())] * 2
    # the profile with a request path as `servetwin calibrate` measures it live (the
    # bench_serving file has no server timestamps to measure one)
    with_path = json.loads(prof.read_text()) | {"request_path": {
        "ingress_s": 0.004, "ingress_samples": 18, "egress_s": 0.0025, "egress_samples": 18,
        "overhead_s": 0.0065, "overhead_samples": 18}}
    (prof.parent / "path.json").write_text(json.dumps(with_path))
    recs = fl.simulate(info, "round_robin", work, profile=prof.parent / "path.json")
    assert [r["arrival_s"] for r in recs] == pytest.approx(
        sorted(r.arrival_s for r in work.requests), abs=2e-6)
    # the same run without the request path: every request is ingress + egress faster
    # (no faults, so moving every arrival by ingress changes nothing else)
    flat = {r["rid"]: r for r in fl.simulate(info, "round_robin", work, profile=prof)}
    for r in recs:
        assert r["ttft_s"] - flat[r["rid"]]["ttft_s"] == pytest.approx(0.0065, abs=3e-6)
        assert r["e2e_s"] - flat[r["rid"]]["e2e_s"] == pytest.approx(0.0065, abs=3e-6)
    # the CPU's steps: a request takes far longer than on the GPU entry's roofline
    roof = fl.simulate(info, "round_robin", work)
    assert fl.latency(recs)["all"]["e2e_mean"] > 3 * fl.latency(roof)["all"]["e2e_mean"]
    again = fl.simulate(info, "round_robin", work, profile=prof.parent / "path.json")
    assert again == recs  # deterministic


@pytest.mark.offline
def test_round_robin_starts_at_the_routers_first_worker(offline):
    info, prof = offline
    work = fl.workload()
    for order in (("replica-0", "replica-1"), ("replica-1", "replica-0")):
        recs = {r["rid"]: r["replica"] for r in fl.simulate(info, "round_robin", work,
                                                            profile=prof, order=order)}
        assert [recs[f"r{i}"] for i in range(4)] == [*order, *order]


@pytest.mark.offline
def test_the_calibrated_twin_fails_the_requests_in_flight_at_the_crash(offline):
    """Hand-checked against the same run without the crash: exactly the requests on
    replica-0 that arrived before the crash and had not ended by it fail (a started stream
    cannot be retried); the roofline twin had finished them all."""
    info, prof = offline
    work = fl.workload(spec=fl.FAILOVER_WORKLOAD)
    calm = fl.simulate(info, "round_robin", work, profile=prof)
    in_flight = sorted(r["rid"] for r in calm if r["replica"] == "replica-0"
                       and r["arrival_s"] <= KILL_AT < r["arrival_s"] + r["e2e_s"])
    assert in_flight, "the workload must keep requests in flight at the crash"
    crashed = fl.simulate(info, "round_robin", work, profile=prof, faults=_crash())
    assert sorted(r["rid"] for r in crashed) == sorted(r.rid for r in work.requests)
    summary = fl.failover_summary(crashed, KILL_AT)
    assert sorted(summary["failed"]) == in_flight
    assert all(r["status"] == "failed" and "mid-response" in r["error"]
               for r in crashed if r["rid"] in in_flight)
    assert summary["retried"] and summary["after_ok_elsewhere"] == summary["sent_after"]
    roof = fl.simulate(info, "round_robin", work, faults=_crash())
    assert fl.failover_summary(roof, KILL_AT)["failed"] == []
    # steps twice as slow keep more requests in flight: at least as many fail
    slow = fl.simulate(info, "round_robin", work, profile=prof, faults=_crash(), step_scale=2)
    assert len(fl.failover_summary(slow, KILL_AT)["failed"]) >= len(in_flight)


@pytest.mark.offline
def test_cache_aware_split_distribution_counts_every_perturbed_run(offline):
    info, prof = offline
    work = fl.workload()
    dist = fl.split_distribution(info, "cache_aware", work, prof, ("replica-0", "replica-1"),
                                 scales=(0.8, 1.0), jitters=2)
    assert sum(dist.values()) == 6
    assert all(sum(map(int, k.split("/"))) == len(work.requests) for k in dist)
    assert dist == fl.split_distribution(info, "cache_aware", work, prof,
                                         ("replica-0", "replica-1"), scales=(0.8, 1.0),
                                         jitters=2)


@pytest.mark.offline
def test_latency_table_per_replica():
    recs = [{"replica": "replica-0", "status": "ok", "ttft_s": 0.1, "e2e_s": 1.0},
            {"replica": "replica-0", "status": "ok", "ttft_s": 0.3, "e2e_s": 2.0},
            {"replica": "replica-1", "status": "ok", "ttft_s": 0.2, "e2e_s": 4.0},
            {"replica": None, "status": "failed", "ttft_s": None, "e2e_s": None}]
    t = fl.latency(recs)
    assert list(t) == ["replica-0", "replica-1", "all"]
    assert t["replica-0"] == {"n": 2, "ttft_mean": 0.2, "ttft_p50": 0.2, "e2e_mean": 1.5,
                              "e2e_p50": 1.5}
    assert t["all"]["n"] == 3 and t["all"]["e2e_p50"] == 2.0


# ---- live ----------------------------------------------------------------------------------
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
def profile(fleet, tmp_path_factory):
    """replica-0 calibrated once, before any router runs (a short budget: every run kind
    is still sampled); the path of its profile."""
    out = tmp_path_factory.mktemp("calibration")
    path = fl.calibrate(fleet.worker_urls[0], out, fl.TEST_BUDGET_S, log=lambda _: None)
    assert fl.calibrate(fleet.worker_urls[0], out, 0.0, log=lambda _: None) == path  # reused
    return path


@pytest.fixture(scope="module")
def runs(fleet, work, profile):
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
    assert sorted(run.order) == ["replica-0", "replica-1"]


def _twin(info, policy, run, work, profile, **kw):
    return fl.simulate(info, policy, run.sent(work), profile=profile, order=run.order, **kw)


@pytest.mark.live
def test_round_robin_alternates_and_the_calibrated_twin_agrees(runs, work, fleet, info,
                                                               profile):
    run = runs["round_robin"]
    _check_complete(run, work, fleet)
    twin_recs = _twin(info, "round_robin", run, work, profile)
    # the twin in the router's worker order, at the live send times: the same replica for
    # every request but those sent within 50 ms of another (they may reach the router in
    # the other order)
    live_at = {r["rid"]: r["replica"] for r in run.records}
    sent = {r["rid"]: r["arrival_s"] for r in run.records}
    differ = [r["rid"] for r in twin_recs if live_at[r["rid"]] != r["replica"]]
    assert len(differ) <= len(work.requests) // 4, differ
    for rid in differ:
        assert any(abs(sent[rid] - t) < 0.05 for o, t in sent.items() if o != rid), (rid, sent)
    assert fl.shares_sorted(fl.split(twin_recs)) == [0.5, 0.5]
    assert fl.cached_share(run.records) == pytest.approx(fl.cached_share(twin_recs), abs=0.1)
    # latency, fleet-wide: the calibrated twin within a factor of 3 of live (the
    # uncalibrated roofline is 50-100x fast). Not closer: a short profile, the machine's
    # load between profiling and replay, and a gap of 30-50 ms in live TTFT not yet
    # explained (docs/fleet-live.md has the per-replica errors)
    live_l, twin_l = fl.latency(run.records)["all"], fl.latency(twin_recs)["all"]
    roof_l = fl.latency(fl.simulate(info, "round_robin", run.sent(work), order=run.order))
    for m in ("ttft_mean", "e2e_mean"):
        assert 1 / 3 < twin_l[m] / live_l[m] < 3, (m, live_l, twin_l)
        assert roof_l["all"][m] / live_l[m] < 1 / 3, (m, live_l, roof_l)


@pytest.mark.live
def test_cache_aware_keeps_templates_together_and_the_twin_agrees(runs, work, fleet, info,
                                                                  profile):
    run = runs["cache_aware"]
    _check_complete(run, work, fleet)
    twin_recs = _twin(info, "cache_aware", run, work, profile)
    live_aff, twin_aff = fl.template_affinity(work, run.records), fl.template_affinity(work, twin_recs)
    assert live_aff >= 0.9 and twin_aff >= 0.9
    # keeping a template on one replica caches more than spreading it (round robin)
    assert fl.cached_share(run.records) > fl.cached_share(runs["round_robin"].records)
    assert fl.cached_share(run.records) == pytest.approx(fl.cached_share(twin_recs), abs=0.1)
    # the request split is a race on in-flight counts (docs/fleet-live.md): the calibrated
    # twin usually finds it one too (more than one outcome when its steps or send times
    # move a little), but not for every draw of send times (a CI run: 17/7 in all 25
    # perturbed runs), and the live draw was among its outcomes in two benchmark runs of
    # three and not in one test run (23/1); so the split is reported, not asserted. What
    # is asserted: every perturbed run serves every request once, on the two replicas
    dist = fl.split_distribution(info, "cache_aware", run.sent(work), profile, run.order)
    live_split = sorted(Counter(r["replica"] for r in run.records).values(), reverse=True)
    print(f"cache_aware split: live {'/'.join(map(str, live_split))}, twin perturbed {dist}")
    assert sum(dist.values()) == 25
    n = len(work.requests)
    assert all(sum(map(int, k.split("/"))) == n and len(k.split("/")) <= 2 for k in dist), dist


@pytest.mark.live
def test_one_server_killed_mid_replay(fleet, info, runs, profile):
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
    # the calibrated twin with the crash at the measured time, the requests at their send
    # times: the same rules, and now the same requests in flight on the killed server
    twin = _twin(info, "round_robin", run, work, profile, faults=_crash(round(kill_at, 3)))
    assert sorted(r["rid"] for r in twin) == sorted(r.rid for r in work.requests)
    assert all(r["arrival_s"] <= kill_at for r in twin if r["status"] != "ok")
    twin_late = [r for r in twin if r["arrival_s"] > kill_at + 0.5]
    assert all(r["status"] == "ok" and r["replica"] == "replica-1" for r in twin_late)
    predicted = fl.failover_summary(twin, kill_at)
    # the requests in flight at the kill fail on both sides. Which ones they are depends
    # on how fast the servers ran between the profile and the kill (0.5-1.8x the profile's
    # steps on this shared machine): the calibrated twin fails some of the requests round
    # robin gave the dead server when any failed live (the roofline twin fails none), and
    # at this run's own measured step speed it names nearly the same ones (all 4 of 4 and
    # 1 of 1 in two benchmark runs; 2 of 4 in a test run, whose r1 and r3 ended just
    # before the kill in the twin and were still streaming live)
    failed_live, failed_twin = set(live["failed"]), set(predicted["failed"])
    assert failed_twin <= set(predicted["on_dead_before"]), predicted
    assert failed_twin or not failed_live, (live, predicted)
    k = fl.drift_scale(run.records, info, profile)
    at_speed = _twin(info, "round_robin", run, work, profile, faults=_crash(round(kill_at, 3)),
                     step_scale=k)
    failed_k = set(fl.failover_summary(at_speed, kill_at)["failed"])
    assert len(failed_live ^ failed_k) <= 2, (k, live, failed_k)
    # round robin hands about every other request after the crash to the dead server until
    # its circuit opens after --cb-failure-threshold (10) failures. Live, those are the
    # refused connections alone (the router's log shows the 10th refusal opening it: a
    # stream that broke after its 200 is not counted), on both sides (twin/cluster.py
    # `Deployment._lost`)
    refused_live, refused_twin = live["attempts"] - len(recs), predicted["attempts"] - len(twin)
    if "closed -> open" in fl.circuit_events(run.router_log):
        assert refused_live == 10, (live, run.router_log[-2000:])
    assert refused_twin == 10, predicted
