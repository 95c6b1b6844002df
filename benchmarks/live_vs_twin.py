"""One workload on the real CPU SGLang server and in the twin (uncalibrated), side by side.

    python benchmarks/live_vs_twin.py [--workload SPEC] [--seed N] [--out DIR] [--no-write]
                                      [SGLang args ...]

Starts the CPU harness server, replays the workload on it (`runtime.client`), simulates
the same workload in the twin with the server's own configuration (from `/server_info`)
and the uncalibrated CPU roofline guess (`twin.perf.cpu_guess`), prints the comparison
table (twin = A, live = B, errors (A - B) / B) with the workload, machine, date and the
client's lateness, and writes it into docs/live.md between the results markers. The two
record directories stay in --out for `servetwin live compare`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402  (one description of the machine)
from runtime.client import ReplayConfig, replay  # noqa: E402
from runtime.cpu.serve import CpuServer  # noqa: E402
from runtime.server_api import probe, twin_server_args  # noqa: E402
from twin.compare import compare_records, format_markdown, format_table  # noqa: E402
from twin.config import derive_capacity  # noqa: E402
from twin.perf.cpu_guess import cpu_step_time  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import get_workload  # noqa: E402

DOC = ROOT / "docs" / "live.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
DEFAULT_WORKLOAD = ("arrival=poisson,rate=1,n=60,prompt=uniform:64:512,output=uniform:16:64,"
                    "templates=4,template_len=256,share=0.5")



def run(spec: str, seed: int, out: Path, sglang_args: list[str]):
    """(terminal report, Markdown report, the live `ReplayResult`)."""
    workload = get_workload(spec, seed)
    with CpuServer(sglang_args) as server:
        print(f"server ready in {server.start_seconds:.0f} s at {server.url}", flush=True)
        facts = probe(server.url)
        load = os.getloadavg()[0]
        live = replay(workload, ReplayConfig(url=server.url, seed=seed), facts=facts)
    live.write(out / "live")
    args = twin_server_args(facts.info)
    cap = derive_capacity(args, "a100-pcie-80gb")  # the KV pool is pinned by --max-total-tokens
    step = cpu_step_time(cap, args)
    twin = simulate(workload, SimConfig(args=args), step_time=step)
    twin.write(out / "twin")
    cmp = compare_records(twin.records, live.records)
    late = live.lateness
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [
        f"Measured {stamp} on {machine()}; load average {load:.1f} when the replay started "
        "(the machine is shared).",
        f"Workload: `{spec}` (seed {seed}, {len(workload.requests)} requests, open loop).",
        f"Live: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, "
        f"SGLang {facts.version}, CPU harness model `{Path(str(facts.info['model_path'])).name}`, "
        f"max_total_tokens {args.max_total_tokens}, chunked_prefill_size "
        f"{args.chunked_prefill_size}, max_running_requests {args.max_running_requests}.",
        f"Twin: the same server arguments, step time `{step.describe()}`.",
        f"Client lateness (ms): P50 {late['p50']}, P99 {late['p99']}, max {late['max']} "
        f"(bound P99 <= {live.meta['max_lateness_ms']:g}).",
    ]
    cmd = f"servetwin live compare {out / 'twin'} {out / 'live'}"
    terminal = "\n".join(head + ["", format_table(cmp, "twin", "live"), "", f"again: {cmd}"])
    rel = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    markdown = "\n".join(["", *(f"- {line}" for line in head), "",
                          format_markdown(cmp, "twin", "live"), "",
                          "Printed by `python benchmarks/live_vs_twin.py`; again from the saved "
                          f"records by `servetwin live compare {rel}/twin {rel}/live`.", ""])
    return terminal, markdown, live


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the results markers")
    before, rest = doc.split(START, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(before + START + "\n" + text + END + after)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "live_vs_twin")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/live.md")
    parser.add_argument("--omp-threads", default="1",
                        help="OMP_NUM_THREADS for the server (default 1; 'inherit' keeps the "
                        "environment's). torch's default of one thread per core collapses "
                        "when another process competes for the cores: see docs/live.md")
    ns, sglang_args = parser.parse_known_args()
    if ns.omp_threads != "inherit":
        os.environ["OMP_NUM_THREADS"] = ns.omp_threads  # inherited by the server
    terminal, markdown, live = run(ns.workload, ns.seed, ns.out, sglang_args)
    print(terminal)
    if not ns.no_write:
        write_doc(markdown)
        print(f"wrote {DOC}")
    live.check()  # a stopped run or a late client: say so, exit non-zero
    return 0


if __name__ == "__main__":
    sys.exit(main())
