"""A policy's effect, live and in the twin: the same workload through the real CPU SGLang
server with fcfs and with each policy (run inside SGLang by servetwin's plugin), and
through the twin calibrated on that server with the same policy spec.

For each policy it reports, per priority tier, the mean queue time live and in the twin,
and the change against fcfs. The favoured class is the tier the policy puts first; the
claim checked is that the twin predicts the direction of the change for every tier and
the favoured class's queue time within a tolerance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration.profile import Bar, ServerLimits, Store, all_samples, make_plan, profile
from calibration.profiles import build_profile, identity, write_profile
from calibration.session import server_facts
from calibration.validate import at_send_times, drift, simulate_like, step_check
from runtime.client import ReplayConfig, replay
from runtime.cpu.serve import CpuServer
from runtime.plugin.env import plugin_env
from twin.metrics import write_records
from twin.workload import Workload

SERVER_FLAGS = ["--schedule-policy", "fcfs", "--max-running-requests", "2"]


@dataclass
class Effect:
    policy: str
    live: dict[int, float]  # tier -> mean queue_s
    twin: dict[int, float]
    not_ok: int = 0
    fallbacks: dict = field(default_factory=dict)
    drift: float | None = None  # this live run's steps / the profile's (a shared machine)
    rescaled: dict[int, float] = field(default_factory=dict)  # the twin x drift

    def advantage(self, which: str = "live", tier: int = 20, base: int = 0) -> float:
        """Mean queue time of `tier` over that of `base`, within one run (so the machine's
        load, which changes between runs, cancels)."""
        q = getattr(self, which)
        return q[tier] / q[base] if q.get(base) else float("nan")


def tier_queue(records: list[dict]) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for r in records:
        if r["status"] == "ok" and r["queue_s"] is not None:
            out.setdefault(r["priority"], []).append(r["queue_s"])
    return {t: float(np.mean(v)) for t, v in sorted(out.items())}


def calibrate(url: str, out: Path, budget_s: float, log=print) -> dict:
    facts = server_facts(url)
    lim = ServerLimits.from_info(facts.info)
    path = out / "profile.json"
    store = Store(path, identity(facts.info))
    bar = Bar(len(make_plan(lim)), budget_s)
    profile(url, store, lim, facts.vocab_size, budget_s, bar)
    bar.close()
    prof = build_profile(all_samples(store, lim), facts.info, ["experiments/policy_effect.py"])
    write_profile(path, prof)
    log(f"calibrated in {budget_s:.0f} s budget: {path}")
    return prof


PRIORITY_FLAGS = ["--enable-priority-scheduling", "--default-priority-value", "0"]


def live_run(spec: str, flags: list[str], workload: Workload, out: Path, log=print):
    """Replay `workload` on a fresh CPU server running `spec` through the plugin."""
    d = out / Path(spec).stem
    d.mkdir(parents=True, exist_ok=True)
    env = plugin_env(spec, d / "decisions.jsonl")
    with CpuServer([*SERVER_FLAGS, *flags], env=env, log_path=d / "server.log") as server:
        log(f"{spec}: server ready in {server.start_seconds:.0f} s")
        facts = server_facts(server.url)
        res = replay(workload, ReplayConfig(url=server.url), None, facts)
        res.check()
        return res.records, facts.info, d


def fallbacks(d: Path) -> dict:
    p = d / "decisions.jsonl.counters.json"
    return json.loads(p.read_text()) if p.exists() else {}


def capacity(info: dict, prof: dict, make: Callable[[float], Workload]) -> float:
    """Requests per second the calibrated twin completes for this mix when overloaded."""
    from twin.metrics import summarize

    records, _ = simulate_like(make(50.0), info, prof)
    return summarize(records)["throughput"]["requests_per_s"]


def run(policies: list[tuple[str, list[str]]], make: Callable[[float], Workload], load: float,
        out: Path, budget_s: float = 60, log=print) -> tuple[list[Effect], Workload]:
    """Calibrate the twin on an fcfs server, size the workload (`make(rate)`) at `load` x
    the calibrated capacity, replay it there (the baseline), then on a fresh server per
    `(spec, extra server flags)`; the twin simulates each run at its live send times.
    Priority reaches SGLang (and so the plugin's views) only with priority scheduling on:
    a policy that reads tiers needs `PRIORITY_FLAGS`."""
    out.mkdir(parents=True, exist_ok=True)
    d = out / "fcfs"
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with CpuServer(SERVER_FLAGS, env=plugin_env("fcfs", d / "decisions.jsonl"),
                   log_path=d / "server.log") as server:
        prof = calibrate(server.url, d, budget_s, log)
        facts = server_facts(server.url)
        cap = capacity(facts.info, prof, make)
        workload = make(load * cap)
        log(f"calibrated capacity {cap:.3f} req/s; workload at {load:.0%}: {workload.name}")
        res = replay(workload, ReplayConfig(url=server.url), None, facts)
        res.check()
    runs = [("fcfs", res.records, facts.info, d, time.monotonic() - t0)]
    for spec, flags in policies:
        t0 = time.monotonic()
        records, info, d = live_run(spec, flags, workload, out, log)
        runs.append((spec, records, info, d, time.monotonic() - t0))
    effects = []
    for spec, records, info, d, took in runs:
        write_records(d / "live.jsonl", records)
        sent = at_send_times(workload, records)
        pol = None if spec == "fcfs" else spec
        twin, step = simulate_like(sent, info, prof, policy=pol)
        write_records(d / "twin.jsonl", twin)
        k = drift(step_check(records, info, step))
        rescaled = tier_queue(simulate_like(sent, info, prof, k, policy=pol)[0]) if k else {}
        counts = fallbacks(d)
        e = Effect(spec, tier_queue(records), tier_queue(twin),
                   sum(r["status"] != "ok" for r in records),
                   {k2: counts.get(k2, 0) for k2 in ("raised", "invalid", "slow")}, k, rescaled)
        effects.append(e)
        log(f"{spec}: live {e.live} twin {e.twin} drift {k} ({took:.0f} s)")
    return effects, workload


def table(effects: list[Effect]) -> str:
    """Per policy and tier: mean queue time live, in the twin, and in the twin with this
    run's measured step drift; and the tier-20 advantage (its queue time over tier 0's,
    within the run) live and in the twin."""
    lines = ["| policy | tier | live queue (s) | twin | twin x drift | drift | VIP advantage "
             "live | twin | not ok | fallbacks (raised/invalid/slow) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in effects:
        fb = "/".join(str(e.fallbacks.get(k, 0)) for k in ("raised", "invalid", "slow"))
        for tier in e.live:
            lines.append(
                f"| {Path(e.policy).stem} | {tier} | {e.live[tier]:.3f} | "
                f"{e.twin.get(tier, float('nan')):.3f} | "
                f"{e.rescaled.get(tier, float('nan')):.3f} | "
                f"{e.drift if e.drift is None else round(e.drift, 2)} | "
                f"{e.advantage('live'):.2f} | {e.advantage('twin'):.2f} | {e.not_ok} | {fb} |")
    return "\n".join(lines)
