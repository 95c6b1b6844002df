"""A vLLM server's own counters from its Prometheus `/metrics`, summed over label sets.

What the twin-vs-live comparison and the vLLM profile read: preemptions, engine steps
(`vllm:iteration_tokens_total_count`: one observation per step), prefix-cache queries and
hits, and the sums and counts of the per-request queue, prefill, decode and TTFT histograms
(vLLM's engine-side timestamps; its OpenAI API returns none of them per request).
"""

from __future__ import annotations

import urllib.request

NAMES = (
    "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_success_total",
)


def parse_counters(text: str, names: tuple[str, ...] = NAMES) -> dict[str, float]:
    """`{name: value summed over its label sets}` for the given metric names."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


def counters(url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        return parse_counters(resp.read().decode())


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
