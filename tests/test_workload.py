"""Workload generators and specs."""

import numpy as np
import pytest

from twin.errors import ConfigError
from twin.workload import finance_qa, from_spec, get_workload, with_count


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


def test_finance_qa_with_arrival_keys():
    """`finance-qa,KEY=...`: the preset's shapes under another arrival process (a load
    test's ramp, a long open-loop day); the bare name and its own closed loop unchanged."""
    assert get_workload("finance-qa,n=600", 0).requests == finance_qa(0).requests
    big = get_workload("finance-qa,n=1200,concurrency=64", 3)
    assert big.concurrency == 64 and big.requests == finance_qa(3, n=1200, concurrency=64).requests
    w = get_workload("finance-qa,arrival=poisson,rate=0.5,n=4000", 1)
    t = np.array([r.arrival_s for r in w.requests])
    p = np.array([r.prompt_tokens for r in w.requests])
    assert w.concurrency is None and w.name == "finance-qa,arrival=poisson,rate=0.5,n=4000"
    assert len(t) == 4000 and (np.diff(t) >= 0).all() and abs(len(t) / t[-1] - 0.5) < 0.04
    assert 0.85 < (p < 1000).mean() < 0.93 and ((p >= 64_000) & (p <= 128_000)).any()
    assert all(r.segments[0] == (1, 256) for r in w.requests)
    assert {r.priority for r in w.requests} == {0, 10, 20}
    assert w.requests == get_workload("finance-qa,arrival=poisson,rate=0.5,n=4000", 1).requests
    ramp = get_workload("finance-qa,arrival=ramp,rate=1,steps=0.5:2,step_s=400", 2)
    t = np.array([r.arrival_s for r in ramp.requests])
    assert 150 < (t < 400).sum() < 250 and 700 < (t >= 400).sum() < 900
    bench = get_workload("finance-qa,clients=bench", 0)
    assert bench.clients == "bench" and bench.requests == finance_qa(0).requests


def test_with_count_sets_n_except_on_a_ramp():
    assert with_count("finance-qa,arrival=poisson,rate=0.4", 50) == \
        "finance-qa,arrival=poisson,rate=0.4,n=50"
    assert with_count("finance-qa", 7) == "finance-qa,arrival=closed,n=7"
    assert len(get_workload(with_count("finance-qa", 7), 0).requests) == 7
    assert with_count("arrival=closed,concurrency=2,n=9", 3) == \
        "arrival=closed,concurrency=2,n=3"
    assert with_count("arrival=ramp,rate=1", 5) == "arrival=ramp,rate=1"


@pytest.mark.parametrize("spec,msg", [
    ("finance-qa,prompt=fixed:5", "prompt cannot be set on the finance-qa preset"),
    ("finance-qa,templates=2,share=1", "templates, share cannot be set"),
    ("finance-qa,rate=1", r"rate has no effect with arrival=closed \(the preset's default\)"),
    ("finance-qa,arrival=poisson,concurrency=3", "concurrency has no effect"),
    ("finance-qa,n=0", "n=0"), ("finance-qa,clients=x", "allowed values: replay, bench"),
    ("arrival=bogus", "allowed values"), ("foo=1", "known keys"),
    ("prompt=weird:1", "distribution"), ("rate=-1", "> 0"),
    ("prompt=uniform:5:1", "A <= B"), ("tiers=x", "PRIORITY:WEIGHT")])
def test_bad_specs_are_explained(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        get_workload(spec, 0)


def test_generated_requests_are_what_make_builds():
    """`from_spec` builds one-segment requests without `Request.make` (issue 14's speed):
    each is the request `make` builds from the same numbers, field for field and type for
    type, and the other shapes (system prompt, templates) still go through `make`."""
    import dataclasses

    from twin.workload import Request

    def fields(r):
        return [(getattr(r, f.name), type(getattr(r, f.name))) for f in dataclasses.fields(r)]

    for spec in ("arrival=poisson,rate=2,n=300,prompt=lognormal:300:1.5,output=uniform:1:9,"
                 "tiers=0:1/3:2",
                 "arrival=gamma,rate=3,cv=2,n=200,templates=4,share=0.5,system_prompt=64"):
        w = from_spec(spec, seed=9)
        for r in w.requests:
            again = Request.make(r.rid, r.arrival_s, r.segments, r.output_tokens,
                                 r.priority, r.ignore_eos)
            assert fields(r) == fields(again)
            assert all(type(h) is int and type(n) is int for h, n in r.segments)


def _finance_reference(seed: int, n: int) -> list:
    """finance_qa's requests drawn one call at a time (the generator before issue 14's
    batching): the specification its batched draws must reproduce."""
    from twin.workload import Request, SegmentIds, _rng

    rng = _rng(seed)
    ids = SegmentIds()
    kind = rng.choice(3, size=n, p=[0.90, 0.08, 0.02])
    tiers = rng.choice(np.array([0, 10, 20]), size=n, p=[0.80, 0.15, 0.05])
    out_reqs = []
    for i in range(n):
        segs = [(1, 256)]
        if kind[i] == 0:
            body = int(max(8, round(250 * np.exp(0.5 * rng.standard_normal()))))
            out = int(max(8, round(150 * np.exp(0.5 * rng.standard_normal()))))
        else:
            lo, hi = (10_000, 32_000) if kind[i] == 1 else (64_000, 128_000)
            body = int(rng.integers(lo, hi + 1)) - 256
            out = int(max(8, round(300 * np.exp(0.5 * rng.standard_normal()))))
            if rng.random() < 0.6:
                segs.append((2000 + int(rng.integers(0, 20)), 2048))
                body -= 2048
        segs.append((ids.unique(), body))
        out_reqs.append(Request.make(f"r{i}", 0.0, segs, out, int(tiers[i])))
    return out_reqs


@pytest.mark.parametrize("seed", [0, 5, 99])
def test_finance_qa_draws_as_one_call_per_draw_would(seed):
    """The batched finance-qa generator gives the requests of the one-call-per-draw
    loop, field for field and type for type (closed loop: no arrival draws)."""
    import dataclasses

    def fields(r):
        return [(getattr(r, f.name), type(getattr(r, f.name))) for f in dataclasses.fields(r)]

    got = finance_qa(seed, n=5000).requests
    want = _finance_reference(seed, 5000)
    assert [fields(r) for r in got] == [fields(r) for r in want]
