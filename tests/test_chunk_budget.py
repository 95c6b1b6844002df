"""The chunk answer as a time budget (`DeadlinePolicy(chunk_budget_s=...)`,
twin/policy/deadline.py `budget_limit`): the cap is the largest page-aligned chunk the
prefill model predicts within the budget after the chunked request's context, and no cap
where not even one page is (a chunk whose cost follows its context, as on the CPU
harness's torch_native attention, past the first chunk). Hand-worked numbers."""

from __future__ import annotations

import math

import pytest
from helpers import bias_selector, req, run_replica
from stepmodels import FixedStepTime

from twin.policy.base import ChunkPlan, RequestView, Snapshot
from twin.policy.check import check_policy
from twin.policy.deadline import (
    S_PER_CHUNK,
    S_PER_TOKEN,
    S_PER_TOKEN_CTX,
    DeadlinePolicy,
    budget_limit,
    chunk_step_s,
    prefill_s,
)

pytestmark = pytest.mark.offline

# (chunk, s_per_chunk, s_per_token, s_per_token_ctx, s_per_ctx_sq)
LINEAR = (1024, 0.01, 0.001, 0.0, 0.0)  # a chunk of n: 0.01 + 0.001 n seconds
SQUARE = (1024, 0.01, 0.0, 0.0, 1e-7)   # a chunk of n after c: 0.01 + 1e-7 (c + n)^2
DEFAULT_MODEL = (S_PER_CHUNK, S_PER_TOKEN, S_PER_TOKEN_CTX, 0.0)  # the users' deployment


def test_the_cap_is_the_largest_page_aligned_chunk_within_the_budget():
    # 0.01 + 0.001 n <= 0.1  <=>  n <= 90: five pages of 16 (80), not six (96)
    assert budget_limit(0.1, 0, 1024, 16, LINEAR) == 80
    assert chunk_step_s(80, 0, *LINEAR[1:]) <= 0.1 < chunk_step_s(96, 0, *LINEAR[1:])
    assert budget_limit(0.1, 0, 1024, 1, LINEAR) == 90
    # the whole rest within the budget: no cap needed
    assert budget_limit(0.1, 0, 50, 16, LINEAR) is None
    assert budget_limit(2.0, 0, 1024, 16, LINEAR) is None


def test_where_a_chunk_costs_its_context_no_cap_is_set():
    # fresh: 0.01 + 1e-7 n^2 <= 0.1  <=>  n <= 948.7: 59 pages of 16 (944)
    assert budget_limit(0.1, 0, 1024, 16, SQUARE) == 944
    # after 2,048 tokens even one page costs 0.01 + 1e-7 x 2064^2 = 0.436 s > 0.1: a cap
    # would only multiply the chunks
    assert chunk_step_s(16, 2048, *SQUARE[1:]) == pytest.approx(0.436, abs=1e-3)
    assert budget_limit(0.1, 2048, 1024, 16, SQUARE) is None


def test_a_chunk_that_would_be_mostly_fixed_cost_is_not_capped():
    fixed = (1024, 0.05, 0.001, 0.0, 0.0)  # a chunk of n: 0.05 + 0.001 n
    # 0.08 s: 30 tokens, whose 0.03 s is less than the step's fixed 0.05 s: no cap
    assert budget_limit(0.08, 0, 1024, 1, fixed) is None
    # 0.125 s: 75 tokens, 0.075 s of token work against 0.05 fixed: capped
    assert budget_limit(0.125, 0, 1024, 1, fixed) == 75
    # after 800 tokens the square's fixed part is 0.01 + 0.064 s; within 0.1 s fit 148
    # new tokens, whose share is 1e-7 x (948^2 - 800^2) = 0.026 s: no cap (without this
    # rule a document's chunks would shrink towards one token as its context grows)
    assert budget_limit(0.1, 800, 1024, 1, SQUARE) is None
    assert budget_limit(0.1, 300, 1024, 1, SQUARE) == 648  # (948)^2: 0.081 of 0.1 s


def test_the_prefill_model_counts_each_chunk_s_square():
    # 2,048 new tokens, fresh, chunks of 1,024: 2 x 0.01 + 1e-7 (1024^2 + 2048^2)
    assert prefill_s(2048, 0, 1024, 0.01, 0.0, 0.0, 1e-7) == pytest.approx(
        0.02 + 1e-7 * (1024**2 + 2048**2))
    # 1,500 after 100: chunks end at 1,124 and 1,600
    assert prefill_s(1500, 100, 1024, 0.0, 0.0, 0.0, 1.0) == 1124**2 + 1600**2
    assert prefill_s(1500, 100, 1024, 0.01, 0.001, 0.0) == pytest.approx(
        0.01 * math.ceil(1500 / 1024) + 1.5)  # without the square: as before


def view(rid, prompt, gen=0, prefix=0):
    return RequestView(rid=rid, prompt_tokens=prompt, prefix_len=prefix, max_new_tokens=50,
                       generated_tokens=gen)


