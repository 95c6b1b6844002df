"""`servetwin rl train --algo es` (experiments/rl/es.py) on the tiny preset with the chunk
menu: deterministic, and what it writes is a selector the `learned` policy runs."""

from __future__ import annotations

import pytest

from experiments.rl.config import preset
from experiments.rl.es import EsConfig, centred_ranks, train_es
from twin.policy.check import check_policy
from twin.policy.learned import LearnedPolicy, load_weights

pytestmark = pytest.mark.offline

TINY = preset("tiny-chunks")


def es(tmp_path, name, **kw):
    ec = EsConfig(env="tiny-chunks", generations=2, pairs=2, episodes=2, eval_every=1,
                  eval_episodes=2, prior_rule=TINY.menu[0], **kw)
    return train_es(tmp_path / name, ec, log=lambda m: None)


def test_es_is_deterministic_and_writes_a_selector_with_chunk_answers(tmp_path):
    a, b = es(tmp_path, "a"), es(tmp_path, "b")
    assert a["history"] == [{**r, "cpu_s": a["history"][i]["cpu_s"]}
                            for i, r in enumerate(b["history"])]
    for name in ("policy-latest.safetensors", "policy-best.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    pol = LearnedPolicy(weights=str(tmp_path / "a" / "policy-latest.safetensors"))
    assert pol.chunks and pol.menu == TINY.menu
    assert check_policy(pol) > 0
    (w, b0), = load_weights(str(tmp_path / "a" / "policy-latest.safetensors"))[0]
    assert w.shape[0] == len(TINY.menu) and abs(w).sum() > 0  # the steps moved it
    assert [r["generation"] for r in a["history"]] == [0, 1, 2]


def test_es_refuses_a_prior_off_the_menu_and_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="not on the menu"):
        train_es(tmp_path, EsConfig(env="tiny-chunks", prior_rule="spf@1x1"), log=lambda m: 0)
    with pytest.raises(ValueError, match="sigma"):
        EsConfig(sigma=0)
    with pytest.raises(ValueError, match="pairs"):
        EsConfig(pairs=0)


def test_centred_ranks():
    assert list(centred_ranks(__import__("numpy").array([3.0, 1.0, 2.0]))) == [0.5, -0.5, 0.0]
