"""Run one simulation: a workload through one simulated SGLang server."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import simpy

from twin.cluster import Deployment
from twin.collector import paused
from twin.config import Capacity, ServerArgs, derive_capacity
from twin.core import run as run_core
from twin.core import why_not
from twin.decider import Decider
from twin.errors import ConfigError
from twin.inputs import COUNT, FINITE, NON_NEGATIVE, POSITIVE, Rule, check, check_optional
from twin.interrupt import run_interruptible
from twin.memory import make_allocator
from twin.memory_stats import memory_summary
from twin.metrics import SERIES_FIELDS, SLO, summarize, twin_records, write_records
from twin.outputs import atomic_write_text, atomic_writer
from twin.overlap import OverlapStepTime, overlaps
from twin.perf import StepTimeModel, default_step_time, make_step_time
from twin.perf.step_cpu import StepCpu, charged
from twin.policy import Policy, PolicyError, make_policy, policy_class, read_spec
from twin.policy import build_policy as build_from_spec
from twin.policy.sglang import CacheAware
from twin.policy.slices import MODES, ScoreWeights, SlicePolicy
from twin.record_sink import CHUNK, Count, RecordSink
from twin.record_table import RecordTable
from twin.replica import DefragConfig, Replica, SwapConfig
from twin.request_path import OFF as REQUEST_PATH_OFF
from twin.request_path import SGLANG_0_5_23, RequestPath
from twin.source import Source
from twin.workload import WARMUP_RID, Workload


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
    # requests carry SGLang's `ignore_eos` (servetwin's live replay sends it: output lengths
    # are exact); False models clients that stop at EOS: running requests then reserve
    # only `new_token_ratio` of their remaining tokens (SGLang's rule)
    ignore_eos: bool = True
    policy: str | None = None  # --policy: a name or a spec file; None: from server args
    # SGLang's request path (twin/request_path.py): the tokenizer manager's queue on the
    # way in, egress to closed-loop clients; None: the costs measured on the CPU harness,
    # or a --calibration profile's own (none if it has none), or none with a fitted step
    # time (validate adds its own path)
    request_path: RequestPath | None = None
    # SGLang's scheduler CPU per step (twin/perf/step_cpu.py) for the roofline and opdb
    # backends; None: the CPU harness's measurement (their default)
    step_cpu: StepCpu | None = None

    def path_for(self, step_time: StepTimeModel) -> RequestPath:
        if self.request_path is not None:
            return self.request_path
        if self.calibration:  # the path the profile measured, if it did (else none)
            from twin.perf.fitted import load_profile
            from twin.request_path import from_profile

            return from_profile(load_profile(self.calibration), self.calibration) \
                or REQUEST_PATH_OFF
        fitted = self.calibration or getattr(step_time, "name", "") == "fitted"
        return REQUEST_PATH_OFF if fitted else SGLANG_0_5_23

    def __post_init__(self) -> None:
        _check_numbers(self)
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
        if self.step_cpu is not None and not isinstance(self.step_cpu, StepCpu):
            raise ConfigError(f"step_cpu {self.step_cpu!r}: must be a StepCpu "
                              "(twin.perf.step_cpu.load reads one from --step-cpu FILE)")


# The twin-only numbers, by flag: finite, integral where they count, in range.
_NUMBER_RULES = {
    "horizon_s": ("--horizon", POSITIVE),
    "sample_every_s": ("sample_every_s", POSITIVE),
    "buddy_min_block_bytes": ("--buddy-min-block", Rule(lo=1, hi=2**50)),
    "kv_reserve_fraction": ("--kv-reserve-fraction", Rule(lo=0, hi=1, hi_open=True)),
    "time_slice_ms": ("--time-slice-ms", POSITIVE),
    "preemption_threshold": ("--preemption-threshold", FINITE),
    "swap_min_tokens": ("--swap-min-tokens", COUNT),
    "host_kv_bytes": ("--host-kv-bytes", NON_NEGATIVE),
    "defrag_every": ("--defrag-every", COUNT),
    "defrag_threshold": ("--defrag-threshold", Rule(lo=0, hi=1, hi_open=True)),
}


def _check_numbers(cfg: SimConfig) -> None:
    for name, (flag, rule) in _NUMBER_RULES.items():
        check_optional(flag, getattr(cfg, name), rule)
    w = cfg.priority_weights
    for part in ("tier", "wait", "speed"):
        check(f"--priority-weights {part}", getattr(w, part), NON_NEGATIVE)


@dataclass
class SimResult:
    records: Sequence[dict]  # a RecordTable (records built on demand) or a list
    summary: dict
    series: list[tuple]
    capacity: Capacity
    backend: str
    counters: dict
    interrupted: str | None = None  # Ctrl-C: why the records are partial
    # (time, cause, tokens moved) of each compaction, when `keep_compactions` was asked
    compaction_log: list = field(default_factory=list)
    records_path: Path | None = None  # where `simulate(out=...)` wrote the records
    # which scheduler loop ran: None the typed core (twin/core.py), else why not
    loop_core: str | None = ""

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        path, done = out / "requests.jsonl", self.records_path
        if not (done is not None and path.exists() and path.samefile(done)):
            write_records(path, self.records)  # (a streamed run wrote its own already)
        atomic_write_text(out / "summary.json", json.dumps(self.summary, indent=2) + "\n")
        write_series(out / "timeseries.csv", self.series)


def write_series(path: Path, series: list) -> None:
    """timeseries.csv: the header, then each sample's fields as `str` writes them (the
    compiled records writer's `csv_block` where it is built: the same bytes)."""
    from twin.record_table import _C

    with atomic_writer(path, binary=True) as fh:
        fh.write((",".join(SERIES_FIELDS) + "\n").encode())
        for i in range(0, len(series), 8192):
            j = min(i + 8192, len(series))
            if _C is not None:
                fh.write(_C.csv_block(series, i, j))
            else:
                fh.write("".join(",".join(map(str, row)) + "\n"
                                 for row in series[i:j]).encode())


