"""Twin against live for a fleet of 2 CPU SGLang servers behind the real sglang-router.

    python benchmarks/fleet_live.py [--no-write] [--out out/fleet_live]

Starts the fleet (runtime/fleet.py), replays experiments/fleet_live.WORKLOAD through a
round_robin and a cache_aware router, then once more through round_robin with replica 0
SIGKILLed after 8 requests were sent; simulates the same deployment in the twin (the
crash at the measured kill time), prints the split and failover tables and rewrites the
results section of docs/fleet-live.md. Records of every run go to --out.
"""

from __future__ import annotations

import argparse
import json
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


def failover_rows(side: str, records: list[dict], kill_at: float) -> list[str]:
    f = fl.failover_summary(records, kill_at)
    return [f"| {side} | {f['sent_before']} | {len(f['failed'])} ({', '.join(f['failed']) or '-'}) "
            f"| {f['sent_after']} | {f['after_ok_elsewhere']} | {len(f['retried'])} "
            f"({', '.join(f['retried']) or '-'}) | {f['attempts']} |"]


def machine() -> str:
    import os

    load = os.getloadavg()[0]
    return (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; load average {load:.1f} at the start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "fleet_live")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite docs/fleet-live.md")
    args = ap.parse_args()
    work = fl.workload()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = [f"Measured {stamp} on {machine()}.", "",
              f"Workload `{fl.WORKLOAD}` (seed 0): {len(work.requests)} requests, open loop.",
              "Live: 2 CPU SGLang 0.5.23 servers (the harness defaults), sglang-router 0.3.2 "
              "with its default flags and the policy shown. Twin: the same deployment "
              "(`twin.fleet`, the servers' own arguments), uncalibrated step times "
              f"(roofline on {fl.TWIN_GPU}).", ""]
    spec = FleetSpec(replicas=2, router=RouterOptions(policy="round_robin"),
                     log_dir=args.out / "logs")
    args.out.mkdir(parents=True, exist_ok=True)
    with Fleet(spec) as fleet:
        print(f"fleet ready in {fleet.start_seconds:.0f} s", flush=True)
        info = fl.server_info(fleet.worker_urls[0])
        table = ["| policy | side | replica | requests | share | prompt tokens | cached tokens "
                 "| cached share | template affinity |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for policy in ("round_robin", "cache_aware"):
            run = fl.replay_through_router(fleet, RouterOptions(policy=policy), work)
            run.result.write(args.out / f"live-{policy}")
            twin = fl.simulate(info, policy, work)
            write_records(args.out / f"twin-{policy}.jsonl", twin)
            table += split_rows(policy, "live", run.records, work)
            table += split_rows(policy, "twin", twin, work)
            print(f"{policy}: done", flush=True)
        fwork = fl.workload(spec=fl.FAILOVER_WORKLOAD)
        run = fl.replay_through_router(fleet, RouterOptions(policy="round_robin"), fwork,
                                       kill=(0, 8))
        run.result.write(args.out / "live-failover")
        (args.out / "live-failover" / "router.log").write_text(run.router_log)
        kill_at = run.kill_at_s
        live = fl.with_attempts(run.records, run.router_log)
        write_records(args.out / "live-failover" / "requests-with-attempts.jsonl", live)
        fault = [{"kind": "crash", "replica": "replica-0", "at_s": round(kill_at, 3),
                  "repair_s": 3600}]
        twin = fl.simulate(info, "round_robin", fwork, faults=fault)
        write_records(args.out / "twin-failover.jsonl", twin)
        fail = ["| side | sent before the kill | failed | sent after | ok on replica-1 | "
                "retried (attempts > 1) | attempts |", "|---|---:|---|---:|---:|---|---:|"]
        fail += failover_rows("live", live, kill_at)
        fail += failover_rows("twin", twin, kill_at)
        circuit = fl.circuit_events(run.router_log)
        errors = sorted({(r["error"] or "")[:120] for r in run.records if r["status"] != "ok"})
    notes = [f"Router circuit breaker of replica-0: {', '.join(circuit) or 'no transition'}."]
    if errors:
        notes.append("Live errors of the failed requests: "
                     + "; ".join(f"`{e}`" for e in errors))
    text = "\n".join(header + table + [
        "", f"Failover: workload `{fl.FAILOVER_WORKLOAD}`, round_robin, default router flags; "
        f"replica-0 SIGKILLed at {kill_at:.2f} s (replay clock), after 8 requests were sent; "
        "the twin crashes it at the same time.", ""] + fail + [""] + notes)
    text += "\n\nPrinted by `python benchmarks/fleet_live.py`.\n"
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
