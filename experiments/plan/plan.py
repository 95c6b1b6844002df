"""A whole plan: candidates searched, costed and ranked; the winner, the Pareto fronts, the
ramp; plan.json, the best candidates' runs, winner.txt and the report (docs/what-if.md).

The winner is the cheapest candidate (GPU-hours at the price table) that meets every SLO at
the target load; ties go to the larger headroom, then the lower id. With the default space
(no --space) a second stage tries every policy of the registry (but `learned`, which needs
a weight file) on the winner's hardware, or, with no winner, on the candidate closest to the
SLOs (the lowest P99 TTFT at the target).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.plan import commands
from experiments.plan.question import Question, WorkloadSource
from experiments.plan.ramp import analyse, ramp_workload
from experiments.plan.run import (
    Executor,
    Progress,
    Store,
    question_key,
    rounded,
    run_candidates,
    write_artifacts,
)
from experiments.plan.space import Candidate, Space
from twin.outputs import atomic_write_text

BEST_FEW = 5


@dataclass(frozen=True)
class PlanSettings:
    out: Path
    jobs: int = 1
    ray: str | None = None
    prices: dict | None = None  # gpu: usd per GPU-hour
    price_source: str = ""
    refine_policies: bool = False
    ramp_step_s: float = 60.0
    window_s: float = 60.0
    ramp: bool = True
    report: bool = True  # report.html (experiments/report/plan_page.py)
    quiet: bool = False


def cost_of(cand: Candidate, prices: dict) -> float:
    return cand.gpus * prices[cand.gpu]


def winner_of(results: list[dict]) -> dict | None:
    ok = [r for r in results if r["status"] == "ok" and r["at_target"]["meets_slo"]]
    return min(ok, key=lambda r: (r["cost_per_hour"], -(r.get("headroom") or 0), r["id"]),
               default=None)


def closest(results: list[dict]) -> dict | None:
    """The candidate nearest to the SLOs: highest attainment, then lowest P99 TTFT, cost."""
    ok = [r for r in results if r["status"] == "ok" and r["at_target"]["ttft_p99_s"]
          is not None]
    return min(ok, key=lambda r: (-r["at_target"]["slo_attainment"],
                                  r["at_target"]["ttft_p99_s"], r["cost_per_hour"], r["id"]),
               default=None)


def pareto(results: list[dict], value, maximize: bool) -> list[str]:
    """Ids not dominated in (cost lower, value better), by cost."""
    pts = sorted((r["cost_per_hour"], -value(r) if maximize else value(r), r["id"])
                  for r in results if r["status"] == "ok" and value(r) is not None)
    front, best = [], None
    for _cost, v, rid in pts:
        if best is None or v < best:
            front.append(rid)
            best = v
    return front


def _best_text(prices: dict):
    def best(results: dict) -> str:
        w = winner_of(list(_costed(results, prices).values()))
        return f"{w['id']} {w['label']} ${w['cost_per_hour']:.2f}/h" if w else "none meets"
    return best


def _costed(results: dict, prices: dict) -> dict:
    out = {}
    for k, r in results.items():
        c = _cand(r)
        out[k] = {**r, "cost_per_hour": cost_of(c, prices)}
    return out


def _cand(r: dict) -> Candidate:
    c = r["config"]
    return Candidate(r["id"], c["gpu"], c["tp"], c["replicas"], c["model"], c["quantization"],
                     tuple(sorted(c["server_args"].items())), c["policy"], c["kv_allocator"],
                     c["router"], c.get("step_time_backend"))


def refine(results: dict, cands: list[Candidate], prices: dict) -> tuple[list, float | None]:
    """Every other registry policy on the winner's (or the closest candidate's) hardware,
    and that candidate's boundary as their first guess."""
    from twin.policy import policy_names

    rows = list(_costed(results, prices).values())
    base = winner_of(rows) or closest(rows)
    if base is None:
        return [], None
    c = _cand(base)
    have = {x.key() for x in cands}
    out = []
    for pol in policy_names():
        if pol == "learned":
            continue
        new = replace(c, id=f"c{len(cands) + len(out) + 1:04d}", policy=pol)
        if new.key() not in have:
            out.append(new)
    return out, (base.get("max_load") or {}).get("scale")


def run_plan(q: Question, source: WorkloadSource, space: Space, s: PlanSettings) -> dict:
    out = s.out
    out.mkdir(parents=True, exist_ok=True)
    cands = space.candidates()
    store = Store(out, question_key(q))
    store.open()
    ex = Executor(s.jobs, s.ray)
    interrupted = True
    try:
        best = _best_text(s.prices)
        progress = Progress(len(cands), s.quiet)
        results = run_candidates(cands, q, store, ex, progress, best)
        if s.refine_policies:
            more, guess = refine(results, cands, s.prices)
            progress.total += len(more)
            results.update(run_candidates(more, q, store, ex, progress, best, guess))
            cands += more
        progress.close()
        plan = assemble(q, cands, results, s)
        _artifacts(q, plan, cands, ex, s)
        interrupted = False
    finally:
        ex.close(interrupted)
    if s.ramp:
        plan["ramp"] = _ramp(q, source, plan, cands, s)
    _write(plan, cands, q, s)
    if s.report:
        _report(s)
    return plan


