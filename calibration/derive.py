"""Step-time samples from what a client can see: token arrival times and `meta_info`.

Pure: timelines in, samples out; no I/O, no clock. A client never sees a step boundary.
It sees, per request, when each output token arrived. Two derivations are used
(docs/calibration.md says what each cannot see):

- **Token gaps** (`token_gap_samples`). Every step of SGLang's loop emits at most one token
  per request it ran, and the tokens of one step reach the client together. All arrivals
  are clustered in time (gaps under `eps_s` join a cluster); each cluster is one step end.
  The step between cluster i-1 and cluster i is a sample when it is certain the server ran
  exactly one step in between: every request that had a token in i-1 and is not finished
  appears in i (a decode step, its batch is those requests), or none of them does and
  only first tokens appear (a prefill step whose prompts fit one chunk); no request
  waiting for its first token across the gap could have been prefilled in a chunk step
  that emits nothing (a prompt longer than the chunk; before a prefill step, any waiting
  request, which may have been chunked into it); and the server was not idle (a decode batch was running, or
  the prefilled requests were sent before i-1). A decode step's duration is the median
  over its requests of their own gap (per-request delivery offsets cancel); a prefill
  step's is the difference of the two clusters' median arrival times.
- **Server timestamps** (`forward_samples`). With `--enable-metrics` SGLang's last
  `meta_info` carries `forward_entry_time` (the request was put in a prefill batch) and
  `prefill_finished_time` (its prefill's results were processed), stamped in the
  scheduler. Their difference is the request's prefill, all chunks of it, without HTTP,
  tokenizer or queue: one sample per prefill batch of requests that had the server to
  themselves. `ttft - queue_time` (what the client sees) minus that difference is the
  request path's own latency, kept as `overhead_s`.

A sample is `{"steps": [[prefill_chunks, [batch, kv_sum]], ...], "dur_s", "kind",
"source", "tag"}`: the duration of a sequence of steps; a prefill chunk is
`[new_tokens, cached_prefix_tokens]` and a decode batch is its size and total KV length
(prompt plus tokens generated before the step, as the twin counts it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timeline:
    """One request as the client saw it (seconds, any common origin)."""

    rid: str
    sent: float
    prompt: int
    cached: int
    tokens: tuple[float, ...]
    meta: dict | None = None
    tag: str = ""
    sent_wall: float | None = None  # wall clock at sending, to read SGLang's stamps against

    @property
    def extend(self) -> int:
        return self.prompt - self.cached


@dataclass(frozen=True)
class Limits:
    """The server limits the derivation must respect (from `/server_info`)."""

    chunk: int | None = None  # chunked_prefill_size; None: no chunking
    max_running: int | None = None


def _step(prefill: Sequence[tuple[int, int]], batch: int, kv_sum: int) -> list:
    return [[[int(n), int(c)] for n, c in prefill], [int(batch), int(kv_sum)]]


def clusters(lines: Sequence[Timeline], eps_s: float) -> list[list[tuple[float, int, int]]]:
    """All token arrivals `(time, timeline index, token index)` grouped into step ends: a
    new cluster starts after a silence longer than `eps_s`, or at a request that already
    has a token in the current one (one step emits one token per request)."""
    events = sorted((t, i, k) for i, tl in enumerate(lines) for k, t in enumerate(tl.tokens))
    out: list[list[tuple[float, int, int]]] = []
    members: set[int] = set()
    for ev in events:
        if out and ev[0] - out[-1][-1][0] <= eps_s and ev[1] not in members:
            out[-1].append(ev)
            members.add(ev[1])
        else:
            out.append([ev])
            members = {ev[1]}
    return out


def token_gap_samples(lines: Sequence[Timeline], limits: Limits = Limits(),
                      eps_s: float = 0.005, idle_margin_s: float = 0.02) -> list[dict]:
    """Single-step samples from the token arrival clusters (see the module doc)."""
    first_at = first_tokens(lines)
    out = []
    for cl, i, active in measurable_gaps(lines, eps_s):
        sample = _gap_sample(lines, cl[i - 1], cl[i], active, first_at, limits,
                             idle_margin_s)
        if sample is not None:
            out.append(sample)
    return out


def first_tokens(lines: Sequence[Timeline]) -> list[float]:
    """Each request's first token time (inf without one)."""
    return [tl.tokens[0] if tl.tokens else np.inf for tl in lines]


def measurable_gaps(lines: Sequence[Timeline], eps_s: float):
    """(clusters, i, active) for every gap between clusters i-1 and i that measures one
    step: `active` holds the requests with a token so far and more to come (updated in
    place). A cluster that starts within eps of the previous one was split only because
    a request repeated: the client read two steps' chunks in one go (it was late), so
    neither gap around that boundary is a step's duration."""
    cl = clusters(lines, eps_s)
    late = {i for i in range(1, len(cl)) if cl[i][0][0] - cl[i - 1][-1][0] <= eps_s}
    active: set[int] = set()
    for i in range(1, len(cl)):
        for _, j, k in cl[i - 1]:
            if k < len(lines[j].tokens) - 1:
                active.add(j)
            else:
                active.discard(j)
        if i in late or i + 1 in late:
            continue
        yield cl, i, active


