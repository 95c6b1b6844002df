"""Regenerate docs/what-if.md: the users' what-if questions answered by `servetwin plan`.

    python benchmarks/what_if.py [--out out/what-if] [--jobs N] [--requests 2000]

Runs (each resumable in its own directory under --out; a rerun only rebuilds the page):
1. `users`: the users' question as the issue states it, `servetwin plan` with no space:
   finance-qa at its peak, P99 TTFT <= 1.5 s over every request;
2. `short`: the same space with the SLO on short questions (prompts under 10k tokens);
3. one-axis plans around the users' deployment (2x A100-80GB PCIe, TP 2, one server):
   replicas, GPU type, model, quantization, chunked prefill size, scheduling policy.
Then writes docs/what-if.md from the plan.json files (the numbers are the twin's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = "ttft:p99:1.5:prompt<10000"
ALL = "ttft:p99:1.5"
USERS = {"gpus": "a100-pcie-80gb", "tp": "2", "replicas": "1"}
AXES = {  # name: (what varies, flags over the users' deployment)
    "replicas": ("replicas of the users' server", {"replicas": "1,2,3,4,6,8"}),
    "gpus": ("GPU type (one server, TP 2 and TP 4)", {"gpus": "a100-pcie-80gb,a100-sxm-80gb,"
                                                   "h100-sxm-80gb,h200-sxm-141gb", "tp": "2,4"}),
    "models": ("a smaller model", {"models": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B,"
                                   "meta-llama/Llama-3.1-8B,Qwen/Qwen3-8B,Qwen/Qwen3-32B"}),
    "quantization": ("quantized weights of their model class (all on the roofline step "
                     "time: aiconfigurator's opdb has no data for the quantized variants)", {
        "quantization": "none,fp8,awq,gptq", "gpus": "a100-pcie-80gb,h100-sxm-80gb",
        "step_time_backends": "roofline"}),
    "policies": ("scheduling policy (two servers)", {"replicas": "2", "policies": "fcfs,lpm,lof,"
                 "priority,shortest-prefill-first,slices,deadline,menu"}),
}


HEAD = """
# What-if capacity planning: `servetwin plan`

`servetwin plan` answers "for this traffic and these SLOs, which deployment, at what cost,
with how much headroom?" with the twin: every candidate of a search space (GPU type, TP,
replicas, model and quantization, SGLang server arguments, scheduling policy, KV allocator,
router) is simulated at the target load, its largest sustainable load is found by a search
over load (bracketing, then geometric bisection to `--precision`, 5 % by default; the same
requests at every load, so each answer is deterministic), and the plan reports the cheapest
candidate meeting every SLO, the Pareto fronts (cost vs P99 TTFT, cost vs goodput), the
headroom of each, and the users' stepped ramp (25-200 % of the target) on the winner with
the alert rule "P99 TTFT > SLO three windows in a row".

```
servetwin plan --out DIR                       # the users' question (below)
servetwin plan --workload 'arrival=poisson,rate=4,n=2000' --target-rps 6 \\
    --slo ttft:p99:1.5 --slo tpot:p90:0.05 --slo 'ttft:attainment:1:0.95:tier=10' \\
    --space space.yaml --out DIR [--jobs N | --ray ADDRESS] [--prices prices.json]
```

