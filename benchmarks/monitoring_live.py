"""The monitoring metrics of one workload measured live (the real CPU SGLang server, its
scraped /metrics) and simulated, under the same names, side by side.

    python benchmarks/monitoring_live.py [--workload SPEC] [--seed N] [--window S] [--out DIR]

Starts the CPU harness server, runs `servetwin live replay --scrape-every 0.5` of the
workload, simulates it on the server's own configuration (`/server_info`) with the
uncalibrated CPU step-time guess, and prints, with the workload, machine and date: the
SGLang counters (live: the increase over the replay; twin: `sglang_registry`), and the
users' metrics over the whole run from each side's records and series. Latencies are not
compared here (the twin is uncalibrated: benchmarks/fidelity.py does that).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from runtime.cpu.serve import CpuServer  # noqa: E402
from runtime.live_metrics import load_run  # noqa: E402
from runtime.server_api import probe, twin_server_args  # noqa: E402
from servetwin.cli import main as cli  # noqa: E402
from twin.config import derive_capacity  # noqa: E402
from twin.metrics import SERIES_FIELDS  # noqa: E402
from twin.monitoring import metric_windows, sglang_registry, twin_gauges  # noqa: E402
from twin.perf.cpu_guess import cpu_step_time  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import get_workload  # noqa: E402

DEFAULT = ("arrival=closed,concurrency=1,n=40,prompt=uniform:16:160,output=uniform:4:16,"
           "templates=3,template_len=256,share=0.8")
COUNTERS = ("sglang:num_requests_total", "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total", "sglang:cached_tokens_total",
            "sglang:time_to_first_token_seconds_count")
USERS = ("radix_sharing_ratio", "batch_efficiency", "memory_pressure_score", "queue_p99")


def twin_counters(records, cap) -> dict[str, float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(sglang_registry(records, capacity_tokens=cap)).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in COUNTERS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=DEFAULT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/servetwin-monitoring-live"))
    ns = ap.parse_args()
    with CpuServer() as server:
        print(f"server ready in {server.start_seconds:.0f} s at {server.url}", flush=True)
        load = os.getloadavg()[0]
        rc = cli(["live", "replay", "--url", server.url, "--workload", ns.workload, "--seed",
                  str(ns.seed), "--out", str(ns.out), "--scrape-every", "0.5",
                  "--max-lateness-ms", "60000"])
        if rc != 0:
            return rc
        facts = probe(server.url)
    live = load_run(ns.out)
    args = twin_server_args(facts.info)
    cap = derive_capacity(args, "a100-pcie-80gb")
    sim = simulate(get_workload(ns.workload, ns.seed), SimConfig(args=args),
                   step_time=cpu_step_time(cap, args))
    print(f"\nworkload {ns.workload} (seed {ns.seed}); measured "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}; load "
          f"average {load:.1f} at the start")
    tc = twin_counters(sim.records, cap.max_total_num_tokens)
    print(f"\n{'metric':42s} {'live':>12s} {'twin':>12s}")
    for name in COUNTERS:
        print(f"{name:42s} {live.totals.get(name, float('nan')):12.0f} {tc.get(name):12.0f}")
    lw = metric_windows(live.records, live.gauges, live.max_running, window_s=1e6)
    tw = metric_windows(sim.records, twin_gauges(sim.series, SERIES_FIELDS,
                                                 cap.max_total_num_tokens),
                        cap.max_running_requests, window_s=1e6)
    for name in USERS:
        a, b = lw[name][0].value, tw[name][0].value
        print(f"{name + ' (whole run)':42s} {_f(a):>12s} {_f(b):>12s}")
    share = live.totals.get("radix_sharing_ratio")
    print(f"{'radix_sharing_ratio (server counters)':42s} {_f(share):>12s} {'':>12s}")
    print(f"max_running_requests: live {live.max_running}, twin {cap.max_running_requests}")
    dur = max(r["arrival_s"] + r["e2e_s"] for r in sim.records if r["e2e_s"] is not None)
    print(f"(the twin's uncalibrated CPU step time ran the workload in {dur:.1f} s; time "
          "averages such as memory_pressure_score weigh the cache's fill over that time)")
    return 0


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


if __name__ == "__main__":
    sys.exit(main())
