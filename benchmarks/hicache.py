"""The users' "zero-copy (host memory) for contexts over 64k" question, answered with SGLang's
own mechanism: the hierarchical cache (`--enable-hierarchical-cache`, twin/hicache.py) beside
the twin's swap and the plain radix cache.

    python benchmarks/hicache.py [--requests 600] [--docs 6] [--seed 0] [--max-total-tokens N]

Workload: finance-qa (the users' mix: 50 closed-loop clients, 90% short questions, 8% documents
of 10k-32k, 2% of 64k-128k), except that the long documents are drawn from `--docs` distinct
documents, so each comes back several times with a new question (a knowledge base: the same
filings asked about again). Deployment: 2x A100-80GB PCIe, TP 2 (the users'), the default
model, the users' --max-total-tokens 140000. Runs:
- `radix`: SGLang's default (a long document evicted from the GPU is recomputed);
- `hicache`: the same with SGLang's hierarchical cache, write_through, host pool 2x the GPU's;
- `hicache-wb`: write_back;
- `hicache-<N>GB`: write_through with a host pool of `--hicache-size` GB per GPU;
- `swap`: the twin's swap of preempted/retracted requests to host (`--swap-min-tokens 1`), the
  users' "zero-copy" idea, with the radix cache as SGLang's.
Prints the workload, machine and date, then per run: P50/P99 TTFT per class (short < 10k,
document 10k-32k, long >= 64k), the prefix-cache hit rate (cached / prompt tokens) per class,
and the host-tier counters. The numbers are the twin's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.config import ServerArgs  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import Request, Workload, finance_qa  # noqa: E402

LONG_DOC_ID = 9_000_000  # segment hashes of the repeated long documents
CLASSES = (("short", 0, 10_000), ("document", 10_000, 64_000), ("long", 64_000, 10**9))


def repeated_docs(seed: int, n: int, docs: int) -> Workload:
    """finance-qa whose 64k-128k documents are `docs` documents asked about again and again:
    system prompt, the document (its length drawn once per document), a new question."""
    base = finance_qa(seed, n)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(64_000 - 256 - 512, 128_000 - 256 - 512, size=docs)
    out = []
    for r in base.requests:
        if r.prompt_tokens < 64_000:
            out.append(r)
            continue
        d = int(rng.integers(0, docs))
        q = int(rng.integers(64, 513))
        segs = [(1, 256), (LONG_DOC_ID + d, int(lengths[d])), (r.segments[-1][0], q)]
        out.append(Request.make(r.rid, r.arrival_s, segs, r.output_tokens, r.priority))
    return Workload("finance-qa-repeated-docs", tuple(out), base.concurrency,
                    description=f"finance-qa, long documents drawn from {docs}")


def run(name: str, wl: Workload, args: ServerArgs, **cfg) -> dict:
    res = simulate(wl, SimConfig(args=args, gpu="a100-pcie-80gb", **cfg))
    recs = [r for r in res.records if r["status"] == "ok"]
    row = {"name": name, "n_ok": len(recs), "n": len(res.records)}
    for cls, lo, hi in CLASSES:
        rs = [r for r in recs if lo <= r["prompt_tokens"] < hi]
        if not rs:
            continue
        ttft = np.array([r["ttft_s"] for r in rs])
        row[cls] = (len(rs), float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)),
                    sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs))
    row["engine"] = res.summary["engine"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--docs", type=int, default=6, help="distinct 64k-128k documents")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=140_000,
                    help="the users' tuned KV pool (tokens)")
    ap.add_argument("--hicache-size", type=int, default=200,
                    help="host pool per GPU (GB) of the large-host run (default 200: a "
                    "two-GPU server with 512 GB of RAM)")
    a = ap.parse_args()
    wl = repeated_docs(a.seed, a.requests, a.docs)
    n_long = sum(r.prompt_tokens >= 64_000 for r in wl.requests)
    print(f"# benchmarks/hicache.py  {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  "
          f"{platform.machine()} {os.cpu_count()} CPUs  python {platform.python_version()}")
    print(f"# workload: {wl.name}: {len(wl.requests)} requests, {wl.concurrency} clients, "
          f"{n_long} long (64k-128k) from {a.docs} documents, seed {a.seed}")
    print(f"# deployment: 2x a100-pcie-80gb TP 2, max_total_tokens {a.max_total_tokens}")
    base = ServerArgs(tp_size=2, max_total_tokens=a.max_total_tokens)
    hi = replace(base, enable_hierarchical_cache=True)
    runs = [("radix", base, {}), ("hicache", hi, {}),
            ("hicache-wb", replace(hi, hicache_write_policy="write_back"), {}),
            (f"hicache-{a.hicache_size}GB", replace(hi, hicache_size=a.hicache_size), {}),
            ("swap", base, {"swap_min_tokens": 1})]
    print("\n| run | class | n | P50 TTFT s | P99 TTFT s | cache hit |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for name, args, cfg in runs:
        print(f"# running {name} ...", file=sys.stderr, flush=True)
        row = run(name, wl, args, **cfg)
        rows.append(row)
        for cls, *_ in CLASSES:
            if cls in row:
                n, p50, p99, hit = row[cls]
                print(f"| {name} | {cls} | {n} | {p50:.2f} | {p99:.2f} | {hit:.1%} |",
                      flush=True)
    print("\n| run | ok/all | host hits | loaded back tokens | load s | load wait s | "
          "written tokens | host evictions | swap outs/ins |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        e, h = row["engine"], row["engine"].get("hicache") or {}
        print(f"| {row['name']} | {row['n_ok']}/{row['n']} | {h.get('host_hits', '-')} | "
              f"{h.get('loaded_back_tokens', '-')} | {_f(h.get('load_back_s'))} | "
              f"{_f(h.get('load_back_wait_s'))} | {h.get('written_tokens', '-')} | "
              f"{h.get('host_evictions', '-')} | {e['swap_outs']}/{e['swap_ins']} |")
    hc = rows[1]["engine"].get("hicache", {})
    print(f"\n# host link {hc.get('host_link_bytes_per_s', 0) / 1e9:.1f} GB/s "
          f"({hc.get('host_link_source')}); host pool {hc.get('host_capacity_tokens')} tokens")


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
