"""Microseconds per step of a step-time backend on random heterogeneous batches.

    python benchmarks/step_time.py [--backend opdb] [--model M] [--gpu G] [--tp N] [--steps N]

Workload (seeded): a mix the replica produces: 70% decode-only steps (batch 1..256, KV
lengths uniform 100..16k, timed through `decode_times` in runs of 32 steps as the replica
advances them, and through `step_time`), 30% mixed steps (1..4 prefill chunks of 1..8192
new tokens with cached prefixes 0..16k, plus 0..128 decode requests). Also prints the
error of folding decode KV lengths in by their mean against per-request evaluation.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np

from twin.config import ServerArgs, derive_capacity
from twin.perf import make_step_time


def batches(rng: np.random.Generator, n: int) -> list[tuple[list, list]]:
    out = []
    for _ in range(n):
        dec = rng.integers(100, 16384, size=int(rng.integers(1, 257))).tolist()
        if rng.random() < 0.7:
            out.append(([], dec))
        else:
            chunks = [(int(rng.integers(1, 8193)), int(rng.integers(0, 16384)))
                      for _ in range(int(rng.integers(1, 5)))]
            out.append((chunks, dec[: int(rng.integers(0, 129))]))
    return out


def time_steps(st, work) -> float:
    t = time.perf_counter()
    for chunks, dec in work:
        st.step_time(chunks, dec)
    return (time.perf_counter() - t) / len(work) * 1e6


def time_decode_runs(st, rng, runs: int, run_len: int = 32) -> float:
    sizes = rng.integers(1, 257, size=runs)
    t = time.perf_counter()
    for b in sizes:
        kv0 = int(b) * 4000
        st.decode_times(int(b), kv0 + np.arange(run_len) * int(b))
    return (time.perf_counter() - t) / (runs * run_len) * 1e6


def fold_error(st, rng, n: int = 300) -> tuple[float, float]:
    """Mean-KV folding vs per-request evaluation: each request charged its share of a
    uniform batch at its own length, mean_i D(b, s_i). Returns (mean, max) |rel. error|."""
    errs = []
    for _ in range(n):
        b = int(rng.integers(2, 257))
        lens = np.exp(rng.uniform(np.log(64), np.log(32768), size=b))
        row = st._decode_row(b)
        folded = float(np.interp(lens.mean(), st.ds, row))
        per_req = float(np.interp(lens, st.ds, row).mean())
        errs.append(abs(folded - per_req) / per_req)
    return float(np.mean(errs)), float(np.max(errs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="opdb")
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--gpu", default="h100-sxm-80gb")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    args = ServerArgs(model_path=a.model, tp_size=a.tp)
    cap = derive_capacity(args, a.gpu)
    t0 = time.perf_counter()
    st = make_step_time(a.backend, cap, args)
    build = time.perf_counter() - t0
    rng = np.random.default_rng(a.seed)
    work = batches(rng, a.steps)
    time_steps(st, work[:500])  # warm the per-batch-size caches
    per_step = time_steps(st, work)
    per_decode = time_decode_runs(st, rng, a.steps // 32)
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print(f"backend {a.backend}: {st.describe()}")
    print(f"workload: {a.steps} random steps (70% decode-only b 1..256, KV U(100,16k); 30% "
          f"mixed, 1..4 chunks of 1..8192 tokens, prefix 0..16k, + 0..128 decodes), seed {a.seed}")
    print(f"start-up (tables) {build:.2f} s")
    print(f"step_time: {per_step:.1f} us per step")
    print(f"decode_times, runs of 32 steps: {per_decode:.2f} us per step")
    if hasattr(st, "_decode_row"):
        mean, worst = fold_error(st, rng)
        print(f"decode KV folded by mean vs per-request (KV log-uniform 64..32k, b 2..256): "
              f"mean |error| {mean * 100:.2f}%, max {worst * 100:.2f}%")


if __name__ == "__main__":
    main()
