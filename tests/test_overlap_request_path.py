"""SGLang's overlap loop and request path (issue 10), pinned by hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest

from twin.config import ServerArgs, derive_capacity
from twin.overlap import FreedLater, OverlapStepTime, overlaps
from twin.perf import make_step_time
from twin.request_path import RequestPath, Tokenizer, client_view
from twin.source import Source
from twin.workload import from_spec

pytestmark = pytest.mark.offline


class Stub:
    """GPU 10 ms per prefill chunk plus 1 ms per decode request; overhead 3 ms."""

    name = "roofline"

    def breakdown(self, chunks, lens):
        return {"gpu": 0.010 * len(chunks) + 0.001 * len(lens), "overhead": 0.003}

    def step_time(self, chunks, lens):
        return sum(self.breakdown(chunks, lens).values())

    def decode_times(self, b, kv_sums):
        return np.full(np.shape(kv_sums), 0.001 * b + 0.003)

    def describe(self):
        return "stub"


def test_overlap_step_is_the_longer_of_gpu_and_cpu():
    st = OverlapStepTime(Stub())
    assert st.step_time([(100, 0)], [5, 5]) == pytest.approx(0.012)  # 12 ms GPU > 3 ms
    assert st.step_time([], [5]) == pytest.approx(0.003)  # 1 ms GPU < 3 ms CPU
    assert st.decode_times(8, np.array([80, 88])) == pytest.approx([0.008, 0.008])
    assert st.decode_times(2, np.array([10])) == pytest.approx([0.003])
    parts = st.breakdown([], [5])
    assert sum(parts.values()) == pytest.approx(st.step_time([], [5]))


def test_overlap_on_gpus_by_default_and_off_with_the_flag_or_a_fitted_model():
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
    roof = make_step_time("roofline", derive_capacity(args, "h100-sxm-80gb"), args)
    assert overlaps(args, roof)
    assert not overlaps(ServerArgs(model_path="meta-llama/Llama-3.1-8B",
                                   disable_overlap_schedule=True), roof)

    class Fitted(Stub):
        name = "fitted"
    assert not overlaps(args, Fitted())
    wrapped = OverlapStepTime(roof)
    kv = np.array([4096 * 64.0])
    oh = roof.breakdown([], [1] * 64)["overhead"]
    assert wrapped.decode_times(64, kv)[0] == pytest.approx(
        max(roof.decode_times(64, kv)[0] - oh, oh))


def test_tokenizer_manager_serves_requests_one_after_another():
    path = RequestPath(per_request_s=1e-3, per_token_s=1e-6, latency_s=2e-3)
    tok = Tokenizer(path)
    # three 1000-token prompts sent together: 2 ms of service each, then 2 ms to the
    # scheduler; a fourth sent later, after the queue has drained, waits for nothing
    assert [tok.arrival(0.0, 1000) for _ in range(3)] == pytest.approx([0.004, 0.006, 0.008])
    assert tok.arrival(1.0, 0) == pytest.approx(1.003)


def test_closed_loop_source_through_the_request_path():
    wl = from_spec("arrival=closed,concurrency=2,n=3,prompt=fixed:1000,output=fixed:4",
                   seed=0)
    src = Source(wl, RequestPath(per_request_s=1e-3, per_token_s=1e-6, egress_s=5e-3))
    assert src.next_time() == pytest.approx(0.002)
    first = src.pop_ready(0.002)
    assert [t for t, _ in first] == [0.0]  # handed out with the client's send time
    assert src.next_time() == pytest.approx(0.004)
    src.pop_ready(0.004)
    src.finished(1.0)  # the server finished one at 1.0: its client sees it at 1.005
    assert src.next_time() == pytest.approx(1.007)
    (sent, _), = src.pop_ready(2.0)
    assert sent == pytest.approx(1.005)



def test_an_open_loop_released_at_once_is_the_tokenizer_one_request_at_a_time():
    """Source._fill_open's one loop (the tokenizer's arithmetic inlined, one heapify) gives
    the arrivals `Tokenizer.arrival` gives request by request, bit for bit, in the same
    order, with the same send times handed out."""
    wl = from_spec("arrival=gamma,cv=3,rate=400,n=3000,prompt=uniform:10:4000,"
                   "output=fixed:4", seed=3)  # bursts: the queue builds and drains
    path = RequestPath(per_request_s=4.53e-3, per_token_s=4.14e-6, latency_s=2.9e-3)
    src = Source(wl, path)
    tok = Tokenizer(path)
    want = [(tok.arrival(r.arrival_s, r.prompt_tokens), r.arrival_s, r.rid)
            for r in wl.requests]
    want.sort(key=lambda w: w[0])  # (stable: equal arrivals keep the sending order)
    got = []
    while src.next_time() is not None:
        t = src.next_time()
        got += [(t, sent, req.rid) for sent, req in src.pop_ready(t)]
    assert got == want
    assert any(a > s + 0.01 for a, s, _ in got)  # some waited in the queue

def test_without_a_path_the_source_is_unchanged():
    wl = from_spec("arrival=closed,concurrency=2,n=3,prompt=fixed:1000,output=fixed:4",
                   seed=0)
    src = Source(wl)
    assert [t for t, _ in src.pop_ready(0.0)] == [0.0, 0.0]
    src.finished(1.0)
    assert src.next_time() == 1.0


def test_client_view_adds_egress_to_ttft_and_e2e_only():
    recs = [{"ttft_s": 0.1, "e2e_s": 1.0, "tpot_s": 0.01}, {"ttft_s": None, "e2e_s": 0.5}]
    out = client_view(recs, RequestPath(egress_s=0.002))
    assert out[0] == {"ttft_s": 0.102, "e2e_s": 1.002, "tpot_s": 0.01}
    assert out[1] == {"ttft_s": None, "e2e_s": 0.502}
    assert recs[0]["ttft_s"] == 0.1


def test_simulate_defaults_on_a_gpu_overlap_and_the_request_path(tmp_path):
    import json

    import simpy

    from twin.request_path import OFF, SGLANG_0_5_23
    from twin.sim import SimConfig, make_replica

    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
    cfg = SimConfig(args=args, gpu="h100-sxm-80gb", step_time_backend="roofline")
    rep, _ = make_replica(simpy.Environment(), cfg)
    assert isinstance(rep.st, OverlapStepTime)
    assert cfg.path_for(rep.st) == SGLANG_0_5_23
    # a fitted step time (a calibration profile, or validate's own): no default path,
    # validate adds the profile's measured one; a profile's own tokenizer costs are its
    # path (tests/test_request_path_calibrate.py), one without them has none
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"step_time": {"backend": "fitted"}}))

    class Fitted(Stub):
        name = "fitted"
    assert SimConfig(args=args, calibration=str(prof)).path_for(rep.st) == OFF
    assert cfg.path_for(Fitted()) == OFF
    plain = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B",
                                      disable_overlap_schedule=True),
                      gpu="h100-sxm-80gb", step_time_backend="roofline")
    rep, _ = make_replica(simpy.Environment(), plain)
    assert not isinstance(rep.st, OverlapStepTime)


def test_requests_sent_together_reach_the_scheduler_one_by_one():
    from twin.sim import SimConfig, simulate

    path = RequestPath(per_request_s=0.01, per_token_s=0.0, latency_s=0.0)
    wl = from_spec("arrival=closed,concurrency=3,n=3,prompt=fixed:100,output=fixed:2",
                   seed=0)
    cfg = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B"),
                    gpu="h100-sxm-80gb", step_time_backend="roofline", request_path=path)
    res = simulate(wl, cfg)
    recs = sorted(res.records, key=lambda r: r["rid"])
    assert all(r["arrival_s"] == 0.0 for r in recs)  # all sent at 0: TTFT counts from there
    # the three reach the scheduler 10, 20 and 30 ms after they were sent: the first is
    # prefilled alone, so each TTFT is at least its own arrival
    ttfts = sorted(r["ttft_s"] for r in recs)
    assert ttfts[0] > 0.01 and ttfts[2] > 0.03


def test_overlap_loop_frees_a_finished_requests_slot_one_pass_later():
    # Two slots; A (2 outputs) and C (10) prefill 0-2, B arrives at 0.5. A finishes in the
    # decode step 2-3. The plain loop admits B at 3. Under the overlap loop step 3-4 was
    # scheduled before step 2-3's results were processed: A's slot is still taken, C
    # decodes alone, and B is admitted at 4 (prefill 4-6: TTFT 5.5 instead of 4.5).
    import simpy
    from helpers import GPU, MODEL, req
    from stepmodels import FixedStepTime

    from twin.cluster import Deployment
    from twin.metrics import twin_records
    from twin.overlap import FreedLater
    from twin.request_path import OFF
    from twin.sim import SimConfig, make_replica
    from twin.workload import Workload

    def run(overlap: bool):
        reqs = (req("A", 0.0, 10, 2), req("C", 0.0, 10, 10), req("B", 0.5, 10, 1))
        cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_running_requests=2,
                                        max_total_tokens=10_000), gpu=GPU,
                        sample_every_s=1e9, debug_checks=True, request_path=OFF)
        env = simpy.Environment()
        rep, _ = make_replica(env, cfg, FixedStepTime(2.0, 1.0))
        if overlap:  # the fixed step model is not a GPU backend: switch the loop on here
            rep.freed_later = FreedLater()
        dep = Deployment(env, Source(Workload("t", reqs, None)))
        dep.add(rep)
        dep.start()
        rep.step_log = []
        env.process(rep.run())
        env.run()
        return rep, {r["rid"]: r for r in twin_records(rep.finished, rep.step_end)}

    rep, recs = run(False)
    assert rep.step_log[2] == ("prefill", 3.0, [("B", 10)], []) and recs["B"]["ttft_s"] == 4.5
    rep, recs = run(True)
    assert rep.step_log[1:4] == [("decode", 2.0, ["A", "C"], 1), ("decode", 3.0, ["C"], 1),
                                 ("prefill", 4.0, [("B", 10)], [])]
    assert recs["B"]["ttft_s"] == 5.5


def test_overlap_hold_is_released_when_nothing_is_in_flight():
    fl = FreedLater()
    fl.add(1, 30)
    assert not fl.turn() and (fl.slots, fl.tokens) == (1, 30)
    assert fl.release() and (fl.slots, fl.tokens) == (0, 0)
    fl.add(2, 5)
    fl.turn()
    assert fl.turn() and (fl.slots, fl.tokens) == (0, 0)


def test_an_open_loop_is_released_as_the_closed_loop_releases_it():
    """An open loop's requests are released in one loop of their own (`_fill_open`, issue
    14's speed): the same heap, send times and tokenizer clock as the general loop gives a
    closed loop with a client per request, with and without the request path, arrivals
    out of order and tied included."""
    from dataclasses import replace

    w = from_spec("arrival=poisson,rate=40,n=400,prompt=uniform:10:9000,output=fixed:5", 3)
    reqs = list(w.requests)
    reqs[10], reqs[20] = reqs[20], reqs[10]  # a trace's rows out of order
    reqs[30] = replace(reqs[30], arrival_s=reqs[29].arrival_s)  # and a tie
    w = replace(w, requests=tuple(reqs))
    for path in (RequestPath(), RequestPath(per_request_s=4.53e-3, per_token_s=4.14e-6,
                                            latency_s=2.9e-3, egress_s=1e-3)):
        fast = Source(w, path)
        slow = Source(replace(w, concurrency=len(reqs)), path)
        assert fast.open_loop and not slow.open_loop
        assert fast._ready == slow._ready and fast._sent == slow._sent
        assert fast._seq == slow._seq == len(reqs) and fast._in_flight == len(reqs)
        if not path.off:
            assert fast._tokenizer.free_at == slow._tokenizer.free_at
        got = fast.pop_ready(1e9)
        assert got == slow.pop_ready(1e9) and len(got) == len(reqs) and fast.exhausted
