"""KV memory per allocator on long-context mixes: effective utilization, fragmentation,
failures, copies. The numbers are each run's summary `memory` section (`twin.memory_stats`,
the same `servetwin simulate` prints), the replica sampling every `--every` simulated
seconds; prints the table of docs/memory.md.

    python benchmarks/allocators.py [--workloads finance-qa long-64k-128k] [--every 0.25]

Columns (docs/memory.md defines each): `util` = tokens holding KV / capacity, averaged
over the samples; `util|q` the same over the samples where requests were waiting (memory
is the limit then); `alloc` allocated / capacity; `int` internal fragmentation (allocated
but unused / allocated), `ext` external (1 - largest free block or run / free), both
averaged; `idle` (allocated - stored + reserve) / capacity; `oom`/`frag` failed
allocations; `realloc`/`moved` buddy growth copies.

The replica reserves at admission (contiguous: prompt + max new tokens; buddy: a block
for the round's own tokens), charges re-allocation and compaction copies at HBM bandwidth
as stalls, and the `+ defrag` rows run the users' rule through the replica
(`--defrag-every 100 --defrag-threshold 0.25`).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import numpy as np
import simpy

from twin.config import ServerArgs
from twin.memory_stats import memory_summary
from twin.metrics import SERIES_FIELDS, twin_records
from twin.sim import SimConfig, build_replica
from twin.workload import PRESETS, Workload, from_spec

WORKLOADS = {
    "finance-qa": lambda: PRESETS["finance-qa"](0),
    "long-64k-128k": lambda: from_spec("arrival=closed,concurrency=8,n=48,"
                                       "prompt=uniform:64000:128000,output=uniform:100:500",
                                       seed=0, name="long-64k-128k"),
}
ALLOCATORS = ["token", "paged", "buddy", "contiguous"]
MIB = 2**20


def config(name: str, every: float, args: ServerArgs, gpu: str, min_block_mib: float = 256,
           defrag: tuple[int, float] | None = None) -> SimConfig:
    return SimConfig(args=args, gpu=gpu, step_time_backend="roofline", kv_allocator=name,
                     buddy_min_block_bytes=min_block_mib * MIB, sample_every_s=every,
                     defrag_every=defrag[0] if defrag else None,
                     defrag_threshold=defrag[1] if defrag else None)


def run(workload: Workload, name: str, every: float, args: ServerArgs, gpu: str,
        min_block_mib: float = 256, defrag: tuple[int, float] | None = None) -> dict:
    cfg = config(name, every, args, gpu, min_block_mib, defrag)
    env = simpy.Environment()
    rep, _ = build_replica(env, workload, cfg)
    env.process(rep.run())
    t0 = time.process_time()
    env.run()
    cpu = time.process_time() - t0
    return row(rep, env.now, cpu, name, min_block_mib, defrag, every)


def row(rep, sim_s: float, cpu: float, name: str, min_block_mib: float,
        defrag: tuple[int, float] | None, every: float) -> dict:
    """One table row: the run's summary `memory` section (twin.memory_stats) and a few
    run totals."""
    m = memory_summary(rep.series, SERIES_FIELDS, rep.alloc.stats(), rep.alloc.name,
                       rep.cap.kv_bytes_per_token, dict(rep.counters.__dict__), every)
    recs = twin_records(rep.finished, rep.step_end)
    ok = [r for r in recs if r["status"] == "ok"]
    label = f"buddy {min_block_mib:g} MiB" if name == "buddy" else name
    if defrag:
        label += f" + defrag {defrag[0]}/{defrag[1]:g}"
    nan = float("nan")
    return {"allocator": label, "compactions": m["compactions"],
            "util": m["effective_utilization"]["mean"],
            "util|q": m["effective_utilization"]["while_waiting"] or nan,
            "alloc": m["allocated_share"], "int": m["internal_fragmentation"]["mean"],
            "ext": m["external_fragmentation"]["mean"], "idle": m["idle_share"],
            "oom": m["alloc_failures"]["oom"], "frag": m["alloc_failures"]["fragmentation"],
            "realloc": m["reallocations"], "moved": m["tokens_moved"],
            "stall_s": m["copy_stall_s"], "ok": len(ok), "n": len(recs),
            "retract": rep.counters.retractions, "sim_s": sim_s,
            "p99_ttft": float(np.percentile([r["ttft_s"] for r in ok], 99)) if ok else 0.0,
            "cpu_s": cpu, "capacity": m["capacity_tokens"], "memory": m}


COLS = ["allocator", "util", "util|q", "alloc", "int", "ext", "idle", "oom", "frag",
        "realloc", "compactions", "moved", "stall_s", "ok", "retract", "sim_s", "p99_ttft",
        "cpu_s"]


def fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--allocators", nargs="+", default=ALLOCATORS, choices=ALLOCATORS)
    ap.add_argument("--every", type=float, default=0.25, help="sample period, simulated s")
    ap.add_argument("--model-path", default=ServerArgs.model_path)
    ap.add_argument("--gpu", default="a100-pcie-80gb")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16, help="for the paged allocator")
    ap.add_argument("--min-block-mib", type=float, nargs="+", default=[256, 64, 16],
                    help="buddy minimum blocks to compare (the users': 256)")
    ns = ap.parse_args()
    print(f"# allocators {datetime.date.today()} on {platform.node()} "
          f"({platform.processor() or platform.machine()}); {ns.model_path} on "
          f"{ns.tp_size}x {ns.gpu}, roofline step times, "
          f"contiguous reserve 15%, paged page {ns.page_size}")
    for wname in ns.workloads:
        w = WORKLOADS[wname]()
        print(f"\n## {wname}: {len(w.requests)} requests\n")
        print("| " + " | ".join(COLS) + " |")
        print("|" + "---|" * len(COLS))
        for name in ns.allocators:
            page = ns.page_size if name == "paged" else 1
            args = ServerArgs(model_path=ns.model_path, tp_size=ns.tp_size, page_size=page)
            for mib in ns.min_block_mib if name == "buddy" else [256]:
                r = run(w, name, ns.every, args, ns.gpu, mib)
                print("| " + " | ".join(fmt(r[c]) for c in COLS) + " |", flush=True)
            if name in ("buddy", "contiguous"):  # the users' defragmentation rule
                r = run(w, name, ns.every, args, ns.gpu, 256, (100, 0.25))
                print("| " + " | ".join(fmt(r[c]) for c in COLS) + " |", flush=True)
        print(f"\ncapacity {r['capacity']} tokens")


if __name__ == "__main__":
    main()
