"""`servetwin plan`: what-if capacity planning over a search space (experiments/plan)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servetwin.args import add_workload_args
from twin.errors import ConfigError

DEFAULT_REQUESTS = 2000


def register(sub: argparse._SubParsersAction) -> None:
    from experiments.plan.question import SLO_HELP
    from experiments.plan.space import KEYS

    p = sub.add_parser(
        "plan", help="what-if capacity planning: the cheapest deployment meeting the SLOs",
        description="Search deployments for a workload at a target load: for each candidate "
        "(GPU type, TP, replicas, model/quantization, SGLang server arguments, policy, KV "
        "allocator, router) the twin finds the largest load meeting every SLO (a search over "
        "load to --precision) and the metrics at the target; then the cheapest candidate "
        "meeting the SLOs, the Pareto fronts (cost vs P99 TTFT, cost vs goodput), headroom, "
        "and the users' stepped ramp to 200 % on the winner. With no --space: the users' "
        "question (finance-qa at its peak, P99 TTFT <= 1.5 s, every GPU of the catalog, TP "
        "1/2/4/8, 1-8 replicas, SGLang's fcfs, then every registry policy on the best "
        "hardware). Writes DIR/plan.json, DIR/candidates/, DIR/ramp/, DIR/winner.txt and "
        "DIR/report.html (docs/what-if.md).")
    add_workload_args(p, "finance-qa")
    q = p.add_argument_group("question")
    t = q.add_mutually_exclusive_group()
    t.add_argument("--target-scale", type=float, default=None,
                   help="target load as a multiple of the workload's rate (default 1.0: its "
                   "peak; a closed loop's peak is what its clients drive on the users' "
                   "2x A100-80GB PCIe TP 2, then open loop at that rate)")
    t.add_argument("--target-rps", type=float, default=None, help="target load in requests/s")
    q.add_argument("--slo", action="append", default=None, metavar="SLO",
                   help=f"repeatable; {SLO_HELP}. A P99 SLO holds when 99 %% of the covered "
                   "requests finish ok within the threshold (rejected = missed). Default "
                   "ttft:p99:1.5 (the users' regulator)")
    q.add_argument("--requests", type=int, default=None,
                   help=f"requests per evaluation for a preset or spec (default "
                   f"{DEFAULT_REQUESTS}: the default plan, ~140 candidates, then runs in "
                   "minutes on 2 cores; the issue's 10000 gives steadier P99s at 5x the time; "
                   "a trace is cut to its first N)")
    q.add_argument("--precision", type=float, default=0.05,
                   help="relative precision of the largest sustainable load (default 0.05)")
    s = p.add_argument_group("search space")
    s.add_argument("--space", type=Path, default=None,
                   help=f"YAML/JSON search space; keys: {', '.join(KEYS)} (each a list; "
                   "server_args a mapping of SGLang argument to list)")
    for key in ("gpus", "tp", "replicas", "models", "quantization", "policies",
                "kv_allocators", "routers", "step_time_backends"):
        s.add_argument("--" + key.replace("_", "-"), default=None, metavar="A,B,...",
                       help=f"comma list for the space's {key!r} (over --space's)")
    s.add_argument("--no-refine", dest="refine", action="store_false",
                   help="without --space: skip the second stage (every registry policy on "
                   "the best hardware)")
    r = p.add_argument_group("run and output")
    r.add_argument("--out", type=Path, required=True,
                   help="output directory; a rerun with the same question resumes there")
    r.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: the machine's cores; 1 = serial)")
    r.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the candidates as Ray tasks on the cluster at ADDRESS ('auto', "
                   "'ray://host:port', or 'local' for a local Ray); needs the ray extra")
    r.add_argument("--prices", type=Path, default=None,
                   help="JSON/YAML {gpu: usd_per_gpu_hour} (default: the table in "
                   "experiments/plan/prices.py, with its sources)")
    r.add_argument("--ramp-step-s", type=float, default=60.0,
                   help="seconds per ramp step (25, 50, ..., 200 %% of the target; default 60)")
    r.add_argument("--window-s", type=float, default=60.0,
                   help="alert-rule window in simulated seconds (default 60)")
    r.add_argument("--no-ramp", dest="ramp", action="store_false", help="skip the ramp")
    r.add_argument("--no-report", dest="report", action="store_false",
                   help="skip report.html (experiments/report/plan_page.py)")
    r.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=run, _parser=p)


def run(ns: argparse.Namespace) -> int:
    from experiments.plan.plan import PlanSettings, run_plan
    from experiments.plan.prices import load_prices
    from experiments.plan.question import parse_slo
    from experiments.plan.run import default_jobs
    from twin.inputs import COUNT, POSITIVE, check
    from twin.outputs import check_out_dir

    check_out_dir(ns.out)
    jobs = int(check("--jobs", ns.jobs, COUNT)) if ns.jobs is not None else default_jobs()
    for flag in ("ramp_step_s", "window_s"):
        check("--" + flag.replace("_", "-"), getattr(ns, flag), POSITIVE)
    source = _source(ns)
    space = _space(ns)
    slos = tuple(parse_slo(x) for x in (ns.slo or ["ttft:p99:1.5"]))
    from experiments.plan.question import build_question

    kind, value = ("rps", ns.target_rps) if ns.target_rps is not None else (
        "scale", ns.target_scale if ns.target_scale is not None else 1.0)
    if not ns.quiet:
        print("building the question ...", file=sys.stderr, flush=True)
    q = build_question(source, _requests(ns, source), kind, value, slos, ns.precision)
    gpus = sorted({c.gpu for c in space.candidates()})
    prices, price_source = load_prices(ns.prices, gpus)
    settings = PlanSettings(ns.out, jobs, ns.ray, prices, price_source,
                            refine_policies=ns.space is None and ns.refine and not
                            _space_flags(ns), ramp_step_s=ns.ramp_step_s,
                            window_s=ns.window_s, ramp=ns.ramp, report=ns.report,
                            quiet=ns.quiet)
    print(f"question: {q.workload} at {q.target_rps:.4g} requests/s ({q.peak_from}); SLOs "
          f"{', '.join(s.name for s in slos)}; {len(space.candidates())} candidates, "
          f"{jobs if not ns.ray else 'ray'} worker(s)")
    import signal

    def stop(signum, frame):  # a kill stops the workers too (finished candidates are kept)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        plan = run_plan(q, source, space, settings)
    except KeyboardInterrupt:
        done = len(list((Path(ns.out) / "candidates").glob("*.json")))
        print(f"interrupted: {done} of {len(space.candidates())} candidates finished, kept in "
              f"{Path(ns.out) / 'candidates'}; the same command resumes from them",
              file=sys.stderr)
        return 130
    _print(plan, ns.out)
    return 0


def _requests(ns: argparse.Namespace, source) -> int | None:
    from twin.inputs import COUNT, check

    if ns.requests is not None:
        return int(check("--requests", ns.requests, COUNT))
    if source.kind == "preset":
        return DEFAULT_REQUESTS
    return ns.trace_limit


def _source(ns: argparse.Namespace):
    from experiments.plan.question import WorkloadSource
    from twin.workload import PRESETS

    if ns.trace is not None:
        if ns.workload is not None:
            raise ConfigError("give exactly one of --workload SPEC and --trace FILE")
        if not ns.trace_format:
            from twin.traces import formats

            raise ConfigError(f"--trace needs --trace-format ({', '.join(formats())})")
        return WorkloadSource("trace", str(ns.trace), ns.seed, ns.trace_format,
                              ns.trace_time_scale, ns.trace_offset)
    name = ns.workload or "finance-qa"
    if name not in PRESETS and "=" not in name:
        raise ConfigError(f"--workload {name!r}: not a preset ({', '.join(PRESETS)}) and not "
                          "a key=value spec")
    return WorkloadSource("preset" if name in PRESETS else "spec", name, ns.seed)


def _space_flags(ns: argparse.Namespace) -> dict:
    out = {}
    for key in ("gpus", "tp", "replicas", "models", "quantization", "policies",
                "kv_allocators", "routers", "step_time_backends"):
        text = getattr(ns, key)
        if text is None:
            continue
        items = [x.strip() for x in text.split(",") if x.strip()]
        if key in ("tp", "replicas"):
            try:
                items = [int(x) for x in items]
            except ValueError:
                raise ConfigError(f"--{key} {text!r}: a comma list of integers") from None
        if key in ("quantization", "step_time_backends"):
            items = [None if x in ("none", "null") else x for x in items]
        out[key] = items
    return out


def _space(ns: argparse.Namespace):
    from experiments.plan.space import DEFAULT_SPACE, Space, load_space, parse_space

    flags = _space_flags(ns)
    if ns.space is not None:
        base = load_space(ns.space)
        if not flags:
            return base
        return parse_space({**base.values, **flags}, f"{ns.space} + flags")
    if flags:
        return parse_space(flags, "<flags>")
    return Space(dict(DEFAULT_SPACE), "<default: the users' question>")


def _print(plan: dict, out: Path) -> None:
    rows = {r["id"]: r for r in plan["candidates"]}
    c = plan["counts"]
    print(f"candidates: {c['ok']} ran ({c['meet_slo']} meet every SLO at the target), "
          f"{c['infeasible']} infeasible, {c['error']} errors")
    rid = plan["winner"] or plan["closest"]
    if rid:
        r = rows[rid]
        a = r["at_target"]
        head = "winner" if plan["winner"] else "no candidate meets every SLO; closest"
        ml = r["max_load"]["rps"]
        print(f"{head}: {rid} {r['label']}: ${r['cost_per_hour']:.2f}/h, P99 TTFT "
              f"{a['ttft_p99_s']:.3f} s, SLO attainment {a['slo_attainment']:.1%}, max load "
              + (f"{ml:.4g} requests/s (headroom {r['headroom']:+.0%})" if ml is not None
                 else "none found"))
    ramp = plan.get("ramp")
    if ramp:
        breaks = ", ".join(f"{k} at {v} %" if v else f"{k} holds to 200 %"
                           for k, v in ramp["first_break"].items())
        print(f"ramp on {ramp['candidate']}: {breaks}; alerts: {len(ramp['alerts'])}")
    print(f"wrote {out}/plan.json, winner.txt, candidates/, ramp/"
          + (", report.html" if (out / "report.html").is_file() else ""))
