"""Run one simulation: a workload through one simulated SGLang server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import simpy

from twin.config import Capacity, ServerArgs, derive_capacity
from twin.errors import ConfigError
from twin.memory import make_allocator
from twin.metrics import SERIES_FIELDS, SLO, summarize, twin_records, write_records
from twin.perf import StepTimeModel, make_step_time
from twin.policy import Policy, make_policy
from twin.policy.slices import MODES, ScoreWeights, SlicePolicy
from twin.replica import DefragConfig, Replica, SwapConfig
from twin.source import Source
from twin.workload import Workload


@dataclass(frozen=True)
class SimConfig:
    args: ServerArgs = field(default_factory=ServerArgs)
    gpu: str = "a100-pcie-80gb"
    step_time_backend: str | None = None  # None: the best backend with data for the setup
    calibration: str | None = None  # a calibration profile (JSON): its fitted step time
    kv_allocator: str = "token"
    horizon_s: float | None = None
    sample_every_s: float = 1.0
    debug_checks: bool = False
    buddy_min_block_bytes: float = 256 * 2**20  # --buddy-min-block (the users' 256 MB)
    kv_reserve_fraction: float = 0.15  # --kv-reserve-fraction (contiguous; the users' 15%)
    # the users' scheduler (twin/policy/slices.py); "off" = SGLang's own scheduling
    preemption_mode: str = "off"
    time_slice_ms: float = 50.0
    priority_weights: ScoreWeights = field(default_factory=ScoreWeights)
    preemption_threshold: float = 10.0
    # swap to host memory instead of recompute (None: recompute, as SGLang)
    swap_min_tokens: int | None = None
    host_kv_bytes: float = 256 * 2**30
    # compaction of the KV allocator (the users: every 100 requests or above 25%)
    defrag_every: int | None = None
    defrag_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("off", *MODES):
            raise ConfigError(f"--preemption-mode {self.preemption_mode!r}: allowed values: "
                              f"off, {', '.join(MODES)}")
        if self.time_slice_ms <= 0:
            raise ConfigError(f"--time-slice-ms {self.time_slice_ms}: must be > 0")
        if self.swap_min_tokens is not None and self.swap_min_tokens < 1:
            raise ConfigError(f"--swap-min-tokens {self.swap_min_tokens}: must be >= 1")
        if self.defrag_every is not None and self.defrag_every < 1:
            raise ConfigError(f"--defrag-every {self.defrag_every}: must be >= 1")
        if self.defrag_threshold is not None and not 0 <= self.defrag_threshold < 1:
            raise ConfigError(f"--defrag-threshold {self.defrag_threshold}: must be in [0, 1)")
        if self.host_kv_bytes < 0:
            raise ConfigError(f"--host-kv-bytes {self.host_kv_bytes}: must be >= 0")


@dataclass
class SimResult:
    records: list[dict]
    summary: dict
    series: list[tuple]
    capacity: Capacity
    backend: str
    counters: dict

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_records(out / "requests.jsonl", self.records)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        with (out / "timeseries.csv").open("w") as fh:
            fh.write(",".join(SERIES_FIELDS) + "\n")
            for row in self.series:
                fh.write(",".join(str(x) for x in row) + "\n")


def choose_backend(cfg: SimConfig, cap: Capacity) -> str:
    if cfg.calibration:
        return "fitted"
    if cfg.step_time_backend:
        return cfg.step_time_backend
    try:
        from twin.perf import default_backend  # provided by the opdb backend when present
    except ImportError:
        return "roofline"
    return default_backend(cap)


def build_replica(env: simpy.Environment, workload: Workload, cfg: SimConfig,
                  step_time: StepTimeModel | None = None) -> tuple[Replica, str]:
    cap = derive_capacity(cfg.args, cfg.gpu)
    backend = choose_backend(cfg, cap)
    if step_time is None and cfg.calibration:
        from twin.perf.fitted import profile_step_time

        step_time = profile_step_time(cfg.calibration, cap, cfg.args)
    st = step_time or make_step_time(backend, cap, cfg.args)
    policy = build_policy(cfg)
    name = cfg.kv_allocator
    if name == "token" and cfg.args.page_size > 1:
        name = "paged"  # SGLang's pool with --page-size > 1 allocates whole pages
    alloc = make_allocator(name, cap.max_total_num_tokens, page_size=cfg.args.page_size,
                           bytes_per_token=cap.kv_bytes_per_token,
                           min_block_bytes=cfg.buddy_min_block_bytes,
                           reserve_fraction=cfg.kv_reserve_fraction)
    rep = Replica(env, cfg.args, cap, st, policy, Source(workload), alloc,
                  horizon_s=cfg.horizon_s, sample_every_s=cfg.sample_every_s,
                  debug_checks=cfg.debug_checks,
                  swap=SwapConfig(cfg.swap_min_tokens, cfg.host_kv_bytes),
                  defrag=DefragConfig(cfg.defrag_every, cfg.defrag_threshold))
    return rep, getattr(st, "name", backend)


def build_policy(cfg: SimConfig) -> Policy:
    if cfg.preemption_mode != "off":
        return SlicePolicy(mode=cfg.preemption_mode, time_slice_ms=cfg.time_slice_ms,
                           weights=cfg.priority_weights,
                           score_threshold=cfg.preemption_threshold)
    return make_policy(cfg.args.schedule_policy,
                       priority_scheduling=cfg.args.enable_priority_scheduling,
                       low_values_first=cfg.args.schedule_low_priority_values_first,
                       preemption_threshold=cfg.args.priority_scheduling_preemption_threshold)


def simulate(workload: Workload, cfg: SimConfig, slo: SLO | None = None,
             step_time: StepTimeModel | None = None, progress=None) -> SimResult:
    """Simulate `workload`; `progress(done, sim_time)` is called at every sample."""
    env = simpy.Environment()
    rep, backend = build_replica(env, workload, cfg, step_time)
    rep.progress = progress
    env.process(rep.run())
    env.run()
    records = twin_records(rep.finished, rep.step_end)
    counters = dict(rep.counters.__dict__)
    summary = summarize(records, slo)
    summary["engine"] = {"backend": backend, "gpu": cfg.gpu, **counters}
    return SimResult(records, summary, rep.series, rep.cap, backend, counters)
