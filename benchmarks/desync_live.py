"""Does a burst-started closed loop stay in lock-step on the real SGLang server? (issue 10)

    python benchmarks/desync_live.py [--clients 16] [--prompt 256] [--output 32] [--waves 6]

Starts the CPU harness server (SGLang 0.5.23, the plain loop: the harness runs
`--disable-overlap-schedule`), sends `arrival=closed,concurrency=C,n=WAVES*C,
prompt=fixed:P,output=fixed:O` with servetwin's replay client (every client starts at 0,
fixed lengths, `ignore_eos`), and simulates the same workload in the twin with the
server's own configuration and the uncalibrated CPU step-time guess. For both it prints
the E2E distribution and, wave by wave (the requests ordered by when they finished, C at a
time), how far apart a wave's requests finished, as a share of the mean E2E: 0 is the
lock-step (every request of a wave ends in the same step), values near 1 mean the
clients' phases are spread over a whole request's latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from runtime.client import ReplayConfig, replay  # noqa: E402
from runtime.cpu.serve import CpuServer  # noqa: E402
from runtime.server_api import probe, twin_server_args  # noqa: E402
from twin.config import derive_capacity  # noqa: E402
from twin.perf.cpu_guess import cpu_step_time  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import get_workload  # noqa: E402


def spreads(records: list[dict], c: int) -> tuple[list[float], list[float]]:
    """(E2E of every ok request, each wave's finish spread / mean E2E)."""
    ok = [r for r in records if r["status"] == "ok"]
    e2e = [r["e2e_s"] for r in ok]
    ends = sorted(r["arrival_s"] + r["e2e_s"] for r in ok)
    mean = statistics.fmean(e2e)
    waves = [ends[i:i + c] for i in range(0, len(ends) - c + 1, c)]
    return e2e, [round((w[-1] - w[0]) / mean, 3) for w in waves]


def describe(name: str, records: list[dict], c: int) -> str:
    e2e, spread = spreads(records, c)
    q = statistics.quantiles(e2e, n=10)
    ttft = statistics.fmean(r["ttft_s"] for r in records if r["status"] == "ok")
    return (f"{name:5s} E2E p10/p50/p90 {q[0]:.3f}/{statistics.median(e2e):.3f}/{q[-1]:.3f} s, "
            f"mean TTFT {ttft:.3f} s; finish spread per wave / mean E2E: {spread}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--waves", type=int, default=6)
    a = ap.parse_args()
    c = a.clients
    spec = (f"arrival=closed,concurrency={c},n={a.waves * c},prompt=fixed:{a.prompt},"
            f"output=fixed:{a.output}")
    workload = get_workload(spec, 0)
    print(f"workload: {spec}", flush=True)
    with CpuServer([]) as server:
        print(f"server ready in {server.start_seconds:.0f} s", flush=True)
        facts = probe(server.url)
        load = os.getloadavg()[0]
        live = replay(workload, ReplayConfig(url=server.url, seed=0), facts=facts)
    args = twin_server_args(facts.info)
    cap = derive_capacity(args, "a100-pcie-80gb")  # the pool is pinned by --max-total-tokens
    twin = simulate(workload, SimConfig(args=args), step_time=cpu_step_time(cap, args))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"Measured {stamp} on {machine()}; load average {load:.1f} at the start")
    print(describe("live", live.records, c))
    print(describe("twin", twin.records, c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