def _report(s: PlanSettings) -> None:
    try:
        from experiments.report.plan_page import write_plan_report
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("experiments.report"):
            raise
        print("servetwin plan: report.html skipped: experiments/report/plan_page.py is not "
              "there yet (the report module)", file=sys.stderr)
        return
    write_plan_report(s.out)


def assemble(q: Question, cands: list[Candidate], results: dict, s: PlanSettings) -> dict:
    rows = []
    target = q.target_rps
    for c in cands:
        r = results[c.id]
        ml = r["max_load"]
        row = {"id": c.id, "label": c.label, "config": c.config(), "status": r["status"],
               "reason": r["reason"], "gpus": c.gpus, "cost_per_hour": cost_of(c, s.prices),
               "max_load": ml or {"scale": None, "rps": None},
               "max_load_bound": r.get("max_load_bound"), "fails_at": r.get("fails_at"),
               "at_target": r["at_target"], "evaluations": r["evaluations"],
               "headroom": (ml["rps"] / target - 1) if ml and ml["rps"] is not None else None,
               "artifacts": None,
               "simulate_command": commands.simulate_command(q, c, s.out),
               "launch_command": None if r["status"] == "infeasible" else
               commands.launch_command(c)}
        rows.append(row)
    win = winner_of(rows)
    near = closest(rows)
    plan = {"version": 1, "question": q.to_json(),
            "prices": {**s.prices, "source": s.price_source},
            "candidates": rows, "winner": win["id"] if win else None,
            "closest": None if win or not near else near["id"],
            "pareto": {"cost_vs_ttft_p99": pareto(rows, lambda r: r["at_target"]["ttft_p99_s"],
                                                  False),
                       "cost_vs_goodput": pareto(rows, lambda r: r["at_target"]["goodput_rps"],
                                                 True)},
            "counts": {k: sum(r["status"] == k for r in rows) for k in
                       ("ok", "infeasible", "error")},
            "ramp": None}
    plan["counts"]["meet_slo"] = sum(r["status"] == "ok" and r["at_target"]["meets_slo"]
                                     for r in rows)
    return plan


def best_few(plan: dict) -> list[str]:
    """The winner and the best few at the target: the cheapest meeting the SLOs, then the
    closest to them."""
    ok = [r for r in plan["candidates"] if r["status"] == "ok"]
    ranked = sorted(ok, key=lambda r: (not r["at_target"]["meets_slo"],
                                       r["cost_per_hour"] if r["at_target"]["meets_slo"] else
                                       -r["at_target"]["slo_attainment"],
                                       r["at_target"]["ttft_p99_s"] or 0, r["id"]))
    ids = [r["id"] for r in ranked[:BEST_FEW]]
    if plan["winner"] and plan["winner"] not in ids:
        ids.insert(0, plan["winner"])
    return ids


def _artifacts(q: Question, plan: dict, cands: list[Candidate], ex: Executor,
               s: PlanSettings) -> None:
    by_id = {c.id: c for c in cands}
    ids = best_few(plan)
    items = [(by_id[i], q, str(s.out / "candidates" / i)) for i in ids]
    ex.map(write_artifacts, items, lambda item, res: None)
    for row in plan["candidates"]:
        if row["id"] in ids:
            row["artifacts"] = f"candidates/{row['id']}"


def _ramp(q: Question, source: WorkloadSource, plan: dict, cands: list[Candidate],
          s: PlanSettings) -> dict | None:
    rid = plan["winner"] or plan["closest"]
    if rid is None:
        return None
    from experiments.plan.evaluate import Runner

    cand = next(c for c in cands if c.id == rid)
    w = ramp_workload(q, source, s.ramp_step_s)
    rq = replace(q, base=w)
    if not s.quiet:
        print(f"ramp: {len(w.requests)} requests, 25-200 % of {q.target_rps:.4g} requests/s "
              f"in steps of {s.ramp_step_s:g} s on {rid} {cand.label}", file=sys.stderr)
    records, _ = Runner(cand, rq, q.seed).simulate(1.0, write_to=s.out / "ramp")
    return {"candidate": rid, **analyse(records, q, s.ramp_step_s, s.window_s)}


def _write(plan: dict, cands: list[Candidate], q: Question, s: PlanSettings) -> None:
    commands.write_workload(q, s.out)
    for c in cands:
        if c.replicas > 1:
            commands.write_deployment(s.out, c, q.seed)
    atomic_write_text(s.out / "plan.json", json.dumps(rounded(plan), indent=1, sort_keys=True)
                      + "\n")
    rid = plan["winner"] or plan["closest"]
    row = next((r for r in plan["candidates"] if r["id"] == rid), None)
    if row is None:
        text = "no candidate ran: see plan.json for every candidate's reason\n"
    else:
        head = ("winner" if plan["winner"] else "no candidate meets every SLO; the closest")
        text = (f"# {head}: {row['id']} {row['label']} (${row['cost_per_hour']:.2f}/h)\n"
                f"# the twin at the target load:\n{row['simulate_command']}\n"
                f"# the real deployment:\n{row['launch_command']}\n")
    atomic_write_text(s.out / "winner.txt", text)
