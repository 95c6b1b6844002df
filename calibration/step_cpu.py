"""The scheduler's CPU work per decode step of a live SGLang server, from its step probe
(runtime/plugin/step_probe.py), fitted as `per_step_s + per_request_s x batch`: the
`StepCpu` the roofline and opdb backends charge (twin/perf/step_cpu.py; `simulate
--step-cpu FILE`, a fleet replica's `twin: {step_cpu: FILE}`).

For each batch size B, B streamed requests with fixed lengths (`ignore_eos`) are sent at
once; the decode steps that ran all B (within 2 %) are kept and their median CPU time per
step, the model's forward and sampling taken out, is one point. `sweep` runs the sizes
`rounds` times, interleaved, so that a busy spell of a shared machine does not fall on one
size only.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np

PHASES = ("ingest", "sched", "run", "proc")  # the loop's phases
COMPUTE = ("fwd", "sample")  # the model's own work inside run_batch


def step_cpu(rec: dict, clock: int) -> float:
    """Seconds of the loop's CPU work in one step, the model's compute taken out
    (clock 0: wall, 1: the scheduler thread's CPU time)."""
    total = sum(rec[p][clock] for p in PHASES if p in rec)
    return (total - sum(rec[c][clock] for c in COMPUTE if c in rec)) / 1e9


def parts(rec: dict, clock: int) -> dict[str, float]:
    """The step's CPU work by phase (seconds): `run` is run_batch less the compute."""
    out = {p: rec.get(p, (0, 0))[clock] / 1e9 for p in PHASES}
    out["run"] -= sum(rec[c][clock] for c in COMPUTE if c in rec) / 1e9
    out["compute"] = sum(rec[c][clock] for c in COMPUTE if c in rec) / 1e9
    return out


def full_batch(records: list[dict], batch: int) -> list[dict]:
    """The decode steps that ran (within 2 % of) all `batch` requests: at a few hundred
    requests one may still be in its prefill or done a step early."""
    return [r for r in records if r["mode"] == "decode" and r["bs"] >= batch - batch // 50
            and all(p in r for p in PHASES)]


def point(records: list[dict], batch: int) -> dict | None:
    """The median step of the full-batch decode steps (`full_batch`), or None."""
    steps = full_batch(records, batch)
    if not steps:
        return None
    out = {"batch": statistics.median(r["bs"] for r in steps), "steps": len(steps),
           "cpu_s": statistics.median(step_cpu(r, 1) for r in steps),
           "wall_s": statistics.median(step_cpu(r, 0) for r in steps)}
    for name in (*PHASES, "compute"):
        out[f"{name}_s"] = statistics.median(parts(r, 1)[name] for r in steps)
    detok = [r["detok"][1] / 1e9 for r in records if r["mode"] == "detok"
             and r["bs"] >= batch - batch // 50]
    out["detok_s"] = statistics.median(detok) if detok else None
    return out


def fit(points: list[dict], key: str = "cpu_s") -> tuple[float, float, float]:
    """(a, b, max |residual|) of `key` = a + b x batch by least squares."""
    x = np.array([p["batch"] for p in points], dtype=float)
    y = np.array([p[key] for p in points], dtype=float)
    if len(points) < 2:
        return float(y[0]), 0.0, 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b), float(np.max(np.abs(y - (a + b * x))))


def read_probe(prefix: Path, seen: dict[str, int]) -> list[dict]:
    """The lines the probe wrote (every process: scheduler steps, detokenizer calls) past
    the byte offsets in `seen`, which move to the files' ends (the probe keeps its files
    open, so they are read on, never removed)."""
    rows = []
    for path in sorted(prefix.parent.glob(prefix.name + ".*")):
        with open(path, "rb") as fh:
            fh.seek(seen.get(path.name, 0))
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        seen[path.name] = seen.get(path.name, 0) + end
        rows += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows


def batch_workload(b: int, prompt: int, output: int, tag: str):
    """B requests sent at once, fixed lengths, rids `TAGr0..` (each run its own)."""
    from twin.workload import get_workload

    wl = get_workload(f"arrival=closed,concurrency={b},n={b},prompt=fixed:{prompt},"
                      f"output=fixed:{output}", 0)
    return replace(wl, requests=tuple(replace(r, rid=tag + r.rid) for r in wl.requests))


def sweep(url: str, prefix: Path, batches: list[int], prompt: int = 32, output: int = 48,
          rounds: int = 1, progress=print, on_run=None) -> list[dict]:
    """One point per batch size from the live server at `url`, whose probe writes
    `prefix.<pid>`. `on_run(b, rows, result)` sees each run's probe rows (a benchmark's
    extra measurements). Raises `ReplayError` when a run's requests are not all `ok` or
    the probe saw none of its decode steps."""
    from runtime.client import ReplayConfig, replay
    from runtime.server_api import ReplayError, probe

    facts = probe(url)
    seen: dict[str, int] = {}
    read_probe(prefix, seen)  # what the probe wrote before: the server's own start-up
    rows: dict[int, list[dict]] = {b: [] for b in batches}
    for k in range(rounds):
        for b in batches:
            res = replay(batch_workload(b, prompt, output, f"k{k}b{b}-"),
                         ReplayConfig(url=url, seed=0, max_lateness_s=60.0), facts=facts)
            bad = [r for r in res.records if r["status"] != "ok"]
            if bad:
                raise ReplayError(f"step CPU sweep, batch {b}: {len(bad)} of {b} requests "
                                  f"not ok (the first: {bad[0]['status']}: "
                                  f"{bad[0]['error']})")
            got = read_probe(prefix, seen)
            if on_run is not None:
                on_run(b, got, res)
            p = point(got, b)
            if p is None:
                raise ReplayError(
                    f"step CPU sweep, batch {b}: the probe wrote no decode step of {b} "
                    f"requests to {prefix}.<pid>: is the server running with "
                    f"SGLANG_PLUGINS=servetwin SERVETWIN_STEP_PROBE={prefix} (and "
                    f"--max-running-requests >= {b})?")
            rows[b] += got
            progress(f"  round {k + 1}/{rounds} batch {b:4d}: {p['steps']} steps, CPU "
                     f"{p['cpu_s'] * 1e3:.3f} ms (wall {p['wall_s'] * 1e3:.3f} ms), model "
                     f"compute {p['compute_s'] * 1e3:.3f} ms")
    return [point(rows[b], b) for b in batches]


def section(points: list[dict]) -> dict:
    """The `step_cpu` section a file gives `twin.perf.step_cpu.load`: the fit and its
    points."""
    a, b, res = fit(points)
    if a < 0 or b < 0:  # a shared machine's noise can tilt a short sweep
        raise ValueError(f"the step CPU fit came out negative ({a * 1e3:.3f} ms + "
                         f"{b * 1e6:.2f} us x batch): measure more batch sizes or rounds")
    return {"per_step_s": a, "per_request_s": b, "max_residual_s": res, "points": points}
