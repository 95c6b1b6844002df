"""The twin's closed-loop clients against SGLang's `bench_serving` (issue 10).

    python benchmarks/closed_loop.py [--clients 1,4,8,16] [--no-replay]

For each client count C: one `servetwin emulate` server (the twin's own replica model on
the wall clock, speed 1, default deployment) is driven by the CPU harness's real
`bench_serving --max-concurrency C` (random ids, 512 prompt / 32 output tokens, max(24,
3C) requests, `--seed 100+C`), and another by servetwin's replay client; their mean TTFT
and TPOT are set beside `servetwin simulate` of the same closed loop with both client
models (twin/workload.py CLIENTS):

- `clients=replay`: the spec's workload (unique prompts), all clients start together;
- `clients=bench`: bench_serving's own requests (its random-ids draw, so a repeated prompt
  is a cache hit as on the server) and its warm-up (a copy of the first request, left in
  the radix cache, then 1 s).

The server model is the same on both sides, so a gap is the client model's (or the
emulator's lateness on a loaded machine: benchmarks/emulator.py measures it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.emulator.agreement import ClosedLoop, bench_serving, replayed, simulated  # noqa: E402
from runtime.emulator.process import EmulatorProcess  # noqa: E402


def _pct(got: float, ref: float) -> str:
    return f"{got / ref - 1:+.1%}"


def run(concurrencies: list[int], with_replay: bool) -> list[dict]:
    from servetwin.cli import build_parser
    from servetwin.cmd_emulate import config_from

    cfg = config_from(build_parser("emulate").parse_args(["emulate"]))
    rows = []
    for c in concurrencies:
        work = ClosedLoop(concurrency=c, requests=max(24, 3 * c), seed=100 + c)
        print(f"{work.spec}, seed {work.seed}: bench_serving ...", file=sys.stderr, flush=True)
        with EmulatorProcess(["--speed", "1"]) as em:
            bench = bench_serving(em.url, work)
        ours = None
        if with_replay:
            print("  servetwin replay ...", file=sys.stderr, flush=True)
            with EmulatorProcess(["--speed", "1"]) as em:
                ours = replayed(em.url, work)
        repeats = len(work.bench_prompts()) - len({p[0] for p in work.bench_prompts()})
        rows.append({"c": c, "n": work.requests, "repeats": repeats, "bench": bench,
                     "replay_client": ours, "sim_replay": simulated(cfg, work, "replay"),
                     "sim_bench": simulated(cfg, work, "bench")})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| C | n | repeated prompts | bench_serving TTFT / TPOT (ms) | simulate "
             "clients=replay | simulate clients=bench | servetwin replay client vs "
             "clients=replay |", "|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        b = r["bench"]
        cells = []
        for key in ("sim_replay", "sim_bench"):
            s = r[key]
            cells.append(f"{s['mean_ttft_ms']:.1f} ({_pct(b['mean_ttft_ms'], s['mean_ttft_ms'])})"
                         f" / {s['mean_tpot_ms']:.2f} "
                         f"({_pct(b['mean_tpot_ms'], s['mean_tpot_ms'])})")
        o, s = r["replay_client"], r["sim_replay"]
        own = "-" if o is None else (
            f"{o['mean_ttft_ms']:.1f} ({_pct(o['mean_ttft_ms'], s['mean_ttft_ms'])}) / "
            f"{o['mean_tpot_ms']:.2f} ({_pct(o['mean_tpot_ms'], s['mean_tpot_ms'])})")
        lines.append(f"| {r['c']} | {r['n']} | {r['repeats']} | {b['mean_ttft_ms']:.1f} / "
                     f"{b['mean_tpot_ms']:.2f} | {cells[0]} | {cells[1]} | {own} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,8,16", help="client counts (default 1,4,8,16)")
    ap.add_argument("--no-replay", action="store_true",
                    help="skip servetwin's own replay client against the emulator")
    ns = ap.parse_args()
    try:
        cs = [int(x) for x in ns.clients.split(",")]
    except ValueError:
        raise SystemExit(f"--clients {ns.clients}: expected counts like 1,4,8,16") from None
    if not cs or min(cs) < 1:
        raise SystemExit(f"--clients {ns.clients}: counts must be >= 1")
    print(f"benchmarks/closed_loop.py on {platform.node()} ({platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}), "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("Workload: closed loop, random ids, 512 prompt / 32 output tokens, "
          "n = max(24, 3C), seed 100+C; one emulator at speed 1 per run, default "
          "deployment (DeepSeek-R1-Distill-Qwen-32B, 2x A100-80GB PCIe, TP 2).")
    print("Cells: simulate's mean, and (measured / simulate - 1) in brackets.\n")
    rows = run(cs, not ns.no_replay)
    print(report(rows))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
