"""What `servetwin emulate` costs on this machine: the requests per second one emulated
server sustains, the lateness of its token stream against the simulated step ends, and
how many emulated servers one core can carry.

    python benchmarks/emulator.py [--quick] [--parts 1,2,3] [--servers 4]

1. Throughput: one emulator at `--speed 1000` (the model's time is negligible: what is
   measured is the HTTP side, the driver and the replica's passes) and C concurrent
   aiohttp clients sending small requests (16 prompt ids, 4 output tokens), streaming and
   not, for a fixed number of requests: requests/s, and the emulator's CPU seconds per
   request (from /proc: its own process only, not the client's).
2. Lateness and capacity: N emulators at speed 1, each serving "an A100 server's" load
   (the default deployment, DeepSeek-R1-Distill-Qwen-32B on 2x A100-80GB PCIe at TP 2,
   replayed by `runtime.client.replay`: Poisson 2 req/s, prompts lognormal 800, outputs
   uniform 50-150); each emulator reports the lateness of every token it published (wall
   time at which its handler got it minus the wall time of its simulated step end) in
   /server_info; its CPU use per wall second gives the servers one core carries at that
   load (1 / CPU share), checked by running N of them at once; a process that only
   sleeps measures how late this machine wakes anything up meanwhile (the floor).
3. Agreement: SGLang's `bench_serving` (the CPU harness's) against one emulator at speed 1,
   closed loops of 1, 4 and 8 clients, 24 requests of 512 prompt and 32 output tokens, vs
   `servetwin simulate` of the same workload: mean TTFT and TPOT; and the same closed loop
   sent by servetwin's own replay client (the twin's model of such a client).

Prints the workload, the machine, the load average and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.client import ReplayConfig, replay  # noqa: E402
from runtime.emulator.process import EmulatorProcess  # noqa: E402
from twin.workload import from_spec  # noqa: E402

SMALL = ["--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "1", "--gpu",
         "h100-sxm-80gb", "--step-time-backend", "roofline"]
A100_LOAD = ("arrival=poisson,rate={rate:g},n={n},prompt=lognormal:800:0.5,"
             "output=uniform:50:150")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (not its children), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        return json.loads(r.read())


async def flood(url: str, n: int, conc: int, stream: bool) -> float:
    """Send `n` small requests from `conc` clients; wall seconds taken."""
    import aiohttp

    body = {"input_ids": list(range(100, 116)), "stream": stream,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    left = iter(range(n))
    async with aiohttp.ClientSession() as s:
        async def client() -> None:
            for _ in left:
                async with s.post(url + "/generate", json=body) as r:
                    await r.read()
                    assert r.status == 200, r.status

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conc)))
        return time.perf_counter() - t0


def throughput(n: int, conc: int) -> None:
    print(f"\n1. requests/s of one emulator (speed 1000, {conc} clients, {n} requests of "
          "16 prompt ids and 4 output tokens)")
    with EmulatorProcess([*SMALL, "--speed", "1000"]) as em:
        for stream in (False, True):
            c0 = cpu_seconds(em.proc.pid)
            wall = asyncio.run(flood(em.url, n, conc, stream))
            cpu = cpu_seconds(em.proc.pid) - c0
            kind = "streaming" if stream else "non-streaming"
            print(f"   {kind:14s} {n / wall:7.0f} req/s   emulator CPU {1e3 * cpu / n:.2f} ms "
                  f"per request ({4 * n / cpu:,.0f} tokens per CPU-second)")


PROBE = """
import json, sys, time
import numpy as np
late, end = [], time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t = time.perf_counter()
    time.sleep(0.01)
    late.append(time.perf_counter() - t - 0.01)
a = np.asarray(late) * 1e3
print(json.dumps({"p50": round(float(np.percentile(a, 50)), 3),
                  "p99": round(float(np.percentile(a, 99)), 3), "max": round(float(a.max()), 3)}))
