"""The request path of SGLang 0.5.23, measured on the CPU harness: the tokenizer manager's
cost per request and per prompt token, and the HTTP part before it.

    python benchmarks/request_path.py [--burst 16] [--lengths 16 256 1024 2048] [--rounds 3]

The tokenizer manager is one process (the HTTP server runs in it too); it handles requests
one after another. A burst of K requests sent at once leaves it one by one: the gaps between
their `api_server_dispatch_finish_ts` (SGLang's stamp when the tokenized request was sent to
the scheduler) are its service time per request. Bursts of prompts of several lengths, sent
as `text` (as bench_serving sends them: tokenized in the tokenizer manager) and as
`input_ids` (as servetwin's replay sends them), give `service = per_request +
per_token x prompt_tokens` by least squares. The same costs are CPU work on a GPU server's
host, so the twin uses them as its default request path on every GPU (twin/request_path.py).
Prints the fit, the machine and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.cpu.serve import CpuServer  # noqa: E402


async def burst(url: str, bodies: list[dict]) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async def one(body: dict) -> dict:
            async with s.post(url + "/generate", json=body) as r:
                return (await r.json())["meta_info"]
        return await asyncio.gather(*(one(b) for b in bodies))


def bodies(kind: str, n: int, k: int, rng: np.random.Generator) -> list[dict]:
    sp = {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0}
    if kind == "input_ids":
        return [{"input_ids": rng.integers(10, 400, n).tolist(), "sampling_params": sp}
                for _ in range(k)]
    words = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
    return [{"text": " ".join(rng.choice(words, n)), "sampling_params": sp} for _ in range(k)]


def gaps(metas: list[dict]) -> list[tuple[int, float]]:
    """(prompt tokens, dispatch gap) for every request after the first of a burst."""
    ms = sorted(metas, key=lambda m: m["api_server_dispatch_finish_ts"])
    return [(m["prompt_tokens"], m["api_server_dispatch_finish_ts"]
             - p["api_server_dispatch_finish_ts"]) for p, m in zip(ms, ms[1:], strict=False)]


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    x = np.array([p for p, _ in points], float)
    y = np.array([g for _, g in points])
    a = np.vstack([np.ones_like(x), x]).T
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ coef
    return float(coef[0]), float(coef[1]), float(np.median(np.abs(resid)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    out: dict[str, list] = {"text": [], "input_ids": []}
    with CpuServer(["--max-running-requests", "64"]) as server:
        for _ in range(a.rounds):
            for kind in out:
                for n in a.lengths:
                    metas = asyncio.run(burst(server.url, bodies(kind, n, a.burst, rng)))
                    out[kind] += gaps(metas)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Measured {stamp} on {platform.node()}: {platform.machine()}, Python "
          f"{platform.python_version()}; SGLang 0.5.23 CPU harness; bursts of {a.burst}, "
          f"prompts {a.lengths}, {a.rounds} rounds.")
    for kind, pts in out.items():
        c0, c1, mad = fit(pts)
        print(f"{kind}: per request {c0 * 1e3:.3f} ms, per prompt token {c1 * 1e6:.3f} us "
              f"(n={len(pts)}, median |residual| {mad * 1e3:.3f} ms; median gap "
              f"{statistics.median(g for _, g in pts) * 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
