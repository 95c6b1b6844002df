"""`servetwin calibrate` fits the request path's tokenizer costs from SGLang's stamps
(`request_received_ts`, `api_server_dispatch_finish_ts`), and `simulate --calibration`
runs the profile's request path (twin/request_path.py)."""

from __future__ import annotations

import json

import pytest

from calibration.derive import Limits, Timeline, samples_from_timelines, tokenizer_samples
from calibration.profiles import request_path, tokenizer_costs
from twin.errors import ConfigError
from twin.request_path import OFF, RequestPath
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload

pytestmark = pytest.mark.offline
PER_REQ, PER_TOK = 1e-3, 2e-6


def _group(prompts: list[int], t0: float = 1000.0) -> list[Timeline]:
    """Requests sent together at wall time t0, received 1 ms later, dispatched one after
    another (service = PER_REQ + PER_TOK x prompt), prefilled as one batch."""
    out, at = [], t0 + 1e-3
    for i, n in enumerate(prompts):
        at += PER_REQ + PER_TOK * n
        meta = {"forward_entry_time": t0 + 0.5, "prefill_finished_time": t0 + 0.75,
                "queue_time": t0 + 0.5 - (at + 2e-3), "request_received_ts": t0 + 1e-3,
                "api_server_dispatch_finish_ts": at}
        out.append(Timeline(f"r{i}", 0.0, n, 0, (0.8,), meta, sent_wall=t0))
    return out


def test_a_runs_tokenizer_sample_has_the_dispatch_gaps_of_requests_that_queued():
    (s,) = tokenizer_samples(_group([100, 300, 50]))
    assert s["kind"] == "tokenizer" and "steps" not in s  # the step-time fit skips it
    assert [n for n, _ in s["dispatch"]] == [300, 50]
    assert [g for _, g in s["dispatch"]] == pytest.approx([PER_REQ + PER_TOK * 300,
                                                           PER_REQ + PER_TOK * 50])
    # the first dispatched waited for no one: ingress = 1 ms HTTP + service + 2 ms
    assert s["first"] == [100, pytest.approx(1e-3 + PER_REQ + PER_TOK * 100 + 2e-3)]


def test_tokenizer_costs_are_fitted_exactly_from_noiseless_gaps():
    samples = [s for g in ([100, 300, 50], [900, 20, 400]) for s in
               samples_from_timelines(_group(g), Limits(2048))]
    got = tokenizer_costs(samples)
    assert got["per_request_s"] == pytest.approx(PER_REQ)
    assert got["per_token_s"] == pytest.approx(PER_TOK)
    assert got["latency_s"] == pytest.approx(3e-3)  # 1 ms before, 2 ms after the tokenizer
    assert got["tokenizer_samples"] == 4
    assert request_path(samples)["per_request_s"] == got["per_request_s"]
    # one prompt length: no per-token cost can be told apart
    one = tokenizer_costs(tokenizer_samples(_group([200, 200, 200])))
    assert one["per_token_s"] == 0.0
    assert one["per_request_s"] == pytest.approx(PER_REQ + PER_TOK * 200)
    assert tokenizer_costs([{"dur_s": 1.0}]) == {}  # no stamps: no costs
    # a request sent after the one before had left did not queue: its gap is not service
    late = _group([100, 300])
    late[1] = Timeline("r1", 0.0, 300, 0, (0.8,), late[1].meta,
                       sent_wall=late[0].meta["api_server_dispatch_finish_ts"] + 1e-4)
    assert tokenizer_samples(late)[0]["dispatch"] == []


def _profile(tmp_path, rp: dict | None):
    coef = {"step": 0.01, "prefill_token": 0.001, "decode_request": 0.002}
    prof = {"step_time": {"backend": "fitted", "form": "linear", "coefficients": coef}}
    if rp is not None:
        prof["request_path"] = rp
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    return str(path)


def test_simulate_calibration_runs_the_profiles_request_path(tmp_path):
    rp = {"ingress_s": 0.01, "egress_s": 0.004, "per_request_s": 0.05, "per_token_s": 1e-4,
          "latency_s": 0.003}
    with_path, without = _profile(tmp_path, rp), None
    assert SimConfig(calibration=with_path).path_for(None) == RequestPath(
        per_request_s=0.05, per_token_s=1e-4, latency_s=0.003, egress_s=0.004)
    wl = Workload("two", (Request.make("a", 0.0, [(1, 100)], 3),
                          Request.make("b", 0.0, [(2, 100)], 3)))
    got = {r["rid"]: r for r in simulate(wl, SimConfig(calibration=with_path)).records}
    tmp2 = tmp_path / "old"
    tmp2.mkdir()
    without = _profile(tmp2, {"ingress_s": 0.01, "egress_s": 0.004})  # an older profile
    assert SimConfig(calibration=without).path_for(None) == OFF
    base = {r["rid"]: r for r in simulate(wl, SimConfig(calibration=without)).records}
    # sent together, a reaches the scheduler after its service (0.06 s) + 3 ms, b one
    # service later: b waits at the tokenizer, not in the scheduler's queue (egress only
    # delays a closed-loop client's next request: twin/source.py)
    service = 0.05 + 1e-4 * 100
    assert got["a"]["ttft_s"] == pytest.approx(service + 0.003 + 0.11)  # alone: 0.11 s
    # b reaches it at 0.123, during a's prefill, and is prefilled after it
    assert got["b"]["ttft_s"] == pytest.approx(0.173 + 0.11)
    assert base["a"]["ttft_s"] == base["b"]["ttft_s"] == pytest.approx(0.21)  # together


def test_a_bad_request_path_value_names_the_file_and_key(tmp_path):
    path = _profile(tmp_path, {"per_request_s": -1.0})
    with pytest.raises(ConfigError, match=r"p.json: request_path.per_request_s=-1.0"):
        SimConfig(calibration=path).path_for(None)


def test_the_plan_has_a_tokenizer_burst_in_its_first_round():
    """Every budget that runs the plan's first few runs gets tokenizer gaps: a burst of
    requests sent together, with cached prompts of several lengths that fit the server."""
    from calibration.profile import ServerLimits, make_plan

    lim = ServerLimits(max_running=16, max_total_tokens=8192, chunk=512, max_input=4096)
    plan = make_plan(lim)
    (burst,) = [r for r in plan if r.kind == "tokenizer"]
    assert plan.index(burst) < 4
    assert len(burst.requests) == 12 and burst.prefix == 512
    lengths = {r.prefix + r.new for r in burst.requests}
    assert lengths == {144, 272, 400, 528}
    assert all(r.prefix <= burst.prefix and r.output == 1 for r in burst.requests)
    # a server with a short context halves the prefix until it fits; too few slots: none
    small = make_plan(ServerLimits(max_running=4, max_total_tokens=600, chunk=None,
                                   max_input=599))
    assert [r.prefix for r in small if r.kind == "tokenizer"] == [256]
    assert not [r for r in make_plan(ServerLimits(3, 8192, 512, 4096)) if r.kind == "tokenizer"]
