"""Workload generators and specs."""

import numpy as np
import pytest

from twin.errors import ConfigError
from twin.workload import finance_qa, from_spec, get_workload


def test_poisson_rate_and_lengths():
    w = from_spec("arrival=poisson,rate=4,n=4000,prompt=uniform:100:200,output=fixed:7", 1)
    t = np.array([r.arrival_s for r in w.requests])
    assert abs(len(t) / t[-1] - 4) < 0.3
    p = np.array([r.prompt_tokens for r in w.requests])
    assert p.min() >= 100 and p.max() <= 200
    assert {r.output_tokens for r in w.requests} == {7}


def test_gamma_is_burstier_than_poisson():
    g = np.diff([r.arrival_s for r in from_spec("arrival=gamma,rate=2,cv=3,n=3000", 2).requests])
    assert 2.4 < g.std() / g.mean() < 3.6


def test_ramp_steps_up_the_rate():
    w = from_spec("arrival=ramp,rate=10,steps=0.25:2,step_s=100", 3)
    t = np.array([r.arrival_s for r in w.requests])
    first, second = (t < 100).sum(), (t >= 100).sum()
    assert 180 < first < 320 and 1800 < second < 2200


def test_templates_share_prefix_segments_and_tiers():
    w = from_spec("n=400,templates=3,template_len=64,share=1,tiers=0:1/20:1", 4)
    firsts = {r.segments[0] for r in w.requests}
    assert len(firsts) == 3 and all(s[1] == 64 for s in firsts)
    assert {r.priority for r in w.requests} == {0, 20}
    assert len({r.segments[-1][0] for r in w.requests}) == 400  # own parts unique


def test_closed_loop_and_determinism():
    a = from_spec("arrival=closed,concurrency=5,n=10", 7)
    assert a.concurrency == 5
    assert a.requests == from_spec("arrival=closed,concurrency=5,n=10", 7).requests


def test_finance_qa_mix():
    w = finance_qa(0)
    p = np.array([r.prompt_tokens for r in w.requests])
    assert w.concurrency == 50 and len(p) == 600
    assert 0.85 < (p < 1000).mean() < 0.93
    assert ((p >= 64_000) & (p <= 128_000)).any()
    assert all(r.segments[0] == (1, 256) for r in w.requests)


@pytest.mark.parametrize("spec,msg", [
    ("arrival=bogus", "allowed values"), ("foo=1", "known keys"),
    ("prompt=weird:1", "distribution"), ("rate=-1", "> 0"),
    ("prompt=uniform:5:1", "A <= B"), ("tiers=x", "PRIORITY:WEIGHT")])
def test_bad_specs_are_explained(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        get_workload(spec, 0)
