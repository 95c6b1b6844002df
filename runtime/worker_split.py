"""Which worker of a fleet did what: per-worker request and token counts from `/metrics`.

Pure (no I/O): the caller snapshots each worker's Prometheus text before and after a run;
`worker_split(before, after)` differences SGLang's counters:

- requests: `sglang:num_requests_total` (finished requests; every label set summed),
- prompt tokens: `sglang:prompt_tokens_total`,
- cached tokens: `sglang:prefill_effective_tokens_total{mode="device_hit"}` (prompt tokens
  served from the radix cache; SGLang 0.5.23 has no `cached_tokens_total`),
- output tokens: `sglang:generation_tokens_total`;

and a vLLM worker's `vllm:request_success_total`, `vllm:prompt_tokens_total`,
`vllm:prompt_tokens_cached_total`, `vllm:generation_tokens_total`.

A worker that died during the run has no "after" snapshot; its row says so (`None` counts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
COUNTERS = {
    "requests": ("sglang:num_requests_total", None),
    "prompt_tokens": ("sglang:prompt_tokens_total", None),
    "cached_tokens": ("sglang:prefill_effective_tokens_total", 'mode="device_hit"'),
    "output_tokens": ("sglang:generation_tokens_total", None),
}
# A vLLM worker (behind servetwin's length router) under vLLM 0.32's names.
VLLM_COUNTERS = {
    "requests": ("vllm:request_success_total", None),
    "prompt_tokens": ("vllm:prompt_tokens_total", None),
    "cached_tokens": ("vllm:prompt_tokens_cached_total", None),
    "output_tokens": ("vllm:generation_tokens_total", None),
}


def counters(prom_text: str) -> dict[str, float] | None:
    """The counters of `COUNTERS` (SGLang) or `VLLM_COUNTERS` in a Prometheus text (sums
    over label sets); None when the text is not a metrics page (e.g. the `# unavailable`
    note of a dead worker)."""
    table = VLLM_COUNTERS if "vllm:" in prom_text and "sglang:" not in prom_text else COUNTERS
    sums = dict.fromkeys(table, 0.0)
    seen = False
    for line in prom_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        for key, (metric, need) in table.items():
            if name == metric and (need is None or need in labels):
                try:
                    v = float(value)
                except ValueError:
                    continue
                if math.isfinite(v):
                    sums[key] += v
                    seen = True
    return sums if seen else None


def worker_split(before: Mapping[str, str], after: Mapping[str, str]) -> list[dict]:
    """One row per worker (in `before`'s order): counts during the run, each worker's share
    of the fleet's requests, and its cached-token share (cached / prompt tokens)."""
    rows = []
    for url, text in before.items():
        b, a = counters(text), counters(after.get(url, ""))
        if b is None or a is None:
            rows.append({"worker": url, **dict.fromkeys(COUNTERS), "note": "no metrics "
                         + ("before" if b is None else "after") + " the run"})
            continue
        rows.append({"worker": url, **{k: int(round(a[k] - b[k])) for k in COUNTERS}})
    total = sum(r["requests"] or 0 for r in rows)
    for r in rows:
        n, prompt = r["requests"], r["prompt_tokens"]
        r["request_share"] = round(n / total, 4) if n is not None and total else None
        r["cached_share"] = (round(r["cached_tokens"] / prompt, 4) if prompt else
                             (None if prompt is None else 0.0))
    return rows
