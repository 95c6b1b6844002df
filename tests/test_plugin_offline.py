"""The plugin's pure parts without SGLang: the decision log's JSON round trip, its replay,
the fault policies' answers and the plugin environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.plugin import decisions
from runtime.plugin.env import plugin_env
from twin.policy.base import Plan
from twin.policy.check import sample_snapshots, validate_plan
from twin.policy.registry import PolicyError, build_policy

pytestmark = pytest.mark.offline


def test_snapshots_survive_the_json_round_trip_exactly():
    for snap in sample_snapshots(seed=3, n=40):
        line = json.dumps(decisions.snapshot_to_json(snap))
        assert decisions.snapshot_from_json(json.loads(line)) == snap


@pytest.mark.parametrize("plan", [Plan(order=(2, 0, 1)), Plan(victims=(1, 0)), Plan(), None])
def test_plans_survive_the_json_round_trip(plan):
    assert decisions.plan_from_json(json.loads(json.dumps(decisions.plan_to_json(plan)))) == plan


def _log(tmp_path, policy_name: str, plans) -> list[dict]:
    policy = build_policy(policy_name)
    path = tmp_path / "d.jsonl"
    lines = [decisions.header_line({"name": policy_name, "params": {}}, {}, {}, False, 5.0)]
    for snap, plan in plans(policy):
        lines.append(decisions.decision_line(snap, plan, "applied", 12.0, False))
    path.write_text("\n".join(lines) + "\n")
    return list(decisions.read_lines(path))


def test_a_log_of_the_policy_s_own_answers_replays_at_100_percent(tmp_path):
    snaps = sample_snapshots(seed=1, n=30)
    lines = _log(tmp_path, "slices", lambda p: [(s, p.decide(s)) for s in snaps])
    result = decisions.replay(lines, decisions.policy_from_header(lines[0]))
    assert (result.decisions, result.identical, result.share) == (30, 30, 1.0)


def test_replay_reports_disagreements_with_their_line(tmp_path):
    snaps = [s for s in sample_snapshots(seed=2, n=30) if s.candidate is None
             and len(s.waiting) >= 2]
    reversed_plans = [(s, Plan(order=tuple(reversed(range(len(s.waiting)))))) for s in snaps]
    lines = _log(tmp_path, "fcfs", lambda p: reversed_plans)
    result = decisions.replay(lines, decisions.policy_from_header(lines[0]), keep=2)
    assert result.identical == 0 and result.decisions == len(snaps)
    assert [d[0] for d in result.disagreements] == [2, 3]  # line numbers, header is line 1


def test_victims_agree_as_a_set():
    assert decisions.same_decision("preempt", Plan(victims=(2, 0)), Plan(victims=(0, 2)))
    assert not decisions.same_decision("order", Plan(order=(1, 0)), Plan(order=(0, 1)))


def test_each_fault_policy_breaks_the_contract_its_own_way():
    from runtime.plugin import faults

    faults.register_all()
    faults.register_all()  # idempotent
    order = next(s for s in sample_snapshots() if s.candidate is None and s.waiting)
    preempt = next(s for s in sample_snapshots() if s.candidate is not None)
    with pytest.raises(RuntimeError):
        build_policy("fault-raise").decide(order)
    assert "permutation" in validate_plan(order, build_policy("fault-nonperm").decide(order))
    assert "not all in range" in validate_plan(preempt,
                                               build_policy("fault-victims").decide(preempt))
    slow = build_policy("fault-slow", sleep_ms=0.0)
    assert validate_plan(order, slow.decide(order)) is None


def test_plugin_env_resolves_spec_files_and_refuses_bad_specs(tmp_path):
    spec = tmp_path / "p.json"
    spec.write_text(json.dumps({"name": "slices", "params": {"mode": "conservative"}}))
    env = plugin_env(str(spec), tmp_path / "d.jsonl", budget_ms=2)
    assert env == {"SGLANG_PLUGINS": "servetwin", "SERVETWIN_POLICY": str(spec.resolve()),
                   "SERVETWIN_DECISION_LOG": str((tmp_path / "d.jsonl").resolve()),
                   "SERVETWIN_POLICY_BUDGET_MS": "2"}
    with pytest.raises(PolicyError, match="allowed values"):
        plugin_env("no-such-policy")


def test_loading_the_plugin_without_a_policy_imports_nothing():
    code = ("import sys, runtime.plugin as p; p.load(); "
            "print(any(m.startswith(('sglang', 'twin', 'runtime.plugin.hooks')) "
            "for m in sys.modules))")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr


def test_the_decisions_command_prints_the_share(tmp_path, capsys):
    from servetwin.cli import main

    snaps = sample_snapshots(seed=4, n=10)
    _log(tmp_path, "fcfs", lambda p: [(s, p.decide(s)) for s in snaps])
    assert main(["live", "decisions", str(tmp_path / "d.jsonl")]) == 0
    assert "10 decisions, 10 identical (100.0 %)" in capsys.readouterr().out


# --- the plugin's order path over duck-typed requests (SGLang's `Req` fields) ---------------

class FakeReq:
    """The fields of SGLang 0.5.23's `Req` that `runtime.plugin.views.req_view` reads;
    hashable by identity like `Req`."""

    def __init__(self, i: int) -> None:
        from types import SimpleNamespace

        self.rid, self.priority = f"r{i}", (i * 5) % 3
        self.origin_input_ids = list(range(3 + i, 103 + i))
        self.output_ids: list[int] = []
        self.prefix_len = (i * 7) % 40
        self.arrival_processed_tokens = 0
        self.sampling_params = SimpleNamespace(max_new_tokens=16 + (i * 37) % 512,
                                               ignore_eos=True)
        self.time_stats = SimpleNamespace(scheduler_recv_time=100.0 + i,
                                          wait_queue_entry_time=100.0 + i * 0.5,
                                          prefill_finished_time=0.0)


def _runtime(name: str, priority: bool):
    from types import SimpleNamespace

    from runtime.plugin.hooks import PluginRuntime
    from twin.policy.registry import read_spec

    args = {"priority_scheduling": priority, "low_values_first": False,
            "preemption_threshold": 10}
    spec = read_spec(name)
    scheduler = SimpleNamespace(
        new_token_ratio_tracker=SimpleNamespace(current=0.7), max_running_requests=8,
        max_total_num_tokens=10_000,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 5_000),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0,
                                   supports_fast_match_prefix=lambda: False))
    return PluginRuntime(spec, build_policy(spec, **args), args, "fcfs", False, 5.0, None,
                         scheduler)


@pytest.mark.parametrize("name,priority", [("lof", False), ("lof", True), ("slices", False),
                                           ("shortest-prefill-first", False)])
def test_the_plugin_orders_the_queue_as_the_policy_decides(name, priority):
    from runtime.plugin.views import views

    rt = _runtime(name, priority)
    assert (rt.sort_key is not None) == (name == "lof")  # the keyed path where it applies
    queue = [FakeReq(i) for i in (5, 1, 9, 3, 7, 0, 8, 2)]
    for passes in range(3):  # the keys kept across passes give the same answer
        snap = rt.order_snapshot(views(queue, False, 0.7), None)
        expected = [queue[i] for i in rt.policy.decide(snap).order]
        assert rt.on_order(queue, None, 0, None, matched=False)
        assert queue == expected, passes
        queue.reverse()


def test_kept_views_follow_forget_or_a_check():
    rt = _runtime("lof", False)
    rt.tracks_changes = True  # as with the adder hook in place in a server
    queue = [FakeReq(i) for i in range(4)]
    rt.on_order(queue, None, 0, None, matched=False)
    req = queue[0]
    req.prefix_len, req.time_stats.wait_queue_entry_time = 99, 500.0  # re-matched, re-queued

    def seen() -> tuple:
        view = rt.waiting_views.of(queue, checked=False)[queue.index(req)]
        return view.prefix_len, view.queue_entry_s

    assert seen() != (99, 500.0)  # tracked: not told, not rebuilt
    rt.waiting_views.forget(req)  # the adder hook examined it
    assert seen() == (99, 500.0)
    req.prefix_len = 3
    assert rt.waiting_views.of(queue, checked=True)[queue.index(req)].prefix_len == 3
    # a pass where SGLang matched prefixes checks every request
    req.prefix_len = 4
    rt.on_order(queue, None, 0, None, matched=True)
    assert rt.waiting_views.of(queue, checked=False)[queue.index(req)].prefix_len == 4


def test_tracking_is_off_where_sglang_changes_waiting_requests_unseen():
    from types import SimpleNamespace

    from runtime.plugin.hooks import _changes_are_tracked

    assert not _changes_are_tracked(None)
    # outside a server the hooks are not in place: never tracked
    assert not _changes_are_tracked(SimpleNamespace(
        tree_cache=SimpleNamespace(supports_fast_match_prefix=lambda: False)))


def test_an_admission_limit_holds_back_the_rest_of_the_order_for_this_pass():
    from twin.policy.base import Policy

    class AdmitTwo(Policy):
        def decide(self, snap):
            return Plan(order=tuple(reversed(range(len(snap.waiting)))), admit=2)

    rt = _runtime("lof", False)
    rt.policy, rt.sort_key = AdmitTwo(), None
    queue = [FakeReq(i) for i in range(5)]
    assert rt.on_order(queue, None, 0, None)
    assert [r.rid for r in queue] == ["r4", "r3", "r2", "r1", "r0"]
    assert [rt.withholds(r) for r in queue] == [False, False, True, True, True]
    # an answer out of contract (admit 0 with nothing running) falls back: nothing held
    rt.policy = type("AdmitNone", (Policy,), {"decide": lambda self, snap: Plan(
        order=tuple(range(len(snap.waiting))), admit=0)})()
    assert not rt.on_order(queue, None, 0, None)
    assert not any(rt.withholds(r) for r in queue) and rt.counters["invalid"] >= 1
    # the log keeps the limit, so a replay can tell it
    line = decisions.plan_from_json(decisions.plan_to_json(Plan(order=(1, 0), admit=1)))
    assert line == Plan(order=(1, 0), admit=1)
    assert not decisions.same_decision("order", line, Plan(order=(1, 0)))
