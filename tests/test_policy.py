"""Policies: order and victims, as SGLang's calc_priority and preempt_to_schedule."""

from dataclasses import dataclass

import pytest

from twin.policy import Snapshot, make_policy, policy_names


@dataclass
class V:
    rid: str
    priority: int = 0
    queue_entry_s: float = 0.0
    max_new_tokens: int = 10
    prefix_len: int = 0
    tokens_held: int = 0
    arrival_s: float = 0.0
    prompt_tokens: int = 10
    generated_tokens: int = 0


def snap(waiting, running=()):
    return Snapshot(0.0, list(waiting), list(running), 100, 100)


def test_registry_has_the_sglang_policies():
    assert {"fcfs", "lpm", "lof", "priority"} <= set(policy_names())
    with pytest.raises(ValueError, match="allowed values"):
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


def test_victims_respect_threshold_and_take_lowest_newest_first():
    p = make_policy("fcfs", priority_scheduling=True, preemption_threshold=10)
    running = [V("old-low", 0, 1.0, tokens_held=30), V("new-low", 0, 2.0, tokens_held=30),
               V("mid", 15, 0.0, tokens_held=100)]
    cand = V("vip", 20)
    assert p.victims(snap([], running), cand, 20) == [1]
    assert p.victims(snap([], running), cand, 50) == [1, 0]
    assert p.victims(snap([], running), cand, 500) == []  # cannot free enough: none
    assert make_policy("fcfs").victims(snap([], running), cand, 20) == []
