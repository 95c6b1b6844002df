"""Small scenarios worked out by hand from SGLang 0.5.x's scheduler, step by step.

Prefill steps take 2 s and decode steps 1 s (`FixedStepTime`), so every time is exact."""

from helpers import req, run_replica
from stepmodels import FixedStepTime

ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)


def test_long_prompt_is_chunked_and_decodes_wait_without_mixed_chunk():
    reqs = [req("A", 0.0, 50, 5), req("B", 0.5, 250, 3)]
    rep, recs = run_replica(reqs, ST, chunked_prefill_size=100, max_total_tokens=10_000)
    assert rep.step_log == [
        ("prefill", 0.0, [("A", 50)], []),
        ("prefill", 2.0, [("B", 100)], []),  # B split at the chunk size...
        ("prefill", 4.0, [("B", 100)], []),  # ...continued first in the next pass...
        ("prefill", 6.0, [("B", 50)], []),  # ...while A's decode waits (prefill first)
        ("decode", 8.0, ["A", "B"], 2),  # B finishes at 10
        ("decode", 10.0, ["A"], 2),
    ]
    assert recs["A"]["ttft_s"] == 2.0 and recs["A"]["itl_s"] == [7.0, 1.0, 1.0, 1.0]
    assert recs["B"]["ttft_s"] == 7.5 and recs["B"]["e2e_s"] == 9.5
    assert recs["A"]["output_tokens"] == 5 and recs["B"]["output_tokens"] == 3


def test_mixed_chunk_puts_running_decodes_into_the_prefill_step():
    reqs = [req("A", 0.0, 50, 5), req("B", 0.5, 250, 3)]
    rep, recs = run_replica(reqs, ST, chunked_prefill_size=100, max_total_tokens=10_000,
                            enable_mixed_chunk=True)
    # the chunk budget shrinks by the number of decodes mixed in (SGLang's PrefillAdder)
    assert rep.step_log[:4] == [
        ("prefill", 0.0, [("A", 50)], []),
        ("mixed", 2.0, [("B", 99)], ["A"]),
        ("mixed", 4.0, [("B", 99)], ["A"]),
        ("mixed", 6.0, [("B", 52)], ["A"]),
    ]
    assert recs["A"]["itl_s"][:3] == [2.0, 2.0, 2.0]
    assert all(r["status"] == "ok" for r in recs.values())


def test_decode_out_of_kv_retracts_the_request_with_fewest_tokens():
    # A is admitted alone; B fits the budget because running requests that may stop at
    # EOS (not ignore_eos) reserve only new_token_ratio (0.7) of their future tokens, so
    # decode later runs out of KV.
    # At t=4 A holds 42 tokens and reserves 0.7 x 27 of 95: B (8 + 25) fits the budget.
    # Decoding from t=6 uses 2 tokens a step: 95 - 50 = 45 tokens last 22 steps, then
    # SGLang retracts the request with the fewest generated tokens: B (23 vs A's 25).
    reqs = [req("A", 0.0, 40, 30), req("B", 3.5, 8, 25)]
    rep, recs = run_replica(reqs, ST, max_total_tokens=95, disable_radix_cache=True,
                            ignore_eos=False)
    assert rep.step_log[:3] == [
        ("prefill", 0.0, [("A", 40)], []),
        ("decode", 2.0, ["A"], 2),  # stops at the step boundary after B's arrival
        ("prefill", 4.0, [("B", 8)], []),
    ]
    assert rep.step_log[3] == ("decode", 6.0, ["A", "B"], 22)
    assert rep.step_log[4] == ("decode", 28.0, ["A"], 5)  # B retracted; A finishes at 33
    assert recs["B"]["retractions"] == 1 and recs["A"]["retractions"] == 0
    # B comes back once A is done and recomputes its prompt plus its 23 outputs
    assert rep.step_log[5] == ("decode", 33.0, [], 0) or rep.step_log[5][:3] == (
        "prefill", 33.0, [("B", 31)])
    assert recs["A"]["output_tokens"] == 30 and recs["B"]["output_tokens"] == 25
    assert rep.counters.retractions == 1


def test_lpm_prefers_the_longest_cached_prefix():
    shared = (7, 40)
    reqs = [req("warm", 0.0, [shared, (100, 10)], 3),
            req("X", 2.5, [(200, 50)], 1), req("Y", 2.6, [shared, (300, 10)], 1)]
    rep, recs = run_replica(reqs, ST, schedule_policy="lpm", max_prefill_tokens=20,
                            max_total_tokens=10_000, chunked_prefill_size=-1)
    # warm's prompt is cached at t=2; at t=3 X and Y both wait and Y matches 40 tokens, so
    # LPM takes Y first; the 20-token prefill budget leaves X for the next step
    assert rep.step_log[1:4] == [
        ("decode", 2.0, ["warm"], 1),
        ("prefill", 3.0, [("Y", 10)], []),
        ("prefill", 5.0, [("X", 50)], []),
    ]
    assert recs["Y"]["cached_tokens"] == 40 and recs["X"]["cached_tokens"] == 0


def test_lpm_falls_back_to_fcfs_above_128_waiting():
    shared = (7, 40)
    reqs = [req("warm", 0.0, [shared, (100, 10)], 3)]
    reqs += [req(f"n{i:03d}", 1.0, [(1000 + i, 50)], 1) for i in range(130)]
    reqs += [req("Y", 1.5, [shared, (300, 10)], 1)]
    rep, _ = run_replica(reqs, ST, schedule_policy="lpm", max_prefill_tokens=20,
                         max_total_tokens=100_000, chunked_prefill_size=-1)
    order = [s[2][0][0] for s in rep.step_log if s[0] == "prefill"]
    assert order[1] == "n000"  # 131 waiting at t=2: FCFS, so Y does not jump the queue
    assert order.index("Y") > 1


def test_priority_preemption_evicts_the_low_priority_request():
    reqs = [req("low", 0.0, 20, 10, prio=0), req("high", 3.5, 20, 2, prio=20)]
    rep, recs = run_replica(reqs, ST, enable_priority_scheduling=True, max_running_requests=1,
                            max_total_tokens=10_000)
    assert rep.step_log[0] == ("prefill", 0.0, [("low", 20)], [])
    # low decodes from t=2; high arrives at 3.5 and is admitted at the 4.0 boundary
    assert rep.step_log[1] == ("decode", 2.0, ["low"], 2)
    assert rep.step_log[2] == ("prefill", 4.0, [("high", 20)], [])
    assert recs["low"]["preemptions"] == 1 and recs["high"]["preemptions"] == 0
    assert recs["high"]["ttft_s"] == 2.5
    assert recs["low"]["output_tokens"] == 10 and recs["low"]["status"] == "ok"


def test_priority_gap_within_threshold_does_not_preempt():
    reqs = [req("low", 0.0, 20, 10, prio=0), req("mid", 3.5, 20, 2, prio=10)]
    rep, recs = run_replica(reqs, ST, enable_priority_scheduling=True, max_running_requests=1,
                            max_total_tokens=10_000)
    assert recs["low"]["preemptions"] == 0
    assert recs["mid"]["arrival_s"] + recs["mid"]["ttft_s"] > recs["low"]["arrival_s"] + \
        recs["low"]["e2e_s"]
