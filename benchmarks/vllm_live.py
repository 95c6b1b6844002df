"""The twin's vLLM V1 replica against a real vLLM 0.32 CPU server.

    python benchmarks/vllm_live.py [--budget-s 120] [--no-write] [--out out/vllm_live]

Starts one vLLM server on the CPU harness (experiments/vllm_live.SERVER_ARGS) behind the
length router's `/generate` front, profiles its step times (calibration/vllm.py, within
--budget-s), replays the four scenarios of experiments/vllm_live.py live and in the twin
(the profile's step times and request path), prints the twin-vs-live table and rewrites
the vLLM results section of docs/fleet-live.md. The profile and every run's records go
to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import vllm_live as vl  # noqa: E402
from twin.metrics import write_records  # noqa: E402

DOC = ROOT / "docs" / "fleet-live.md"
START, END = "<!-- vllm-results:start -->", "<!-- vllm-results:end -->"


def machine() -> str:
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; load average {os.getloadavg()[0]:.1f} at the start")


def describe(name: str) -> str:
    work = vl.workload(name)
    if name == "prefix":
        return f"`{vl.PREFIX_SPEC}` (seed 0)"
    r = work.requests
    if len({(q.prompt_tokens, q.output_tokens) for q in r}) > 1:
        return ", ".join(f"{q.rid} {q.prompt_tokens} + {q.output_tokens} tokens at "
                         f"{q.arrival_s:g} s" for q in r)
    gap = r[1].arrival_s - r[0].arrival_s if len(r) > 1 else 0.0
    return (f"{len(r)} requests of {r[0].prompt_tokens} + {r[0].output_tokens} tokens, "
            f"{gap:g} s apart")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=120.0, help="profiling budget")
    ap.add_argument("--out", default="out/vllm_live")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite the doc")
    ns = ap.parse_args()
    from calibration.vllm import profile as run_profile
    from runtime.length_router import LengthRouterProcess, Pool
    from runtime.vllm_cpu.serve import VllmServer

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = machine()
    rows = []
    with VllmServer(vl.cli_args(), log_path=out / "vllm.log") as engine, \
            LengthRouterProcess([Pool("vllm", engine.url, "vllm", None)],
                                log_path=out / "front.log") as front:
        print(f"vLLM ready in {engine.start_seconds:.0f} s; profiling ({ns.budget_s:.0f} s)",
              flush=True)
        prof = run_profile(front.url, engine.url, vl.limits(), out / "profile.json",
                           ns.budget_s, vl.VOCAB, vl.SERVER_ARGS, log=lambda _: None)
        model_dir = str(engine.harness.model_dir)
        for name in vl.SCENARIOS:
            work = vl.workload(name)
            live, delta = vl.replay_scenario(front.url, engine.url, work)
            twin = vl.simulate(work, model_dir, prof)
            write_records(out / f"{name}-live.jsonl", live)
            write_records(out / f"{name}-twin.jsonl", twin.records)
            (out / f"{name}-metrics.json").write_text(json.dumps(delta, indent=1) + "\n")
            rows += [vl.live_row(name, live, delta), vl.twin_row(name, twin)]
            print(f"  {name} done", flush=True)
    text = report(stamp, where, prof, rows)
    print(text)
    if not ns.no_write:
        doc = DOC.read_text()
        head, _, rest = doc.partition(START)
        _, _, tail = rest.partition(END)
        DOC.write_text(head + START + "\n" + text + "\n" + END + tail)
    return 0


def report(stamp: str, where: str, prof: dict, rows: list[dict]) -> str:
    c = prof["step_time"]["coefficients"]
    fit = prof["fit"]
    args = " ".join(vl.cli_args())
    lines = [f"Measured {stamp} on {where}.", "",
             f"Live: vLLM 0.32.0 (CPU harness, tiny dummy Llama, `{args}`, block size 128, "
             "one OpenMP thread) behind the length router's `/generate` front. Twin: "
             "`VllmReplica` with the same arguments, step times of a vLLM profile made just "
             f"before ({prof['runs']} runs, {fit['samples']} samples "
             f"{fit['samples_by_source']}; linear: step {c['step'] * 1e3:.1f} ms, "
             f"{c['prefill_token'] * 1e6:.0f} us per prefill token, "
             f"{c['decode_request'] * 1e3:.2f} ms per decode request; median |residual| "
             f"{fit['residuals']['median_abs_rel']:.0%}), request path "
             f"{prof['request_path']['total_s'] * 1e3:.0f} ms added to TTFT and E2E.", ""]
    lines += [f"- `{n}`: {describe(n)}" for n in vl.SCENARIOS]
    lines += ["", vl.fmt_table(rows), "",
              "`steps`: engine steps that emitted a token (live: "
              "`vllm:iteration_tokens_total` count); `chunk_steps`: steps that carried a "
              "chunk of the long prompt; `max_running`: most requests between first and "
              "last token at once; `fcfs`: first tokens in arrival order; `queue_mean_s` "
              "live: `vllm:request_queue_time_seconds` sum / count.", "",
              "Printed by `python benchmarks/vllm_live.py`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
