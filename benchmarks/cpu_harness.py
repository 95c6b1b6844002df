"""Measure the CPU harness: install time, server start, decode step, 1k-token prefill.

    python benchmarks/cpu_harness.py [--no-write] [SGLang args ...]

Starts a real server with the tiny dummy-weight model, times a batch-1 decode step
(median gap between streamed tokens), a prefill of 1024 new tokens and of 16 new
tokens (the fixed per-step overhead) from the client, and writes the numbers with
the date and machine into docs/cpu-harness.md between the results markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.cpu.install import require_harness  # noqa: E402
from runtime.cpu.model import DEFAULT_SPEC, FIRST_ORDINARY_ID  # noqa: E402
from runtime.cpu.serve import CpuServer  # noqa: E402

DOC = ROOT / "docs" / "cpu-harness.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def stream(url: str, input_ids: list[int], max_new_tokens: int) -> tuple[list[float], dict]:
    """Arrival times (monotonic s, from send) of the streamed chunks, and the final meta_info."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}  # fmt: skip
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    sent = time.monotonic()
    arrivals, meta = [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.monotonic() - sent)
                meta = json.loads(line[5:])["meta_info"]
    return arrivals, meta


def fresh_prompt(n: int, salt: int) -> list[int]:
    span = DEFAULT_SPEC.vocab_size - FIRST_ORDINARY_ID
    return [FIRST_ORDINARY_ID + (salt * 1_000_003 + i * 7919) % span for i in range(n)]


def decode_gaps(url: str, batch: int, tokens: int = 97) -> list[float]:
    """Gaps between streamed tokens of `batch` concurrent requests (the first gap dropped)."""
    with ThreadPoolExecutor(batch) as pool:
        runs = list(
            pool.map(lambda s: stream(url, fresh_prompt(16, 900 + s), tokens)[0], range(batch))
        )
    return [b - a for arrivals in runs for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]


def measure(url: str) -> dict:
    ttft_1k, ttft_16, forward_1k = [], [], []
    for salt in range(1, 4):
        arrivals, meta = stream(url, fresh_prompt(1024, salt), 1)
        ttft_1k.append(arrivals[0])
        if "prefill_finished_time" in meta and "forward_entry_time" in meta:
            forward_1k.append(meta["prefill_finished_time"] - meta["forward_entry_time"])
        ttft_16.append(stream(url, fresh_prompt(16, salt + 100), 1)[0][0])
    gaps = decode_gaps(url, batch=1)
    gaps_8 = decode_gaps(url, batch=8)
    return {
        "decode_step_8_ms": 1000 * statistics.median(gaps_8),
        "decode_step_ms": 1000 * statistics.median(gaps),
        "decode_step_p90_ms": 1000 * statistics.quantiles(gaps, n=10)[-1],
        "prefill_1k_ttft_ms": 1000 * statistics.median(ttft_1k),
        "prefill_1k_forward_ms": 1000 * statistics.median(forward_1k) if forward_1k else None,
        "prefill_16_ttft_ms": 1000 * statistics.median(ttft_16),
    }


def report(install_s: float | None, start_s: float, numbers: dict) -> str:
    spec = DEFAULT_SPEC
    forward = numbers["prefill_1k_forward_ms"]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {platform.node()}: "
        f"{platform.processor() or platform.machine()}, {_cpu_model()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}.",
        "",
        f"Model `{spec.name}`: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, intermediate "
        f"{spec.intermediate_size}, vocab {spec.vocab_size}, "
        f"{spec.num_parameters / 1e6:.1f} M parameters (float32).",
        "",
        "| what | time |",
        "| --- | --- |",
        f"| install (`servetwin live install-cpu`, fresh) | "
        f"{'n/a' if install_s is None else f'{install_s:.0f} s'} |",
        f"| server start to first `/generate` answered | {start_s:.1f} s |",
        f"| decode step, batch 1 (median gap between streamed tokens) | "
        f"{numbers['decode_step_ms']:.1f} ms (p90 {numbers['decode_step_p90_ms']:.1f} ms) |",
        f"| decode step, batch 8 (median gap, 8 concurrent streams) | "
        f"{numbers['decode_step_8_ms']:.1f} ms |",
        f"| prefill of 1024 new tokens (TTFT, 1 output token) | {numbers['prefill_1k_ttft_ms']:.0f} ms |",
        f"| the same, forward only (`prefill_finished_time - forward_entry_time`) | "
        f"{'n/a' if forward is None else f'{forward:.0f} ms'} |",
        f"| prefill of 16 new tokens (TTFT: the per-step overhead) | {numbers['prefill_16_ttft_ms']:.0f} ms |",
    ]  # fmt: skip
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only, leave the doc alone")
    args, sglang_args = parser.parse_known_args()
    harness = require_harness()
    install_s = json.loads(harness.marker.read_text()).get("fresh_install_s")
    with CpuServer(sglang_args) as server:
        print(f"server up in {server.start_seconds:.1f} s on {server.url} (log {server.log_path})")
        numbers = measure(server.url)
    text = report(install_s, server.start_seconds, numbers)
    print(text)
    if not args.no_write:
        write_doc(text)
        print(f"written to {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
