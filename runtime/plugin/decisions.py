"""The decision log: one JSON line per decision, shared by the plugin's writer and
`servetwin live decisions`' reader. Pure: no SGLang, no clock, no pickle.

Line kinds (each a JSON object with `"kind"`):
- `header` (first line): the policy spec, the server settings it was built with, whether
  the policy ran natively (SGLang's own sort, only logged), the clock and the budget;
- `decision`: `snapshot` (every `Snapshot` and `RequestView` field), `plan` (`order`,
  `victims`; null when the policy raised), `outcome` (`applied`, `native`, `raised`,
  `invalid`), `slow` / `us` (the decision's duration) and, for a preempt question asked
  because a request found no KV room, `"cause": "kv"`. A chunk question's line
  (`"question": "chunk"`) also has the `chunked` request's view, the `budget` and
  `page_size` it was asked with and `first` (a prompt's first chunk); its `plan` is
  `{limit, park}`;
- `counters`: the plugin's counters at that moment (written on every fallback).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from twin.policy.base import ChunkPlan, Plan, RequestView, Snapshot

VERSION = 1
_VIEW_FIELDS = tuple(f.name for f in fields(RequestView))
_SNAP_SCALARS = tuple(f.name for f in fields(Snapshot) if f.name not in ("waiting", "running"))


def view_to_json(v: RequestView) -> dict[str, Any]:
    out = {name: getattr(v, name) for name in _VIEW_FIELDS}
    out["prefix_path"] = list(v.prefix_path)
    return out


def view_from_json(d: dict[str, Any]) -> RequestView:
    kw = {k: d[k] for k in _VIEW_FIELDS if k in d}
    kw["prefix_path"] = tuple(d.get("prefix_path", ()))
    return RequestView(**kw)


def snapshot_to_json(s: Snapshot) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(s, name) for name in _SNAP_SCALARS}
    out["waiting"] = [view_to_json(v) for v in s.waiting]
    out["running"] = [view_to_json(v) for v in s.running]
    return out


def snapshot_from_json(d: dict[str, Any]) -> Snapshot:
    kw = {k: d[k] for k in _SNAP_SCALARS if k in d}
    return Snapshot(waiting=tuple(view_from_json(v) for v in d["waiting"]),
                    running=tuple(view_from_json(v) for v in d["running"]), **kw)


def plan_to_json(p: Plan | None) -> dict[str, Any] | None:
    if p is None:
        return None
    out = {"order": None if p.order is None else list(p.order), "victims": list(p.victims)}
    if p.admit is not None:
        out["admit"] = p.admit
    return out


def plan_from_json(d: dict[str, Any] | None) -> Plan | None:
    if d is None:
        return None
    order = d.get("order")
    return Plan(order=None if order is None else tuple(order),
                victims=tuple(d.get("victims", ())), admit=d.get("admit"))


def header_line(spec: dict, policy_args: dict, server: dict, native: bool,
                budget_ms: float) -> str:
    """`policy_args` are the server settings `build_policy` got (priority scheduling, ...);
    `server` what else the plugin knows of the server (its own --schedule-policy, TP rank)."""
    return json.dumps({"kind": "header", "version": VERSION, "spec": spec,
                       "policy_args": policy_args, "server": server, "native": native,
                       "clock": "time.perf_counter", "budget_ms": budget_ms})


def decision_line(snap: Snapshot, plan: Plan | None, outcome: str, us: float,
                  slow: bool, cause: str | None = None) -> str:
    """`cause`: why a preempt question was asked, "kv" when a request found no KV room
    (the users' design), absent for SGLang's own question (no request slot left)."""
    line = {"kind": "decision", "question": snap.question,
            "snapshot": snapshot_to_json(snap), "plan": plan_to_json(plan),
            "outcome": outcome, "us": round(us, 1), "slow": slow}
    if cause is not None:
        line["cause"] = cause
    return json.dumps(line)


def chunk_line(snap: Snapshot, chunked: RequestView, budget: int, page_size: int,
               plan: ChunkPlan | None, outcome: str, us: float, slow: bool,
               first: bool) -> str:
    """A chunk question and its answer (`plan` None when the policy raised, or answered
    something that is not a `ChunkPlan` of whole numbers)."""
    ok = (isinstance(plan, ChunkPlan) and isinstance(plan.park, int)
          and (plan.limit is None or isinstance(plan.limit, int)))
    return json.dumps({"kind": "decision", "question": "chunk",
                       "snapshot": snapshot_to_json(snap), "chunked": view_to_json(chunked),
                       "budget": budget, "page_size": page_size, "first": first,
                       "plan": {"limit": plan.limit, "park": plan.park} if ok else None,
                       "outcome": outcome, "us": round(us, 1), "slow": slow})


def chunk_plan_from_json(d: dict[str, Any] | None) -> ChunkPlan | None:
    return None if d is None else ChunkPlan(limit=d.get("limit"), park=d.get("park", 0))


def read_lines(path: Path | str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from None


def same_decision(question: str, a: Plan | None, b: Plan | None) -> bool:
    """Identical answers: the same order (and the same admission limit); for preemption the same set of victims (SGLang
    releases them as a set, so their order does not change what happens)."""
    if a is None or b is None:
        return a is b
    if question == "chunk":
        return isinstance(b, ChunkPlan) and (a.limit, a.park) == (b.limit, b.park)
    if question == "order":
        return a.order == b.order and a.admit == b.admit
    return sorted(a.victims) == sorted(b.victims)


@dataclass
class Agreement:
    decisions: int = 0
    identical: int = 0
    skipped: int = 0  # logged without a plan (the live policy raised)
    #: the first few (line number, question, logged plan, the twin's plan or None: it raised)
    disagreements: list[tuple[int, str, Plan, Plan | None]] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.identical / self.decisions if self.decisions else 1.0


def replay(lines: Iterable[dict[str, Any]], policy, keep: int = 5) -> Agreement:
    """Ask `policy` every logged snapshot (its order or preempt question, or a chunk
    question with the logged chunked request) and compare with the logged answer."""
    out = Agreement()
    for number, d in enumerate(lines, 1):
        if d.get("kind") != "decision":
            continue
        chunk = d.get("question") == "chunk"
        logged = (chunk_plan_from_json if chunk else plan_from_json)(d["plan"])
        if logged is None:
            out.skipped += 1
            continue
        snap = snapshot_from_json(d["snapshot"])
        question = "chunk" if chunk else snap.question
        try:
            if chunk:
                ours = policy.chunk(snap, view_from_json(d["chunked"]), d["budget"],
                                    d["page_size"])
            else:
                ours = policy.decide(snap)
        except Exception:  # the twin's policy failing is a disagreement, not a crash
            ours = None
        out.decisions += 1
        if same_decision(question, logged, ours):
            out.identical += 1
        elif len(out.disagreements) < keep:
            out.disagreements.append((number, question, logged, ours))
    return out


def policy_from_header(header: dict[str, Any]):
    """The twin's policy as the live plugin built it (spec plus server settings)."""
    from twin.policy.registry import build_policy, spec_from_dict

    if header.get("kind") != "header":
        raise ValueError("the decision log does not start with a header line")
    spec = spec_from_dict(header["spec"], "decision log header")
    return build_policy(spec, **header.get("policy_args", {}))