def choose_backend(cfg: SimConfig, cap: Capacity) -> str:
    """The backend's name for `cfg` (builds the opdb tables when none is asked for: use
    `step_time_for`, which returns the model it built)."""
    if cfg.calibration:
        return "fitted"
    if cfg.step_time_backend:
        return cfg.step_time_backend
    return step_time_for(cfg, cap).name


def step_time_for(cfg: SimConfig, cap: Capacity) -> StepTimeModel:
    """The step-time model for `cfg`: its calibration profile, the backend it names, or
    the best backend with data for the setup (built once)."""
    if cfg.calibration:
        from twin.perf.fitted import profile_step_time

        return profile_step_time(cfg.calibration, cap, cfg.args)
    st = (make_step_time(cfg.step_time_backend, cap, cfg.args) if cfg.step_time_backend
          else default_step_time(cap, cfg.args))
    return charged(st, cfg.step_cpu) if cfg.step_cpu else st


def make_replica(env: simpy.Environment, cfg: SimConfig,
                 step_time: StepTimeModel | None = None,
                 decider: Decider | None = None) -> tuple[Replica, str]:
    """One simulated server for `cfg`, not yet fed (a `Deployment` feeds it)."""
    cap = derive_capacity(cfg.args, cfg.gpu)
    st = step_time or step_time_for(cfg, cap)
    backend = getattr(st, "name", cfg.step_time_backend or "custom")
    overlap = overlaps(cfg.args, st)  # SGLang's default overlap loop (twin/overlap.py)
    if overlap:
        st = OverlapStepTime(st)
    policy = decider.policy if decider is not None else build_policy(cfg)
    name = cfg.kv_allocator
    if name == "token" and cfg.args.page_size > 1:
        name = "paged"  # SGLang's pool with --page-size > 1 allocates whole pages
    try:
        alloc = make_allocator(name, cap.max_total_num_tokens, page_size=cfg.args.page_size,
                               bytes_per_token=cap.kv_bytes_per_token,
                               min_block_bytes=cfg.buddy_min_block_bytes,
                               reserve_fraction=cfg.kv_reserve_fraction)
    except ValueError as exc:  # a setting the allocator cannot work with, explained
        raise ConfigError(f"--kv-allocator {name}: {exc}") from None
    rep = Replica(env, cfg.args, cap, st, policy, None, alloc,
                  horizon_s=cfg.horizon_s, sample_every_s=cfg.sample_every_s,
                  debug_checks=cfg.debug_checks,
                  swap=SwapConfig(cfg.swap_min_tokens, cfg.host_kv_bytes),
                  defrag=DefragConfig(cfg.defrag_every, cfg.defrag_threshold),
                  decider=decider, ignore_eos=cfg.ignore_eos, overlap=overlap)
    return rep, backend


