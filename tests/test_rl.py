"""The RL scheduler: environment contract, determinism, accounting, the numpy export, a
tiny training run, reward shaping, and the shipped policy (docs/rl.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.rl import ENV_ID
from experiments.rl.config import preset
from experiments.rl.env import SchedulingEnv
from experiments.rl.episode import Ledger, run_policy
from experiments.rl.evaluate import episode_workload, evaluate_policy, mean_stats
from twin.policy import (
    RequestView,
    Snapshot,
    build_policy,
    make_policy,
    read_spec,
    spec_from_dict,
)
from twin.policy.check import check_policy
from twin.policy.features import feature_names
from twin.policy.learned import LearnedPolicy

TINY = preset("tiny")


def rollout(env: SchedulingEnv, seed: int, actions_seed: int = 0, policy=None):
    """Observations, rewards and the final info of one episode with seeded random
    actions (or `policy(obs)`)."""
    rng = np.random.default_rng(actions_seed)
    obs, info = env.reset(seed=seed)
    observations, rewards, snaps = [obs], [], [env.episode.decider.pending]
    while True:
        act = int(rng.integers(env.action_space.n)) if policy is None else policy(obs)
        obs, r, term, trunc, info = env.step(act)
        observations.append(obs)
        rewards.append(r)
        snaps.append(env.episode.decider.pending)
        if term or trunc:
            return observations, rewards, info, snaps[:-1]


def test_check_env_and_registration():
    env = SchedulingEnv("tiny")
    check_env(env, skip_render_check=True)
    check_env(SchedulingEnv("tiny-v2"), skip_render_check=True)  # the pass-v2 observation
    made = gym.make(ENV_ID, config="tiny")
    assert made.observation_space.shape == (len(feature_names()),)
    obs, _ = made.reset(seed=3)
    assert made.observation_space.contains(obs)


def test_same_seed_and_actions_give_identical_episodes():
    a = rollout(SchedulingEnv("tiny"), seed=11, actions_seed=5)
    b = rollout(SchedulingEnv("tiny"), seed=11, actions_seed=5)
    assert np.array_equal(np.array(a[0]), np.array(b[0]))
    assert a[1] == b[1]
    assert json.dumps(a[2]["episode_stats"]) == json.dumps(b[2]["episode_stats"])
    c = rollout(SchedulingEnv("tiny"), seed=12, actions_seed=5)
    assert not np.array_equal(np.array(a[0][:5]), np.array(c[0][:5]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_request_is_accounted_for(seed):
    env = SchedulingEnv("tiny", drain_factor=0.3 if seed % 2 else 1.5)  # some dropped
    _, rewards, info, _ = rollout(env, seed=seed, actions_seed=seed)
    ep = env.episode
    wanted = sorted(r.rid for r in episode_workload_of(env, seed).requests)
    got = sorted(r.rid for r in ep.rep.finished)
    assert got == wanted  # each exactly once
    assert set(ep.ledger.outcome) == set(wanted)
    assert sum(rewards) == pytest.approx(ep.ledger.total, abs=1e-9)
    stats = info["episode_stats"]
    assert stats["requests"] == len(wanted)
    # the return is the mean over classes of attainment minus the share dropped
    for cls in ("short", "documents"):
        assert stats[f"slo_{cls}"] is not None
    dropped = sum(ep.ledger.outcome[r] == "dropped" for r in wanted)
    assert dropped == stats["dropped_short"] + stats["dropped_documents"]


def episode_workload_of(env: SchedulingEnv, seed: int):
    return episode_workload(env.cfg, seed)


def test_vector_env():
    venv = gym.vector.SyncVectorEnv([lambda: SchedulingEnv("tiny") for _ in range(2)])
    obs, _ = venv.reset(seed=[1, 2])
    assert obs.shape == (2, len(feature_names()))
    for _ in range(30):  # through at least one autoreset
        obs, rew, term, trunc, _ = venv.step(np.array([1, 0]))
    assert np.isfinite(obs).all()


def test_starving_a_class_does_not_pay():
    """On a real episode: replacing the outcome by "every short question met, every
    document dropped" raises plain goodput (met requests) but lowers the return."""
    cfg = preset("tiny")
    wl = episode_workload(cfg, 21, {"load": 1.5, "burst_cv": 2.0})
    from experiments.rl.env import capacity_of, step_time_for

    ledger, records, _ = run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg),
                                    make_policy("fcfs"))
    starved = Ledger.for_workload(wl, cfg.targets)
    doc = {r.rid: cfg.targets.is_document(r.prompt_tokens) for r in wl.requests}
    for rid, w in starved.weight.items():
        starved.outcome[rid] = "dropped" if doc[rid] else "met"
        starved.earned[rid] = -w if doc[rid] else w
    met = sum(v == "met" for v in ledger.outcome.values())
    assert sum(v == "met" for v in starved.outcome.values()) > met  # plain goodput: pays
    assert starved.total == pytest.approx(0.0, abs=1e-9)  # ours: a dropped class costs
    assert starved.total < ledger.total  # as much as the other class can earn
    # and serving the starved class late instead of dropping it always earns more
    late = Ledger.for_workload(wl, cfg.targets)
    gain_late = sum(w for rid, w in late.weight.items() if not doc[rid])
    assert gain_late > starved.total


