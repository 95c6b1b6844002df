"""Twin against live for a fleet of 2 CPU SGLang servers behind the real sglang-router.

    nice -n 10 python benchmarks/fleet_live.py [--no-write] [--out out/fleet_live]
                                               [--budget-s 120]

Starts the fleet (runtime/fleet.py), calibrates the twin on replica 0 (`servetwin
calibrate`'s machinery, --budget-s seconds; --out's calibration/profile.json is reused
when it is there), replays experiments/fleet_live.WORKLOAD through a round_robin and a
cache_aware router, then once more through round_robin with replica 0 SIGKILLed after 8
requests were sent. The twin simulates each run's requests at their live send times,
calibrated (every replica takes the profile) and, for comparison, uncalibrated (the
roofline on a GPU), in the live router's worker order, the crash at the measured kill
time. Prints the split, latency and failover tables and rewrites the results section of
docs/fleet-live.md. Records of every run go to --out.
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

from experiments import fleet_live as fl  # noqa: E402
from runtime.fleet import Fleet, FleetSpec  # noqa: E402
from runtime.router import RouterOptions  # noqa: E402
from twin.metrics import write_records  # noqa: E402

DOC = ROOT / "docs" / "fleet-live.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
KILL_AFTER = 8


def split_rows(policy: str, side: str, records: list[dict], work) -> list[str]:
    rows = []
    aff = fl.template_affinity(work, records)
    for replica, row in fl.split(records).items():
        rows.append(f"| {policy} | {side} | {replica} | {row['requests']} | "
                    f"{row['request_share']:.3f} | {row['prompt_tokens']} | "
                    f"{row['cached_tokens']} | {row['cached_share']:.3f} | {aff:.3f} |")
    rows.append(f"| {policy} | {side} | all | {len(records)} | 1.000 | "
                f"{sum(r['prompt_tokens'] for r in records)} | "
                f"{sum(r['cached_tokens'] or 0 for r in records)} | "
                f"{fl.cached_share(records):.3f} | {aff:.3f} |")
    return rows


def _err(twin, live) -> str:
    return f"{(twin - live) / live:+.0%}" if twin is not None and live else "-"


def latency_rows(policy: str, live: list[dict], sides: dict[str, list[dict]]) -> list[str]:
    """One row per replica and metric: live, then each twin side and its error."""
    lt = fl.latency(live)
    tw = {k: fl.latency(v) for k, v in sides.items()}
    rows = []
    for replica, row in lt.items():
        for metric in ("ttft_mean", "ttft_p50", "e2e_mean", "e2e_p50"):
            cells = [f"{row[metric]:.3f}"]
            for t in tw.values():
                v = t.get(replica, {}).get(metric)
                cells += [f"{v:.3f}" if v is not None else "-", _err(v, row[metric])]
            rows.append(f"| {policy} | {replica} ({row['n']}) | {metric.replace('_', ' ')} | "
                        + " | ".join(cells) + " |")
    return rows


def failover_rows(side: str, records: list[dict], kill_at: float) -> list[str]:
    f = fl.failover_summary(records, kill_at)
    return [f"| {side} | {f['sent_before']} | {', '.join(f['on_dead_before']) or '-'} | "
            f"{len(f['failed'])} ({', '.join(f['failed']) or '-'}) "
            f"| {f['sent_after']} | {f['after_ok_elsewhere']} | {len(f['retried'])} "
            f"({', '.join(f['retried']) or '-'}) | {f['attempts']} |"]


def machine() -> str:
    load = os.getloadavg()[0]
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; load average {load:.1f} at the start")


def describe_profile(path: Path) -> str:
    p = json.loads(path.read_text())
    st, rp, fit = p["step_time"], p.get("request_path") or {}, p.get("fit") or {}
    held = (fit.get("held_out") or {}).get(f"{st.get('form')}/{st.get('target')}") or {}
    return (f"{fit.get('samples', '?')} samples, `{st.get('form')}` form, held-out median "
            f"|error| {held.get('median_abs_rel', float('nan')):.1%}; request path ingress "
            f"{1e3 * rp.get('ingress_s', 0):.1f} ms, egress {1e3 * rp.get('egress_s', 0):.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "fleet_live")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="seconds of calibration (when --out has no profile yet)")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite docs/fleet-live.md")
    args = ap.parse_args()
    work = fl.workload()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = machine()
    spec = FleetSpec(replicas=2, router=RouterOptions(policy="round_robin"),
                     log_dir=args.out / "logs")
    args.out.mkdir(parents=True, exist_ok=True)
    split_t = ["| policy | side | replica | requests | share | prompt tokens | cached tokens "
               "| cached share | template affinity |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lat = ["| policy | replica (ok) | metric | live (s) | twin (s) | error | twin x drift (s) "
           "| error | twin roofline (s) | error |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes: list[str] = []
    with Fleet(spec) as fleet:
        print(f"fleet ready in {fleet.start_seconds:.0f} s", flush=True)
        info = fl.server_info(fleet.worker_urls[0])
        t0 = time.monotonic()
        prof = fl.calibrate(fleet.worker_urls[0], args.out / "calibration", args.budget_s)
        print(f"calibration: {time.monotonic() - t0:.0f} s", flush=True)
        hop = fl.router_hop(fleet)
        print(f"router hop: {hop}", flush=True)
        for policy in ("round_robin", "cache_aware"):
            run = fl.replay_through_router(fleet, RouterOptions(policy=policy), work)
            run.result.write(args.out / f"live-{policy}")
            sent = run.sent(work)
            drift = fl.drift_of(run.records, info, prof)
            k = fl.drift_scale(run.records, info, prof)
            twin = fl.simulate(info, policy, sent, profile=prof, order=run.order)
            scaled = fl.simulate(info, policy, sent, profile=prof, order=run.order,
                                 step_scale=k)
            roof = fl.simulate(info, policy, sent, order=run.order)
            for name, recs in (("twin", twin), ("twin-drift", scaled), ("twin-roofline", roof)):
                write_records(args.out / f"{name}-{policy}.jsonl", recs)
            split_t += split_rows(policy, "live", run.records, work)
            split_t += split_rows(policy, "twin", twin, work)
            split_t += split_rows(policy, "twin roofline", roof, work)
            lat += latency_rows(policy, run.records, {"twin": twin, "drift": scaled,
                                                      "roofline": roof})
            notes.append(f"- {policy}: router order {', '.join(run.order)}; this run's steps / "
                         "the profile's: " + ", ".join(
                             f"{r} {v:.2f}" if v else f"{r} -" for r, v in drift.items())
                         + f" (twin x drift: {k:.2f})")
            if policy == "cache_aware":
                live_counts = "/".join(str(row["requests"]) for row in sorted(
                    fl.split(run.records).values(), key=lambda r: -r["requests"]))
                twin_counts = "/".join(str(row["requests"]) for row in sorted(
                    fl.split(twin).values(), key=lambda r: -r["requests"]))
                dist = fl.split_distribution(info, policy, sent, prof, run.order)
                notes.append(f"- cache_aware split: live {live_counts}, calibrated twin "
                             f"{twin_counts}; the calibrated twin over {sum(dist.values())} "
                             "perturbed runs (steps x 0.6-1.6, send times +-20 ms): "
                             + ", ".join(f"{s} x{n}" for s, n in dist.most_common()))
            print(f"{policy}: done", flush=True)
        fwork = fl.workload(spec=fl.FAILOVER_WORKLOAD)
        run = fl.replay_through_router(fleet, RouterOptions(policy="round_robin"), fwork,
                                       kill=(0, KILL_AFTER))
        run.result.write(args.out / "live-failover")
        (args.out / "live-failover" / "router.log").write_text(run.router_log)
        kill_at = run.kill_at_s
        live = fl.with_attempts(run.records, run.router_log)
        write_records(args.out / "live-failover" / "requests-with-attempts.jsonl", live)
        fault = [{"kind": "crash", "replica": "replica-0", "at_s": round(kill_at, 3),
                  "repair_s": 3600}]
        sent = run.sent(fwork)
        drift = fl.drift_of(run.records, info, prof)
        k = fl.drift_scale(run.records, info, prof)
        twins = {"twin": fl.simulate(info, "round_robin", sent, profile=prof, faults=fault,
                                     order=run.order),
                 "twin x drift": fl.simulate(info, "round_robin", sent, profile=prof,
                                             faults=fault, order=run.order, step_scale=k),
                 "twin roofline": fl.simulate(info, "round_robin", sent, faults=fault,
                                              order=run.order)}
        for name, recs in twins.items():
            write_records(args.out / f"{name.replace(' ', '-')}-failover.jsonl", recs)
        fail = ["| side | sent before the kill | of them to replica-0 | failed | sent after | "
                "ok on replica-1 | retried (attempts > 1) | attempts |",
                "|---|---:|---|---|---:|---:|---|---:|"]
        fail += failover_rows("live", live, kill_at)
        for name, recs in twins.items():
            fail += failover_rows(name, recs, kill_at)
        lat_f = lat[:2] + latency_rows("failover (ok)", run.records,
                                       {"twin": twins["twin"], "drift": twins["twin x drift"],
                                        "roofline": twins["twin roofline"]})
        circuit = fl.circuit_events(run.router_log)
        errors = sorted({(r["error"] or "")[:120] for r in run.records if r["status"] != "ok"})
        notes.append(f"- failover: router order {', '.join(run.order)}; steps / the "
                     "profile's: " + ", ".join(f"{r} {v:.2f}" if v else f"{r} -"
                                               for r, v in drift.items())
                     + f" (twin x drift: {k:.2f})")
    notes.append(f"- the router's hop (`fl.router_hop`: `{fl.HOP_WORKLOAD}`, sent straight "
                 f"to each server, then through round_robin): TTFT P50 {hop['direct_ttft_p50_s']:.3f} s "
                 f"direct, {hop['router_ttft_p50_s']:.3f} s through the router "
                 f"({hop['n'][0]} and {hop['n'][1]} requests)")
    fail_notes = [f"Router circuit breaker of replica-0: {', '.join(circuit) or 'no transition'}."]
    if errors:
        fail_notes.append("Live errors of the failed requests: "
                          + "; ".join(f"`{e}`" for e in errors))
    header = [f"Measured {stamp} on {where}.", "",
              f"Workload `{fl.WORKLOAD}` (seed 0): {len(work.requests)} requests, open loop.",
              "Live: 2 CPU SGLang 0.5.23 servers (the harness defaults), sglang-router 0.3.2 "
              "with its default flags and the policy shown. Twin: the same deployment "
              "(`twin.fleet`, the servers' own arguments, replicas in the router's worker "
              "order), the requests at their live send times; `twin`: every replica "
              f"calibrated on replica-0 ({describe_profile(prof)}); `twin roofline`: "
              f"uncalibrated (roofline on {fl.TWIN_GPU}); `twin x drift`: the calibrated "
              "twin with every step scaled by the live run's own measured steps / the "
              "profile's (a diagnostic of the model, not a prediction).", ""]
    text = "\n".join(
        header + split_t + ["", "Latency per replica (ok requests; errors (twin - live) / "
                            "live):", ""] + lat + ["", *notes, "",
        f"Failover: workload `{fl.FAILOVER_WORKLOAD}`, round_robin, default router flags; "
        f"replica-0 SIGKILLed at {kill_at:.2f} s (replay clock), after {KILL_AFTER} requests "
        "were sent; the twin crashes it at the same time.", ""] + fail + [""] + fail_notes
        + ["", "Latency of the failover run's ok requests:", ""] + lat_f)
    text += "\n\nPrinted by `nice -n 10 python benchmarks/fleet_live.py`.\n"
    print(text)
    (args.out / "summary.md").write_text(text)
    (args.out / "kill.json").write_text(json.dumps({"kill_at_s": kill_at}) + "\n")
    if not args.no_write:
        doc = DOC.read_text()
        head, rest = doc.split(START, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