def test_deadline_answers_with_the_budget_only_around_short_questions():
    pol = DeadlinePolicy(chunk_budget_s=0.1, park_steps=2, s_per_chunk=0.01, s_per_token=0.0,
                         s_per_token_ctx=0.0, s_per_ctx_sq=1e-7, chunk=1024)
    short = view("s", 100, 3)
    ask = lambda doc, running=(short,), waiting=(): pol.chunk(  # noqa: E731
        Snapshot(now=1.0, waiting=waiting, running=running), doc, 1024, 16)
    assert ask(view("D", 5_000)) == ChunkPlan(limit=944, park=2)  # its first chunk
    assert ask(view("D", 5_000, prefix=2048)) == ChunkPlan(limit=None, park=2)  # deep
    assert ask(view("D", 5_000), running=(), waiting=(short,)) == ChunkPlan(limit=944)
    assert ask(view("D", 5_000), running=(view("E", 9_000, 1),)) == ChunkPlan()  # docs only
    assert ask(view("D", 5_000), running=()) == ChunkPlan()
    assert check_policy(pol) > 0


def test_a_budget_and_a_token_cap_together_are_refused():
    with pytest.raises(ValueError, match="chunk_budget_s .* not together with chunk_tokens"):
        DeadlinePolicy(chunk_budget_s=0.1, chunk_tokens=256)
    with pytest.raises(ValueError, match="chunk_budget_s"):
        DeadlinePolicy(chunk_budget_s=-1.0)


def test_in_the_twin_the_budget_caps_a_first_chunk_and_leaves_the_deep_ones(tmp_path):
    # Steps are fixed (prefill 2 s, decode 1 s); the policy's own model decides the cap:
    # pages of one token here: a fresh chunk of 948 fits 0.1 s (948.7), a chunk after 948
    # does not fit at all (square term), so D's first chunk is capped at 948 beside the
    # running S and its later ones are SGLang's full 1,000 (the budget of this server).
    import json

    p = tmp_path / "policy.json"
    p.write_text(json.dumps({"name": "deadline", "params": {
        "withhold": "none", "chunk_budget_s": 0.1, "s_per_chunk": 0.01, "s_per_token": 0.0,
        "s_per_token_ctx": 0.0, "s_per_ctx_sq": 1e-7, "chunk": 1000}}))
    rep, recs = run_replica([req("S", 0.0, 10, 20), req("D", 0.5, 5000, 2)],
                            FixedStepTime(2.0, 1.0), policy=str(p), chunked_prefill_size=1000,
                            max_total_tokens=20_000)
    prefills = [(t, chunks) for kind, t, chunks, _ in rep.step_log if kind == "prefill"]
    assert prefills[:3] == [(0, [("S", 10)]), (2.0, [("D", 948)]), (4.0, [("D", 1000)])]
    assert sum(n for _, chunks in prefills for rid, n in chunks if rid == "D") == 5000
    assert {r["status"] for r in recs.values()} == {"ok"}


def test_menu_entries_carry_a_budget_and_a_learned_selector_answers_with_it(tmp_path):
    from experiments.rl.config import preset
    from twin.policy.deadline import BudgetAnswer
    from twin.policy.menu import menu_entry

    assert menu_entry("hold-hopeless@0.3sx8") == ("hold-hopeless", BudgetAnswer(0.3, 8))
    for bad in ("deadline@0sx8", "deadline@-1sx8", "deadline@0.3sx999", "deadline@sx2",
                "deadline@infsx2"):
        with pytest.raises(ValueError, match="SECONDSsxPARK"):
            menu_entry(bad)
    cfg = preset("finance-qa-budget-v2")
    menu = list(cfg.menu)
    pol = bias_selector(tmp_path, cfg, 2)  # the third entry: hold-hopeless@0.2sx8
    assert pol.chunks and menu[2] == "hold-hopeless@0.2sx8"
    snap = Snapshot(now=1.0, waiting=(), running=(view("s", 100, 3),))
    doc = view("D", 20_000, prefix=16_384)
    # the users' prefill model (the file's): 0.2 s after 16,384 cached tokens
    expect = budget_limit(0.2, 16_384, 3_616, 1, (8192, *DEFAULT_MODEL))
    assert 400 < expect < 1000
    assert pol.chunk(snap, doc, 8192, 1) == ChunkPlan(limit=expect, park=8)
    assert check_policy(pol) > 0


def test_the_budget_environment_runs_an_episode_with_every_request_accounted_for():
    import gymnasium as gym

    import experiments.rl  # noqa: F401  (registers the id)

    env = gym.make("servetwin/Scheduling-v0", config="finance-qa-budget-v2")
    env.reset(seed=5, options={"load": 1.5, "burst_cv": 2.0})
    done, steps, info = False, 0, {}
    while not done:
        _, _, term, trunc, info = env.step(steps % 4)
        done, steps = term or trunc, steps + 1
    stats = info["episode_stats"]
    n = env.unwrapped.cfg.family.n
    assert steps > 10 and stats["requests"] == n and stats["slo_attainment"] is not None, stats


def test_the_cli_offers_every_environment_preset():
    from experiments.rl.config import PRESETS
    from servetwin.cmd_rl import ENV_PRESETS

    assert sorted(ENV_PRESETS) == sorted(PRESETS)
