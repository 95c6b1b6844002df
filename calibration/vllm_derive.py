"""Step-time samples of a vLLM V1 server: token gaps read under vLLM's scheduling rules, and
engine-side durations from vLLM's own per-request histograms.

Pure: timelines and metric deltas in, samples out (the shape of `calibration.derive`'s:
`{"steps": [[prefill_chunks, [batch, kv_sum]], ...], "dur_s", "kind", "source", "tag"}`).

vLLM's step is not SGLang's. One token budget per step (`max_num_batched_tokens`) is
shared by every running request: each decoding request takes one token, and the waiting
ones take what is left, chunked (chunked prefill is always on), in the same step. So a
prompt that arrives while B requests decode is prefilled in one step only if its tokens
plus B fit the budget; otherwise its first chunk runs silently beside the decodes (the
step emits only their tokens) and the step that emits its first token computed only the
rest. SGLang's token-gap rules (`calibration.derive`) assumed a prefill chunk of
`chunked_prefill_size` prompt tokens alone; read on vLLM they attributed whole prompts to
steps that computed their tail (a 512-token prompt beside one decode: measured 15 ms,
where the prompt alone takes 190 ms). The rules here, for the step between two token
clusters `prev` and `cur` (each a step end):
- every request that had a token so far and is not finished has one in `cur` (the decode
  batch is known), and no request has two tokens in a cluster (merged steps);
- the new first tokens' prompt tokens plus one token per decoding request fit the budget,
  and none of those prompts can have had a chunk in the step that ended at `prev`: each
  was sent after the cluster before `prev` (that step was scheduled before it reached the
  engine), or they would all have fit whole beside what that step is known to have run
  (then, scheduled in it, they would have emitted their first tokens at `prev`);
- no other request was waiting across the gap (sent before `prev`, first token after
  `cur`) unless `max_num_seqs` requests were running: vLLM would have given it a chunk of
  this step's budget;
- a step with no decodes counts only if its prompts were sent before `prev` (the engine
  was busy when the step began) -- with nothing running, the start of the step is unknown.

Engine-side samples (vLLM's `/metrics`, read before and after a profiling run), the
counterpart of SGLang's forward stamps, free of HTTP and streaming delays:
- `vllm:request_prefill_time_seconds` (scheduled to first token): a run of one request
  gives its prefill, chunked into the budget (source `vllm-prefill-time`); a run of K
  prompts whose first tokens came in one cluster and fit the budget gives that one step
  (the histogram's mean over the K);
- `vllm:request_decode_time_seconds` (first token to last): a run of B requests with the
  same output length whose first tokens came in one cluster decoded in lock-step, so the
  mean is the run's N - 1 decode steps at batch B (source `vllm-decode-time`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from calibration.derive import (
    Timeline,
    _step,
    _unique,
    chunk_steps,
    first_tokens,
    measurable_gaps,
)

PREFILL = "vllm:request_prefill_time_seconds"
DECODE = "vllm:request_decode_time_seconds"
QUEUE = "vllm:request_queue_time_seconds"
EPS_S = 0.005  # a silence longer than this starts the next cluster (a step end)


def token_gap_samples(lines: Sequence[Timeline], budget: int, max_num_seqs: int,
                      eps_s: float = EPS_S, idle_margin_s: float = 0.02) -> list[dict]:
    """Single-step samples from token arrival clusters under vLLM's rules (module doc)."""
    first_at = first_tokens(lines)
    out = []
    for cl, i, active in measurable_gaps(lines, eps_s):
        before = float(np.median([t for t, _, _ in cl[i - 2]])) if i >= 2 else None
        s = _gap(lines, cl[i - 1], cl[i], before, active, first_at, budget, max_num_seqs,
                 idle_margin_s)
        if s is not None:
            out.append(s)
    return out


