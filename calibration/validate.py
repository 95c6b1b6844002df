"""Validate a calibration profile: the same held-out workload live and in the twin.

`validate()` replays the workload on the live server (`runtime.client.replay`), then
simulates the very requests it sent (each at its actual send time, so the client's own
lateness is not an error of the twin) in a twin built with the server's own arguments
from `/server_info` and the profile's step time, and compares the two record sets
(`twin.compare`: twin = A, live = B, errors (twin - live) / live).

The twin's replica starts a request when it reaches the scheduler and ends it when its
last step ends; a client also sees the request path (HTTP, tokenizer manager, detokenizer).
The profile's `request_path` latencies are added the way they happen: the request reaches
the twin's scheduler `ingress_s` after it was sent, and each token reaches the client
`egress_s` after its step (TTFT and E2E grow by both; TPOT and ITL do not change).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from calibration.deployment import server_differences
from calibration.profiles import HARNESS_GPU, check_profile, read_profile
from calibration.session import server_facts
from twin.compare import Comparison, compare_records, format_markdown, format_table
from twin.workload import Workload


@dataclass
class Validation:
    workload: str
    live_records: list[dict]
    twin_records: list[dict]
    comparison: Comparison
    warnings: list[str]
    live_meta: dict
    backend: str
    step_check: dict  # the profile's step times against this live run's own steps
    rescaled: Comparison | None = None  # a twin with steps scaled by the measured drift
    # the server's own arguments (the twin's) that differ from those the profile recorded
    deployment: list[str] = field(default_factory=list)

    def table(self) -> str:
        return format_table(self.comparison, "twin", "live")

    def markdown(self) -> str:
        return format_markdown(self.comparison, "twin", "live")


def path_latency(profile: dict) -> tuple[float, float]:
    """(ingress, egress) seconds of the request path; all of it as egress when only the
    total was measured."""
    rp = profile.get("request_path") or {}
    if rp.get("ingress_samples"):
        return max(rp["ingress_s"], 0.0), max(rp["egress_s"], 0.0)
    return 0.0, max(rp.get("overhead_s", 0.0), 0.0)


def at_send_times(workload: Workload, live_records: list[dict]) -> Workload:
    """The workload with each request at the time the live client actually sent it."""
    sent = {r["rid"]: r["arrival_s"] for r in live_records}
    reqs = tuple(replace(r, arrival_s=sent.get(r.rid, r.arrival_s)) for r in workload.requests)
    if workload.concurrency is None:
        reqs = tuple(sorted(reqs, key=lambda r: r.arrival_s))
    return replace(workload, requests=reqs)


def simulate_like(workload: Workload, info: dict, profile: dict,
                  step_scale: float = 1.0, policy: str | None = None
                  ) -> tuple[list[dict], object]:
    """The twin's records for `workload` on the server `info` describes, with the profile's
    step time and request-path latency (and `policy`, a spec, where the server ran one
    through the plugin)."""
    from runtime.server_api import twin_server_args
    from twin.config import derive_capacity
    from twin.perf.fitted import from_step_time_section
    from twin.sim import SimConfig, simulate

    args = twin_server_args(info)
    cap = derive_capacity(args, HARNESS_GPU)
    step = from_step_time_section(profile["step_time"], cap, args)
    if step_scale != 1.0:
        step = Scaled(step, step_scale)
    ingress, egress = path_latency(profile)
    shifted = replace(workload, requests=tuple(
        replace(r, arrival_s=r.arrival_s + ingress) for r in workload.requests))
    result = simulate(shifted, SimConfig(args=args, gpu=HARNESS_GPU, policy=policy),
                      step_time=step)
    # the twin's queue_s already starts where SGLang's queue_time does (the scheduler
    # taking the request in), so records compare as they are
    return TwinRecords((_client_view(rec, ingress, egress) for rec in result.records),
                       result.summary["memory"]), step


class TwinRecords(list):
    """The twin's records of a run, and its summary's `memory` section."""

    def __init__(self, records, memory: dict) -> None:
        super().__init__(records)
        self.memory = memory


def _client_view(rec: dict, ingress: float, egress: float) -> dict:
    out = dict(rec)
    out["arrival_s"] = round(rec["arrival_s"] - ingress, 6)
    for key in ("ttft_s", "e2e_s"):
        if rec[key] is not None:
            out[key] = round(rec[key] + ingress + egress, 6)
    return out


def validate(url: str, profile_path: Path, workload: Workload, out: Path | None = None,
             force: bool = False, seed: int = 0, progress=None) -> Validation:
    from runtime.client import INTERRUPTED, ReplayConfig, replay

    facts = server_facts(url)
    profile = read_profile(profile_path)
    warnings = check_profile(profile, facts.info, force)
    live = replay(workload, ReplayConfig(url=url, seed=seed), progress, facts)
    if out is not None:
        live.write(out / "live")
    if live.stop_reason == INTERRUPTED:
        raise KeyboardInterrupt  # Ctrl-C: the live records so far are written
    if live.stop_reason:
        live.check()  # raises: the live run is incomplete
    # the client's lateness is no error here: the twin gets the actual send times
    twin_records, step = simulate_like(at_send_times(workload, live.records), facts.info,
                                       profile)
    cmp = compare_records(twin_records, live.records)
    check = step_check(live.records, facts.info, step)
    v = Validation(workload.name, live.records, twin_records, cmp, warnings + cmp.warnings(),
                   live.meta, step.describe(), check,
                   deployment=server_differences(profile, facts.info))
    k = drift(check)
    if k is not None:
        rescaled, _ = simulate_like(at_send_times(workload, live.records), facts.info,
                                    profile, k)
        v.rescaled = compare_records(rescaled, live.records)
    if out is not None:
        write_outputs(v, out, profile_path)
    return v


class Scaled:
    """A step-time model times a constant (a diagnostic: the drift a live run measured)."""

    def __init__(self, base, k: float) -> None:
        self.base, self.k, self.name = base, k, getattr(base, "name", "scaled")

    def step_time(self, prefill_chunks, decode_kv_lens) -> float:
        return self.k * self.base.step_time(prefill_chunks, decode_kv_lens)

    def decode_times(self, batch_size, kv_sums):
        return self.k * self.base.decode_times(batch_size, kv_sums)

    def breakdown(self, prefill_chunks, decode_kv_lens) -> dict[str, float]:
        return {k: self.k * v for k, v in self.base.breakdown(prefill_chunks,
                                                              decode_kv_lens).items()}

    def describe(self) -> str:
        return f"{self.k:.3g} x [{self.base.describe()}]"


def drift(check: dict) -> float | None:
    """One ratio, measured / profile, over the live run's isolated steps (sample-weighted
    geometric mean of the per-kind medians)."""
    if not check:
        return None
    n = sum(v["n"] for v in check.values())
    return float(np.exp(sum(v["n"] * np.log(v["ratio"]) for v in check.values()) / n))


def step_check(live_records: list[dict], info: dict, step) -> dict:
    """Per sample kind: how the profile's step times compare with the steps of this very
    live run (token-gap samples of its records): `ratio` is the median of measured /
    predicted. A ratio far from 1 means the server ran slower or faster than when it was
    profiled (on a shared machine, other load), which no scheduling model can predict."""
    from calibration.derive import samples_from_timelines, timelines_from_records
    from calibration.fit import _lens, error_stats
    from calibration.profile import ServerLimits

    samples = samples_from_timelines(timelines_from_records(live_records),
                                     ServerLimits.from_info(info).derive_limits())
    out = {}
    for kind in sorted({s["kind"] for s in samples}):
        meas = np.array([s["dur_s"] for s in samples if s["kind"] == kind])
        pred = np.array([sum(step.step_time([tuple(c) for c in pf], _lens(b, kv))
                             for pf, (b, kv) in s["steps"]) for s in samples if s["kind"] == kind])
        out[kind] = error_stats((pred - meas) / meas) | {
            "ratio": round(float(np.median(meas / pred)), 3)}
    return out


def format_step_check(check: dict, rescaled: Comparison | None = None) -> str:
    if not check:
        return "steps of the live run: none could be isolated"
    text = "steps of the live run, measured / profile (median): " + "; ".join(
        f"{k} {v['ratio']:.2f} (n={v['n']})" for k, v in check.items())
    if rescaled is not None:
        text += (f"; a twin with every step x{drift(check):.2f} (diagnostic, not a "
                 "prediction) would err: " + ", ".join(
                     f"{m} {rescaled.row(m).rel_err:+.0%}" for m in
                     ("TTFT p50", "TTFT p99", "TPOT p50", "E2E p50", "E2E p99")
                     if rescaled.row(m).rel_err is not None))
    return text


def write_outputs(v: Validation, out: Path, profile_path: Path) -> None:
    from calibration.report import write_report
    from twin.metrics import summarize, write_records
    from twin.outputs import atomic_write_text

    (out / "twin").mkdir(parents=True, exist_ok=True)
    write_records(out / "twin" / "requests.jsonl", v.twin_records)
    summary = summarize(v.twin_records)
    if isinstance(v.twin_records, TwinRecords):
        summary["memory"] = v.twin_records.memory
    atomic_write_text(out / "twin" / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(out / "fidelity.md",
                      f"Workload `{v.workload}`; profile `{profile_path}`; twin step time: "
                      f"{v.backend}\n\n{v.markdown()}\n\n"
                      f"{format_step_check(v.step_check, v.rescaled)}\n")
    write_report(out / "report.html", v.live_records, v.twin_records,
                 f"servetwin fidelity: {v.workload}", v.table())