def small_model(steps: int, seed: int = 0, config: str = "tiny"):
    import torch.nn as nn
    from stable_baselines3 import PPO

    env = SchedulingEnv(config)
    model = PPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=4, seed=seed,
                policy_kwargs=dict(net_arch=dict(pi=[32, 32], vf=[32, 32]),
                                   activation_fn=nn.ReLU), device="cpu", verbose=0)
    if steps:
        model.learn(steps)
    return model, env


@pytest.mark.parametrize("config", ["tiny", "tiny-hold", "tiny-v2"])
def test_exported_policy_decides_as_the_network(tmp_path, config):
    """Same features, same choice; with the hold menu also the same plan (order and
    admission) as the environment applied."""
    import torch

    from experiments.rl.export import actor_layers, export_selector

    torch.set_num_threads(1)
    model, env = small_model(256, config=config)
    path = export_selector(actor_layers(model.policy), preset(config), tmp_path / "p.safetensors")
    numpy_policy = LearnedPolicy(weights=str(path))
    check_policy(numpy_policy)
    agree = total = held = 0
    for seed in (31, 32):
        obs_list, _, _, snaps = rollout(env, seed, policy=lambda o: int(
            model.predict(o, deterministic=True)[0]))
        for obs, snap in zip(obs_list, snaps, strict=False):
            net = int(model.predict(obs, deterministic=True)[0])
            assert np.array_equal(obs, env._obs(snap))
            total += 1
            agree += numpy_policy.choice(snap) == net
            plan = numpy_policy.decide(snap)
            assert plan == env.episode.held.rule_plan(snap, net)
            held += any(env.episode.held.rule_plan(snap, c).admit is not None
                        for c in range(env.action_space.n))
    assert total > 20 and agree == total
    if config != "tiny":
        assert held > 0  # the menu withholds admission on some of these passes


def test_tiny_training_beats_random_actions(tmp_path):
    import torch

    from experiments.rl.train import TrainConfig, train

    torch.set_num_threads(1)
    res = train(tmp_path, TrainConfig(env="tiny", timesteps=6144, eval_every=6144,
                                      eval_episodes=6, n_steps=128), log=lambda s: None)
    seeds = [1_000_000 + i for i in range(6)]
    learned = mean_stats(evaluate_policy(TINY, LearnedPolicy(
        weights=str(tmp_path / "policy-final.safetensors")), seeds))
    randoms = [sum(rollout(SchedulingEnv("tiny"), s, actions_seed=s)[1]) for s in seeds]
    assert learned["return"] > float(np.mean(randoms))
    assert (tmp_path / "report.html").stat().st_size > 10_000
    assert res["history"][-1]["timesteps"] >= 6144


def test_training_resumes_from_its_checkpoint(tmp_path):
    from experiments.rl.train import TrainConfig, Trainer

    tc = TrainConfig(env="tiny", timesteps=256, eval_every=256, eval_episodes=1, n_steps=128)
    Trainer(tmp_path, tc, log=lambda s: None).run()
    lines: list[str] = []
    more = TrainConfig(**{**tc.__dict__, "timesteps": 512})
    with pytest.raises(ValueError, match="another configuration"):
        Trainer(tmp_path, more, log=lines.append)
    t = Trainer(tmp_path, tc, log=lines.append)
    assert t.model.num_timesteps == 256 and any("resumed" in x for x in lines)
    assert not list(tmp_path.glob("*.zip")) and not list(tmp_path.glob("*.pkl"))


@pytest.mark.parametrize("name,features", [("finance-qa", "pass-v1"),
                                           ("finance-qa-v2", "pass-v2")])