def _gap(lines, prev, cur, before: float | None, running: set[int], first_at, budget: int,
         max_seqs: int, margin: float) -> dict | None:
    if not (_unique(prev) and _unique(cur)):
        return None
    t_prev = float(np.median([t for t, _, _ in prev]))
    t_cur = float(np.median([t for t, _, _ in cur]))
    firsts = [i for _, i, k in cur if k == 0]
    decoders = {i: k for _, i, k in cur if k > 0}
    if set(decoders) != running or not (decoders or firsts):
        return None
    if sum(lines[i].extend for i in firsts) + len(decoders) > budget:
        return None  # vLLM split those prompts over this step and an earlier one
    early = [i for i in firsts if before is None or lines[i].sent <= before]
    if early and not _whole_in_prev(lines, prev, firsts, budget, max_seqs):
        return None  # it may have had a chunk in the step that ended at `prev`
    if not decoders and any(lines[i].sent > t_prev - margin for i in firsts):
        return None  # the engine may have been idle: the step's start is unknown
    waiting = [j for j, tl in enumerate(lines) if j not in firsts and tl.sent < t_prev
               and first_at[j] > t_cur]
    if waiting and len(decoders) + len(firsts) < max_seqs:
        return None  # a waiting request would have had a chunk of this step
    chunks = [(lines[i].extend, lines[i].cached) for i in firsts]
    kv = sum(lines[i].prompt + k for i, k in decoders.items())
    in_prev = {i for _, i, _ in prev}
    gaps = [lines[i].tokens[k] - lines[i].tokens[k - 1] for i, k in decoders.items()
            if i in in_prev]
    dur = float(np.median(gaps)) if gaps else t_cur - t_prev
    kind = "mixed" if (firsts and decoders) else ("prefill" if firsts else "decode")
    tag = lines[firsts[0] if firsts else next(iter(decoders))].tag
    return {"steps": [_step(chunks, len(decoders), kv)], "dur_s": round(dur, 7),
            "kind": kind, "source": "token-gap", "tag": tag}


def _whole_in_prev(lines, prev, firsts: list[int], budget: int, max_seqs: int) -> bool:
    """Whether the prompts of `firsts` would all have been computed whole in the step
    that ended at `prev`, had they been scheduled in it: the tokens that step is known to
    have run (one per decode, a whole prompt per first token: an upper bound) plus theirs
    fit the budget, and the sequences fit `max_num_seqs`. Then a first token in `cur`
    means the request reached the engine after that step was scheduled."""
    used = sum(1 if k > 0 else lines[j].extend for _, j, k in prev)
    return (used + sum(lines[i].extend for i in firsts) <= budget
            and len(prev) + len(firsts) <= max_seqs)


def _one_cluster(lines: Sequence[Timeline], eps_s: float = EPS_S) -> bool:
    """All first tokens in one cluster: one step emitted them all."""
    firsts = sorted(tl.tokens[0] for tl in lines)
    return bool(firsts) and all(b - a <= eps_s for a, b in zip(firsts, firsts[1:],
                                                                strict=False))


def engine_samples(lines: Sequence[Timeline], delta: dict, budget: int, tag: str) -> list[dict]:
    """Samples from a run's `/metrics` delta (module doc); `lines` are all its requests,
    finished and in the order sent."""
    n = len(lines)
    if not n or any(not tl.tokens for tl in lines):
        return []
    out = []
    if delta.get(PREFILL + "_count") == n and delta.get(PREFILL + "_sum", 0) > 0:
        mean = delta[PREFILL + "_sum"] / n
        if n == 1:
            tl = lines[0]
            steps = chunk_steps(tl.extend, tl.cached, budget)
            out.append({"steps": steps, "dur_s": round(mean, 7),
                        "kind": "prefill" if len(steps) == 1 else "chunked-prefill",
                        "source": "vllm-prefill-time", "tag": tag})
        elif _one_cluster(lines) and sum(tl.extend for tl in lines) <= budget:
            out.append({"steps": [_step([(tl.extend, tl.cached) for tl in lines], 0, 0)],
                        "dur_s": round(mean, 7), "kind": "prefill",
                        "source": "vllm-prefill-time", "tag": tag})
    outputs = {len(tl.tokens) for tl in lines}
    if delta.get(DECODE + "_count") == n and len(outputs) == 1 and _one_cluster(lines):
        m = outputs.pop()
        mean = delta.get(DECODE + "_sum", 0) / n
        if m >= 2 and mean > 0:
            steps = [_step([], n, sum(tl.prompt + k for tl in lines)) for k in range(1, m)]
            out.append({"steps": steps, "dur_s": round(mean, 7), "kind": "decode-run",
                        "source": "vllm-decode-time", "tag": tag})
    return out


def request_path(lines: Sequence[Timeline], delta: dict) -> float | None:
    """A lone request's TTFT outside the engine: TTFT - vLLM's queue time - its prefill
    time (HTTP, the front, the API server's input processing and output streaming)."""
    if len(lines) != 1 or not lines[0].tokens or delta.get(PREFILL + "_count") != 1:
        return None
    tl = lines[0]
    return tl.tokens[0] - tl.sent - delta[PREFILL + "_sum"] - delta.get(QUEUE + "_sum", 0.0)
