"""`servetwin calibrate` and `servetwin validate`: argument parsing and printing.

calibrate profiles a live SGLang server (or reads runs already made) and writes a
calibration profile; validate replays a held-out workload live and in the calibrated twin
and prints the fidelity table (calibration/, docs/calibration.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servetwin.args import add_workload_args
from twin.errors import ConfigError
from twin.hardware import GPUS
from twin.workload import SPEC_HELP


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the twin's step time to a live SGLang or vLLM server",
        description="Profile a live SGLang server (prefill, decode and mixed runs within a "
        "time budget; resumable) and/or read earlier runs, fit the step-time model, and "
        "write a calibration profile. Raw traces go to PROFILE.runs.jsonl and samples to "
        "PROFILE.samples.jsonl as they are taken; running again with the same --out "
        "resumes. A vLLM V1 server (its OpenAI API; found by /v1/models) is profiled the "
        "same way through servetwin's length router, with samples from vLLM's own "
        "/metrics histograms; give it --max-num-seqs and --max-num-batched-tokens (vLLM "
        "reports neither). The profile records the engine, model and device, and is "
        "refused for another engine (docs/calibration.md).")
    p.add_argument("--url", help="the live server, e.g. http://127.0.0.1:30000")
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="time for the profiling runs, seconds (default 300; 0: no new runs, "
                   "refit on the runs a resumable profile already holds)")
    p.add_argument("--from-records", type=Path, action="append", default=[], metavar="DIR",
                   help="also fit on a `servetwin live replay --out` directory (repeatable)")
    p.add_argument("--from-bench-serving", type=Path, action="append", default=[],
                   metavar="FILE", help="also fit on a bench_serving --output-details file "
                   "(repeatable)")
    p.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="the server's GPU type, recorded in the profile as its device "
                   "(SGLang's /server_info does not name it); not for a CPU server")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="a vLLM server's --max-num-seqs (required for vLLM: its API does "
                   "not report it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="a vLLM server's --max-num-batched-tokens, its token budget per "
                   "step (required for vLLM)")
    p.set_defaults(func=run_calibrate)

    v = sub.add_parser(
        "validate", help="replay a held-out workload live and in the calibrated twin",
        description="Replay a workload on the live server and simulate the same requests "
        "in the twin with the server's own arguments (from /server_info) and the profile's "
        "step time; print the fidelity table (errors (twin - live) / live) and write "
        "live/ and twin/ records, fidelity.md and report.html to --out.", epilog=SPEC_HELP)
    v.add_argument("--url", required=True, help="the live server")
    v.add_argument("--calibration", type=Path, required=True, metavar="PROFILE",
                   help="a profile from `servetwin calibrate`")
    add_workload_args(v)
    v.add_argument("--out", type=Path, default=Path("out/validate"),
                   help="output directory (default out/validate)")
    v.add_argument("--force", action="store_true",
                   help="use a profile made on another model, SGLang version or device "
                   "(warns)")
    v.set_defaults(func=run_validate)


def run_calibrate(ns: argparse.Namespace) -> int:
    from calibration.offline import from_bench_serving, from_record_dir
    from calibration.profiles import build_profile, identity, write_profile
    from twin.inputs import NON_NEGATIVE, check
    from twin.outputs import check_out_file

    if not ns.url and not ns.from_records and not ns.from_bench_serving:
        raise ConfigError("give --url (profile a live server) and/or --from-records / "
                          "--from-bench-serving (fit on runs already made)")
    check("--budget-s", ns.budget_s, NON_NEGATIVE)
    check_out_file(ns.out)
    if ns.url:
        from calibration.vllm import is_vllm

        if is_vllm(ns.url.rstrip("/")):
            return _calibrate_vllm(ns)
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(ns, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: only for a vLLM server; "
                              f"{ns.url or 'the offline inputs'} is not one (an SGLang "
                              "server reports its limits in /server_info)")
    samples, info, sources = [], None, []
    if ns.url:
        try:
            samples, info = _profile_live(ns.url.rstrip("/"), ns.out, ns.budget_s)
        except KeyboardInterrupt:
            runs = ns.out.with_suffix(".runs.jsonl")
            print(f"\nservetwin calibrate: interrupted (Ctrl-C): the runs finished are kept in "
                  f"{runs} (the one in progress is not); no profile written. Run the same "
                  "command again to resume, or add --budget-s 0 to fit on those runs only",
                  file=sys.stderr)
            return 130
        sources.append(f"live profile of {ns.url} ({ns.out.with_suffix('.runs.jsonl')})")
    for path, reader in [(d, from_record_dir) for d in ns.from_records] + \
            [(f, from_bench_serving) for f in ns.from_bench_serving]:
        got, got_info = reader(path)
        if info is not None and identity(got_info) != identity(info):
            raise ConfigError(f"{path} measured another server ({identity(got_info)}) than "
                              f"the rest ({identity(info)}); calibrate them separately")
        info = info or got_info
        samples += got
        sources.append(f"{path} ({len(got)} samples)")
    profile = build_profile(samples, info or {}, sources, gpu=ns.gpu)
    write_profile(ns.out, profile)
    print(describe(profile))
    print(f"wrote {ns.out}")
    return 0


def _calibrate_vllm(ns: argparse.Namespace) -> int:
    """`calibrate --url` of a vLLM server (calibration/vllm.py)."""
    from calibration.profile import Bar
    from calibration.profiles import write_profile
    from calibration.vllm import calibrate, describe
    from twin.inputs import COUNT, check

    url = ns.url.rstrip("/")
    if ns.from_records or ns.from_bench_serving or ns.gpu:
        flag = ("--from-records" if ns.from_records else "--from-bench-serving"
                if ns.from_bench_serving else "--gpu")
        raise ConfigError(f"{flag}: not for a vLLM server ({url}); vLLM profiles come from "
                          "live runs only")
    missing = [f for f in ("max_num_seqs", "max_num_batched_tokens")
               if getattr(ns, f) is None]
    if missing:
        raise ConfigError(f"{url} is a vLLM server, whose API reports neither max_num_seqs "
                          "nor max_num_batched_tokens: give the values it was started with, "
                          + " ".join(f"--{f.replace('_', '-')} N" for f in missing))
    check("--max-num-seqs", ns.max_num_seqs, COUNT)
    check("--max-num-batched-tokens", ns.max_num_batched_tokens, COUNT)
    try:
        prof = calibrate(url, ns.out, ns.budget_s, ns.max_num_seqs, ns.max_num_batched_tokens,
                         progress_factory=Bar)
    except KeyboardInterrupt:
        print(f"\nservetwin calibrate: interrupted (Ctrl-C): the runs finished are kept in "
              f"{ns.out.with_suffix('.runs.jsonl')} (the one in progress is not); no profile "
              "written. Run the same command again to resume, or add --budget-s 0 to fit on "
              "those runs only", file=sys.stderr)
        return 130
    write_profile(ns.out, prof)
    print(describe(prof))
    print(f"wrote {ns.out}")
    return 0


def _profile_live(url: str, out: Path, budget_s: float):
    from calibration.profile import Bar, ServerLimits, Store, all_samples, make_plan, profile
    from calibration.profiles import identity
    from calibration.session import server_facts

    facts = server_facts(url)
    lim = ServerLimits.from_info(facts.info)
    store = Store(out, identity(facts.info))
    store.load()
    print(f"server: SGLang {facts.version}, model {facts.info.get('model_path')}; limits: "
          f"max running {lim.max_running}, KV pool {lim.max_total_tokens} tokens, chunk "
          f"{lim.chunk}, max input {lim.max_input}"
          + (f"; resuming after {len(store.done)} runs" if store.done else ""))
    bar = Bar(len(make_plan(lim)), budget_s)
    counts = profile(url, store, lim, facts.vocab_size, budget_s, bar)
    bar.close()
    print(f"runs: {counts['ran']} now, {counts['resumed']} resumed, {counts['over_budget']} "
          f"left out by the budget, of {counts['planned']} planned; failed requests "
          f"{counts['failed_requests']}")
    return all_samples(store, lim), facts.info


def describe(profile: dict) -> str:
    from calibration.profiles import describe_fit

    lines = describe_fit(profile, "SGLang")
    rp = profile["request_path"]
    lines.append(f"request path: ingress {rp['ingress_s'] * 1e3:.1f} ms, egress "
                 f"{rp['egress_s'] * 1e3:.1f} ms ({rp['overhead_samples']} samples)")
    if "per_request_s" in rp:  # the tokenizer manager's costs (simulate --calibration)
        lines.append(f"tokenizer: {rp['per_request_s'] * 1e3:.3f} ms per request + "
                     f"{rp['per_token_s'] * 1e6:.3f} us per prompt token, then "
                     f"{rp['latency_s'] * 1e3:.1f} ms ({rp['tokenizer_samples']} gaps)")
    return "\n".join(lines)


def run_validate(ns: argparse.Namespace) -> int:
    from calibration.validate import format_step_check, validate
    from servetwin.args import workload_from
    from servetwin.cmd_live_replay import Progress
    from twin.outputs import check_out_dir

    workload = workload_from(ns)
    check_out_dir(ns.out)
    progress = Progress(len(workload.requests))
    try:
        v = validate(ns.url.rstrip("/"), ns.calibration, workload, ns.out, ns.force, ns.seed,
                     progress)
    except KeyboardInterrupt:
        kept = (f"the live run so far is in {ns.out}/live (every request recorded, "
                "summary.json marked partial)" if (ns.out / "live" / "summary.json").exists()
                else "nothing was replayed yet")
        print(f"\nservetwin validate: interrupted (Ctrl-C): {kept}; no comparison made",
              file=sys.stderr)
        return 130
    progress.close()
    print(f"workload: {workload.name} ({len(workload.requests)} requests); twin step time: "
          f"{v.backend}")
    print("twin deployment: the server's own arguments (/server_info)" + (
        "; the profile recorded other values (the twin follows the server): "
        + "; ".join(v.deployment) if v.deployment else ", the same as the profile's"))
    print(v.table())
    print(format_step_check(v.step_check, v.rescaled))
    for w in v.warnings:
        print(f"warning: {w}")
    print(f"wrote {ns.out}/live, {ns.out}/twin, {ns.out}/fidelity.md, {ns.out}/report.html")
    return 0
