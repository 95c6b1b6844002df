"""`servetwin simulate`: run a workload through the twin of one SGLang server."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

from servetwin.args import (
    add_server_args,
    add_workload_args,
    given_server_args,
    gpu_from,
    server_args_from,
    workload_from,
)
from twin.collector import paused
from twin.config import derive_capacity
from twin.errors import ConfigError, InfeasibleError
from twin.inputs import COUNT, check
from twin.metrics import SLO, format_summary
from twin.outputs import atomic_write_text, check_out_dir
from twin.policy import policy_names
from twin.policy.slices import ScoreWeights
from twin.record_sink import CHUNK
from twin.sim import SimConfig, simulate
from twin.workload import SPEC_HELP

DEFAULT_WORKLOAD = "finance-qa"
USERS_MODEL = "deepseek-ai/DeepSeek-V3"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="simulate a workload on one SGLang server (the default command)",
        description="Simulate a workload on the twin of one SGLang 0.5.x server. With no "
        "arguments: the finance-qa workload on 2x A100-80GB PCIe at TP 2.",
        epilog=SPEC_HELP)
    add_server_args(p)
    add_workload_args(p, DEFAULT_WORKLOAD)
    pol = p.add_argument_group("scheduling policy (the same spec runs live through the plugin)")
    pol.add_argument("--policy", default=None, metavar="SPEC",
                     help="a policy name (" + ", ".join(policy_names()) + ") or a JSON/YAML "
                     "spec file {\"name\": ..., \"params\": {...}}; the live engine runs the "
                     "same spec through servetwin's SGLang plugin (docs/policies.md). "
                     "Default: SGLang's --schedule-policy")
    pol.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                     help="model clients that stop at EOS: running requests reserve only "
                     "new_token_ratio of their remaining tokens (default: requests carry "
                     "ignore_eos, as servetwin's live replay sends them; a jsonl trace's "
                     "per-request ignore_eos key wins over either)")
    m = p.add_argument_group("the users' scheduler and memory design (twin-only, not SGLang flags)")
    m.add_argument("--preemption-mode", default="off",
                   choices=["off", "conservative", "moderate", "aggressive"],
                   help="off = SGLang's own scheduling (default); the others use a score "
                   "from VIP tier, time waited and generation speed (docs/architecture.md)")
    m.add_argument("--time-slice-ms", type=float, default=50.0,
                   help="re-evaluate priorities at least this often (default 50)")
    m.add_argument("--priority-weights", default="1,1,0.1",
                   help="score weights TIER,WAIT(per s),SPEED(per token/s) (default 1,1,0.1)")
    m.add_argument("--preemption-threshold", type=float, default=10.0,
                   help="score gap above which moderate mode preempts (default 10)")
    m.add_argument("--swap-min-tokens", type=int, default=None,
                   help="swap preempted requests with at least N KV tokens to host memory "
                   "instead of recomputing (default: always recompute, as SGLang)")
    m.add_argument("--host-kv-bytes", type=float, default=256 * 2**30,
                   help="host memory for swapped KV, bytes (default 256 GiB)")
    m.add_argument("--kv-allocator", default="token",
                   help="token (SGLang's pool, default) | paged | buddy | contiguous")
    m.add_argument("--buddy-min-block", type=float, default=256 * 2**20,
                   help="buddy allocator's minimum block in bytes (default 256 MiB)")
    m.add_argument("--kv-reserve-fraction", type=float, default=0.15,
                   help="contiguous allocator's safety reserve (default 0.15)")
    m.add_argument("--defrag-every", type=int, default=None,
                   help="compact the KV allocator every N finished requests (users: 100)")
    m.add_argument("--defrag-threshold", type=float, default=None,
                   help="compact when external fragmentation exceeds F (users: 0.25)")
    s = p.add_argument_group("simulation and output")
    s.add_argument("--step-time-backend", default=None,
                   help="roofline | opdb | fitted (default: opdb where measured data covers "
                   "the model and GPU, else roofline)")
    s.add_argument("--calibration", default=None, metavar="PROFILE",
                   help="a calibration profile from `servetwin calibrate`: its fitted step "
                   "time (overrides --step-time-backend), and its server (model, TP, every "
                   "server argument it recorded, device) as the defaults; server flags "
                   "given here override them (the header says which). A CPU-harness "
                   "profile has no GPU: --gpu then asks for another device")
    s.add_argument("--step-cpu", default=None, metavar="FILE",
                   help="SGLang's scheduler CPU per step measured on your GPU host (JSON: "
                   "`benchmarks/step_cpu_cost.py --json` output, or a file with a "
                   "`step_cpu` section {per_step_s, per_request_s}) for the roofline and "
                   "opdb step times; default: the CPU harness's 1.086 ms + 18.8 us per "
                   "request (docs/calibration.md). A fitted step time ignores it")
    s.add_argument("--force", action="store_true",
                   help="use a --calibration profile of another engine version, model or "
                   "device than asked for (warns)")
    s.add_argument("--horizon", type=float, default=None,
                   help="stop at this simulated time (s); unfinished requests are 'aborted'")
    s.add_argument("--slo-ttft", type=float, default=1.5,
                   help="TTFT target in s for SLO attainment (default 1.5: the users' P99)")
    s.add_argument("--slo-tpot", type=float, default=None, help="TPOT target in s")
    s.add_argument("--slo-e2e", type=float, default=None, help="E2E target in s")
    s.add_argument("--out", type=Path, help="write requests.jsonl, summary.json, "
                   "timeseries.csv here. Records are streamed: at most --record-chunk "
                   "finished requests are held in memory, then their records are spilled "
                   "to an unnamed temporary file in this directory and merged at the end "
                   "into requests.jsonl, which appears (by rename) only when whole; a "
                   "Ctrl-C still writes every request once, with its status")
    s.add_argument("--record-chunk", type=int, default=CHUNK, metavar="N",
                   help=f"finished requests held in memory before their records are "
                   f"spilled beside --out (default {CHUNK}, ~80 MB of request state; the "
                   f"files are the same bytes for any N; a --deployment fleet too). Without "
                   f"--out one server keeps no records at all, only the summary's numbers "
                   f"(~150 bytes a request; with --alerts the records go to a temporary "
                   f"directory, which the alerts read back)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    from servetwin.cmd_alerts import add_simulate_args

    add_simulate_args(s)
    s.add_argument("--debug-checks", action="store_true",
                   help="check memory and radix-cache invariants at every scheduling pass "
                   "(Replica.check_integrity; slow)")
    from servetwin.cmd_fleet import add_args as add_fleet_args

    add_fleet_args(p)
    p.set_defaults(func=run, _parser=p)


class Progress:
    """A one-line progress bar on stderr, shown once a run passes two seconds; when
    stderr is not a terminal, a line every 30 s instead."""

    def __init__(self, total: int) -> None:
        self.total, self.start, self.last = total, time.monotonic(), 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, sim_t: float) -> None:
        now = time.monotonic()
        if now - self.start < 2 or now - self.last < (0.5 if self.tty else 30):
            return
        self.last = now
        frac = done / max(self.total, 1)
        bar = "#" * int(30 * frac)
        text = f"[{bar:30s}] {done}/{self.total} requests, {sim_t:,.0f} s simulated"
        print("\r" + text if self.tty else text, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.last and self.tty:
            print(file=sys.stderr)


def sim_config(ns: argparse.Namespace, args, gpu: str) -> SimConfig:
    try:
        weights = ScoreWeights.parse(ns.priority_weights)
    except ValueError as exc:
        raise ConfigError(f"--priority-weights: {exc}") from None
    return SimConfig(args=args, gpu=gpu, step_time_backend=ns.step_time_backend,
                     calibration=ns.calibration,
                     horizon_s=ns.horizon, debug_checks=ns.debug_checks,
                     kv_allocator=ns.kv_allocator, buddy_min_block_bytes=ns.buddy_min_block,
                     kv_reserve_fraction=ns.kv_reserve_fraction,
                     preemption_mode=ns.preemption_mode, time_slice_ms=ns.time_slice_ms,
                     priority_weights=weights, preemption_threshold=ns.preemption_threshold,
                     swap_min_tokens=ns.swap_min_tokens, host_kv_bytes=ns.host_kv_bytes,
                     defrag_every=ns.defrag_every, defrag_threshold=ns.defrag_threshold,
                     policy=ns.policy, ignore_eos=ns.ignore_eos,
                     step_cpu=_step_cpu(ns.step_cpu))


def _step_cpu(path: str | None):
    if path is None:
        return None
    from twin.perf.step_cpu import load

    return load(path)


def run(ns: argparse.Namespace) -> int:
    if ns.deployment or ns.fault:
        if not ns.deployment:
            raise ConfigError("--fault needs --deployment (faults name a fleet's replicas)")
        from servetwin.cmd_fleet import run as run_fleet

        return run_fleet(ns, DEFAULT_WORKLOAD)
    # the collector paused for the whole command: a run's cyclic garbage is a builder's
    # few dozen objects, and each collection would walk the workload, the requests and
    # their records again (docs/perf.md, sixteenth round)
    with paused():
        return _command(ns)


def _command(ns: argparse.Namespace) -> int:
    args, gpu, calibrated = _deployment(ns)
    workload = workload_from(ns, DEFAULT_WORKLOAD)
    from servetwin.cmd_alerts import simulate_rules

    rules = simulate_rules(ns)  # --alerts (may set --defrag-threshold)
    cfg = sim_config(ns, args, gpu)
    slo = SLO(ns.slo_ttft, ns.slo_tpot, ns.slo_e2e)
    cap = derive_capacity(args, gpu)
    check("--record-chunk", ns.record_chunk, COUNT)
    if ns.out:
        check_out_dir(ns.out)
    if not ns.json:
        for line in calibrated:
            print(line)
        _print_header(cap, workload, args, gpu)
    with contextlib.ExitStack() as stack:
        # --alerts read the records back: without --out they go to a temporary directory
        where = ns.out or (Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="servetwin-records-"))) if rules else None)
        return _run(ns, workload, cfg, slo, rules, where)


def _run(ns: argparse.Namespace, workload, cfg: SimConfig, slo: SLO, rules: list,
         where: Path | None) -> int:
    from servetwin.cmd_alerts import attach_alerts, format_alerts
    from twin.record_table import WHY_PYTHON
    from twin.replica import WHY_LOOP_PYTHON

    # the same results either way; say why it is slower
    slow = [*([f"requests.jsonl's writer ({WHY_PYTHON})"] if WHY_PYTHON and where else []),
            *([f"the decode passes ({WHY_LOOP_PYTHON})"] if WHY_LOOP_PYTHON else [])]
    if slow:
        print(f"servetwin: note: the Python code runs {' and '.join(slow)}: the same "
              "results, more slowly", file=sys.stderr)
    progress = Progress(len(workload.requests))
    result = simulate(workload, cfg, slo, progress=progress, keep_compactions=bool(rules),
                      out=where, keep_records=False, record_chunk=ns.record_chunk)
    progress.close()
    alerts, note = attach_alerts(rules, result, ns.alert_window, ns.burn_scale) if rules \
        else ([], None)
    if ns.out:
        result.write(ns.out)
        _write_launch(ns.out, cfg)
        if rules:
            from twin.alerts import alerts_jsonl

            atomic_write_text(ns.out / "alerts.jsonl", alerts_jsonl(alerts))
    if ns.json:
        import json

        print(json.dumps(result.summary, indent=2))
    else:
        print(f"step-time backend: {result.backend}")
        print("scheduler loop: " + ("the typed core (twin/_corec.pyx)" if result.loop_core is None
                                    else f"the Python replica ({result.loop_core})"))
        print(format_summary(result.summary))
        if rules:
            if note:
                print(note)
            print(format_alerts(alerts))
        if ns.out:
            print(f"wrote {ns.out}/requests.jsonl, summary.json, timeseries.csv, "
                  "sglang_launch.txt (the same deployment on the real engine)")
    if result.interrupted:
        print(interrupted_note(result.interrupted, result.summary, ns.out), file=sys.stderr)
        return 130
    return 0


def interrupted_note(why: str, summary: dict, out: Path | None) -> str:
    """What a Ctrl-C'd simulation kept, and where."""
    n = summary["requests"]
    done = n - summary["status"]["aborted"]
    where = (f"{out}/requests.jsonl has all {n} requests ({done} finished, the "
             "rest aborted), summary.json is marked partial" if out else
             "the summary above is partial (give --out to keep the records)")
    return f"servetwin simulate: {why}: {where}"


