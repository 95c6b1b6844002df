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


def test_queue_time_sums_every_round_as_sglang_reports_it():
    # low waits 0 s before its first forward; preempted at 4.0 it waits again until high
    # (prefill 4-6, its second token at 7) leaves its slot: readmitted at 7.0, 3 s later.
    # SGLang's queue_time adds the rounds (set_forward_entry_time after a retraction).
    reqs = [req("low", 0.0, 20, 10, prio=0), req("high", 3.5, 20, 2, prio=20)]
    rep, recs = run_replica(reqs, ST, enable_priority_scheduling=True, max_running_requests=1,
                            max_total_tokens=10_000)
    assert recs["high"]["queue_s"] == 0.0  # taken in at the 4.0 boundary, admitted there
    assert recs["low"]["queue_s"] == 3.0


def test_finished_chunks_enter_the_radix_cache_before_the_prompt_is_done():
    # A's 300-token prompt is chunked at 250: after its first chunk (t=2) its first two
    # segments are computed and SGLang caches them (cache_unfinished_req), so B, which
    # arrived at 1.0 with the same two segments, matches 200 tokens and joins A's last
    # chunk with only its own 50 (without chunk caching it would match 0 and be cut).
    reqs = [req("A", 0.0, [(1, 100), (2, 100), (3, 100)], 2),
            req("B", 1.0, [(1, 100), (2, 100), (9, 50)], 1)]
    rep, recs = run_replica(reqs, ST, chunked_prefill_size=250, max_total_tokens=10_000)
    assert rep.step_log[:2] == [("prefill", 0.0, [("A", 250)], []),
                                ("prefill", 2.0, [("A", 50), ("B", 50)], [])]
    assert recs["B"]["cached_tokens"] == 200 and recs["A"]["cached_tokens"] == 0
    assert recs["B"]["ttft_s"] == 3.0


def test_retraction_re_estimates_the_ratio_with_sglangs_plus_one(monkeypatch):
    # A (200 outputs) decodes with B until the 400-token pool runs out at t=181; B (fewer
    # tokens) is retracted; A has 178 of 200: the ratio becomes (178 + 20 x 1) / (200 + 1)
    # (estimate_new_token_ratio_after_retract), not / 200
    from twin.replica import Replica

    seen = []
    orig = Replica._retract

    def spy(self):
        orig(self)
        seen.append((self.env.now, self.new_token_ratio, [r.rid for r in self.running]))
    monkeypatch.setattr(Replica, "_retract", spy)
    reqs = [req("A", 0.0, 40, 200), req("B", 3.5, 8, 200), req("C", 3.6, 8, 200)]
    rep, recs = run_replica(reqs, ST, max_total_tokens=400, disable_radix_cache=True,
                            ignore_eos=False)
    assert rep.step_log[3:5] == [("decode", 6.0, ["A", "B"], 175), ("decode", 181.0, ["A"], 22)]
    assert seen[0] == (181.0, (178 + 20) / 201, ["A"])
    assert recs["B"]["retractions"] == 1


def test_retraction_evicts_twenty_tokens_per_remaining_request_at_once(monkeypatch):
    # release_req evicts remaining x SGLANG_RETRACT_DECODE_STEPS tokens from the radix
    # cache right away: B's cached 8-token prompt (unlocked by its retraction) goes at once,
    # A's locked 40 stay; B comes back later with nothing cached
    from twin.replica import Replica

    seen = []
    orig = Replica._retract

    def spy(self):
        before = self.tree.total_tokens
        orig(self)
        seen.append((before, self.tree.total_tokens))
    monkeypatch.setattr(Replica, "_retract", spy)
    reqs = [req("A", 0.0, 40, 200), req("B", 3.5, 8, 200), req("C", 3.6, 8, 200)]
    rep, recs = run_replica(reqs, ST, max_total_tokens=400, ignore_eos=False)
    assert seen[0] == (48, 40)
    assert recs["B"]["retractions"] == 1 and recs["B"]["cached_tokens"] == 0
