"""The users' scheduler (time slices, three preemption modes) and swap, step by step.

Prefill steps take 2 s, decode steps 1 s. `low` (tier 0) runs alone from t=0; `vip`
(tier 20) arrives at 3.5 while the single running slot is taken. At the 4.0 boundary:
low's score = 0 + 4 s waited - 0.1 x (3 tokens / 2 s) = 3.85; vip's = 20 + 0.5 = 20.5."""

import pytest
import simpy
from helpers import GPU, MODEL, req
from stepmodels import FixedStepTime

from twin.config import ServerArgs
from twin.metrics import twin_records
from twin.request_path import OFF
from twin.sim import SimConfig, build_replica
from twin.workload import Workload

ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)
KV_BYTES = 131072  # Llama-3.1-8B, bf16, tp 1: 2 x 32 layers x 8 heads x 128 x 2 bytes
HOST_BW = 31.5e9  # A100 SXM host link: PCIe 4.0 x16


def run(mode, **cfg_kw):
    reqs = [req("low", 0.0, 20, 10, prio=0), req("vip", 3.5, 20, 2, prio=20)]
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_running_requests=1,
                                    max_total_tokens=10_000),
                    gpu=GPU, sample_every_s=1e9, request_path=OFF, debug_checks=True, preemption_mode=mode,
                    **cfg_kw)
    env = simpy.Environment()
    rep, _ = build_replica(env, Workload("t", tuple(reqs)), cfg, ST)
    rep.step_log = []
    env.process(rep.run())
    env.run()
    return rep, {r["rid"]: r for r in twin_records(rep.finished, rep.step_end)}


@pytest.mark.parametrize("mode", ["moderate", "aggressive"])
def test_vip_preempts_at_the_next_boundary(mode):
    rep, recs = run(mode, time_slice_ms=1000)
    assert rep.step_log[:3] == [
        ("prefill", 0.0, [("low", 20)], []),
        ("decode", 2.0, ["low"], 2),  # nobody waits: the run ends at the step after 3.5
        ("prefill", 4.0, [("vip", 20)], []),
    ]
    assert recs["low"]["preemptions"] == 1 and recs["vip"]["ttft_s"] == 2.5
    # low comes back after vip: its prompt is still in the radix cache, so only its 3
    # outputs are recomputed; out of the batch from 4 until that recompute ends at 9
    assert ("prefill", 7.0, [("low", 3)], []) in rep.step_log
    assert recs["low"]["lost_s"] == 5.0 and recs["low"]["output_tokens"] == 10


def test_conservative_never_preempts_it_only_reorders():
    rep, recs = run("conservative", time_slice_ms=1000)
    assert recs["low"]["preemptions"] == 0
    assert recs["vip"]["arrival_s"] + recs["vip"]["ttft_s"] >= recs["low"]["e2e_s"]


def test_moderate_spares_a_victim_that_has_not_run_a_slice():
    # with a 10 s slice, low (running since t=2) is not yet preemptible at t=4
    rep, recs = run("moderate", time_slice_ms=10_000)
    assert recs["low"]["preemptions"] == 0


def test_moderate_respects_the_score_threshold():
    rep, recs = run("moderate", time_slice_ms=1000, preemption_threshold=30.0)
    assert recs["low"]["preemptions"] == 0


def test_swap_moves_the_kv_and_charges_pcie_time():
    rep, recs = run("aggressive", time_slice_ms=1000, swap_min_tokens=1)
    kv = 20 + 3 - 1  # prompt + generated - the token not yet in the cache
    out_s = kv * KV_BYTES / HOST_BW
    # swap-out stalls the replica before vip's prefill; swap-in joins low without recompute
    assert rep.step_log[2] == ("prefill", pytest.approx(4.0 + out_s), [("vip", 20)], [])
    assert recs["low"]["kv_moved_bytes"] == 2 * kv * KV_BYTES
    assert rep.counters.swap_outs == 1 and rep.counters.swap_ins == 1
    assert not any(s[0] == "prefill" and s[2][0][0] == "low" for s in rep.step_log[1:])
    assert recs["low"]["output_tokens"] == 10 and recs["low"]["status"] == "ok"


def test_swap_falls_back_to_recompute_when_the_host_is_full():
    rep, recs = run("aggressive", time_slice_ms=1000, swap_min_tokens=1,
                    host_kv_bytes=1000)
    assert rep.counters.swap_outs == 0 and recs["low"]["kv_moved_bytes"] == 0
    assert ("prefill", 7.0, [("low", 3)], []) in rep.step_log


def test_time_slices_bound_decode_runs_while_someone_waits():
    reqs = [req("a", 0.0, 20, 40), req("b", 1.0, 20, 5)]  # b waits for the only slot
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=10_000,
                                    max_running_requests=1), gpu=GPU,
                    sample_every_s=1e9, request_path=OFF, preemption_mode="conservative", time_slice_ms=5000)
    env = simpy.Environment()
    rep, _ = build_replica(env, Workload("t", tuple(reqs)), cfg, ST)
    rep.step_log = []
    env.process(rep.run())
    env.run()
    starts = [s[1] for s in rep.step_log if s[0] == "decode"]
    assert starts[:3] == [2.0, 5.0, 10.0]  # runs end at the 5 s slice boundaries