def _deployment(ns: argparse.Namespace) -> tuple:
    """(ServerArgs, gpu, header lines): the command line over the --calibration profile's
    deployment (refused when it measured another engine, model or device) over defaults."""
    if not ns.calibration:
        return server_args_from(ns), gpu_from(ns), []
    from calibration.deployment import asked_identity, check, header, profile_deployment
    from twin.perf.fitted import load_profile

    profile = load_profile(ns.calibration)
    dep, given = profile_deployment(profile), given_server_args(ns)
    flags = " and ".join(f for f, k in (("--model-path", "model_path"), ("--gpu", "gpu"))
                         if k in given)
    hint = (f"Drop {flags} to simulate the server {ns.calibration} measured" if flags else
            "The twin models SGLang 0.5.x: calibrate such a server")
    for note in check(profile, asked_identity(given, dep), ns.force, "asked", hint):
        print(f"servetwin: warning: {note}", file=sys.stderr)
    args, gpu = server_args_from(ns, dep.server_args), gpu_from(ns, dep.gpu)
    return args, gpu, header(ns.calibration, profile, dep, given, args, gpu)


def _write_launch(out: Path, cfg: SimConfig) -> None:
    """The same deployment on the real engine, and what does not carry over."""
    import shlex

    from runtime.launch import launch_command, not_sglang

    lines = [shlex.join(launch_command(cfg.args))] + [f"# {n}" for n in not_sglang(cfg)]
    atomic_write_text(out / "sglang_launch.txt", "\n".join(lines) + "\n")


def _print_header(cap, workload, args, gpu: str) -> None:
    print(f"workload: {workload.name} ({len(workload.requests)} requests"
          + (f", closed loop x{workload.concurrency}" if workload.concurrency else "") + ")")
    print(cap.startup_log())
    if args.model_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B" and gpu == \
            "a100-pcie-80gb":
        try:
            derive_capacity(type(args)(model_path=USERS_MODEL, tp_size=args.tp_size), gpu)
        except InfeasibleError as exc:
            print(f"model: {cap.model.name}, DeepSeek's 128k-context model that fits; the "
                  f"users' DeepSeek-V3-class model does not: {exc}")
