"""The live RL comparison's scaling to the CPU server (experiments/rl/live.py): the deadline
rules' prefill model fitted with the square term, the time-budget chunk answer moved to the
server's scale, and the spec files the live runs use. Offline: the step model is built by
hand here; the live runs are benchmarks (benchmarks/rl.py --live-only)."""

from __future__ import annotations

import json

import pytest

from experiments.rl.live import fit_prefill, scaled_budget, spec_files
from twin.perf.fitted import LinearStepTime
from twin.policy import read_spec
from twin.policy.deadline import (
    S_PER_CHUNK,
    S_PER_TOKEN,
    S_PER_TOKEN_CTX,
    DeadlinePolicy,
    prefill_s,
)
from twin.policy.features import SloTargets
from twin.policy.registry import build_policy

pytestmark = pytest.mark.offline

# a server whose chunk costs 20 ms + 0.1 ms a token + 50 ns x (context + chunk)^2
STEP = LinearStepTime({"step": 0.02, "prefill_token": 1e-4, "prefill_ctx_sq": 5e-8})


def test_the_square_term_is_recovered_and_without_it_the_fit_misses_small_chunks():
    a, b, c, chunk, d = fit_prefill(STEP, 1024, square=True)
    assert (a, b, c, d) == pytest.approx((0.02, 1e-4, 0.0, 5e-8), rel=1e-6, abs=1e-12)
    assert chunk == 1024
    plain = fit_prefill(STEP, 1024)
    assert len(plain) == 4
    # 32 tokens after 2,048: 0.02 + 0.0032 + 5e-8 x 2080^2 = 0.2395 s, fresh 0.0233 s;
    # the plain fit (its context term is per new token) cannot have both: it puts the
    # deep cost in the per-chunk constant and predicts a small fresh chunk 10x too slow,
    # so a time budget would never cap a first chunk
    for cached, truth in ((2048, 0.2395), (0, 0.0233)):
        assert STEP.step_time([(32, cached)], []) == pytest.approx(truth, abs=1e-4)
        assert prefill_s(32, cached, 1024, a, b, c, d) == pytest.approx(truth, abs=1e-4)
    assert prefill_s(32, 0, 1024, *plain[:3]) > 10 * 0.0233


def test_a_budget_keeps_its_share_of_a_full_fresh_chunk():
    theirs = prefill_s(8192, 0, 8192, S_PER_CHUNK, S_PER_TOKEN, S_PER_TOKEN_CTX)
    ours = STEP.step_time([(1024, 0)], [])
    assert scaled_budget(0.3, STEP, 1024) == pytest.approx(0.3 * ours / theirs, abs=1e-4)


def test_the_budget_rules_are_written_with_the_square_model(tmp_path):
    model = fit_prefill(STEP, 1024, square=True)
    t = SloTargets(ttft_s=0.5, tpot_s=0.2, doc_tokens=800, doc_ttft_s_per_token=0.001)
    specs = spec_files(tmp_path, t, model, None, budget=(0.05, 8))
    assert {"deadline:hopeless+budget0.05x8", "deadline:documents+budget0.05x8",
            "deadline:documents", "shortest-prefill-first"} <= set(specs)
    params = json.loads(open(specs["deadline:hopeless+budget0.05x8"]).read())["params"]
    assert (params["withhold"], params["chunk_budget_s"], params["park_steps"]) == (
        "hopeless", 0.05, 8)
    assert params["s_per_ctx_sq"] == pytest.approx(5e-8)
    pol = build_policy(read_spec(specs["deadline:hopeless+budget0.05x8"]))
    assert isinstance(pol, DeadlinePolicy) and pol.chunks
    assert not any("+budget" in k for k in spec_files(tmp_path, t, model, None))