def build_replica(env: simpy.Environment, workload: Workload, cfg: SimConfig,
                  step_time: StepTimeModel | None = None,
                  decider: Decider | None = None) -> tuple[Replica, str]:
    """A deployment of one server fed by `workload`; its feeder process is started,
    the caller starts `rep.run()`."""
    rep, backend = make_replica(env, cfg, step_time, decider)
    dep = Deployment(env, Source(workload, cfg.path_for(rep.st)), horizon_s=cfg.horizon_s)
    dep.add(rep)
    dep.start()
    return rep, backend


def build_policy(cfg: SimConfig) -> Policy:
    """`--policy SPEC` (a name or a JSON/YAML spec file), else the users' scheduler when
    `--preemption-mode` is on, else SGLang's `--schedule-policy`. Server arguments
    (priority scheduling, its preemption threshold, low values first) reach every policy
    that takes them; a spec's own params win."""
    a = cfg.args
    server = dict(priority_scheduling=a.enable_priority_scheduling,
                  low_values_first=a.schedule_low_priority_values_first,
                  preemption_threshold=a.priority_scheduling_preemption_threshold)
    if cfg.policy:
        if cfg.preemption_mode != "off":
            raise ConfigError(f"--policy {cfg.policy} and --preemption-mode "
                              f"{cfg.preemption_mode}: give one (the users' scheduler is "
                              f"the policy 'slices')")
        try:
            return build_from_spec(read_spec(cfg.policy), **server)
        except PolicyError as exc:
            raise ConfigError(f"--policy: {exc}") from None
    if cfg.preemption_mode != "off":
        return SlicePolicy(mode=cfg.preemption_mode, time_slice_ms=cfg.time_slice_ms,
                           weights=cfg.priority_weights,
                           score_threshold=cfg.preemption_threshold)
    name = a.schedule_policy
    if a.disable_radix_cache and isinstance(policy_class(name), type) and issubclass(
            policy_class(name), CacheAware):
        if name == "shortest-prefill-first":
            raise ConfigError("--schedule-policy shortest-prefill-first: SGLang refuses it "
                              "without the radix cache (\"Experimental "
                              "shortest-prefill-first requires prefix caching\")")
        name = "fcfs"  # SGLang: cache-aware policies become fcfs without the radix cache
    return make_policy(name, **server)


