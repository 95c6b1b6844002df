"""The request path of SGLang 0.5.23, measured on the CPU harness: the tokenizer manager's
cost per request and per prompt token, and the HTTP part before it.

    python benchmarks/request_path.py [--burst 16] [--lengths 16 256 1024 2048] [--rounds 3]
    python benchmarks/request_path.py --stream 8 [--stream-out 128] [--rounds 3]

The tokenizer manager is one process (the HTTP server runs in it too); it handles requests
one after another. A burst of K requests sent at once leaves it one by one: the gaps between
their `api_server_dispatch_finish_ts` (SGLang's stamp when the tokenized request was sent to
the scheduler) are its service time per request. Bursts of prompts of several lengths, sent
as `text` (as bench_serving sends them: tokenized in the tokenizer manager) and as
`input_ids` (as servetwin's replay sends them), give `service = per_request +
per_token x prompt_tokens` by least squares. The same costs are CPU work on a GPU server's
host, so the twin uses them as its default request path on every GPU (twin/request_path.py).
Prints the fit, the machine and the date.

`--stream B`: the way out instead. B streamed requests decode together (fixed lengths,
`ignore_eos`) with SGLang's per-request `stream_interval` at 1 (its default: every step's
token goes to the detokenizer and the client) and at 16, rounds interleaved; the mean
decode step each way (from the client's token times: (E2E - TTFT) / (tokens - 1)) and
their difference per step and per request: the scheduler-side and detokenizer cost of
streaming every token (CPU work that shares the harness's two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
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


async def streamed(url: str, batch: int, out_len: int, interval: int) -> list[float]:
    """Each request's mean decode step (client times) with `stream_interval` = interval."""
    import time

    import aiohttp

    sp = {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0,
          "stream_interval": interval}
    rng = np.random.default_rng(interval)

    async def one(s: aiohttp.ClientSession) -> float:
        body = {"input_ids": rng.integers(10, 400, 64).tolist(), "sampling_params": sp,
                "stream": True}
        first, last, n = None, None, 0
        async with s.post(url + "/generate", json=body) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = time.perf_counter()
                first = first or last
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
        if n != out_len or first is None:
            raise RuntimeError(f"stream_interval {interval}: {n} of {out_len} tokens")
        return (last - first) / (out_len - 1)

    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(one(s) for _ in range(batch)))


def stream_cost(url: str, batch: int, out_len: int, rounds: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(rounds):
        for interval in out:
            out[interval] += asyncio.run(streamed(url, batch, out_len, interval))
    return out


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
    ap.add_argument("--stream", type=int, default=None, metavar="B",
                    help="measure the way out instead: B streamed requests at "
                    "stream_interval 1 and 16")
    ap.add_argument("--stream-out", type=int, default=128, help="tokens per streamed request")
    a = ap.parse_args()
    if a.stream:
        return stream_main(a)
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


def stream_main(a) -> int:
    with CpuServer(["--max-running-requests", str(max(a.stream, 16))]) as server:
        asyncio.run(streamed(server.url, 2, 8, 1))  # warm-up, not measured
        got = stream_cost(server.url, a.stream, a.stream_out, a.rounds)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Measured {stamp} on {platform.node()}: {platform.machine()}, Python "
          f"{platform.python_version()}; SGLang 0.5.23 CPU harness; {a.stream} streamed "
          f"requests x {a.stream_out} tokens, {a.rounds} rounds interleaved.")
    med = {k: statistics.median(v) for k, v in got.items()}
    for k, v in med.items():
        print(f"stream_interval {k:2d}: decode step median {v * 1e3:.3f} ms "
              f"(mean {statistics.mean(got[k]) * 1e3:.3f} ms, n={len(got[k])})")
    d = med[1] - med[16]
    print(f"streaming every token: {d * 1e3:+.3f} ms per step, {d / a.stream * 1e6:+.1f} us "
          f"per request per step; ratio {med[1] / med[16]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
