"""Readers for real traces, each giving a `Workload`.

Formats: `azure` (Azure LLM inference trace 2023 CSV), `mooncake` (Mooncake FAST'25 JSONL,
`hash_ids` are 512-token blocks), `bench_serving` (SGLang `bench_serving --output-details`
JSONL, keeping the measured TTFTs and ITLs), `jsonl` (ours: one request per line, also
reads the twin's own `requests.jsonl`). A malformed row raises `TraceError` naming the
file, line and field.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from twin.errors import ConfigError, TraceError
from twin.registry import Registry
from twin.workload import Request, SegmentIds, Workload

MOONCAKE_BLOCK = 512
Reader = Callable[[Path], Workload]
READERS: Registry[Reader] = Registry("trace reader", "--trace-format")
reader = READERS.register


def formats() -> list[str]:
    return READERS.names()


def _int(path: Path, line: int, row: dict, key: str, minimum: int = 0) -> int:
    if key not in row:
        raise TraceError(str(path), line, key, "missing")
    value = row[key]
    try:
        out = int(value)
        if isinstance(value, float) and value != out:
            raise ValueError
    except (TypeError, ValueError):
        raise TraceError(str(path), line, key, f"not an integer: {value!r}") from None
    if out < minimum:
        raise TraceError(str(path), line, key, f"{out} is below {minimum}")
    return out


def _float(path: Path, line: int, row: dict, key: str) -> float:
    try:
        out = float(row[key])
    except KeyError:
        raise TraceError(str(path), line, key, "missing") from None
    except (TypeError, ValueError):
        raise TraceError(str(path), line, key, f"not a number: {row[key]!r}") from None
    if not math.isfinite(out) or out < 0:
        raise TraceError(str(path), line, key, f"must be a finite number >= 0, got {out}")
    return out


def _json_lines(path: Path):
    with path.open() as fh:
        for line_no, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(str(path), line_no, "<line>", f"not JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise TraceError(str(path), line_no, "<line>", "not a JSON object")
            yield line_no, row


@reader("azure")
def read_azure(path: Path) -> Workload:
    ids, requests, t0 = SegmentIds(), [], None
    with path.open(newline="") as fh:
        rows = csv.DictReader(fh)
        for field in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
            if field not in (rows.fieldnames or []):
                raise TraceError(str(path), 1, field, "missing from the CSV header")
        for line_no, row in enumerate(rows, 2):
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            except (TypeError, ValueError):
                raise TraceError(str(path), line_no, "TIMESTAMP",
                                 f"not a timestamp: {row['TIMESTAMP']!r}") from None
            t0 = ts if t0 is None else t0
            prompt = _int(path, line_no, row, "ContextTokens", 1)
            out = _int(path, line_no, row, "GeneratedTokens", 1)
            requests.append(Request.make(f"az{line_no - 2}", ts - t0,
                                         [(ids.unique(), prompt)], out))
    return Workload(path.name, tuple(requests), description=f"azure trace {path}")


@reader("mooncake")
def read_mooncake(path: Path) -> Workload:
    requests = []
    for line_no, row in _json_lines(path):
        t = _float(path, line_no, row, "timestamp") / 1000.0
        n_in = _int(path, line_no, row, "input_length", 1)
        out = _int(path, line_no, row, "output_length", 1)
        hashes = row.get("hash_ids")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise TraceError(str(path), line_no, "hash_ids", "must be a list of integers")
        if math.ceil(n_in / MOONCAKE_BLOCK) != len(hashes):
            raise TraceError(str(path), line_no, "hash_ids",
                             f"{len(hashes)} blocks do not cover input_length {n_in} "
                             f"in {MOONCAKE_BLOCK}-token blocks")
        last = n_in - MOONCAKE_BLOCK * (len(hashes) - 1)
        segs = [(h, MOONCAKE_BLOCK) for h in hashes[:-1]] + [(hashes[-1], last)]
        requests.append(Request.make(f"mc{line_no - 1}", t, segs, out))
    return Workload(path.name, tuple(requests), description=f"mooncake trace {path}")


@reader("bench_serving")
def read_bench_serving(path: Path) -> Workload:
    """The last run in the file. bench_serving records no send times: requests arrive
    evenly at the run's `request_rate` (all at 0 when it was inf), closed-loop when the
    run had `max_concurrency`."""
    runs = list(_json_lines(path))
    if not runs:
        raise TraceError(str(path), 1, "<file>", "no bench_serving run in the file")
    line_no, run = runs[-1]
    for key in ("input_lens", "output_lens"):
        if not isinstance(run.get(key), list):
            raise TraceError(str(path), line_no, key, "missing or not a list")
    n = len(run["input_lens"])
    if len(run["output_lens"]) != n:
        raise TraceError(str(path), line_no, "output_lens", "length differs from input_lens")
    rate = run.get("request_rate", float("inf"))
    rate = float("inf") if rate in (None, "inf", "Infinity") else float(rate)
    ttfts, itls = run.get("ttfts") or [], run.get("itls") or []
    ids, requests, reference = SegmentIds(), [], {}
    for i in range(n):
        row = {"input_lens": run["input_lens"][i], "output_lens": run["output_lens"][i]}
        prompt = _int(path, line_no, row, "input_lens", 1)
        out = _int(path, line_no, row, "output_lens", 1)
        rid = f"bs{i}"
        t = 0.0 if math.isinf(rate) else i / rate
        requests.append(Request.make(rid, t, [(ids.unique(), prompt)], out))
        if i < len(ttfts):
            reference[rid] = {"ttft_s": ttfts[i], "itl_s": itls[i] if i < len(itls) else None}
    conc = run.get("max_concurrency")
    return Workload(path.name, tuple(requests), int(conc) if conc else None, reference,
                    description=f"bench_serving run (line {line_no}) of {path}")


@reader("jsonl")
def read_jsonl(path: Path) -> Workload:
    """One request per line: `rid`, `arrival_s`, `output_tokens`, optional `priority`, and
    either `segments` ([[hash, n_tokens], ...]) or `prompt_tokens`."""
    ids, requests = SegmentIds(), []
    for line_no, row in _json_lines(path):
        t = _float(path, line_no, row, "arrival_s")
        out = _int(path, line_no, row, "output_tokens", 1)
        prio = _int(path, line_no, row, "priority", -(2**31)) if "priority" in row else 0
        segs = row.get("segments")
        if segs is not None:
            if not (isinstance(segs, list) and segs and all(
                    isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) for x in s)
                    and s[1] > 0 for s in segs)):
                raise TraceError(str(path), line_no, "segments",
                                 "must be a non-empty list of [hash, n_tokens>0] pairs")
        else:
            segs = [(ids.unique(), _int(path, line_no, row, "prompt_tokens", 1))]
        rid = str(row.get("rid", f"j{line_no}"))
        requests.append(Request.make(rid, t, segs, out, prio))
    return Workload(path.name, tuple(requests), description=f"jsonl trace {path}")


def load_trace(path: str | Path, fmt: str, *, time_scale: float = 1.0, offset_s: float = 0.0,
               limit: int | None = None) -> Workload:
    """Read a trace; keep requests from `offset_s` seconds in, shifted to start at 0, gaps
    multiplied by `time_scale`, at most `limit` of them."""
    read = READERS.get(fmt)
    if time_scale <= 0:
        raise ConfigError(f"--trace-time-scale {time_scale}: must be > 0")
    if limit is not None and limit < 1:
        raise ConfigError(f"--trace-limit {limit}: must be >= 1")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--trace {path}: no such file")
    w = read(p)
    reqs = sorted(w.requests, key=lambda r: r.arrival_s)  # stable: file order breaks ties
    reqs = [r for r in reqs if r.arrival_s >= offset_s][:limit]
    if not reqs:
        raise ConfigError(f"--trace {path}: no request at or after --trace-offset {offset_s}")
    reqs = [Request(r.rid, (r.arrival_s - offset_s) * time_scale, r.segments, r.output_tokens,
                    r.priority, r.prompt_tokens) for r in reqs]
    ref = {r.rid: w.reference[r.rid] for r in reqs if r.rid in w.reference}
    return Workload(w.name, tuple(reqs), w.concurrency, ref, w.description)
