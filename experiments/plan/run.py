"""Running a plan: every candidate's search, serial, over local processes or on Ray, with a
progress line, resumable from the output directory, then plan.json and its files.

Each finished candidate is written to `DIR/candidates/<id>.json` at once. A rerun with the
same question skips them; with another question (`DIR/question.json` differs) or another
candidate under the same id it refuses, naming the difference. Results are ordered by
candidate id, so a serial and a parallel run write byte-identical plan.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.plan.evaluate import Runner, infeasible_reason, search
from experiments.plan.question import Question, WorkloadSource
from experiments.plan.space import Candidate
from twin.errors import ConfigError, ServetwinError
from twin.outputs import atomic_write_text


def evaluate_group(cands: list[Candidate], q: Question, guess: float | None = None) -> list:
    """The searches of candidates that differ only in their replica count, fewest first
    (runs in a worker): each one's boundary, scaled by the replica ratio, is the next one's
    first guess."""
    out, prev = [], None
    for c in cands:
        if prev is not None:
            ml = (prev[1].get("max_load") or {}).get("scale")
            guess = None if ml is None else ml * c.replicas / prev[0].replicas
        result = evaluate_candidate(c, q, guess)
        out.append(result)
        prev = (c, result)
    return out


def group_key(c: Candidate) -> tuple:
    return tuple(x for i, x in enumerate(c.key()) if i != 2)  # all but the replica count


def groups(cands: list[Candidate]) -> list[list[Candidate]]:
    """Candidates by everything but the replica count (a single replica carries the
    space's first router, so it heads that router's group)."""
    by: dict[tuple, list[Candidate]] = {}
    for c in cands:
        by.setdefault(group_key(c), []).append(c)
    return [sorted(g, key=lambda c: (c.replicas, c.id)) for g in by.values()]


def evaluate_candidate(cand: Candidate, q: Question, guess: float | None = None) -> dict:
    """The search for one candidate: status, reason, search results."""
    t0 = time.process_time()
    out = {"id": cand.id, "label": cand.label, "config": cand.config(), "gpus": cand.gpus}
    reason = infeasible_reason(cand, q)
    if reason is not None:
        return {**out, "status": "infeasible", "reason": reason, "max_load": None,
                "at_target": None, "evaluations": [], "cpu_s": time.process_time() - t0}
    try:
        found = search(Runner(cand, q, q.seed), q.precision, guess)
    except Exception as exc:  # noqa: BLE001 - one candidate's failure is its result
        why = str(exc) if isinstance(exc, ServetwinError) else f"{type(exc).__name__}: {exc}"
        return {**out, "status": "error", "reason": why, "max_load": None,
                "at_target": None, "evaluations": [], "cpu_s": time.process_time() - t0}
    return {**out, "status": "ok", "reason": None, **found,
            "cpu_s": time.process_time() - t0}


def write_artifacts(cand: Candidate, q: Question, where: str) -> str:
    """The candidate's run at the target load, written as `servetwin simulate --out` does."""
    Runner(cand, q, q.seed).simulate(q.target_scale, write_to=Path(where))
    return cand.id


def question_key(q: Question) -> dict:
    """What makes two plans the same question (the workload's requests by digest)."""
    h = hashlib.sha256()
    for r in q.base.requests:
        h.update(repr((r.rid, r.arrival_s, r.segments, r.output_tokens, r.priority)).encode())
    return {**q.to_json(), "workload_sha256": h.hexdigest()}