def test_shipped_policy_runs_with_numpy_alone(name, features):
    spec = read_spec(f"learned:{name}")
    pol = build_policy(spec)
    assert pol.kind == "selector" and pol.features == features
    check_policy(pol)
    about = json.loads(Path(spec.params["weights"]).with_suffix(".json").read_text())
    assert about["evaluation"] and about["train"] and about["command"]
    with pytest.raises(Exception, match="not a shipped policy"):
        read_spec("learned:no-such-policy")


def test_menu_spf_with_the_chunk_cap_is_sglangs_shortest_prefill_first():
    from experiments.rl.env import capacity_of, step_time_for

    cfg = preset("tiny", chunk_cap=True)
    wl = episode_workload(cfg, 5, {"load": 1.5, "burst_cv": 2.0})
    t = cfg.targets.to_json()
    runs = [run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg), build_policy(s))[1]
            for s in (read_spec("shortest-prefill-first"),
                      spec_from_dict({"name": "menu", "params": {"rule": "spf", **t,
                                                                 "chunk_cap": True}}))]
    assert json.dumps(runs[0]) == json.dumps(runs[1])
    uncapped = run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg), build_policy(
        spec_from_dict({"name": "menu", "params": {"rule": "spf", **t}})))[1]
    assert json.dumps(uncapped) != json.dumps(runs[0])  # the cap changes the schedule


def test_selector_file_carries_its_chunk_cap(tmp_path):
    from experiments.rl.export import export_selector

    rng = np.random.default_rng(0)
    n_in = len(feature_names())
    layers = [(rng.normal(size=(8, n_in)), rng.normal(size=8)),
              (rng.normal(size=(4, 8)), rng.normal(size=4))]
    capped = LearnedPolicy(weights=str(export_selector(
        layers, preset("tiny", chunk_cap=True), tmp_path / "c.safetensors")))
    plain = LearnedPolicy(weights=str(export_selector(layers, TINY, tmp_path / "p.safetensors")))
    assert hasattr(capped, "chunk_limit") and not hasattr(plain, "chunk_limit")
    check_policy(capped)
    assert (tmp_path / "p.safetensors").read_bytes() == export_selector(
        layers, TINY, tmp_path / "q.safetensors").read_bytes()  # same input, same bytes


def test_pass_v2_features_are_pass_v1_plus_the_deadline_rules_view():
    """pass-v2 = pass-v1 + what the deadline policy's grouping sees, on real passes."""
    from twin.policy.features import SLACK_FIELDS, pass_features
    from twin.policy.menu import deadline_policy

    cfg = preset("tiny-v2")
    env = SchedulingEnv(cfg)
    n1 = len(feature_names())
    assert len(feature_names(features="pass-v2")) == n1 + len(SLACK_FIELDS)
    assert env.observation_space.shape == (n1 + len(SLACK_FIELDS),)
    names = feature_names(features="pass-v2")
    seen_docs = 0
    for seed in (5, 6):
        obs_list, _, _, snaps = rollout(env, seed, actions_seed=seed)
        for obs, snap in zip(obs_list, snaps, strict=False):
            v1 = pass_features(snap, cfg.targets).astype(np.float32)
            assert np.array_equal(obs[:n1], v1)
            g = deadline_policy("laxity", cfg.targets).groups(snap)
            f = dict(zip(names, obs, strict=True))
            for key in ("kept", "hopeless", "overdue"):
                assert f[f"log_{key}_documents"] == np.float32(np.log1p(len(g[key])) / 4)
            assert f["log_ok_short"] == np.float32(np.log1p(len(g["ok"])) / 6)
            docs = g["kept"] + g["hopeless"] + g["overdue"]
            if docs:
                seen_docs += 1
                want = np.clip(min(g["slack"][i] for i in docs) / 60, -1, 1)
                assert f["min_document_slack"] == np.float32(want)
    assert seen_docs > 5  # the slack features were exercised, not all zero


