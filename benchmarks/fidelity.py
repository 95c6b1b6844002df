"""The whole calibration loop on the CPU harness, from nothing: how close is the twin?

    python benchmarks/fidelity.py [--budget-s 150] [--out DIR] [--no-write] [--priority]
                                  [--omp-threads 1]

Starts the CPU SGLang server, profiles it within the budget (`calibration.profile`), fits
the step time (`calibration.fit`), then validates on held-out workloads that differ from
every profiling run (Poisson and bursty arrivals, other length distributions, shared
prefixes): light load, about 70 % of capacity, and near saturation (95 %, bursty gamma
arrivals with CV 3, so requests queue), where capacity is what the calibrated twin itself
predicts for that workload's mix. `--priority` starts the
server with priority scheduling and adds a workload with priority tiers. Prints one table
(workload, metric, live, twin, error) and writes it, with the date, the machine and the
fitted coefficients, into docs/calibration.md between the results markers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profile import Bar, ServerLimits, Store, all_samples, make_plan, profile  # noqa: E402
from calibration.profiles import build_profile, identity, machine, write_profile  # noqa: E402
from calibration.session import server_facts  # noqa: E402
from calibration.validate import format_step_check, validate  # noqa: E402
from runtime.cpu.serve import CpuServer  # noqa: E402
from servetwin.cmd_calibrate import describe  # noqa: E402

DOC = ROOT / "docs" / "calibration.md"
START, END = "<!-- fidelity:start -->", "<!-- fidelity:end -->"
ROWS = ("TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
        "E2E p50", "E2E p90", "E2E p99", "queue p50", "queue p99", "throughput",
        "cached-token share", "retractions")
# (name, spec without arrival/rate/n, load as a share of capacity, requests)
WORKLOADS = (
    ("light", "prompt=uniform:64:512,output=uniform:16:64", 0.25, 40),
    ("medium-shared-prefix", "prompt=uniform:32:256,output=uniform:16:64,templates=4,"
     "template_len=512,share=0.6", 0.7, 90),
    ("near-saturation-bursty", "prompt=lognormal:200:0.6,output=uniform:16:96", 0.95, 120),
)
PRIORITY = ("priority-tiers", "prompt=uniform:64:384,output=uniform:16:64,tiers=0:0.8/10:0.2",
            0.7, 60)


def capacity(info: dict, prof: dict, body: str) -> float:
    """Requests per second the calibrated twin completes for this mix when overloaded."""
    from calibration.validate import simulate_like
    from twin.metrics import summarize
    from twin.workload import from_spec

    wl = from_spec(f"arrival=poisson,rate=50,n=150,{body}", seed=99)
    records, _ = simulate_like(wl, info, prof)
    return summarize(records)["throughput"]["requests_per_s"]


def run(budget_s: float, out: Path, priority: bool) -> tuple[str, str]:
    args = ["--enable-priority-scheduling"] if priority else []
    with CpuServer(args) as server:
        print(f"server ready in {server.start_seconds:.0f} s at {server.url}", flush=True)
        facts = server_facts(server.url)
        lim = ServerLimits.from_info(facts.info)
        prof_path = out / "profile.json"
        for stale in (prof_path.with_suffix(".runs.jsonl"), prof_path.with_suffix(".samples.jsonl")):
            stale.unlink(missing_ok=True)
        store = Store(prof_path, identity(facts.info))
        bar = Bar(len(make_plan(lim)), budget_s)
        t0 = time.monotonic()
        counts = profile(server.url, store, lim, facts.vocab_size, budget_s, bar)
        bar.close()
        prof = build_profile(all_samples(store, lim), facts.info, ["benchmarks/fidelity.py"])
        write_profile(prof_path, prof)
        profile_s = time.monotonic() - t0
        print(describe(prof), flush=True)
        results = []
        for name, body, load, n in WORKLOADS + ((PRIORITY,) if priority else ()):
            cap = capacity(facts.info, prof, body)
            arrival = "gamma,cv=3" if name.endswith("bursty") else "poisson"
            spec = f"arrival={arrival},rate={load * cap:.3f},n={n},{body}"
            loadavg = os.getloadavg()[0]
            print(f"{name}: {spec} (twin capacity {cap:.2f} req/s; load average "
                  f"{loadavg:.1f})", flush=True)
            from twin.workload import from_spec

            v = validate(server.url, prof_path, from_spec(spec, seed=7, name=name), out / name,
                         seed=7)
            print(v.table(), "\n" + format_step_check(v.step_check, v.rescaled), flush=True)
            results.append((name, spec, cap, loadavg, v))
    return report(prof, counts, profile_s, results, facts.version)


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.3g}"


def report(prof: dict, counts: dict, profile_s: float, results: list, version: str):
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [f"Measured {stamp} on {machine()} (shared: other jobs ran alongside).",
            f"SGLang {version}, CPU harness model `{prof['model']['name']}`, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}; profile: "
            f"{counts['ran']} of {counts['planned']} runs in {profile_s:.0f} s, "
            f"{prof['fit']['samples']} samples; chosen `{prof['step_time']['form']}`, "
            f"{prof['step_time'].get('target')} target; held-out error (run total / per "
            "step, median |error|): " + ", ".join(
                f"{f} {e.get('run_total_abs_rel', float('nan')):.1%} / "
                f"{e.get('median_abs_rel', float('nan')):.1%}"
                for f, e in prof["fit"]["held_out"].items()) + "."]
    lines = ["| workload | metric | live | twin | (twin - live) / live |",
             "| --- | --- | ---: | ---: | ---: |"]
    text = [f"{'workload':<22} {'metric':<20} {'live':>10} {'twin':>10} {'error':>8}"]
    for name, _spec, _cap, _load, v in results:
        for row in v.comparison.rows:
            if row.metric not in ROWS:
                continue
            unit = f" ({row.unit})" if row.unit else ""
            err = f"{row.rel_err:+.1%}" if row.rel_err is not None else "-"
            lines.append(f"| {name} | {row.metric}{unit} | {_fmt(row.b)} | {_fmt(row.a)} | {err} |")
            text.append(f"{name:<22} {row.metric + unit:<20} {_fmt(row.b):>10} "
                        f"{_fmt(row.a):>10} {err:>8}")
    notes = [f"- `{name}`: `{spec}` (seed 7; twin capacity {cap:.2f} req/s; load average "
             f"{load:.1f} at its start); {format_step_check(v.step_check, v.rescaled)}."
             for name, spec, cap, load, v in results]
    coef = ["", "Fitted coefficients (seconds per count; +- one standard error):", "",
            "| term | value | +- |", "| --- | ---: | ---: |"]
    for term, value in prof["step_time"]["coefficients"].items():
        err = prof["step_time"]["uncertainty"].get(term)
        coef.append(f"| {term} | {value:.4g} | {'-' if err is None else f'{err:.2g}'} |")
    rp = prof["request_path"]
    coef.append(f"\nRequest path: ingress {rp['ingress_s'] * 1e3:.1f} ms, egress "
                f"{rp['egress_s'] * 1e3:.1f} ms.")
    markdown = "\n".join(["", *head, "", *lines, "", *notes, *coef,
                          "", "Printed by `python benchmarks/fidelity.py`.", ""])
    terminal = "\n".join(head + [""] + text + [""] + notes)
    return terminal, markdown


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the results markers")
    before, rest = doc.split(START, 1)
    DOC.write_text(before + START + "\n" + text + END + rest.split(END, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "fidelity")
    parser.add_argument("--no-write", action="store_true", help="do not update the docs")
    parser.add_argument("--priority", action="store_true",
                        help="priority scheduling on, plus a workload with priority tiers")
    parser.add_argument("--omp-threads", default="1",
                        help="OMP_NUM_THREADS for the server (default 1; see docs/live.md)")
    ns = parser.parse_args()
    if ns.omp_threads != "inherit":
        os.environ["OMP_NUM_THREADS"] = ns.omp_threads
    ns.out.mkdir(parents=True, exist_ok=True)
    terminal, markdown = run(ns.budget_s, ns.out, ns.priority)
    print(terminal)
    if not ns.no_write:
        write_doc(markdown)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
