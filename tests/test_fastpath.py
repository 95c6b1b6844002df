"""The plain loop (twin/fastpath.py) against SimPy's: byte-identical records, summaries and
time series on random and fixed configurations in its domain; the domain and the switch."""

import json

import pytest
from helpers import GPU, MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin import fastpath
from twin.config import ServerArgs
from twin.request_path import OFF, SGLANG_0_5_23
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload, from_spec

pytestmark = pytest.mark.offline

SEGMENTS = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 300)), min_size=1, max_size=4)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 30))
    reqs, t = [], 0.0
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.001, 0.3])) + draw(st.floats(0, 1.5))
        segs = [(h * 1000 + j, k) for j, (h, k) in enumerate(draw(SEGMENTS))]
        reqs.append(Request.make(f"q{i}", t, segs, draw(st.integers(1, 40)),
                                 draw(st.sampled_from([0, 5, 20]))))
    return Workload("prop", tuple(reqs), None)


@st.composite
def configs(draw):
    chunk = draw(st.sampled_from([-1, 64, 256]))
    policy = draw(st.sampled_from(["fcfs", "lof", "lpm"]))
    return SimConfig(
        args=ServerArgs(
            model_path=MODEL,
            max_total_tokens=draw(st.integers(400, 3000)),
            chunked_prefill_size=chunk,
            max_prefill_tokens=draw(st.sampled_from([128, 1024, 16384])),
            max_running_requests=draw(st.sampled_from([None, 1, 3])),
            schedule_policy=policy,
            disable_radix_cache=draw(st.booleans()),
            enable_mixed_chunk=draw(st.booleans()) and chunk > 0,
            enable_priority_scheduling=draw(st.booleans()) and policy != "lpm",
            disable_overlap_schedule=draw(st.booleans()),
            page_size=draw(st.sampled_from([1, 1, 16])),
        ),
        gpu=GPU, step_time_backend="roofline", sample_every_s=draw(st.sampled_from([0.05, 1.0])),
        preemption_mode=draw(st.sampled_from(["off", "off", "moderate", "aggressive"])),
        time_slice_ms=draw(st.sampled_from([5.0, 50.0])),
        swap_min_tokens=draw(st.sampled_from([None, None, 1, 200])),
        kv_allocator=draw(st.sampled_from(["token", "token", "buddy", "contiguous"])),
        buddy_min_block_bytes=draw(st.sampled_from([16, 64, 256])) * 131072,
        defrag_every=draw(st.sampled_from([None, 3])),
        defrag_threshold=draw(st.sampled_from([None, 0.25])),
        ignore_eos=draw(st.booleans()),
        request_path=draw(st.sampled_from([None, OFF, SGLANG_0_5_23])))


def outputs(w: Workload, cfg: SimConfig, tmp, general: bool, monkeypatch) -> tuple:
    """(requests.jsonl, summary.json, timeseries.csv) bytes of one run."""
    if general:
        monkeypatch.setenv(fastpath.GENERAL_LOOP_ENV, "1")
    else:
        monkeypatch.delenv(fastpath.GENERAL_LOOP_ENV, raising=False)
    assert (fastpath.reason_not(w, cfg) is None) is (not general)
    out = tmp / ("general" if general else "fast")
    runs = []
    plain = fastpath.run
    monkeypatch.setattr(fastpath, "run", lambda rep: (runs.append(rep), plain(rep)))
    simulate(w, cfg).write(out)
    monkeypatch.setattr(fastpath, "run", plain)
    assert len(runs) == (0 if general else 1), "simulate did not take the loop asked for"
    return tuple((out / f).read_bytes() for f in ("requests.jsonl", "summary.json",
                                                   "timeseries.csv"))


def assert_same(w, cfg, tmp, monkeypatch) -> None:
    fast = outputs(w, cfg, tmp, False, monkeypatch)
    general = outputs(w, cfg, tmp, True, monkeypatch)
    for name, a, b in zip(("requests.jsonl", "summary.json", "timeseries.csv"), fast, general,
                          strict=True):
        assert a == b, f"{name} differs between the plain loop and SimPy's"


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workloads(), configs())
def test_random_configurations_give_the_same_bytes(tmp_path_factory, monkeypatch, w, cfg):
    assert_same(w, cfg, tmp_path_factory.mktemp("fp"), monkeypatch)


VIDUR = "arrival=poisson,rate={rate},n={n},prompt=uniform:1000:4000,output=uniform:100:500"
SHARED = ("arrival=poisson,rate=8,n=200,prompt=uniform:200:3000,output=uniform:20:300,"
          "templates=6,template_len=1024,share=0.7,system_prompt=256")