"""


def machine_probe(seconds: float) -> subprocess.Popen:
    """A process that only sleeps 10 ms at a time: how late this machine wakes a process
    up, the floor under any emulator's lateness."""
    return subprocess.Popen([sys.executable, "-c", PROBE, str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def a100_load(n_servers: int, n_requests: int, speed: float = 1.0) -> None:
    spec = A100_LOAD.format(n=n_requests, rate=2 * speed)
    print(f"\n2. {n_servers} emulator(s) at speed {speed:g}, each replaying {spec} on the "
          f"wall clock (2 req/s simulated; default deployment: 32B on 2x A100-80GB PCIe, "
          "TP 2)")
    work = from_spec(spec, 0)
    with_ems = [EmulatorProcess(["--speed", str(speed)]) for _ in range(n_servers)]
    for em in with_ems:
        em.start()
    try:
        c0 = [cpu_seconds(em.proc.pid) for em in with_ems]
        probe = machine_probe(work.requests[-1].arrival_s + 5)
        t0 = time.perf_counter()
        results = asyncio.run(_replays([em.url for em in with_ems], work))
        wall = time.perf_counter() - t0
        floor = json.loads(probe.communicate()[0])
        print(f"   this machine wakes a sleeping process late by P50 {floor['p50']} ms, P99 "
              f"{floor['p99']} ms, max {floor['max']} ms meanwhile (load average "
              f"{os.getloadavg()[0]:.1f})")
        for i, (em, res) in enumerate(zip(with_ems, results, strict=True)):
            cpu = cpu_seconds(em.proc.pid) - c0[i]
            late = server_info(em.url)["emulated"]["lateness_ms"]
            ok = sum(r["status"] == "ok" for r in res.records)
            print(f"   server {i}: {ok}/{len(res.records)} ok; token lateness P50 "
                  f"{late['p50']} ms, P99 {late['p99']} ms, max {late['max']} ms "
                  f"({late['tokens']} tokens); CPU {cpu:.1f} s over {wall:.0f} s wall "
                  f"= {cpu / wall:.3f} of a core -> {wall / cpu:.0f} such servers per core")
    finally:
        for em in with_ems:
            em.stop()


async def _replays(urls: list[str], work) -> list:
    loop = asyncio.get_running_loop()
    cfgs = [ReplayConfig(url=u, max_lateness_s=60.0, request_timeout_s=120.0) for u in urls]
    return await asyncio.gather(*(loop.run_in_executor(None, replay, work, c) for c in cfgs))


def agreement(concurrencies: list[int]) -> None:
    from runtime.emulator.agreement import ClosedLoop, bench_serving, replayed, simulated
    from servetwin.cli import build_parser
    from servetwin.cmd_emulate import config_from

    cfg = config_from(build_parser("emulate").parse_args(["emulate"]))
    print("\n3. bench_serving (the CPU harness's SGLang) against one emulator at speed 1 "
          "vs servetwin simulate, default deployment")
    for c in concurrencies:
        work = ClosedLoop(concurrency=c, seed=100 + c)
        with EmulatorProcess(["--speed", "1"]) as em:
            bench = bench_serving(em.url, work)
        with EmulatorProcess(["--speed", "1"]) as em:
            ours = replayed(em.url, work)
        sim = simulated(cfg, work)
        print(f"   {work.spec}:")
        for who, got in (("bench_serving", bench), ("servetwin replay", ours)):
            row = [f"{got[k]:7.2f} vs {sim[k]:7.2f} ms ({got[k] / sim[k] - 1:+.1%})"
                   for k in ("mean_ttft_ms", "mean_tpot_ms")]
            print(f"     {who:16s} mean TTFT {row[0]}, mean TPOT {row[1]}  (emulator vs "
                  "simulate)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--servers", type=int, default=4, help="emulators run at once in part 2")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    ap.add_argument("--speed", type=float, default=1.0,
                    help="part 2's speed factor (the replay's rate scales with it)")
    ns = ap.parse_args()
    parts = {int(p) for p in ns.parts.split(",")}
    print(f"benchmarks/emulator.py on {platform.node()} ({platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}), "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.1f}")
    if 1 in parts:
        throughput(300 if ns.quick else 2000, 16)
    if 2 in parts:
        a100_load(1, 20 if ns.quick else 120, ns.speed)
        a100_load(ns.servers, 20 if ns.quick else 120, ns.speed)
    if 3 in parts:
        agreement([4] if ns.quick else [1, 4, 8])
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
