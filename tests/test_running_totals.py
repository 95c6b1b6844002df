"""The running batch's totals (twin/replica.py, issue 14): the prompt and generated sums and
the fewest tokens left are updated on join, leave and every step instead of summed over
the batch at every decode run; `check_integrity` (`--debug-checks`) recounts them.

Step times are round (prefill 2 s, decode 1 s) so the timelines are exact."""

from __future__ import annotations

import pytest
import simpy
from helpers import GPU, MODEL, req
from stepmodels import FixedStepTime

from twin.config import ServerArgs
from twin.sim import SimConfig, build_replica
from twin.workload import Workload

pytestmark = pytest.mark.offline

ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)


def replica_at(requests, until, ignore_eos=True, **server):
    """A replica run up to `until` seconds (debug checks on at every pass)."""
    args = ServerArgs(model_path=MODEL, **server)
    cfg = SimConfig(args=args, gpu=GPU, sample_every_s=1e9, debug_checks=True,
                    ignore_eos=ignore_eos)
    env = simpy.Environment()
    rep, _ = build_replica(env, Workload("t", tuple(requests)), cfg, ST)
    env.process(rep.run())
    env.run(until=until)
    return rep


REQS = [req("a", 0.0, 10, 20), req("b", 0.5, 30, 6), req("c", 1.0, 50, 12)]


def totals(rep):
    return rep._sum_prompt, rep._sum_gen


def test_totals_follow_joins_steps_and_leaves():
    # a is prefilled alone [0, 2], b and c after it; by 7.5 s all three decode; b (6
    # tokens) finishes first
    seen = []
    for t in (1.0, 3.0, 5.5, 7.5, 9.5, 12.5, 30.0):
        rep = replica_at(REQS, t)
        seen.append((t, sorted(r.rid for r in rep.running), totals(rep)))
        running = rep.running
        assert totals(rep) == (sum(r.prompt_tokens for r in running),
                               sum(r.generated_tokens for r in running))
        if rep._min_left is not None:
            assert rep._min_left == min(r.max_new_tokens - r.generated_tokens
                                        for r in running)
    # the batch grew and shrank: the totals went up and back to nothing
    assert seen[1][1] == ["a"] and seen[1][2][0] == 10
    assert seen[3][1] == ["a", "b", "c"] and seen[3][2][0] == 90
    assert "b" not in seen[5][1]
    assert seen[-1][1] == [] and seen[-1][2] == (0, 0)


@pytest.mark.parametrize("field,message", [("_sum_prompt", "prompt total"),
                                           ("_sum_gen", "generated total"),
                                           ("_min_left", "fewest tokens left")])
def test_debug_checks_catch_a_wrong_total(field, message):
    rep = replica_at(REQS, 7.5)
    assert len(rep.running) == 3
    rep.check_integrity()  # right as they are
    if field == "_min_left":
        rep._min_left = min(r.max_new_tokens - r.generated_tokens for r in rep.running) + 1
    else:
        setattr(rep, field, getattr(rep, field) + 1)
    with pytest.raises(AssertionError, match=message):
        rep.check_integrity()


def test_totals_recounted_after_retractions():
    # not reserving whole outputs (ignore_eos off), a 400-token pool runs out at 181 s:
    # B is retracted (test_replica_semantics); the debug checks at every pass recount
    # the totals after it, and mid-run they match the batch
    reqs = [req("A", 0.0, 40, 200), req("B", 3.5, 8, 200), req("C", 3.6, 8, 200)]
    server = dict(max_total_tokens=400, disable_radix_cache=True)
    mid = replica_at(reqs, 182.0, ignore_eos=False, **server)
    assert mid.counters.retractions == 1
    assert [r.rid for r in mid.running] == ["A"]
    assert totals(mid) == (40, mid.running[0].generated_tokens)
    rep = replica_at(reqs, 1e6, ignore_eos=False, **server)
    assert [r.status for r in rep.finished] == ["ok"] * 3
    assert totals(rep) == (0, 0)