- **Workload and load.** `--workload` (a preset or spec) or `--trace`; the target as
  `--target-scale` (a multiple of the workload's rate, default 1) or `--target-rps`. A
  closed loop (finance-qa's 50 clients) has no rate of its own: its peak is the rate its
  clients drive on the users' deployment (2x A100-80GB PCIe, TP 2; one simulation), and its
  requests then arrive as a Poisson process at that rate, so faster deployments are not
  rewarded with less traffic. `--requests N` (default 2000) sets the requests per evaluation.
- **SLOs.** `METRIC:STAT:THRESHOLD_S[:TARGET][:tier=N][:prompt<N]`, metric `ttft`, `tpot`
  or `e2e`, stat `p50`/`p90`/`p99` or `attainment` with a target share. A P99 SLO holds when
  99 % of the requests it covers finished `ok` within the threshold: a rejected or
  aborted request is a miss, never dropped.
- **Space.** YAML/JSON, every key a list (a scalar is a list of one): `gpus`, `tp`,
  `replicas`, `models`, `quantization` (null, fp8, awq, gptq), `server_args` (SGLang
  argument names to lists: chunked_prefill_size, max_running_requests,
  mem_fraction_static, page_size, disable_radix_cache, ...), `policies` (the registry's
  names; SGLang's own become `--schedule-policy`, others run through the plugin live),
  `kv_allocators`, `routers`. The same keys are flags (`--gpus a,b --tp 2,4`). An unknown
  key or value is refused with the file, line, key path and the allowed values.
- **Feasibility.** A candidate SGLang would refuse is `infeasible` with the numbers
  (weights that do not fit, TP that does not divide the heads, prompts as long as the
  context or the KV pool: "context too long").
- **Output.** `DIR/plan.json` (every candidate, its status, metrics at the target, max
  load, headroom, the loads simulated, its commands), `DIR/candidates/<id>.json` (the
  resume files) and `DIR/candidates/<id>/` (the winner's and the best few's runs at the
  target: requests.jsonl, summary.json, timeseries.csv), `DIR/ramp/`, `DIR/workload.jsonl`
  (the target-load requests), `DIR/deployments/` (multi-replica candidates as deployment
  files), `DIR/winner.txt` (`servetwin simulate` replaying the winner's run byte for byte,
  and the `sglang.launch_server` / `sglang_router.launch_router` commands), and
  `DIR/report.html`.
- **Runs.** Parallel over the cores by default (`--jobs`), candidates grouped by replica
  count (each boundary, scaled, is the next one's first guess); serial and parallel give
  byte-identical plan.json. `--ray ADDRESS` runs the same groups as Ray tasks on a Ray cluster (`pip install 'servetwin[ray]'`; `--ray local` starts a Ray of its own on loopback and shuts it down after; the plan is byte-identical to a serial one: tests/test_plan.py). A rerun into
  the same directory resumes: finished candidates are read back; a changed question or
  space is refused, naming what changed.
- **Prices.** experiments/plan/prices.py: on-demand $/GPU-hour with their source and date;
  `--prices FILE` overrides.
"""


def run_plan(out: Path, flags: dict, slo: str, ns) -> dict:
    if ns.render_only:  # read back what an earlier run left
        return json.loads((out / "plan.json").read_text())
    args = [sys.executable, "-m", "servetwin.cli", "plan", "--out", str(out), "--slo", slo,
            "--jobs", str(ns.jobs), "--requests", str(ns.requests), "--quiet"]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", v]
    print(f"$ servetwin plan --out {out} --slo '{slo}' "
          + " ".join(f"--{k} {v}" for k, v in flags.items()), file=sys.stderr, flush=True)
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "plan.json").read_text())


def chunk_plans(base: Path, ns) -> list[dict]:
    """Chunked prefill sizes need a server_args space file."""
    space = base / "chunk-space.json"
    base.mkdir(parents=True, exist_ok=True)
    space.write_text(json.dumps({"gpus": ["a100-pcie-80gb"], "tp": [2], "replicas": [1, 2],
                                 "server_args": {"chunked_prefill_size":
                                                 [1024, 2048, 4096, 8192, 16384]}}))
    return [run_plan(base / "chunk", {"space": str(space)}, SHORT, ns)]


def fmt(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(p: dict, limit: int | None = None) -> list[str]:
    lines = ["| id | candidate | GPUs | $/h | status | P99 TTFT all ok (s) | SLO value (s) "
             "| SLO share | meets | max load (req/s) | headroom |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = p["candidates"]
    ok = sorted((r for r in rows if r["status"] == "ok"),
                key=lambda r: (not r["at_target"]["meets_slo"], r["cost_per_hour"], r["id"]))
    rest = [r for r in rows if r["status"] != "ok"]
    for r in (ok[:limit] if limit else ok) + ([] if limit else rest):
        a = r["at_target"] or {}
        slo = next(iter(a.get("slos", {}).values()), {})
        lines.append(
            f"| {r['id']} | {r['label']} | {r['gpus']} | {r['cost_per_hour']:.2f} | "
            f"{r['status']}{': ' + r['reason'][:90] if r['reason'] else ''} | "
            f"{fmt(a.get('ttft_p99_s'))} | "
            f"{fmt(slo.get('value_s'), '.3f', 'inf' if a else '-')} | "
            f"{fmt(slo.get('share'), '.1%')} | {'yes' if a.get('meets_slo') else 'no'} | "
            f"{fmt(r['max_load']['rps'], '.3g', 'none')} | {fmt(r['headroom'], '+.0%')} |")
    return lines


def answer(p: dict) -> str:
    rid = p["winner"] or p["closest"]
    if rid is None:
        return "no candidate ran"
    r = next(x for x in p["candidates"] if x["id"] == rid)
    a = r["at_target"]
    head = "cheapest meeting the SLO" if p["winner"] else "none meets the SLO; closest"
    ml = r["max_load"]["rps"]
    return (f"{head}: **{r['label']}** ({r['gpus']} GPUs, ${r['cost_per_hour']:.2f}/h): P99 "
            f"TTFT {a['ttft_p99_s']:.3f} s over all requests, SLO share "
            f"{next(iter(a['slos'].values()))['share']:.1%}, max sustainable load "
            + (f"{ml:.3g} requests/s (headroom {r['headroom']:+.0%})" if ml is not None
               else "none found (not even 1/16 of the peak)"))


def ramp_lines(p: dict) -> list[str]:
    ramp = p.get("ramp")
    if not ramp:
        return ["(no ramp)"]
    out = [f"Ramp on {ramp['candidate']}, {ramp['step_s']:g} s per step (P99 TTFT of "
           f"`{ramp.get('watched', 'all requests')}`'s requests; all requests in brackets):",
           "",
           "| load | req/s | P99 TTFT (s) | P99 TPOT (s) | P99 E2E (s) | "
           + " | ".join(ramp["first_break"]) + " |",
           "|---|---|---|---|---|" + "---|" * len(ramp["first_break"])]
    for st in ramp["steps"]:
        out.append(f"| {st['load_pct']} % | {st['rps']:.3f} | {fmt(st['ttft_p99_s'])} "
                   f"({fmt(st.get('ttft_p99_all_s'))}) | "
                   f"{fmt(st['tpot_p99_s'])} | {fmt(st['e2e_p99_s'])} | "
                   + " | ".join("meets" if v else "breaks" for v in st["meets"].values()) + " |")
    brk = ", ".join(f"`{k}` first breaks at {v} %" if v else f"`{k}` holds to 200 %"
                    for k, v in ramp["first_break"].items())
    out += ["", f"{brk}. The alert rule ({ramp['alerts'][0]['rule'] if ramp['alerts'] else 'P99 TTFT above the SLO in 3 windows in a row'}) "
            f"fired {len(ramp['alerts'])} time(s)"
            + (": " + ", ".join(f"at {a['start_s']:g} s" + (f" (resolved {a['end_s']:g} s)"
                                                            if a["end_s"] else "")
                               for a in ramp["alerts"]) if ramp["alerts"] else "") + "."]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "what-if")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "what-if.md")
    ap.add_argument("--render-only", action="store_true",
                    help="rebuild the page from the plans already in --out")
    ns = ap.parse_args()

    users = run_plan(ns.out / "users", {}, ALL, ns)
    short = run_plan(ns.out / "short", {}, SHORT, ns)
    axes = {name: run_plan(ns.out / name, {**USERS, **flags}, SHORT, ns)
            for name, (_, flags) in AXES.items()}
    chunk = chunk_plans(ns.out, ns)[0]
    ns.doc.write_text(render(users, short, axes, chunk, ns) + "\n")
    print(f"wrote {ns.doc}", file=sys.stderr)


def render(users, short, axes, chunk, ns) -> str:
    from calibration.profiles import machine

    q = users["question"]
    text = [HEAD.strip(), "",
            f"Generated by `python benchmarks/what_if.py` on "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d} ({machine()}); "
            f"{ns.requests} requests per evaluation, precision {q['precision']:.0%}, seed "
            f"{q['seed']}. The peak: {q['peak_from']}.", "",
            "## In short", ""] + short_answers(users, short, axes) + ["",
            "## 1. The users' question as stated: P99 TTFT <= 1.5 s over every request", "",
            answer(users) + ".", "",
            f"{users['counts']['ok']} candidates ran, {users['counts']['infeasible']} were "
            f"infeasible, {users['counts']['meet_slo']} met the SLO.", ""]
    text += _users_row(users)
    text += ["", "The ten closest candidates:", ""] + table(users, 10)
    text += ["", "## 2. P99 TTFT <= 1.5 s for the short questions (prompts under 10k tokens)",
             "", answer(short) + ".", ""] + ramp_lines(short)
    text += ["", "The cheapest ten that meet it (or the closest):", ""] + table(short, 10)
    text += ["", "## 3. What changes the answer for the users' deployment", "",
             "Each plan varies one thing from the users' deployment (one server of "
             "DeepSeek-R1-Distill-Qwen-32B on 2x A100-80GB PCIe at TP 2, SGLang's fcfs) at "
             f"the same peak, with the short-question SLO `{SHORT}`.", ""]
    for name, (what, flags) in AXES.items():
        p = axes[name]
        text += [f"### {what}", "", f"`servetwin plan --slo '{SHORT}' "
                 + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in {**USERS, **flags}.items())
                 + "`", "", answer(p) + ".", ""] + table(p) + [""]
    text += ["### chunked prefill size (1 and 2 servers)", "", answer(chunk) + ".", ""]
    text += table(chunk) + [""]
    return "\n".join(text)


def short_answers(users: dict, short: dict, axes: dict) -> list[str]:
    out = []
    mine = next((x for x in users["candidates"] if x["label"] == "1x a100-pcie-80gb TP2 fcfs"),
                None)
    if mine and mine["status"] == "ok":
        out.append(f"- **Their deployment** (2x A100-80GB PCIe, TP 2) at the peak: P99 TTFT "
                   f"{mine['at_target']['ttft_p99_s']:.0f} s, "
                   f"{mine['at_target']['slo_attainment']:.0%} of requests within 1.5 s: it "
                   "does not meet P99 <= 1.5 s.")
    near = next((x for x in users["candidates"] if x["id"] == (users["winner"] or
                                                                users["closest"])), None)
    low = min(near["evaluations"], key=lambda e: e["scale"]) if near else None
    why = "" if users["winner"] or not low else (
        f" Even at {low['scale']:.4g} of the peak, with almost no queueing, its P99 TTFT is "
        f"{low['ttft_p99_s']:.2f} s: 2 % of the requests are 64k-128k-token documents, so "
        "the P99 of all requests falls among them, and their prefill alone takes longer "
        "than 1.5 s.")
    out.append("- **P99 TTFT <= 1.5 s over every request**: " + answer(users) + "." + why)
    out.append("- **For the short questions** (prompts under 10k tokens): " + answer(short)
               + ".")
    ramp = short.get("ramp")
    if ramp:
        brk = ", ".join(f"{v} %" if v else "holds to 200 %" for v in ramp["first_break"].values())
        out.append(f"- **Headroom at 200 % of the peak** (the ramp on {ramp['candidate']}): "
                   f"the short-question SLO first breaks at {brk}; the three-windows alert "
                   f"fired {len(ramp['alerts'])} time(s).")
    quant = axes.get("quantization")
    if quant:
        parts = [f"{r['label'].split(' fcfs')[0]} {r['config']['quantization'] or 'bf16'}: "
                 f"P99 TTFT {r['at_target']['ttft_p99_s']:.1f} s, max load "
                 f"{fmt(r['max_load']['rps'], '.3g', 'none')} req/s"
                 for r in quant["candidates"] if r["status"] == "ok"]
        out.append("- **FP8 / AWQ / GPTQ** (roofline step time): " + "; ".join(parts) + ".")
    return out


def _users_row(p: dict) -> list[str]:
    r = next((x for x in p["candidates"] if x["label"] == "1x a100-pcie-80gb TP2 fcfs"), None)
    if r is None or r["status"] != "ok":
        return []
    a = r["at_target"]
    return [f"Their deployment ({r['id']}, one server on 2x A100-80GB PCIe at TP 2): P99 TTFT "
            f"{a['ttft_p99_s']:.1f} s at the peak, {a['slo_attainment']:.1%} of requests "
            f"within 1.5 s: it does **not** meet the SLO"
            + (f"; its largest sustainable load is {r['max_load']['rps']:.3g} requests/s"
               if r["max_load"]["rps"] else "; not even at 1/16 of the peak") + "."]


if __name__ == "__main__":
    main()
