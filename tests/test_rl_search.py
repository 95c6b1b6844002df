"""The clairvoyant rollout search (experiments/rl/search.py, benchmarks/rl_ceiling.py): it
never does worse than its base rule, it is deterministic, and it accounts for every
request; on the tiny environment so that each episode takes well under a second."""

from __future__ import annotations

import pytest

from experiments.rl.config import preset
from experiments.rl.search import base_stats, search_episode

pytestmark = pytest.mark.offline

TINY = preset("tiny-v2")  # the deadline menu with the pass-v2 observation
OPTS = {"load": 1.5, "burst_cv": 2.0}


def outcome(stats: dict) -> tuple[int, int]:
    """(requests within their SLO, requests dropped) of an episode's statistics."""
    return (round(stats["slo_attainment"] * stats["requests"]),
            stats["dropped_short"] + stats["dropped_documents"])


@pytest.mark.parametrize("documents", [False, True])
def test_search_beats_its_base_rule_where_a_deviation_pays(documents):
    # seed 12 has a question where another answer than hold-documents' meets more SLOs
    seed = 12
    base = base_stats(TINY, seed, OPTS, "hold-documents")
    res = search_episode(TINY, seed, OPTS, "hold-documents", "slo", documents)
    (met, drops), (met_base, drops_base) = outcome(res.stats), outcome(base)
    assert res.deviations >= 1 and drops <= drops_base and met > met_base
    assert res.stats["requests"] == base["requests"] == TINY.family.n
    assert sum(res.chosen.values()) == res.decisions
    assert res.searched > 0 and res.rollouts >= 2 * res.searched


def test_search_is_deterministic():
    a = search_episode(TINY, 11, OPTS, "hold-documents", "slo", keep_trace=True)
    b = search_episode(TINY, 11, OPTS, "hold-documents", "slo", keep_trace=True)
    assert a.stats == b.stats and a.chosen == b.chosen and len(a.trace) == len(b.trace)
    assert all((x[0] == y[0]).all() and x[1:] == y[1:] for x, y in zip(a.trace, b.trace,
                                                                     strict=True))
    assert outcome(a.stats)[0] >= outcome(base_stats(TINY, 11, OPTS, "hold-documents"))[0]


def test_bad_base_and_objective_are_refused():
    with pytest.raises(ValueError, match="allowed values"):
        search_episode(TINY, 1, OPTS, "fcfs")
    with pytest.raises(ValueError, match="allowed values: slo, return"):
        search_episode(TINY, 1, OPTS, "hold-documents", "goodput")


def test_entries_that_differ_only_by_their_chunk_answer_are_both_tried():
    # the same order, two chunk answers: every question with a document about is searched
    from dataclasses import replace

    cfg = replace(TINY, menu=("hold-hopeless@1024x4", "hold-hopeless"))
    res = search_episode(cfg, 12, OPTS, "hold-hopeless@1024x4", "slo")
    assert res.searched > 0 and res.rollouts >= 2 * res.searched
    assert res.stats["requests"] == cfg.family.n