def first_difference(a, b, at: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{at}{k}"
            d = first_difference(a[k], b[k], f"{at}{k}.")
            if d:
                return d
        return None
    return None if a == b else at.rstrip(".") or "<value>"


@dataclass
class Progress:
    """candidates done/total, best so far and ETA, one line on stderr."""

    total: int
    quiet: bool = False
    done: int = 0
    skipped: int = 0
    best: str = "-"

    def __post_init__(self) -> None:
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, result: dict, best: str, resumed: bool = False) -> None:
        self.done += 1
        self.skipped += resumed
        self.best = best
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self.last < 10 and self.done < self.total):
            return
        self.last = now
        ran = self.done - self.skipped
        eta = (now - self.start) / ran * (self.total - self.done) if ran else 0.0
        bar = "#" * int(24 * self.done / max(self.total, 1))
        text = (f"[{bar:24s}] {self.done}/{self.total} candidates"
                + (f" ({self.skipped} resumed)" if self.skipped else "")
                + f", best so far: {best}, ETA {_mmss(eta)}")
        print("\r" + text[:160] if self.tty else text, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet and self.done:
            print(file=sys.stderr)


def _mmss(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


class Executor:
    """Runs `fn(cand, q, ...)` for many candidates: in this process (jobs 1), in a process
    pool (forkserver: no state shared with the parent), or as Ray tasks."""

    def __init__(self, jobs: int, ray_address: str | None = None) -> None:
        self.jobs, self.ray_address, self.pool, self.ray = jobs, ray_address, None, None
        self.own_ray = False  # a Ray this run started ("local"), shut down with it
        if ray_address:
            try:
                import ray
            except ModuleNotFoundError:
                raise ConfigError("--ray: the ray package is not installed; install the "
                                  "extra: pip install 'servetwin[ray]'") from None
            if not ray.is_initialized():
                if ray_address == "local":  # a Ray of our own, on loopback only
                    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False,
                             log_to_driver=False)
                    self.own_ray = True
                else:
                    ray.init(address=ray_address, include_dashboard=False,
                             log_to_driver=False)
            self.ray = ray
        elif jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context(
                "forkserver"))

    def map(self, fn: Callable, items: list[tuple], on_done: Callable) -> None:
        """`on_done(item, result)` as each finishes (any order)."""
        if self.ray is not None:
            remote = self.ray.remote(fn)
            refs = {remote.remote(*item): item for item in items}
            pending = list(refs)
            while pending:
                ready, pending = self.ray.wait(pending, num_returns=1)
                on_done(refs[ready[0]], self.ray.get(ready[0]))
        elif self.pool is not None:
            from concurrent.futures import as_completed

            futures = {self.pool.submit(fn, *item): item for item in items}
            for fut in as_completed(futures):
                on_done(futures[fut], fut.result())
        else:
            for item in items:
                on_done(item, fn(*item))

    def close(self, interrupted: bool = False) -> None:
        """Wait for the workers; on an interrupt stop them (finished candidates are kept)."""
        if self.own_ray:
            self.ray.shutdown()
            self.own_ray = False
        if self.pool is None:
            return
        if interrupted:
            procs = list(getattr(self.pool, "_processes", {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.terminate()
        else:
            self.pool.shutdown()


@dataclass
class Store:
    """`DIR/question.json` and `DIR/candidates/<id>.json`."""

    out: Path
    key: dict

    def open(self) -> None:
        (self.out / "candidates").mkdir(parents=True, exist_ok=True)
        path = self.out / "question.json"
        if path.is_file():
            old = json.loads(path.read_text())
            diff = first_difference(old, self.key)
            if diff:
                raise ConfigError(
                    f"--out {self.out}: holds a plan of another question ({diff}: "
                    f"{_at(old, diff)!r} there, {_at(self.key, diff)!r} now); give a new "
                    "--out directory, or delete that one to start over")
        else:
            atomic_write_text(path, _dumps(self.key))

    def done(self, cand: Candidate) -> dict | None:
        path = self.out / "candidates" / f"{cand.id}.json"
        if not path.is_file():
            return None
        result = json.loads(path.read_text())
        if result["config"] != json.loads(json.dumps(cand.config())):
            raise ConfigError(
                f"--out {self.out}: candidate {cand.id} there is {result['label']!r}, now it "
                f"is {cand.label!r}: the search space changed; give a new --out directory")
        return result

    def save(self, result: dict) -> None:
        atomic_write_text(self.out / "candidates" / f"{result['id']}.json", _dumps(result))


def _at(d, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _dumps(obj) -> str:
    return json.dumps(rounded(obj), indent=1, sort_keys=True) + "\n"


def rounded(obj):
    """Floats to 6 significant... digits after the point (the contract's rounding)."""
    if isinstance(obj, float):
        return round(obj, 6)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [rounded(v) for v in obj]
    return obj


def run_candidates(cands: list[Candidate], q: Question, store: Store, ex: Executor,
                   progress: Progress, best: Callable[[dict], str],
                   guess: float | None = None) -> dict[str, dict]:
    """Every candidate's result by id: resumed from `store`, or evaluated (a group of
    replica counts per task) and saved."""
    results: dict[str, dict] = {}
    todo = []
    for group in groups(cands):
        prior = [store.done(c) for c in group]
        if all(p is not None for p in prior):
            for p in prior:
                results[p["id"]] = p
                progress.update(p, best(results), resumed=True)
        else:
            todo.append((group, q, guess))

    def done(item, group_results: list) -> None:
        for result in group_results:
            result = json.loads(_dumps(result))  # as it will be read back on resume
            store.save(result)
            results[result["id"]] = result
            progress.update(result, best(results))

    ex.map(evaluate_group, todo, done)
    return {k: results[k] for k in sorted(results)}


def default_jobs() -> int:
    return os.cpu_count() or 1


__all__ = ["Executor", "Progress", "Store", "WorkloadSource", "default_jobs",
           "evaluate_candidate", "evaluate_group", "question_key", "run_candidates",
           "write_artifacts"]