def _unique(cluster: list[tuple[float, int, int]]) -> bool:
    ids = [i for _, i, _ in cluster]
    return len(ids) == len(set(ids))


def _gap_sample(lines, prev, cur, running: set[int], first_at, limits: Limits,
                margin: float) -> dict | None:
    """The sample of the step from cluster `prev` to `cur`, or None when unsure;
    `running` holds the requests started and unfinished at `prev`."""
    if not (_unique(prev) and _unique(cur)):
        return None  # two tokens of one request in one cluster: steps merged
    t_prev, t_cur = float(np.median([t for t, _, _ in prev])), \
        float(np.median([t for t, _, _ in cur]))
    firsts = [i for _, i, k in cur if k == 0]
    decoders = {i: k for _, i, k in cur if k > 0}
    if decoders and set(decoders) != set(running):
        return None
    if not decoders and not firsts:
        return None
    if firsts:
        total = sum(lines[i].extend for i in firsts)
        if limits.chunk is not None and total > limits.chunk:
            return None  # the prompts needed more than one chunk step
        if not running and any(lines[i].sent > t_prev - margin for i in firsts):
            return None  # the server may have been idle: the step start is unknown
    full = limits.max_running is not None and len(running) >= limits.max_running
    waiting = [j for j, tl in enumerate(lines) if j not in firsts and tl.sent < t_prev
               and first_at[j] > t_cur]
    if waiting and not full and (firsts or any(_chunked(lines[j], limits) for j in waiting)):
        return None  # a waiting request may have been prefilled in a silent chunk step
    chunks = [(lines[i].extend, lines[i].cached) for i in firsts]
    kv = sum(lines[i].prompt + k for i, k in decoders.items())
    in_prev = {i for _, i, _ in prev}
    gaps = [lines[i].tokens[k] - lines[i].tokens[k - 1] for i, k in decoders.items()
            if i in in_prev]  # per-request gaps: their delivery offsets cancel
    dur = float(np.median(gaps)) if gaps else t_cur - t_prev
    kind = "mixed" if (firsts and decoders) else ("prefill" if firsts else "decode")
    return {"steps": [_step(chunks, len(decoders), kv)], "dur_s": round(dur, 7),
            "kind": kind, "source": "token-gap", "tag": lines[firsts[0] if firsts else
                                                             next(iter(decoders))].tag}


def _chunked(tl: Timeline, limits: Limits) -> bool:
    """Whether the request's prefill may take a step that emits no token: only a prompt
    longer than the chunk has a chunk step of its own that finishes nothing."""
    return limits.chunk is not None and tl.extend > limits.chunk


def chunk_steps(extend: int, cached: int, chunk: int | None) -> list[list]:
    """The steps SGLang runs to prefill one request alone: chunks of at most `chunk`."""
    if chunk is None or extend <= chunk:
        return [_step([(extend, cached)], 0, 0)]
    steps, done = [], 0
    while done < extend:
        n = min(chunk, extend - done)
        steps.append(_step([(n, cached + done)], 0, 0))
        done += n
    return steps


def forward_samples(lines: Sequence[Timeline], limits: Limits = Limits()) -> list[dict]:
    """Prefill samples from SGLang's `forward_entry_time` / `prefill_finished_time`: one per
    prefill batch (requests with the same two stamps) that ran with no other request in
    flight. A lone request may span several chunk steps; a batch must fit one chunk."""
    groups: dict[tuple[float, float], list[int]] = {}
    for i, tl in enumerate(lines):
        m = tl.meta or {}
        fwd, pf = m.get("forward_entry_time"), m.get("prefill_finished_time")
        if fwd and pf and pf > fwd and tl.tokens:
            groups.setdefault((fwd, pf), []).append(i)
    out = []
    for (fwd, pf), members in sorted(groups.items()):
        if not _alone(lines, members):
            continue
        if len(members) == 1:
            tl = lines[members[0]]
            steps = chunk_steps(tl.extend, tl.cached, limits.chunk)
        else:
            total = sum(lines[i].extend for i in members)
            if limits.chunk is not None and total > limits.chunk:
                continue
            steps = [_step([(lines[i].extend, lines[i].cached) for i in members], 0, 0)]
        sample = {"steps": steps, "dur_s": round(pf - fwd, 7),
                  "kind": "prefill" if len(steps) == 1 else "prefill-chunked",
                  "source": "forward-timestamps", "tag": lines[members[0]].tag}
        out.append(sample | _path_latency([lines[i] for i in members], fwd, pf))
    return out