def test_weight_file_names_its_feature_set(tmp_path):
    """A pass-v2 file computes pass-v2; the shipped pass-v1 file still loads as pass-v1;
    an unknown feature set is refused with the allowed values."""
    from experiments.rl.export import export_selector

    rng = np.random.default_rng(1)
    cfg = preset("tiny-v2")
    n_in = len(feature_names(features="pass-v2"))
    layers = [(rng.normal(size=(8, n_in)), rng.normal(size=8)),
              (rng.normal(size=(len(cfg.menu), 8)), rng.normal(size=len(cfg.menu)))]
    pol = LearnedPolicy(weights=str(export_selector(layers, cfg, tmp_path / "v2.safetensors")))
    assert pol.features == "pass-v2"
    check_policy(pol)
    with pytest.raises(ValueError, match=r"expected w \(n, 74\)"):  # v2 weights as v1
        LearnedPolicy(weights=str(export_selector(layers, preset("tiny-hold"),
                                                  tmp_path / "v1.safetensors")))
    shipped = build_policy(read_spec("learned:finance-qa"))
    assert shipped.features == "pass-v1"
    bad = {"meta": {"kind": "selector", "features": "pass-v9", "menu": ["spf"]},
           "layers": [{"w": [[0.0] * len(feature_names())], "b": [0.0]}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="pass-v9.*allowed values: pass-v1, pass-v2"):
        LearnedPolicy(weights=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="feature set"):
        preset("tiny", features="pass-v9")


def test_shipped_v2_policy_switches_rules_within_an_episode():
    """learned:finance-qa-v2 is not one rule in disguise: on a 150 % load episode of the
    users' deployment it picks both hold-documents and laxity, and accounts for every
    request."""
    cfg = preset("finance-qa-deadline-v2")
    pol = build_policy(read_spec("learned:finance-qa-v2"))
    picks: list[str] = []
    pick = pol.choice

    def choice(snap):
        c = pick(snap)
        picks.append(pol.menu[c])
        return c

    pol.choice = choice
    wl = episode_workload(cfg, 2_000_000, {"load": 1.5, "burst_cv": 2.0})
    from experiments.rl.env import capacity_of, step_time_for

    ledger, records, _ = run_policy(cfg, wl, step_time_for(cfg), capacity_of(cfg), pol)
    assert len(records) == len(wl.requests) == len(ledger.outcome)
    assert {"hold-documents", "laxity"} <= set(picks)


def _reference_waiting_running(snap, t, k):
    """pass-v1's numbers one slot and one request at a time, with numpy's own means: the
    form the features had before they were computed column by column (the specification
    the test holds them to, bit for bit)."""
    from twin.policy.features import (
        QUEUE_FIELDS,
        RUN_FIELDS,
        SLO_FIELDS,
        SLOT_FIELDS,
        _log,
        _targets,
    )

    def arrays(views):
        return {"arrival": np.array([r.arrival_s for r in views], float),
                "prompt": np.array([r.prompt_tokens for r in views], float),
                "prefix": np.array([r.prefix_len for r in views], float),
                "prio": np.array([r.priority for r in views], float)}

    n = len(snap.waiting)
    slots, queue = np.zeros((k, len(SLOT_FIELDS))), np.zeros(len(QUEUE_FIELDS))
    queue[0] = _log(n, 6)
    if n:
        a = arrays(snap.waiting)
        prompt, prefix = a["prompt"], np.minimum(a["prefix"], a["prompt"])
        uncached = prompt - prefix
        late = (snap.now - a["arrival"]) / _targets(t, prompt, a["prio"])
        doc = prompt >= t.doc_tokens
        for s, i in enumerate(sorted(range(n), key=lambda i: (a["arrival"][i], i))[:k]):
            slots[s] = (1.0, _log(prompt[i], 12), _log(uncached[i], 12),
                        prefix[i] / max(prompt[i], 1.0), min(late[i], 8.0) / 8,
                        a["prio"][i] / 20, float(doc[i]))
        short = ~doc
        queue[1:] = (short.mean(), _log(uncached.sum(), 14), _log(uncached.min(), 12),
                     min(late.max(), 8.0) / 8, (late > 1).mean(),
                     (late[short] > 1).mean() if short.any() else 0.0, _log(doc.sum(), 4))
    cap, r = max(snap.kv_capacity, 1), snap.running
    run, slo = np.zeros(len(RUN_FIELDS)), np.zeros(len(SLO_FIELDS))
    run[0] = _log(len(r), 6)
    run[3:6] = ((cap - snap.kv_free - snap.kv_evictable) / cap, snap.kv_free / cap,
                snap.kv_evictable / cap)
    if len(r):
        a = arrays(r)
        left = np.array([x.max_new_tokens - x.generated_tokens for x in r], float)
        run[1] = (a["prompt"] >= t.doc_tokens).mean()
        run[2] = _log(left.sum(), 12)
        run[6] = sum(x.reserved_tokens for x in r) / cap
        first = np.array([np.nan if x.first_token_s is None else x.first_token_s for x in r])
        started = ~np.isnan(first)
        if started.any():
            ratio = (first - a["arrival"])[started] / _targets(t, a["prompt"], a["prio"])[started]
            slo[0] = (ratio > 1).mean()
            slo[1] = min(ratio.mean(), 4.0) / 4
        gen = np.array([x.generated_tokens for x in r], float)
        decoding = started & (gen > 1)
        if decoding.any() and t.tpot_s:
            slo[2] = ((snap.now - first[decoding]) / (gen[decoding] - 1) > t.tpot_s).mean()
    return np.clip(np.concatenate([slots.ravel(), queue, run, slo]), -1.0, 1.0)


@pytest.mark.parametrize("name", ["finance-qa", "tiny"])
def test_features_column_by_column_are_the_slot_by_slot_numbers(name):
    """The features computed a column at a time (one pass over the views, the shares as
    counts over lengths) are the slot-by-slot numbers bit for bit, on real passes."""
    from twin.policy.features import pass_features

    cfg = preset(name)
    env = SchedulingEnv(cfg)
    seen = 0
    for seed in (3, 4):
        _, _, _, snaps = rollout(env, seed, actions_seed=seed)
        for snap in snaps:
            got = pass_features(snap, cfg.targets, cfg.k_slots)
            want = _reference_waiting_running(snap, cfg.targets, cfg.k_slots)
            assert got.tobytes() == want.tobytes()
            seen += len(snap.waiting) > 1 and len(snap.running) > 1
    assert seen > 20  # busy passes, not empty ones


def _reference_slack(snap, t, prefill):
    """pass-v2's SLACK_FIELDS as numpy computed them entry by entry (each log its own
    `np.log1p` call): the form before the logs were taken together."""
    from twin.policy.features import SLACK_FIELDS, SLACK_SCALE_S, _log
    from twin.policy.menu import deadline_policy

    out = np.zeros(len(SLACK_FIELDS))
    pol = deadline_policy("laxity", t, prefill)
    out[9] = float(any(not t.is_document(r.prompt_tokens) for r in snap.running))
    if not snap.waiting:
        return out
    g = pol.groups(snap)
    slack = g["slack"]
    due = [i for i in g["kept"] if slack[i] <= pol.margin_s]
    out[0:4] = (_log(len(g["kept"]), 4), _log(len(due), 4), _log(len(g["hopeless"]), 4),
                _log(len(g["overdue"]), 4))
    docs = g["kept"] + g["hopeless"] + g["overdue"]
    if docs:
        out[4] = min(slack[i] for i in docs) / SLACK_SCALE_S
    if g["kept"]:
        out[5] = min(slack[i] for i in g["kept"]) / SLACK_SCALE_S
    out[6:8] = (_log(len(g["ok"]), 6), _log(len(g["late"]), 6))
    shorts = g["ok"] + g["late"]
    if shorts:
        w = snap.waiting
        head = min(shorts, key=lambda i: (w[i].arrival_s, i))
        target = t.ttft_target(w[head].prompt_tokens, w[head].priority)
        out[8] = min((snap.now - w[head].arrival_s) / target, 4.0) / 4
    return np.clip(out, -1.0, 1.0)


def test_pass_v2_features_are_the_entry_by_entry_numbers():
    """pass-v2 (pass-v1 and the deadline policy's slack groups) on real passes of a v2
    preset: the slot-by-slot numbers, then the slack entries as computed one log at a
    time, bit for bit."""
    from twin.policy.features import pass_features
    from twin.policy.menu import prefill_params

    cfg = preset("finance-qa-chunks-v2")
    env = SchedulingEnv(cfg)
    pre = prefill_params(cfg.prefill)
    seen = 0
    for seed in (3, 4):
        _, _, _, snaps = rollout(env, seed, actions_seed=seed)
        for snap in snaps:
            got = pass_features(snap, cfg.targets, cfg.k_slots, "pass-v2", pre)
            want = np.concatenate([_reference_waiting_running(snap, cfg.targets, cfg.k_slots),
                                   _reference_slack(snap, cfg.targets, pre)])
            assert got.tobytes() == want.tobytes()
            seen += len(snap.waiting) > 1
    assert seen > 20


_VIEWS = st.builds(
    lambda rid, prio, arrival, prompt, prefix, max_new, gen, first, res: RequestView(
        rid=str(rid), priority=prio, arrival_s=arrival, queue_entry_s=arrival,
        prompt_tokens=prompt, prefix_len=prefix, max_new_tokens=max_new + gen,
        generated_tokens=gen, first_token_s=None if first is None else arrival + first,
        reserved_tokens=res),
    st.integers(0, 10**6), st.sampled_from([0, 5, 10, 20]),
    st.one_of(st.integers(0, 3), st.floats(0.0, 500.0)),
    st.integers(0, 130_000), st.integers(0, 140_000), st.integers(1, 4000),
    st.integers(0, 3),
    st.one_of(st.none(), st.sampled_from([1.5, 3.0, math.nan]), st.floats(0.0, 40.0)),
    st.floats(0.0, 5000.0))


@settings(max_examples=500, deadline=None)
@given(waiting=st.lists(_VIEWS, max_size=14), running=st.lists(_VIEWS, max_size=14),
       now=st.one_of(st.sampled_from([0, 1.5, 3.0, 4.5]), st.floats(0.0, 600.0)),
       kv=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
       tiers=st.sampled_from([(), ((5, 0.8),), ((10, 0.5), (5, 0.9), (10, 0.4)),
                              ((0, 0.0),)]),
       tpot=st.sampled_from([None, 0.0, 0.05]), k=st.sampled_from([1, 4, 8]))
def test_features_on_drawn_passes_are_the_slot_by_slot_numbers(waiting, running, now, kv,
                                                              tiers, tpot, k):
    """Drawn passes (empty and busy queues, matches longer than the prompt, whole and
    fractional times, the clock's int 0, waits and first tokens exactly at a target
    (1.5 s: the boundaries of "late"), tiers named twice, a tier with a 0 s target (inf
    and NaN waits), a NaN first token, no TPOT target, fewer waiting than slots): pass-v1
    is the slot-by-slot numbers, bit for bit (NaN compared as bytes too)."""
    from twin.policy.features import SloTargets, pass_features

    t = SloTargets(tpot_s=tpot, tier_ttft_s=tiers)
    snap = Snapshot(now=now, waiting=tuple(waiting), running=tuple(running),
                    kv_capacity=kv[0], kv_free=kv[1], kv_evictable=kv[2])
    got = pass_features(snap, t, k)
    assert got.tobytes() == _reference_waiting_running(snap, t, k).tobytes()


@pytest.mark.parametrize("name", ["tiny", "tiny-hold", "tiny-v2", "tiny-chunks",
                                  "finance-qa-admit-v2", "finance-qa-chunks-v2"])
def test_the_environment_on_the_typed_core_is_the_python_replicas(monkeypatch, name):
    """The environment's episodes run on the typed core (twin/core.py `start`: its order
    questions asked of the agent, the snapshots built from its columns) and give the
    Python replica's observations, rewards and infos exactly: two episodes of seeded
    random actions each way, over menus that withhold admission and answer chunk
    questions (a chunk answer per menu entry in finance-qa-chunks-v2)."""
    from twin import core
    if core._CORE is None:
        pytest.skip(f"the typed core is not built: {core.WHY_NO_CORE}")

    def episodes(on: bool) -> list:
        if on:
            monkeypatch.delenv("SERVETWIN_PYTHON_LOOP", raising=False)
        else:
            monkeypatch.setenv("SERVETWIN_PYTHON_LOOP", "1")
        env = SchedulingEnv(name)
        out = []
        for seed in (3, 4):
            obs, rewards, info, _ = rollout(env, seed, actions_seed=seed)
            assert (env.episode.core is not None) == on
            out.append(([o.tobytes() for o in obs], rewards, json.dumps(info, sort_keys=True)))
        return out

    typed, python = episodes(True), episodes(False)
    assert sum(len(r) for _, r, _ in typed) > 20  # questions were asked and answered
    assert typed == python


def test_the_latest_wait_keeps_numpys_zero():
    """The queue's longest wait when it is zero: numpy's max of equal zeros may be the
    -0.0 (an arrival a subnormal after now: found by the drawn passes), Python's max the
    first 0.0; the features keep numpy's."""
    from twin.policy.features import SloTargets, pass_features

    w = [RequestView(rid=str(i), prompt_tokens=1, max_new_tokens=1) for i in range(4)]
    w.append(RequestView(rid="doc", arrival_s=5e-324, queue_entry_s=5e-324,
                         prompt_tokens=4096, max_new_tokens=1))
    snap = Snapshot(now=0, waiting=tuple(w), running=())
    t = SloTargets(tpot_s=None)
    assert pass_features(snap, t, 1).tobytes() == _reference_waiting_running(snap, t, 1).tobytes()
