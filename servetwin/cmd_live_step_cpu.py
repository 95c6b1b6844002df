"""`servetwin live step-cpu`: measure a live SGLang server's scheduler CPU per decode step
(calibration/step_cpu.py) and write it for `simulate --step-cpu FILE` and a fleet
replica's `twin: {step_cpu: FILE}`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from servetwin.cli import UserError

DEFAULT_BATCHES = [1, 8, 32, 64, 128]


def register_step_cpu(sub) -> None:
    p = sub.add_parser(
        "step-cpu", help="measure a live SGLang server's scheduler CPU per decode step",
        description="Send batches of B streamed requests at once (fixed lengths, "
        "ignore_eos) to a live SGLang 0.5.23 server that runs servetwin's step probe, read "
        "the probe's timings of every scheduler-loop step (the model's forward and sampling "
        "taken out) and fit the CPU work per decode step as per_step_s + per_request_s x "
        "batch. The server must run on this machine with servetwin's plugin and "
        "SGLANG_PLUGINS=servetwin SERVETWIN_STEP_PROBE=PREFIX in its environment (`servetwin "
        "live serve-cpu --step-probe PREFIX` on the CPU harness). The output is what "
        "`servetwin simulate --step-cpu FILE` and a fleet replica's `twin: {step_cpu: FILE}` "
        "read: the roofline and opdb backends then charge this host's scheduler CPU instead "
        "of SGLang 0.5.23's default measured on the CPU harness (docs/calibration.md).")
    p.add_argument("--url", required=True, help="the live server, e.g. http://127.0.0.1:30000")
    p.add_argument("--probe", required=True, type=Path, metavar="PREFIX",
                   help="the server's SERVETWIN_STEP_PROBE (its files are PREFIX.<pid>)")
    p.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    p.add_argument("--batches", type=int, nargs="+", default=DEFAULT_BATCHES, metavar="B",
                   help="batch sizes, one point each (default: "
                   f"{' '.join(map(str, DEFAULT_BATCHES))}; at most the server's "
                   "--max-running-requests)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output", type=int, default=48,
                   help="output tokens per request (default 48, at least 8)")
    p.add_argument("--rounds", type=int, default=1,
                   help="sweeps of the batch sizes, interleaved (default 1)")
    p.set_defaults(func=run_step_cpu)


def run_step_cpu(ns: argparse.Namespace) -> int:
    from calibration.profiles import machine
    from calibration.step_cpu import section, sweep
    from runtime.server_api import ReplayError, probe
    from twin.outputs import atomic_write_text, check_out_file

    batches = sorted(set(ns.batches))
    if batches[0] < 1:
        raise UserError(f"--batches {ns.batches}: batch sizes must be >= 1")
    if len(batches) < 2:
        raise UserError(f"--batches {ns.batches}: give at least two sizes (the fit has two "
                        "parameters)")
    if ns.prompt < 1 or ns.output < 8 or ns.rounds < 1:
        raise UserError(f"--prompt {ns.prompt} (>= 1), --output {ns.output} (>= 8), --rounds "
                        f"{ns.rounds} (>= 1)")
    if not ns.probe.parent.is_dir():
        raise UserError(f"--probe {ns.probe}: no directory {ns.probe.parent} on this machine "
                        "(the server's probe writes there)")
    check_out_file(ns.out, "--out")
    try:
        facts = probe(ns.url)
        limit = facts.info.get("max_running_requests")
        if isinstance(limit, int) and limit > 0 and batches[-1] > limit:
            raise UserError(f"--batches up to {batches[-1]}: the server runs at most {limit} "
                            "requests (--max-running-requests); a batch that large never "
                            "decodes whole")
        print(f"step CPU of {ns.url} (SGLang {facts.version}): batches {batches}, "
              f"prompt {ns.prompt}, output {ns.output}, {ns.rounds} round(s)", flush=True)
        load0 = os.getloadavg()[0]
        points = sweep(ns.url, ns.probe, batches, ns.prompt, ns.output, ns.rounds,
                       progress=lambda s: print(s, flush=True))
        sec = section(points)
    except (ReplayError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    out = {"step_cpu": sec,
           "server": {"url": ns.url, "version": facts.version,
                      "model_path": facts.info.get("model_path"),
                      "tp_size": facts.info.get("tp_size"),
                      "disable_overlap_schedule": facts.info.get("disable_overlap_schedule")},
           "workload": {"batches": batches, "prompt": ns.prompt, "output": ns.output,
                        "rounds": ns.rounds},
           "measured_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
           "machine": machine(), "load_average": [round(load0, 2),
                                                  round(os.getloadavg()[0], 2)]}
    atomic_write_text(ns.out, json.dumps(out, indent=1) + "\n")
    print(f"per step {sec['per_step_s'] * 1e3:.3f} ms + {sec['per_request_s'] * 1e6:.2f} us x "
          f"batch (max |residual| {sec['max_residual_s'] * 1e3:.3f} ms); wrote {ns.out} "
          f"(for simulate --step-cpu {ns.out}, or a fleet replica's twin: {{step_cpu: ...}})")
    return 0