GRID = [  # (workload spec, server args, twin settings): the CLI's shapes, small
    (VIDUR.format(rate=1.5, n=200), {}, {"step_time_backend": "opdb"}),
    (VIDUR.format(rate=5, n=300), {}, {"step_time_backend": "opdb", "gpu": "h100-sxm-80gb"}),
    (VIDUR.format(rate=20, n=200), {"max_total_tokens": 20000}, {}),
    (VIDUR.format(rate=20, n=200), {"max_total_tokens": 20000}, {"ignore_eos": False}),
    (SHARED, {"schedule_policy": "lpm"}, {}),
    (SHARED, {"enable_mixed_chunk": True, "chunked_prefill_size": 512}, {}),
    (SHARED, {"disable_radix_cache": True, "disable_overlap_schedule": True}, {}),
    ("arrival=gamma,rate=10,cv=4,n=200,prompt=uniform:100:2000,output=uniform:1:200",
     {"max_running_requests": 8}, {}),
    (VIDUR.format(rate=6, n=150) + ",tiers=0:0.8/10:0.15/20:0.05",
     {"enable_priority_scheduling": True, "max_running_requests": 12}, {}),
    (VIDUR.format(rate=6, n=150) + ",tiers=0:0.8/10:0.15/20:0.05", {"max_total_tokens": 40000},
     {"preemption_mode": "aggressive", "swap_min_tokens": 500}),
    (VIDUR.format(rate=4, n=150), {"max_total_tokens": 60000},
     {"kv_allocator": "contiguous", "defrag_every": 20}),
    (VIDUR.format(rate=5, n=150), {"page_size": 16, "max_total_tokens": 50000}, {}),
]


@pytest.mark.parametrize("spec,server,twin", GRID, ids=[f"grid{i}" for i in range(len(GRID))])
@pytest.mark.parametrize("seed", [0, 7])
def test_cli_shaped_runs_give_the_same_bytes(tmp_path, monkeypatch, spec, server, twin, seed):
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, **server),
                    **{"gpu": GPU, "step_time_backend": "roofline", **twin})
    assert_same(from_spec(spec, seed), cfg, tmp_path, monkeypatch)


def test_domain_and_switch(monkeypatch):
    monkeypatch.delenv(fastpath.GENERAL_LOOP_ENV, raising=False)
    open_loop = from_spec(VIDUR.format(rate=1, n=5), 0)
    cfg = SimConfig(args=ServerArgs(model_path=MODEL), gpu=GPU)
    assert fastpath.reason_not(open_loop, cfg) is None
    assert isinstance(fastpath.environment(open_loop, cfg), fastpath.PlainClock)
    closed = Workload("c", open_loop.requests, 2)
    assert fastpath.reason_not(closed, cfg) == "closed loop"
    assert fastpath.reason_not(open_loop, SimConfig(args=cfg.args, gpu=GPU,
                                                    debug_checks=True)) == "--debug-checks"
    assert fastpath.reason_not(open_loop, SimConfig(args=cfg.args, gpu=GPU,
                                                    horizon_s=5.0)) == "--horizon"
    monkeypatch.setenv(fastpath.GENERAL_LOOP_ENV, "1")
    assert fastpath.reason_not(open_loop, cfg) == f"{fastpath.GENERAL_LOOP_ENV} is set"
    assert not isinstance(fastpath.environment(open_loop, cfg), fastpath.PlainClock)


def test_an_empty_workload_ends_at_once(tmp_path, monkeypatch):
    cfg = SimConfig(args=ServerArgs(model_path=MODEL), gpu=GPU, step_time_backend="roofline")
    assert_same(Workload("empty", (), None), cfg, tmp_path, monkeypatch)
    res = simulate(Workload("empty", (), None), cfg)
    assert json.loads(json.dumps(res.summary))["engine"]["decode_steps"] == 0


def test_a_ctrl_c_keeps_the_same_partial_records(tmp_path, monkeypatch):
    """Interrupted at the same sample (progress raises KeyboardInterrupt, as a Ctrl-C
    does), both loops write the same partial records and summary."""
    w = from_spec(VIDUR.format(rate=5, n=300), 3)
    cfg = SimConfig(args=ServerArgs(model_path=MODEL), gpu=GPU, step_time_backend="roofline")

    def stop(done, now):
        if done >= 40:
            raise KeyboardInterrupt

    outs = []
    for general in (False, True):
        monkeypatch.setenv(fastpath.GENERAL_LOOP_ENV, "1" if general else "0")
        res = simulate(w, cfg, progress=stop)
        assert res.interrupted and res.summary["partial"]["unfinished"] > 0
        res.write(tmp_path / str(general))
        outs.append([(tmp_path / str(general) / f).read_bytes()
                     for f in ("requests.jsonl", "summary.json")])
    assert outs[0] == outs[1]


def test_the_copied_replica_methods_are_current():
    """The plain loop runs its own copy of a few replica methods (twin/fastpath.py,
    COPIED). If this fails, a replica method changed: bring fastpath's copy in line with
    it (the equivalence tests above say where), then set its digest to
    `fastpath.code_digest(Replica.<name>)`. Until then the copy is off (slower, correct)."""
    from twin.replica import Replica

    stale = {n: fastpath.code_digest(getattr(Replica, n))
             for n, ok in fastpath.copies_current().items() if not ok}
    assert not stale, f"replica methods changed since fastpath copied them: {stale}"
