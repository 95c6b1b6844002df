"""The replica answers an order question without a snapshot where the policy needs none
(`Policy.keeps_queue_order`: fcfs; `Policy.sort_key`: priority, lof), and builds the
running batch's views only when a policy reads them (`twin.views.RunningViews`); either
way the answer is the one asking the policy from a whole snapshot gives: the same
records, pass for pass (issue 14). A recorded decision (`PolicyDecider.log`) always has
the whole snapshot, so the recorded run is the reference."""

from __future__ import annotations

import pytest
import simpy
from helpers import GPU, MODEL

from twin.config import ServerArgs
from twin.decider import PolicyDecider
from twin.metrics import twin_records
from twin.policy import Policy, Snapshot, make_policy
from twin.policy.base import RequestView
from twin.sim import SimConfig, build_policy, build_replica
from twin.views import RunningViews, _build
from twin.workload import from_spec

# overloaded, so that many requests wait at most passes; three priority tiers
LOAD = ("arrival=poisson,rate=12,n=160,prompt=uniform:300:3000,output=uniform:20:200,"
        "tiers=0:0.6/10:0.3/20:0.1")


def _run(policy_name: str, priority: bool, ask: bool):
    args = ServerArgs(model_path=MODEL, schedule_policy=policy_name,
                      enable_priority_scheduling=priority, max_running_requests=8)
    cfg = SimConfig(args=args, gpu=GPU, step_time_backend="roofline", sample_every_s=1.0,
                    ignore_eos=False)  # reservations read new_token_ratio
    env = simpy.Environment()
    decider = PolicyDecider(build_policy(cfg))
    if ask:
        decider.log = []  # a recorded decision is always asked of the policy
    rep, _ = build_replica(env, from_spec(LOAD, 5), cfg, decider=decider)
    rep.step_log = []
    env.process(rep.run())
    env.run()
    return rep, twin_records(rep.finished, rep.step_end), decider.log


@pytest.mark.parametrize("name,priority", [
    ("fcfs", False), ("fcfs", True), ("lof", False), ("lpm", False), ("dfs-weight", False),
    ("shortest-prefill-first", False), ("lof", True)])
def test_shortcut_gives_the_answer_the_policy_gives(name, priority):
    rep_a, recs_a, log = _run(name, priority, ask=True)
    rep_b, recs_b, _ = _run(name, priority, ask=False)
    assert len(log) > 50  # the workload puts real order questions
    assert any(len(snap.waiting) >= 3 for snap, _ in log)
    if name == "lof" or priority:  # a keyed policy reorders the queue somewhere
        assert any(list(plan.order) != sorted(plan.order) for _, plan in log)
    assert recs_a == recs_b
    assert rep_a.step_log == rep_b.step_log
    assert rep_a.series == rep_b.series
    assert len(recs_b) == 160 and all(r["status"] == "ok" for r in recs_b)


class _Admits(Policy):
    def decide(self, snap: Snapshot):
        from twin.policy import Plan
        return Plan(order=tuple(range(len(snap.waiting))), admit=1)


class _Reorders(Policy):
    def order(self, snap: Snapshot) -> list[int]:
        return list(reversed(range(len(snap.waiting))))


def test_which_policies_keep_the_queue_order():
    assert make_policy("fcfs").keeps_queue_order()
    assert not make_policy("fcfs", priority_scheduling=True).keeps_queue_order()
    for name in ("lof", "lpm", "hrrn", "dfs-weight", "random"):
        assert not make_policy(name).keeps_queue_order(), name
    assert not _Admits().keeps_queue_order()  # its admit limit is an answer too
    assert not _Reorders().keeps_queue_order()
    snap = Snapshot(now=0.0, waiting=(RequestView("a"), RequestView("b")), running=())
    assert Policy().decide(snap).order == (0, 1)  # what the shortcut stands for


def test_running_views_are_built_on_demand_and_only_during_the_decision():
    rep, _, _ = _run("fcfs", False, ask=False)
    reqs = rep.finished[:3]
    for r in reqs:  # as if still decoding: a reservation that reads the ratio
        r.generated_tokens, r.ignore_eos = 5, False
    lazy = RunningViews(reqs, 0.7)
    assert len(lazy) == 3 and bool(lazy) and lazy._views is None  # no view built
    assert lazy.views() == tuple(_build(r, 0.7, True) for r in reqs)
    assert lazy[0].reserved_tokens == (reqs[0].max_new_tokens - 5) * 0.7
    assert lazy == tuple(lazy) and hash(lazy) == hash(tuple(lazy)) and lazy[1:] == lazy.views()[1:]
    lazy.close()
    assert lazy[0].rid == reqs[0].rid  # read during the decision: kept
    late = RunningViews(reqs, 0.7)
    late.close()
    assert len(late) == 3  # no view needed
    with pytest.raises(RuntimeError, match="after its decision"):
        late[0]
    assert not RunningViews([], 0.7)