def test_compaction_stalls_for_the_bytes_it_moves():
    """Contiguous runs, freed out of order, leave holes; compacting after every finish moves
    the live runs down, and the replica stalls for read + write of those bytes over HBM."""
    from twin.workload import from_spec

    w = from_spec("arrival=poisson,rate=20,n=40,prompt=uniform:200:3000,output=uniform:5:60", 3)
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=20_000), gpu=GPU,
                    step_time_backend="roofline", sample_every_s=1e9, request_path=OFF, debug_checks=True,
                    kv_allocator="contiguous", kv_reserve_fraction=0.0, defrag_every=1)
    env = simpy.Environment()
    rep, _ = build_replica(env, w, cfg)
    env.process(rep.run())
    env.run()
    moved = rep.alloc.stats().tokens_moved  # contiguous never re-allocates: all compaction
    assert rep.counters.compactions > 0 and moved > 0
    hbm = rep.cap.gpu.hbm_bw
    assert rep.counters.compaction_s == pytest.approx(2 * moved * KV_BYTES / hbm)
    assert rep.counters.stall_s >= rep.counters.compaction_s
    assert len(rep.finished) == 40 and all(r.status == "ok" for r in rep.finished)


def test_unplaceable_admissions_do_not_livelock_the_scheduler():
    """Regression (found by hypothesis): under priority preemption a buddy pool too
    fragmented to place the admitted request made every pass admit, fail to place and
    retry at the same instant. A pass that places nothing now falls through to decode."""
    from twin.workload import Request

    reqs = (Request(rid='q0', arrival_s=1.1125369292536007e-308, segments=((6000, 114),), output_tokens=32, priority=5, prompt_tokens=114), Request(rid='q1', arrival_s=1.5521256060266917, segments=((5000, 257), (3001, 143), (3002, 257)), output_tokens=1, priority=20, prompt_tokens=657), Request(rid='q2', arrival_s=3.1110276043029392, segments=((1000, 292), (5001, 187)), output_tokens=40, priority=5, prompt_tokens=479), Request(rid='q3', arrival_s=3.6553086724185238, segments=((1000, 33), (4001, 60), (1002, 220), (5003, 154)), output_tokens=16, priority=0, prompt_tokens=467), Request(rid='q4', arrival_s=4.892928617910656, segments=((2000, 178), (4001, 287), (5002, 96)), output_tokens=11, priority=20, prompt_tokens=561), Request(rid='q5', arrival_s=5.92299308081679, segments=((6000, 206),), output_tokens=29, priority=20, prompt_tokens=206), Request(rid='q6', arrival_s=7.7466165109009975, segments=((2000, 232),), output_tokens=35, priority=0, prompt_tokens=232), Request(rid='q7', arrival_s=8.842034162406142, segments=((2000, 200), (5001, 53), (6002, 103)), output_tokens=24, priority=20, prompt_tokens=356), Request(rid='q8', arrival_s=8.842034162406142, segments=((4000, 41),), output_tokens=6, priority=5, prompt_tokens=41), Request(rid='q9', arrival_s=9.334141887407961, segments=((4000, 300), (6001, 19), (5002, 61), (6003, 192)), output_tokens=28, priority=0, prompt_tokens=572), Request(rid='q10', arrival_s=10.244040103496417, segments=((6000, 107), (3001, 188)), output_tokens=13, priority=0, prompt_tokens=295), Request(rid='q11', arrival_s=10.256319085740305, segments=((6000, 226), (6001, 115), (2002, 138), (3003, 129)), output_tokens=31, priority=5, prompt_tokens=608), Request(rid='q12', arrival_s=10.771243781513634, segments=((3000, 269),), output_tokens=38, priority=0, prompt_tokens=269), Request(rid='q13', arrival_s=12.278928231405843, segments=((2000, 38), (4001, 15), (3002, 171), (5003, 52)), output_tokens=40, priority=0, prompt_tokens=276), Request(rid='q14', arrival_s=12.347349530520004, segments=((4000, 5), (2001, 58), (2002, 169), (5003, 223)), output_tokens=2, priority=0, prompt_tokens=455), Request(rid='q15', arrival_s=13.198440340670405, segments=((6000, 172), (4001, 202)), output_tokens=39, priority=20, prompt_tokens=374), Request(rid='q16', arrival_s=13.955090788546043, segments=((3000, 300), (3001, 131)), output_tokens=17, priority=20, prompt_tokens=431), Request(rid='q17', arrival_s=15.047938212061744, segments=((4000, 287), (3001, 107), (1002, 168), (1003, 240)), output_tokens=33, priority=5, prompt_tokens=802), Request(rid='q18', arrival_s=16.045315665547133, segments=((5000, 59), (5001, 62), (1002, 300)), output_tokens=19, priority=0, prompt_tokens=421))
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=919,
                                    chunked_prefill_size=64, max_running_requests=3,
                                    enable_mixed_chunk=True, enable_priority_scheduling=True),
                    gpu=GPU, step_time_backend="roofline", kv_allocator="buddy",
                    sample_every_s=0.05, debug_checks=True,
                    buddy_min_block_bytes=8388608, preemption_mode="conservative",
                    time_slice_ms=5.0, defrag_every=3, defrag_threshold=0.25)
    env = simpy.Environment()
    rep, _ = build_replica(env, Workload("t", reqs), cfg)
    env.process(rep.run())
    env.run()
    assert sorted(r.rid for r in rep.finished) == sorted(r.rid for r in reqs)
    assert all(r.status in ("ok", "aborted") for r in rep.finished)