def _path_latency(members: list[Timeline], fwd: float, pf: float) -> dict:
    """The request path outside the scheduler's steps: `overhead_s` = TTFT - queue_time -
    prefill; with the wall-clock send time, split into `ingress_s` (send to SGLang's
    waiting queue) and `egress_s` (prefill results to the client)."""
    out = {}
    overhead = [tl.tokens[0] - tl.sent - (tl.meta or {}).get("queue_time", 0.0) - (pf - fwd)
                for tl in members]
    out["overhead_s"] = round(float(np.median(overhead)), 7)
    walls = [tl for tl in members if tl.sent_wall and "queue_time" in (tl.meta or {})]
    if walls:
        ingress = [fwd - tl.meta["queue_time"] - tl.sent_wall for tl in walls]
        egress = [tl.sent_wall + (tl.tokens[0] - tl.sent) - pf for tl in walls]
        out["ingress_s"] = round(float(np.median(ingress)), 7)
        out["egress_s"] = round(float(np.median(egress)), 7)
    return out


def tokenizer_samples(lines: Sequence[Timeline]) -> list[dict]:
    """The tokenizer manager's serial work (twin/request_path.py) from SGLang's stamps,
    one sample of a run (none without the stamps): the run's requests in the order the
    manager dispatched them to the scheduler (`api_server_dispatch_finish_ts`); one sent
    (client wall clock, same host) before the one before it left waited for it, so the
    gap between their dispatches is its whole serial cost (HTTP handling and tokenizing
    share the manager's event loop; SGLang's own `request_received_ts` is stamped only
    when that loop takes the request up, after the one before has left): `dispatch` =
    [[prompt tokens, gap]]; `first` = [prompt tokens, ingress (send to the waiting
    queue)] of the first dispatched, which waited for no one. No `steps`: the step-time
    fit leaves it out."""
    key = "api_server_dispatch_finish_ts"
    have = sorted((tl for tl in lines if tl.sent_wall and key in (tl.meta or {})),
                  key=lambda tl: tl.meta[key])
    if not have:
        return []
    gaps = [[b.prompt, round(b.meta[key] - a.meta[key], 7)]
            for a, b in zip(have, have[1:], strict=False) if b.sent_wall <= a.meta[key]]
    out = {"kind": "tokenizer", "source": "tokenizer-stamps", "dispatch": gaps,
           "tag": have[0].tag}
    m = have[0].meta
    if "forward_entry_time" in m and "queue_time" in m:
        ingress = m["forward_entry_time"] - m["queue_time"] - have[0].sent_wall
        out["first"] = [have[0].prompt, round(ingress, 7)]
    return [out]


def _alone(lines: Sequence[Timeline], members: list[int]) -> bool:
    """No request outside `members` was in flight while they were."""
    start = min(lines[i].sent for i in members)
    end = max(lines[i].tokens[0] for i in members)
    mem = set(members)
    return not any(j not in mem and tl.sent < end and (tl.tokens[-1] if tl.tokens else
                                                        np.inf) > start
                   for j, tl in enumerate(lines))


def samples_from_timelines(lines: Sequence[Timeline], limits: Limits = Limits()) -> list[dict]:
    """Every sample both derivations give; the forward stamps add the prefill samples and
    the tokenizer's stamps a request-path sample (no steps: not a step-time sample)."""
    return (token_gap_samples(lines, limits) + forward_samples(lines, limits)
            + tokenizer_samples(lines))


# ---- offline inputs ------------------------------------------------------------------
def timelines_from_records(records: Iterable[dict], tag: str = "") -> list[Timeline]:
    """Timelines from `servetwin live replay` records (`requests.jsonl`): arrival, TTFT and
    the per-token gaps. Records keep no forward stamps: token-gap samples only."""
    out = []
    for r in records:
        if r.get("status") != "ok" or r.get("ttft_s") is None:
            continue
        first = r["arrival_s"] + r["ttft_s"]
        times = first + np.concatenate([[0.0], np.cumsum(r.get("itl_s") or [])])
        out.append(Timeline(r["rid"], r["arrival_s"], int(r["prompt_tokens"]),
                            int(r.get("cached_tokens") or 0), tuple(times.tolist()), tag=tag))
    return out


def timelines_from_bench_serving(run: dict, tag: str = "") -> list[Timeline]:
    """Timelines from one `bench_serving --output-details` run. It records no send times:
    at `request_rate` inf every request is taken as sent at 0; otherwise at i / rate."""
    rate = run.get("request_rate", float("inf"))
    rate = float("inf") if rate in (None, "inf", "Infinity") else float(rate)
    out = []
    for i, (n_in, ttft) in enumerate(zip(run["input_lens"], run.get("ttfts") or [],
                                         strict=False)):
        if not ttft:
            continue
        sent = 0.0 if np.isinf(rate) else i / rate
        itl = (run.get("itls") or [[]] * len(run["input_lens"]))[i] or []
        times = sent + ttft + np.concatenate([[0.0], np.cumsum(itl)])
        out.append(Timeline(f"bs{i}", sent, int(n_in), 0, tuple(times.tolist()), tag=tag))
    return out
