"""Small builders shared by the simulator tests."""

from __future__ import annotations

import simpy

from twin.config import ServerArgs
from twin.sim import SimConfig, build_replica
from twin.workload import Request, Workload

GPU = "a100-sxm-80gb"
MODEL = "meta-llama/Llama-3.1-8B"


def req(rid: str, t: float, prompt: int | list, out: int, prio: int = 0, seg: int | None = None):
    """A request; `prompt` is a token count (one unique segment) or a segment list."""
    if isinstance(prompt, int):
        segs = [(seg if seg is not None else abs(hash(rid)) % (1 << 30) + (1 << 32), prompt)]
    else:
        segs = prompt
    return Request.make(rid, t, segs, out, prio)


def run_replica(requests, step_time, concurrency=None, ignore_eos=True, policy=None,
                path=None, **server):
    """Run the replica with a step log; returns (replica, records by rid). The scheduler
    alone: no request path unless `path` (a `RequestPath`) is given."""
    from twin.metrics import twin_records
    from twin.request_path import OFF

    args = ServerArgs(model_path=MODEL, **server)
    cfg = SimConfig(args=args, gpu=GPU, sample_every_s=1e9, debug_checks=True,
                    ignore_eos=ignore_eos, policy=policy, request_path=path or OFF)
    env = simpy.Environment()
    rep, _ = build_replica(env, Workload("test", tuple(requests), concurrency), cfg, step_time)
    rep.step_log = []
    env.process(rep.run())
    env.run()
    recs = {r["rid"]: r for r in twin_records(rep.finished, rep.step_end)}
    return rep, recs


def bias_selector(tmp_path, cfg, pick: int):
    """A learned selector for preset `cfg` whose one layer has zero weights, so its bias
    alone picks menu entry `pick` on every pass (a weight file in `tmp_path`)."""
    import json

    import numpy as np

    from experiments.rl.export import selector_meta
    from twin.policy.features import feature_names
    from twin.policy.learned import LearnedPolicy

    n_in, n_out = len(feature_names(cfg.k_slots, cfg.features)), len(cfg.menu)
    bias = [0.0] * n_out
    bias[pick] = 1.0
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"meta": selector_meta(cfg), "layers": [
        {"w": np.zeros((n_out, n_in)).tolist(), "b": bias}]}))
    return LearnedPolicy(weights=str(path))
