"""One candidate against the question: feasibility, one simulation at one load, and the search
for the largest load that meets every SLO.

A single-replica candidate runs through `twin.sim.simulate`, a multi-replica one through
`twin.fleet.simulate_fleet` (its replicas behind the candidate's router). The load search
uses the twin's determinism: the same requests at every load (`Question.at`), so a load
either meets the SLOs or not, every time. It brackets the boundary (doubling up from the
target while the SLOs hold, or checking a floor of 1/16 of the target when they do not),
then bisects geometrically until the bracket is within `precision` (5 %: the largest
sustainable load found, `lo`, is within 5 % of the first load found to fail, `hi`). A
guess (the same hardware's boundary with fewer replicas, scaled by the replica count) is
tried first with its neighbour one precision step away, which brackets the boundary in two
runs when capacity scales with replicas. Where the SLOs are not monotone in load the
search finds one boundary, not necessarily the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from experiments.plan.question import Question, Slo
from experiments.plan.space import Candidate
from twin.config import derive_capacity
from twin.errors import ServetwinError
from twin.sim import SimConfig

MAX_FACTOR = 64.0  # the search stops doubling at 64x the target (max_load then "at least")
FLOOR_FACTOR = 1 / 16  # below 1/16 of the target a candidate has no sustainable load


def sim_config(cand: Candidate) -> SimConfig:
    return SimConfig(args=cand.args(), gpu=cand.gpu, kv_allocator=cand.kv_allocator,
                     policy=cand.twin_policy, step_time_backend=cand.step_time_backend)


def fleet_doc(cand: Candidate, seed: int) -> dict:
    """The candidate as a deployment spec (twin/fleet.py), for replicas > 1."""
    args = {k: v for k, v in sorted(vars(cand.args()).items())
            if v != getattr(type(cand.args())(), k) or k in ("model_path", "tp_size")}
    twin = {}
    if cand.kv_allocator != "token":
        twin["kv_allocator"] = cand.kv_allocator
    if cand.twin_policy:
        twin["policy"] = cand.twin_policy
    rep = {"name": "r", "count": cand.replicas, "engine": "sglang", "server_args": args}
    if twin:
        rep["twin"] = twin
    if cand.step_time_backend:
        rep["step_time_backend"] = cand.step_time_backend
    return {"name": cand.id, "gpu": cand.gpu, "seed": seed, "router": {"name": cand.router},
            "replicas": [rep]}


def infeasible_reason(cand: Candidate, q: Question) -> str | None:
    """Why SGLang would refuse this candidate or its requests, with the numbers; None if
    it runs. Prompts SGLang would reject (as long as the context or the KV pool) make a
    candidate infeasible: the twin would record them `rejected`."""
    try:
        cfg = sim_config(cand)
        cap = derive_capacity(cfg.args, cfg.gpu)
        from twin.sim import build_policy

        build_policy(cfg)
    except ServetwinError as exc:
        return str(exc)
    longest = max(r.prompt_tokens for r in q.base.requests)
    if longest >= cap.max_req_input_len:
        too_long = sum(r.prompt_tokens >= cap.max_req_input_len for r in q.base.requests)
        return (f"context too long: {too_long} of {len(q.base.requests)} prompts (the longest "
                f"{longest} tokens) reach SGLang's limit of {cap.max_req_input_len} tokens "
                f"(context {cap.context_len}, KV pool {cap.max_total_num_tokens} tokens on "
                f"{cand.tp}x {cand.gpu}); SGLang would reject them")
    return None


@dataclass
class Runner:
    """Simulations of one candidate; capacity and step-time tables are built once."""

    cand: Candidate
    q: Question
    seed: int = 0
    _kinds: object = None
    _step_time: object = None
    runs: list = field(default_factory=list)  # the scales simulated, in order
    backend: str | None = None  # the step-time backend the runs used

    def simulate(self, scale: float, write_to=None):
        """The records of the question's workload at `scale` (and its results written to
        `write_to` if given); returns (records, summary)."""
        self.runs.append(scale)
        workload = self.q.at(scale)
        slo = _legacy_slo(self.q.slos)
        if self.cand.replicas == 1:
            from twin.sim import simulate, step_time_for

            cfg = sim_config(self.cand)
            if self._step_time is None:
                self._step_time = step_time_for(cfg, derive_capacity(cfg.args, cfg.gpu))
            res = simulate(workload, cfg, slo, step_time=self._step_time)
            self.backend = res.backend
        else:
            from twin.fleet import Kinds, parse_spec, simulate_fleet

            self._kinds = self._kinds or Kinds()
            spec = parse_spec(fleet_doc(self.cand, self.seed), f"<candidate {self.cand.id}>")
            res = simulate_fleet(spec, workload, slo, kinds=self._kinds)
            self.backend = ",".join(sorted({k[2] for k in self._kinds.cache.values()}))
        if write_to is not None:
            res.write(write_to)
        return res.records, res.summary


def _legacy_slo(slos: tuple[Slo, ...]):
    """The thresholds as twin.metrics.SLO (the summary's attainment line), first of each."""
    from twin.metrics import SLO

    first = {}
    for s in slos:
        first.setdefault(s.metric, s.threshold_s)
    return SLO(first.get("ttft"), first.get("tpot"), first.get("e2e"))


def measure(records, summary: dict, slos: tuple[Slo, ...]) -> dict:
    """The contract's `at_target` numbers for one run, and each SLO's achieved share."""
    recs = list(records)
    per_slo, all_met = {}, [True] * len(recs)
    for s in slos:
        covered = [i for i, r in enumerate(recs) if s.covers(r)]
        good = 0
        for i in covered:
            if s.met_by(recs[i]):
                good += 1
            else:
                all_met[i] = False
        share = good / len(covered) if covered else 1.0
        per_slo[s.name] = {"share": share, "needs": s.share, "covered": len(covered),
                           "meets": share >= s.share - 1e-12,
                           "value_s": _rank_value(s, [recs[i] for i in covered])}
    dur = summary["duration_s"] or 0.0
    ok = summary["status"]["ok"]

    def pct(metric: str, p: str):
        return summary[f"{metric}_s"][p]

    return {"ttft_p50_s": pct("ttft", "p50"), "ttft_p99_s": pct("ttft", "p99"),
            "tpot_p50_s": pct("tpot", "p50"), "tpot_p99_s": pct("tpot", "p99"),
            "e2e_p99_s": pct("e2e", "p99"),
            "throughput_rps": ok / dur if dur else None,
            "goodput_rps": sum(all_met) / dur if dur else None,
            "slo_attainment": sum(all_met) / len(recs) if recs else None,
            "meets_slo": all(v["meets"] for v in per_slo.values()),
            "slos": per_slo, "requests": len(recs), "status": dict(summary["status"])}


def _rank_value(s: Slo, covered: list[dict]) -> float | None:
    """The covered requests' metric at the SLO's share, by nearest rank (a request that
    did not finish ok counts as infinite): the SLO holds exactly when this is within the
    threshold. None when that rank falls on an unfinished request (or nothing is covered)."""
    if not covered:
        return None
    vals = sorted(math.inf if r["status"] != "ok" else (r[f"{s.metric}_s"] or 0.0)
                  for r in covered)
    v = vals[max(0, math.ceil(s.share * len(vals) - 1e-9) - 1)]
    return None if math.isinf(v) else v


def search(runner: Runner, precision: float, guess: float | None = None) -> dict:
    """The largest scale meeting every SLO (within `precision`) and the metrics at the
    target; every simulated load is listed under `evaluations`. `guess` (a scale, e.g. the
    same hardware's boundary with one replica fewer, scaled) is tried first with its
    neighbour one precision step away: a good guess brackets the boundary in two runs."""
    q, t = runner.q, runner.q.target_scale
    step = 1 + precision
    cache: dict[float, dict] = {}

    def meets(scale: float) -> bool:
        if scale not in cache:
            records, summary = runner.simulate(scale)
            cache[scale] = measure(records, summary, q.slos)
        return cache[scale]["meets_slo"]

    meets(t)
    if guess is not None and t * FLOOR_FACTOR < guess < t * MAX_FACTOR:
        _gallop(meets, cache, guess, step, t * FLOOR_FACTOR, t * MAX_FACTOR)
    lo, hi = _bracket(cache)
    capped = False
    while hi is None:  # every load so far meets: double up
        if lo * 2 > t * MAX_FACTOR:
            capped = True
            break
        meets(lo * 2)
        lo, hi = _bracket(cache)
    if lo is None:  # the floor: below it a candidate has no sustainable load
        meets(min(t * FLOOR_FACTOR, hi / step))
        lo, hi = _bracket(cache)
    while lo is not None and hi is not None and hi / lo > step * (1 + 1e-9):
        meets(math.sqrt(lo * hi))
        lo, hi = _bracket(cache)
    evals = [{"scale": s, "rps": s * q.base_rps, "meets_slo": m["meets_slo"],
              "ttft_p99_s": m["ttft_p99_s"], "slo_attainment": m["slo_attainment"]}
             for s, m in sorted(cache.items())]
    return {"max_load": {"scale": lo, "rps": None if lo is None else lo * q.base_rps},
            "fails_at": {"scale": hi, "rps": None if hi is None else hi * q.base_rps},
            "max_load_bound": "at least (search capped)" if capped else (
                f"below {FLOOR_FACTOR:g} of the target" if lo is None else
                f"within {precision:.0%}: {hi * q.base_rps:.6g} rps fails"),
            "at_target": {**cache[t], "backend": runner.backend}, "evaluations": evals}


def _gallop(meets, cache: dict, guess: float, step: float, floor: float, cap: float) -> None:
    """From `guess`, steps of 1, 2, 4, ... precision steps away from it (up while the SLOs
    hold, down while they fail) until the answer changes or the known bracket is reached."""
    up, x, k = meets(guess), guess, 1
    while True:
        nxt = x * step**k if up else x / step**k
        lo, hi = _bracket(cache)
        if not floor <= nxt <= cap or (up and hi is not None and nxt >= hi) or (
                not up and lo is not None and nxt <= lo):
            return
        if meets(nxt) != up:
            return
        x, k = nxt, 2 * k


def _bracket(cache: dict[float, dict]) -> tuple[float | None, float | None]:
    """(the largest passing load below the smallest failing one, that failing load)."""
    fails = [s for s, m in cache.items() if not m["meets_slo"]]
    hi = min(fails, default=None)
    passes = [s for s, m in cache.items() if m["meets_slo"] and (hi is None or s < hi)]
    return max(passes, default=None), hi
