"""Policies: order and victims, as SGLang's calc_priority and preempt_to_schedule; the
contract check over every registered policy; spec files."""

import json

import numpy as np
import pytest

from twin.policy import (
    Plan,
    PolicyError,
    RequestView,
    Snapshot,
    build_policy,
    make_policy,
    policy_names,
    read_spec,
)
from twin.policy.check import PolicyContractError, check_policy
from twin.policy.learned import FEATURES, write_safetensors

pytestmark = pytest.mark.offline


def V(rid, priority=0, queue_entry_s=0.0, **kw):
    return RequestView(rid=rid, priority=priority, queue_entry_s=queue_entry_s, **kw)


def snap(waiting, running=(), **kw):
    return Snapshot(0.0, tuple(waiting), tuple(running), 100, 0, 100, **kw)


def test_registry_has_the_sglang_policies():
    assert {"fcfs", "lpm", "lof", "priority", "hrrn", "dfs-weight", "random",
            "shortest-prefill-first", "slices", "learned"} <= set(policy_names())
    with pytest.raises(PolicyError, match="allowed values"):
        make_policy("nope")


def test_fcfs_keeps_order_and_priority_sorts_high_first_then_oldest():
    w = [V("a", 0, 1.0), V("b", 5, 2.0), V("c", 5, 0.5)]
    assert make_policy("fcfs").order(snap(w)) == [0, 1, 2]
    assert make_policy("fcfs", priority_scheduling=True).order(snap(w)) == [2, 1, 0]
    assert make_policy("fcfs", priority_scheduling=True, low_values_first=True).order(
        snap(w)) == [0, 2, 1]


def test_lof_and_lpm():
    w = [V("a", max_new_tokens=5, prefix_len=50), V("b", max_new_tokens=50, prefix_len=0),
         V("c", max_new_tokens=20, prefix_len=80)]
    assert make_policy("lof").order(snap(w)) == [1, 2, 0]
    assert make_policy("lpm").order(snap(w)) == [2, 0, 1]
    many = [V(str(i), prefix_len=i) for i in range(129)]
    assert make_policy("lpm").order(snap(many)) == list(range(129))
    assert not make_policy("lpm").wants_prefix_match(129)


def test_lpm_defers_duplicate_heads_with_short_matches():
    # a and c share their first 32 tokens and neither has more than 32 cached: c waits
    w = [V("a", prefix_len=0, head=7), V("b", prefix_len=10, head=8),
         V("c", prefix_len=0, head=7), V("d", prefix_len=40, head=7)]
    assert make_policy("lpm").order(snap(w)) == [3, 1, 0, 2]


def test_victims_respect_threshold_and_take_lowest_newest_first():
    p = make_policy("fcfs", priority_scheduling=True, preemption_threshold=10)
    running = [V("old-low", 0, 1.0, reserved_tokens=30), V("new-low", 0, 2.0, reserved_tokens=30),
               V("mid", 15, 0.0, reserved_tokens=100)]
    w = [V("vip", 20)]
    assert p.victims(snap(w, running, candidate=0, tokens_needed=20)) == [1]
    assert p.victims(snap(w, running, candidate=0, tokens_needed=50)) == [1, 0]
    assert p.victims(snap(w, running, candidate=0, tokens_needed=0)) == [1]  # a slot only
    assert p.victims(snap(w, running, candidate=0, tokens_needed=500)) == []
    assert make_policy("fcfs").victims(snap(w, running, candidate=0, tokens_needed=20)) == []
    assert p.decide(snap(w, running, candidate=0, tokens_needed=20)) == Plan(victims=(1,))


@pytest.mark.parametrize("name", policy_names())
def test_check_policy_over_every_registered_policy(name):
    if name == "learned":  # needs weights: the shipped finance-qa policy
        assert check_policy(build_policy("learned:finance-qa")) > 0
        return
    assert check_policy(make_policy(name)) > 0
    assert check_policy(make_policy(name, priority_scheduling=True)) > 0


def test_check_policy_catches_broken_policies():
    class Dup:
        name = "dup"

        def decide(self, s):
            return Plan(order=(0,) * len(s.waiting)) if s.candidate is None else Plan()

    class Flaky:
        name = "flaky"
        n = 0

        def decide(self, s):
            self.n += 1
            return Plan(order=tuple(range(len(s.waiting))), victims=()) \
                if s.candidate is None else Plan(victims=(0,) * (self.n % 2))

    with pytest.raises(PolicyContractError, match="permutation"):
        check_policy(Dup())
    with pytest.raises(PolicyContractError, match="different answer|not all in range"):
        check_policy(Flaky())


def test_learned_policy_from_safetensors_and_json(tmp_path):
    w = np.zeros((1, len(FEATURES)))
    w[0, FEATURES.index("priority")] = 1.0  # score = priority / 10
    write_safetensors(tmp_path / "p.safetensors", {"w0": w, "b0": np.zeros(1)})
    p = build_policy(read_spec_file_json(tmp_path, {
        "name": "learned", "params": {"weights": "p.safetensors"}}))
    assert check_policy(p) > 0
    assert p.order(snap([V("a", 0), V("b", 5), V("c", 2)])) == [1, 2, 0]
    (tmp_path / "p.json").write_text(json.dumps({"layers": [
        {"w": [[0.0] * len(FEATURES)], "b": [0.0]}]}))
    q = build_policy(read_spec_file_json(tmp_path, {"name": "learned",
                                                    "params": {"weights": "p.json"}}))
    assert q.order(snap([V("a", 0, 2.0), V("b", 5, 1.0)])) == [1, 0]  # ties: queue entry


def read_spec_file_json(tmp_path, data):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(data))
    return read_spec(str(f))


@pytest.mark.parametrize("data, match", [
    ({"name": "slices", "params": {"mode": "moderate", "slice": 3}}, "no parameter 'slice'"),
    ({"name": "slices", "params": {"time_slice_ms": "fast"}}, "expected a finite number"),
    ({"name": "slices", "extra": 1}, "unknown key"),
    ({"name": "nope"}, "allowed values"),
    ({"params": {}}, "field 'name'"),
    ([1, 2], "expected an object"),
    ({"name": "slices", "params": {"mode": "wild"}}, "allowed values: conservative"),
    ({"name": "learned", "params": {"weights": "missing.safetensors"}}, "no such file"),
])
def test_spec_errors_are_clear(tmp_path, data, match):
    with pytest.raises(PolicyError, match=match):
        build_policy(read_spec_file_json(tmp_path, data))


def test_spec_file_missing_and_yaml(tmp_path):
    with pytest.raises(PolicyError, match="no such file"):
        read_spec(str(tmp_path / "none.json"))
    (tmp_path / "s.yaml").write_text("name: slices\nparams:\n  mode: aggressive\n")
    p = build_policy(read_spec(str(tmp_path / "s.yaml")))
    assert p.mode == "aggressive" and p.time_slice_s == 0.05