def simulate(workload: Workload, cfg: SimConfig, slo: SLO | None = None,
             step_time: StepTimeModel | None = None, progress=None,
             keep_compactions: bool = False, out: Path | None = None,
             keep_records: bool = True, record_chunk: int = CHUNK) -> SimResult:
    """Simulate `workload`; `progress(done, sim_time)` is called at every sample;
    `keep_compactions`: log each KV compaction (the defragmentation alert's record).

    Records: in memory (`result.records`) by default. With `out` (a directory) they are
    streamed to `out/requests.jsonl` as requests finish (twin/record_sink.py: at most
    `record_chunk` finished requests held, the rest spilled beside it and merged at the
    end, the same bytes; `result.records` reads the file back); `keep_records=False`
    without `out`: only the summary (nothing per request is kept)."""
    env = simpy.Environment()
    rep, backend = build_replica(env, workload, cfg, step_time)
    rep.progress = progress
    if keep_compactions:
        rep.compaction_log = []
    bench = workload.clients == "bench"  # bench_serving's warm-up is not measured (no record)
    sink = None
    if out is not None or not keep_records:
        sink = RecordSink(rep, None if out is None else
                          Path(out) / "requests.jsonl", record_chunk,
                          WARMUP_RID if bench else None)
        rep.finished = sink
        rep.feed.done_tickets = Count()  # the deployment's tickets: not needed for one
    interrupted = None
    rep.loop_core = why_not(rep)  # None: the typed core runs it (twin/core.py)
    if rep.loop_core is None:
        stopped = run_core(rep)
    else:
        env.process(rep.run())
        # keep what is done: every request still gets its record (stopped between events)
        stopped = run_interruptible(env, rep.wait_in_events)
    if stopped:
        interrupted = f"interrupted (Ctrl-C) at simulated time {env.now:.3f} s"
    with paused():  # the records and the summary make no cycles (twin/collector.py)
        if sink is not None:
            warmup = sink.skipped
            if interrupted:
                left = _unfinished(workload, sink.rids(), interrupted, env.now)
                records, summary = sink.finish_with(left, slo)
            else:
                records, summary = sink.finish(slo)
        else:
            finished = rep.finished
            if bench:
                finished = [r for r in finished if not r.req.rid.startswith(WARMUP_RID)]
            warmup = len(rep.finished) - len(finished)
            if interrupted:
                records = with_unfinished(twin_records(finished, rep.step_end), workload,
                                          interrupted, env.now)
            else:  # built on demand; written and summarised from columns
                records = RecordTable(finished, rep.step_end)  # (twin/record_table.py)
            summary = summarize(records, slo)
    counters = dict(rep.counters.__dict__)
    if bench:
        summary["warmup"] = {"requests": warmup,
                             "measured": False}  # served before the loop, as bench_serving
    if interrupted:
        summary["partial"] = {"stop_reason": interrupted, "simulated_s": round(env.now, 6),
                              "unfinished": summary["status"]["aborted"]}
    summary["engine"] = {"backend": backend, "gpu": cfg.gpu, **counters}
    summary["memory"] = memory_summary(rep.series, SERIES_FIELDS, rep.alloc.stats(),
                                       rep.alloc.name, rep.cap.kv_bytes_per_token, counters,
                                       cfg.sample_every_s)
    return SimResult(records, summary, rep.series, rep.cap, backend, counters, interrupted,
                     rep.compaction_log or [], sink.path if sink is not None else None,
                     rep.loop_core)


def with_unfinished(records: list[dict], workload: Workload, why: str,
                    now: float) -> list[dict]:
    """`records` plus an `aborted` record for every request of `workload` that has none
    (in the server, or not yet arrived, when the run stopped), in arrival order."""
    left = list(_unfinished(workload, {r["rid"] for r in records}, why, now))
    out = records + twin_records(left, [])
    return sorted(out, key=lambda r: (r["arrival_s"], r["rid"]))


def _unfinished(workload: Workload, have: set[str], why: str, now: float) -> Iterator:
    """An `aborted` SimRequest for each request of `workload` whose rid is not in `have`."""
    from twin.request_state import SimRequest

    for req in workload.requests:
        if req.rid not in have:
            r = SimRequest(req, req.arrival_s, -1)
            r.status, r.finish_s = "aborted", max(now, req.arrival_s)
            r.error = f"{why}, before it finished"
            yield r
