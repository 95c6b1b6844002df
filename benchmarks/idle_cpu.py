"""What an idle CPU SGLang server costs, with and without SGLang's `--sleep-on-idle`.

    python benchmarks/idle_cpu.py [--idle-s 15]

Starts the CPU harness's server twice, one after the other (the harness command as is, then
with `--sleep-on-idle` taken out), sends three small requests, then measures the CPU
seconds its processes use over `--idle-s` seconds of doing nothing (their utime + stime
from /proc). Why the harness passes the flag: docs/cpu-harness.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from runtime.cpu.serve import CpuServer, post_json  # noqa: E402

FLAG = "--sleep-on-idle"


def group_cpu_s(pgid: int) -> float:
    """utime + stime (seconds) of every live process in process group `pgid`."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def idle_cost(sleep_on_idle: bool, idle_s: float) -> tuple[float, float]:
    server = CpuServer(log_path=ROOT / "out" / "idle_cpu" / f"server-{sleep_on_idle}.log")
    if not sleep_on_idle:
        server.command = [a for a in server.command if a != FLAG]
    with server:
        body = {"input_ids": list(range(5, 105)),
                "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
        for _ in range(3):
            post_json(server.url + "/generate", body)
        time.sleep(1.0)
        c0 = group_cpu_s(server.pid)
        time.sleep(idle_s)
        return group_cpu_s(server.pid) - c0, server.start_seconds or 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-s", type=float, default=15.0)
    ns = ap.parse_args()
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine {machine()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"| server | idle CPU-s over {ns.idle_s:g} s | share of a core | start s |")
    print("|---|---|---|---|")
    for on in (True, False):
        cpu, start = idle_cost(on, ns.idle_s)
        label = f"harness ({FLAG})" if on else f"without {FLAG}"
        print(f"| {label} | {cpu:.2f} | {cpu / ns.idle_s:.0%} | {start:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
