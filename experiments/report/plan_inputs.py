"""`plan.json` read and checked against the plan output contract (docs/reports.md): every
key the plan report draws, with an error naming the file and the key's path."""

from __future__ import annotations

from pathlib import Path

from experiments.report.inputs import ReportInputError, read_json

_CANDIDATE = {"id": str, "label": str, "config": dict, "status": str, "gpus": int,
              "cost_per_hour": (int, float), "max_load": dict}
_AT_TARGET = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p99_s",
              "throughput_rps", "goodput_rps", "slo_attainment", "meets_slo")
STATUSES = ("ok", "infeasible", "error")


def read_plan(plan_dir: Path) -> dict:
    path = Path(plan_dir) / "plan.json"
    if not path.is_file():
        raise ReportInputError(f"{path}: missing (a `servetwin plan --out` directory has "
                               "plan.json)")
    plan = read_json(path)
    _check(plan, path)
    return plan


def _fail(path: Path, key: str, problem: str) -> ReportInputError:
    return ReportInputError(f"{path}: key {key!r}: {problem}")


def _get(obj: dict, key: str, kind, path: Path, where: str, nullable: bool = False):
    name = f"{where}.{key}" if where else key
    if key not in obj:
        raise _fail(path, name, "missing")
    value = obj[key]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)):
        raise _fail(path, name, f"{value!r} is not a {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise _fail(path, name, f"{value!r} is not a {_kind_name(kind)}")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "JSON object", list: "list", str: "string", int: "integer",
             float: "number", bool: "boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _check(plan: dict, path: Path) -> None:
    version = _get(plan, "version", int, path, "")
    if version != 1:
        raise _fail(path, "version", f"{version} is not a version this report reads (1)")
    question = _get(plan, "question", dict, path, "")
    for n, slo in enumerate(_get(question, "slos", list, path, "question")):
        where = f"question.slos[{n}]"
        if not isinstance(slo, dict):
            raise _fail(path, where, "not a JSON object")
        _get(slo, "metric", str, path, where)
        _get(slo, "stat", str, path, where)
        _get(slo, "threshold_s", (int, float), path, where)
    _get(_get(question, "target", dict, path, "question"), "rps", (int, float), path,
         "question.target")
    ids = []
    for n, cand in enumerate(_get(plan, "candidates", list, path, "")):
        ids.append(_check_candidate(cand, path, f"candidates[{n}]"))
    winner = _get(plan, "winner", str, path, "", nullable=True)
    if winner is not None and winner not in ids:
        raise _fail(path, "winner", f"{winner!r} is not a candidate id")
    pareto = _get(plan, "pareto", dict, path, "")
    for key in ("cost_vs_ttft_p99", "cost_vs_goodput"):
        for cid in _get(pareto, key, list, path, "pareto"):
            if cid not in ids:
                raise _fail(path, f"pareto.{key}", f"{cid!r} is not a candidate id")
    ramp = _get(plan, "ramp", dict, path, "", nullable=True)
    if ramp is not None:
        _check_ramp(ramp, path)


def _check_candidate(cand: object, path: Path, where: str) -> str:
    if not isinstance(cand, dict):
        raise _fail(path, where, "not a JSON object")
    for key, kind in _CANDIDATE.items():
        _get(cand, key, kind, path, where)
    if cand["status"] not in STATUSES:
        raise _fail(path, f"{where}.status", f"{cand['status']!r} is not one of "
                    + ", ".join(STATUSES))
    _get(cand, "reason", str, path, where, nullable=True)
    for key in ("scale", "rps"):
        _get(cand["max_load"], key, (int, float), path, f"{where}.max_load", nullable=True)
    at = _get(cand, "at_target", dict, path, where, nullable=True)
    if at is not None:
        for key in _AT_TARGET:
            _get(at, key, bool if key == "meets_slo" else (int, float), path,
                 f"{where}.at_target", nullable=key != "meets_slo")
    _get(cand, "headroom", (int, float), path, where, nullable=True)
    _get(cand, "artifacts", str, path, where, nullable=True)
    return cand["id"]


def _check_ramp(ramp: dict, path: Path) -> None:
    _get(ramp, "candidate", str, path, "ramp")
    _get(ramp, "slo_s", (int, float), path, "ramp")
    for n, step in enumerate(_get(ramp, "steps", list, path, "ramp")):
        where = f"ramp.steps[{n}]"
        if not isinstance(step, dict):
            raise _fail(path, where, "not a JSON object")
        for key in ("load_pct", "rps", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s"):
            _get(step, key, (int, float), path, where, nullable=key != "load_pct")
        _get(step, "meets", dict, path, where)
    _get(ramp, "first_break", dict, path, "ramp")
    for key, fields in (("windows", ("start_s", "end_s")), ("alerts", ("start_s",))):
        for n, item in enumerate(_get(ramp, key, list, path, "ramp")):
            where = f"ramp.{key}[{n}]"
            if not isinstance(item, dict):
                raise _fail(path, where, "not a JSON object")
            for f in fields:
                _get(item, f, (int, float), path, where)
