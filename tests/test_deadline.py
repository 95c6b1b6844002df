"""The deadline-aware admission policy (twin/policy/deadline.py): Moore-Hodgson, the
order by group, what each `withhold` mode holds back, and the policy contract."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.policy import Plan, RequestView, Snapshot, build_policy, spec_from_dict
from twin.policy.check import check_policy, validate_plan
from twin.policy.deadline import WITHHOLD, DeadlinePolicy, moore_hodgson, prefill_s


def test_moore_hodgson_keeps_the_most_jobs_on_time():
    # (deadline, duration, key): EDF alone would finish only a (then b, c late)
    kept, late = moore_hodgson([(10, 8, 0), (12, 5, 1), (13, 5, 2)], start=0)
    assert kept == [1, 2] and late == [0]
    assert moore_hodgson([(5, 1, 0), (6, 1, 1)], 0) == ([0, 1], [])


def test_prefill_model_grows_with_context():
    m = (8192, 0.0, 1e-4, 1e-9)
    assert prefill_s(0, 0, *m) == 0.0
    assert prefill_s(1000, 50_000, *m) > prefill_s(1000, 0, *m)


def req(rid, prompt, arrival, running=False, first=None):
    return RequestView(rid=rid, prompt_tokens=prompt, arrival_s=arrival, queue_entry_s=arrival,
                       max_new_tokens=100, generated_tokens=5 if running else 0,
                       first_token_s=first)


def snap(now, waiting, running=()):
    return Snapshot(now=now, waiting=tuple(waiting), running=tuple(running),
                    kv_capacity=300_000, kv_free=300_000)


# a short question (deadline 101.5), a document that can make it (20k tokens: target
# 11.5 s, about 4.5 s of prefill) and one that cannot (arrived 200 s ago)
QUEUE = [req("doc-ok", 20_000, 99.0), req("short", 300, 100.0), req("doc-late", 30_000, -100.0)]
RUNNING = [req("run", 200, 90.0, running=True, first=91.0)]


def test_order_shorts_then_kept_then_hopeless_documents():
    pol = DeadlinePolicy(withhold="none")
    plan = pol.decide(snap(100.0, QUEUE, RUNNING))
    assert plan.order == (1, 0, 2) and plan.admit is None


def test_what_each_mode_withholds():
    s = snap(100.0, QUEUE, RUNNING)
    admit = {m: DeadlinePolicy(withhold=m).decide(s).admit for m in WITHHOLD}
    # hopeless: the late document waits; documents / laxity: both wait while a short runs
    assert admit == {"none": None, "hopeless": 2, "documents": 1, "laxity": 1}
    # laxity: once the kept document's slack is down to the margin it starts
    late_now = snap(104.5, QUEUE, RUNNING)
    assert DeadlinePolicy(withhold="laxity").decide(late_now).admit == 2
    # an idle server serves everything, in every mode
    idle = snap(100.0, QUEUE)
    assert all(DeadlinePolicy(withhold=m).decide(idle).admit is None for m in WITHHOLD)


def test_every_mode_keeps_the_contract():
    for m in WITHHOLD:
        pol = build_policy(spec_from_dict({"name": "deadline", "params": {"withhold": m}}))
        assert check_policy(pol) > 0


def test_validate_plan_refuses_withholding_everything_from_an_idle_server():
    s = snap(100.0, QUEUE)
    assert validate_plan(s, Plan(order=(0, 1, 2), admit=0))
    assert validate_plan(s, Plan(order=(0, 1, 2), admit=4))
    assert validate_plan(s, Plan(order=(0, 1, 2), admit=1)) is None
    assert validate_plan(snap(100.0, QUEUE, RUNNING), Plan(order=(0, 1, 2), admit=0)) is None


def test_the_replica_withholds_and_still_serves_everyone():
    """A policy that admits one request per pass while anything runs: every request is
    served (an idle server admits all), and the schedule differs from the same order
    without withholding."""
    from experiments.rl.config import preset
    from experiments.rl.env import capacity_of, step_time_for
    from experiments.rl.episode import run_policy
    from experiments.rl.evaluate import episode_workload
    from twin.policy import Policy

    class OneAtATime(Policy):
        name = "one-at-a-time"

        def __init__(self, hold: bool) -> None:
            super().__init__()
            self.hold = hold

        def decide(self, snap):
            if snap.candidate is not None:
                return Plan(victims=())
            order = tuple(range(len(snap.waiting)))
            return Plan(order=order, admit=1 if self.hold and snap.running else None)

    cfg = preset("tiny")
    wl = episode_workload(cfg, 3, {"load": 1.5, "burst_cv": 2.0})
    runs = [run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg), OneAtATime(h))
            for h in (True, False)]
    held, free = (r[1] for r in runs)
    assert [r["status"] for r in held] == ["ok"] * len(wl.requests)
    assert held != free


def test_groups_are_kept_per_snapshot_and_model_and_handed_out_as_copies():
    """The last snapshot's groups serve the next policy asking of the same snapshot with
    the same targets, prefill model and aging bound (a menu's four modes, the pass-v2
    features), and no other; each caller gets its own lists."""
    s = snap(100.0, QUEUE, RUNNING)
    first = DeadlinePolicy(withhold="hopeless").groups(s)
    first["kept"].append(99)  # a caller's own copy
    assert DeadlinePolicy(withhold="laxity").groups(s) == DeadlinePolicy()._groups(s)
    assert 99 not in DeadlinePolicy().groups(s)["kept"]
    # another aging bound: doc-late (200 s waiting) is overdue only under 150 s
    aged = DeadlinePolicy(max_defer_s=150.0).groups(s)
    assert aged == DeadlinePolicy(max_defer_s=150.0)._groups(s)
    assert aged["overdue"] == [2] and DeadlinePolicy().groups(s)["overdue"] == []
    # an equal snapshot that is another object is computed anew, to the same groups
    again = snap(100.0, QUEUE, RUNNING)
    assert DeadlinePolicy().groups(again) == DeadlinePolicy()._groups(s)


def _moore_hodgson_by_scan(jobs, start):
    """The reference: each late job drops the longest kept one found by a scan."""
    kept, late, t = [], [], start
    for job in sorted(jobs):
        kept.append(job)
        t += job[1]
        if t > job[0]:
            worst = max(range(len(kept)), key=lambda j: (kept[j][1], kept[j][2]))
            t -= kept[worst][1]
            late.append(kept.pop(worst)[2])
    return [k for _, _, k in kept], late


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.25, 10.0]),
                          st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0])), max_size=40),
       st.sampled_from([-1.0, 0.0, 0.3]))
def test_moore_hodgson_by_heap_is_the_scan(pairs, start):
    """The heap drops the same job as a scan of the kept ones would (ties in deadline and
    duration included: the largest key goes), so the same keys in the same order."""
    jobs = [(d, dur, k) for k, (d, dur) in enumerate(pairs)]
    assert moore_hodgson(jobs, start) == _moore_hodgson_by_scan(jobs, start)


def _groups_by_columns(pol, s):
    """The groups with each deadline from `waiting_targets`' numpy column (the form
    before the targets were computed request by request in Python floats)."""
    from twin.policy.features import waiting_targets

    w, now = s.waiting, s.now
    deadline = [r.arrival_s + t for r, t in zip(w, waiting_targets(s, pol.targets),
                                                 strict=True)]
    cost = [pol.prefill_s(r) for r in w]
    doc = [pol.targets.is_document(r.prompt_tokens) for r in w]
    shorts = [i for i in range(len(w)) if not doc[i]]
    g = {"ok": sorted((i for i in shorts if now + cost[i] <= deadline[i]),
                      key=lambda i: (deadline[i], i)),
         "late": sorted((i for i in shorts if now + cost[i] > deadline[i]),
                        key=lambda i: (w[i].arrival_s, i))}
    docs = [i for i in range(len(w)) if doc[i]]
    g["overdue"] = sorted((i for i in docs if pol.max_defer_s
                           and now - w[i].arrival_s > pol.max_defer_s),
                          key=lambda i: (w[i].arrival_s, i))
    over = set(g["overdue"])
    start = now + sum(cost[i] for i in shorts)
    g["kept"], g["hopeless"] = _moore_hodgson_by_scan(
        [(deadline[i], cost[i], i) for i in docs if i not in over], start)
    g["hopeless"].sort(key=lambda i: (w[i].arrival_s, i))
    g["slack"] = [d - now - c for d, c in zip(deadline, cost, strict=True)]
    return g


_WAITING = st.lists(st.builds(
    lambda i, prio, arrival, prompt, prefix: RequestView(
        rid=f"r{i}", priority=prio, arrival_s=arrival, queue_entry_s=arrival,
        prompt_tokens=prompt, prefix_len=prefix, max_new_tokens=50),
    st.integers(0, 999), st.sampled_from([0, 5, 10]),
    st.one_of(st.integers(0, 3), st.floats(-700.0, 100.0)),
    st.one_of(st.integers(1, 5000), st.integers(4096, 130_000)), st.integers(0, 20_000)),
    max_size=20)


@settings(max_examples=300, deadline=None)
@given(waiting=_WAITING, now=st.one_of(st.sampled_from([0, 1.5, 100.0]),
                                       st.floats(0.0, 200.0)),
       tiers=st.sampled_from([None, [[5, 0.8]], [[10, 0.5], [5, 0.9], [10, 0.4]]]),
       defer=st.sampled_from([0.0, 150.0, 600.0]))
def test_groups_are_their_column_form(waiting, now, tiers, defer):
    """Each deadline computed in Python floats is `waiting_targets`' float: the groups,
    in order, and the slacks are the column form's, bit for bit (tiers named twice,
    documents, matches longer than the prompt, no aging bound)."""
    import struct

    pol = DeadlinePolicy(tier_ttft_s=tiers, max_defer_s=defer)
    s = snap(now, waiting, RUNNING)
    got, want = pol._groups(s), _groups_by_columns(pol, s)
    assert {k: v for k, v in got.items() if k != "slack"} == \
        {k: v for k, v in want.items() if k != "slack"}
    assert [struct.pack("d", x) for x in got["slack"]] == \
        [struct.pack("d", x) for x in want["slack"]]
