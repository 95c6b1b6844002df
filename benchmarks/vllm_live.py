"""The twin's vLLM V1 replica against a real vLLM 0.32 CPU server, before and after vLLM's
own calibration, side by side.

    python benchmarks/vllm_live.py [--budget-s 120] [--no-write] [--out out/vllm_live]

Starts one vLLM server on the CPU harness (experiments/vllm_live.SERVER_ARGS) behind the
length router's `/generate` front, profiles its step times once (calibration/vllm.py,
within --budget-s) and fits the same runs twice: "before", token gaps read under SGLang's
rules as the first vLLM profiles did (calibration/derive.py, plus lone prefills), and
"after", under vLLM's rules with vLLM's own prefill and decode histograms
(calibration/vllm_derive.py). Replays the four scenarios of experiments/vllm_live.py live
and simulates each with both profiles through a deployment's `calibration:` key (the
profile's request path added), and prints the twin-vs-live table, the latency gap
(TTFT, queue, E2E) before and after, and the step-time check (the live scenarios' own
steps against the profile: the machine's drift); rewrites the vLLM results section of
docs/fleet-live.md. The profiles and every run's records go to --out.
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
GAP = (("ttft_mean_s", "TTFT mean"), ("ttft_p50_s", "TTFT P50"), ("queue_mean_s", "queue mean"),
       ("e2e_mean_s", "E2E mean"))


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
    from calibration.vllm import fit_profile, server_facts
    from calibration.vllm import profile as run_profile
    from runtime.length_router import LengthRouterProcess, Pool
    from runtime.vllm_cpu.serve import VllmServer

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = machine()
    rows, gaps, checks = [], [], {}
    with VllmServer(vl.cli_args(), log_path=out / "vllm.log") as engine, \
            LengthRouterProcess([Pool("vllm", engine.url, "vllm", None)],
                                log_path=out / "front.log") as front:
        print(f"vLLM ready in {engine.start_seconds:.0f} s; profiling ({ns.budget_s:.0f} s)",
              flush=True)
        facts = server_facts(engine.url)
        after_path, before_path = out / "profile.json", out / "profile-sglang-rules.json"
        after = run_profile(front.url, engine.url, vl.limits(), after_path, ns.budget_s,
                            vl.VOCAB, vl.SERVER_ARGS, log=lambda _: None, facts=facts)
        runs = [json.loads(x) for x in after_path.with_suffix(".runs.jsonl").read_text()
                .splitlines() if x.strip()]
        before = fit_profile(runs, vl.limits(), vl.SERVER_ARGS, facts, rules="sglang")
        before_path.write_text(json.dumps(before, indent=2) + "\n")
        model_dir = str(engine.harness.model_dir)
        for name in vl.SCENARIOS:
            work = vl.workload(name)
            live, delta = vl.replay_scenario(front.url, engine.url, work)
            twin_b = vl.simulate(work, model_dir, before_path)
            twin_a = vl.simulate(work, model_dir, after_path)
            checks[name] = check = vl.step_check(live, after)
            twin_s = vl.simulate(work, model_dir, vl.scaled(after, check["total_ratio"] or 1.0))
            write_records(out / f"{name}-live.jsonl", live)
            write_records(out / f"{name}-twin.jsonl", twin_a.records)
            write_records(out / f"{name}-twin-before.jsonl", twin_b.records)
            (out / f"{name}-metrics.json").write_text(json.dumps(delta, indent=1) + "\n")
            lrow, brow, arow, srow = (vl.live_row(name, live, delta), vl.twin_row(name, twin_b),
                                      vl.twin_row(name, twin_a), vl.twin_row(name, twin_s))
            brow["side"], arow["side"] = "twin before", "twin after"
            rows += [lrow, arow]
            gaps.append((name, lrow, brow, arow, srow))
            print(f"  {name} done", flush=True)
    text = report(stamp, where, after, before, rows, gaps, checks)
    print(text)
    if not ns.no_write:
        doc = DOC.read_text()
        head, _, rest = doc.partition(START)
        _, _, tail = rest.partition(END)
        DOC.write_text(head + START + "\n" + text + "\n" + END + tail)
    return 0


def _fit_line(prof: dict) -> str:
    c, fit = prof["step_time"]["coefficients"], prof["fit"]
    by = fit["residuals_by_kind"]
    kinds = ", ".join(f"{k} {v['median_abs_rel']:.0%}/{v['p90_abs_rel']:.0%}"
                      for k, v in by.items() if v.get("n"))
    return (f"{fit['samples']} samples {fit['samples_by_source']}; step "
            f"{c['step'] * 1e3:.1f} ms, {c['prefill_token'] * 1e6:.0f} us per prefill token, "
            f"{c['decode_request'] * 1e3:.2f} ms per decode request, "
            f"{c['decode_kv_token'] * 1e6:.2f} us per KV token; {prof['step_time']['target']} "
            f"target; median/P90 |residual| by kind: {kinds}")


def _pct(twin, live) -> str:
    if twin is None or live is None or live < 0.001:
        return "-"  # a queue under a millisecond is vLLM's bookkeeping
    return f"{(twin - live) / live:+.0%}"


def gap_table(gaps) -> str:
    out = ["| scenario | metric | live (s) | twin before (s) | twin after (s) | error before | "
           "error after | after x drift: error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, live, before, after, drift in gaps:
        for key, label in GAP:
            lv, bv, av = live[key], before[key], after[key]
            out.append(f"| {name} | {label} | {vl._cell(lv)} | {vl._cell(bv)} | "
                       f"{vl._cell(av)} | {_pct(bv, lv)} | {_pct(av, lv)} | "
                       f"{_pct(drift[key], lv)} |")
    return "\n".join(out)


def mean_abs(gaps, side: int) -> str:
    errs = [abs(g[side][k] - g[1][k]) / g[1][k] for g in gaps for k, _ in GAP
            if k != "queue_mean_s" and g[1][k] and g[side][k] is not None]
    return f"{sum(errs) / len(errs):.1%}" if errs else "-"


def report(stamp: str, where: str, after: dict, before: dict, rows: list[dict], gaps,
           checks: dict) -> str:
    args = " ".join(vl.cli_args())
    lines = [f"Measured {stamp} on {where}.", "",
             f"Live: vLLM {after['engine']['version']} (CPU harness, tiny dummy Llama, "
             f"`{args}`, block size 128, one OpenMP thread) behind the length router's "
             "`/generate` front. Twin: `VllmReplica` with the same arguments through a "
             "deployment's `calibration:` key, step times fitted on one profiling session "
             f"made just before ({after['runs']} runs) read two ways, the profile's request "
             f"path ({after['request_path']['total_s'] * 1e3:.0f} ms) added to TTFT and E2E:",
             "",
             f"- before (token gaps under SGLang's rules, as the first vLLM profiles): "
             f"{_fit_line(before)};",
             f"- after (vLLM's rules and its prefill/decode histograms, "
             f"`servetwin calibrate`): {_fit_line(after)}.", ""]
    lines += [f"- `{n}`: {describe(n)}" for n in vl.SCENARIOS]
    lines += ["", vl.fmt_table(rows), "",
              "`steps`: engine steps that emitted a token (live: "
              "`vllm:iteration_tokens_total` count); `chunk_steps`: steps that carried a "
              "chunk of the long prompt; `max_running`: most requests between first and "
              "last token at once; `fcfs`: first tokens in arrival order; `queue_mean_s` "
              "live: `vllm:request_queue_time_seconds` sum / count.", "",
              "The latency gap, twin against live, before and after (errors (twin - live) "
              "/ live):", "", gap_table(gaps), "",
              f"Mean |error| over TTFT mean/P50 and E2E mean of the four scenarios: before "
              f"{mean_abs(gaps, 2)}, after {mean_abs(gaps, 3)}, after x drift "
              f"{mean_abs(gaps, 4)}.", "",
              "Step-time check (the live scenarios' own token-gap steps, vLLM's rules, "
              "measured / the after profile's prediction: median, and sum / sum): " + ", ".join(
                  f"{n} {c['ratio']} / {c['total_ratio']} ({c['samples']} steps)"
                  for n, c in checks.items())
              + ". `after x drift`: the after profile with every step scaled by that scenario's "
              "sum / sum, i.e. the twin on a machine as slow as the live run measured it (a "
              "diagnostic of the scheduling model, not a prediction).", "",
              "Printed by `python benchmarks/vllm_live.py`."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
