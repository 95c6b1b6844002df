"""Readers for real traces, each giving a `Workload`.

Formats: `azure` (Azure LLM inference trace 2023 CSV), `mooncake` (Mooncake FAST'25 JSONL,
`hash_ids` are 512-token blocks), `bench_serving` (SGLang `bench_serving --output-details`
JSONL, keeping the measured TTFTs and ITLs), `jsonl` (ours: one request per line, also
reads the twin's own `requests.jsonl`). A malformed row raises `TraceError` naming the
file, line and field.

`ignore_eos` per request: only `jsonl` says (its `ignore_eos` key). Azure and Mooncake
rows carry lengths only, and bench_serving's output does not record whether it ran with
`--disable-ignore-eos` (it sends `ignore_eos` by default): their requests take the run's
setting (`--no-ignore-eos`).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from twin.errors import ConfigError, TraceError
from twin.inputs import (
    COUNT,
    MAX_TIME_S,
    MAX_TOKENS,
    NON_NEGATIVE,
    POSITIVE,
    PRIORITY,
    TOKENS,
    Rule,
    check,
    check_field,
    read_text,
    text_lines,
)
from twin.registry import Registry
from twin.workload import Request, SegmentIds, Workload

MOONCAKE_BLOCK = 512
Reader = Callable[[Path], Workload]
READERS: Registry[Reader] = Registry("trace reader", "--trace-format")
reader = READERS.register


def formats() -> list[str]:
    return READERS.names()


def _int(path: Path, line: int, row: dict, key: str) -> int:
    """A token count."""
    return int(check_field(path, line, row, key, TOKENS))


def _float(path: Path, line: int, row: dict, key: str) -> float:
    return float(check_field(path, line, row, key, Rule(lo=0, hi=MAX_TIME_S * 1000)))


def _json_lines(path: Path):
    for line_no, text in enumerate(text_lines(read_text(path, "--trace")), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise TraceError(str(path), line_no, "<line>", f"not JSON: {msg}") from None
        if not isinstance(row, dict):
            raise TraceError(str(path), line_no, "<line>", "not a JSON object")
        yield line_no, row


def _csv_rows(path: Path):
    """(line number, row) of a CSV file with a header."""
    rows = csv.DictReader(io.StringIO(read_text(path, "--trace"), newline=""))
    try:
        header = rows.fieldnames or []
        for field in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
            if field not in header:
                raise TraceError(str(path), 1, field, "missing from the CSV header")
        for row in rows:
            yield rows.line_num, row
    except csv.Error as exc:
        raise TraceError(str(path), rows.line_num, "<line>", f"not CSV: {exc}") from None


@reader("azure")
def read_azure(path: Path) -> Workload:
    """Arrival times relative to the earliest row (rows need not be in time order)."""
    stamps, lengths = [], []
    for line_no, row in _csv_rows(path):
        text = row["TIMESTAMP"]
        try:
            ts = datetime.fromisoformat(text[:26]).timestamp()
        except (TypeError, ValueError, OverflowError, OSError):
            raise TraceError(str(path), line_no, "TIMESTAMP",
                             f"not a timestamp: {text!r}") from None
        stamps.append(ts)
        lengths.append((_int(path, line_no, row, "ContextTokens"),
                        _int(path, line_no, row, "GeneratedTokens")))
    t0 = min(stamps, default=0.0)
    ids = SegmentIds()
    requests = tuple(Request.make(f"az{i}", ts - t0, [(ids.unique(), prompt)], out)
                     for i, (ts, (prompt, out)) in enumerate(zip(stamps, lengths, strict=True)))
    return Workload(path.name, requests, description=f"azure trace {path}")


@reader("mooncake")
def read_mooncake(path: Path) -> Workload:
    requests = []
    for line_no, row in _json_lines(path):
        t = _float(path, line_no, row, "timestamp") / 1000.0
        n_in = _int(path, line_no, row, "input_length")
        out = _int(path, line_no, row, "output_length")
        hashes = row.get("hash_ids")
        if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hashes):
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
    rate = _bench_rate(path, line_no, run)
    ttfts, itls = _bench_list(path, line_no, run, "ttfts"), _bench_list(path, line_no, run, "itls")
    ids, requests, reference = SegmentIds(), [], {}
    for i in range(n):
        row = {f"input_lens[{i}]": run["input_lens"][i],
               f"output_lens[{i}]": run["output_lens"][i]}
        prompt = _int(path, line_no, row, f"input_lens[{i}]")
        out = _int(path, line_no, row, f"output_lens[{i}]")
        rid = f"bs{i}"
        t = 0.0 if math.isinf(rate) else i / rate
        requests.append(Request.make(rid, t, [(ids.unique(), prompt)], out))
        if i < len(ttfts):
            reference[rid] = {"ttft_s": ttfts[i], "itl_s": itls[i] if i < len(itls) else None}
    conc = run.get("max_concurrency")
    if conc is not None:
        conc = int(check_field(path, line_no, run, "max_concurrency", COUNT))
    return Workload(path.name, tuple(requests), conc, reference,
                    description=f"bench_serving run (line {line_no}) of {path}")


def _bench_rate(path: Path, line_no: int, run: dict) -> float:
    """The run's request rate: inf (everything at once) when absent, null or "inf"."""
    rate = run.get("request_rate")
    if rate is None or rate in ("inf", "Infinity") or rate == float("inf"):
        return float("inf")
    return float(check_field(path, line_no, run, "request_rate", POSITIVE))


def _bench_list(path: Path, line_no: int, run: dict, key: str) -> list:
    """`ttfts` (seconds per request) or `itls` (a list of seconds per request); null
    entries allowed."""
    values = run.get(key) or []
    if key == "itls":
        ok = isinstance(values, list) and all(
            v is None or isinstance(v, list) and all(map(_seconds, v)) for v in values)
    else:
        ok = isinstance(values, list) and all(v is None or _seconds(v) for v in values)
    if not ok:
        what = "lists of seconds >= 0" if key == "itls" else "seconds >= 0"
        raise TraceError(str(path), line_no, key, f"must be a list of {what} (or null)")
    return values


def _seconds(value: object) -> bool:
    if isinstance(value, str):
        return False
    try:
        NON_NEGATIVE.parse(value)
    except ValueError:
        return False
    return True


@reader("jsonl")
def read_jsonl(path: Path) -> Workload:
    """One request per line: `rid`, `arrival_s`, `output_tokens`, optional `priority` and
    `ignore_eos` (true/false; absent: the run's setting; the twin's records carry
    `"ignore_eos": false` for a request that did not ignore EOS), and either `segments`
    ([[hash, n_tokens], ...]) or `prompt_tokens`. A `rid` given twice (or null) is
    refused: records are keyed by it."""
    ids, requests, seen = SegmentIds(), [], {}
    for line_no, row in _json_lines(path):
        t = _float(path, line_no, row, "arrival_s")
        out = _int(path, line_no, row, "output_tokens")
        prio = int(check_field(path, line_no, row, "priority", PRIORITY)) \
            if "priority" in row else 0
        segs = row.get("segments")
        if segs is not None:
            if not (isinstance(segs, list) and segs and all(
                    isinstance(s, list) and len(s) == 2 and all(
                        isinstance(x, int) and not isinstance(x, bool) for x in s)
                    and 0 < s[1] <= MAX_TOKENS for s in segs)):
                raise TraceError(str(path), line_no, "segments",
                                 f"must be a non-empty list of [hash, n_tokens] pairs, "
                                 f"n_tokens in [1, {MAX_TOKENS}]")
        else:
            segs = [(ids.unique(), _int(path, line_no, row, "prompt_tokens"))]
        rid = _rid(path, line_no, row, seen)
        requests.append(Request.make(rid, t, segs, out, prio, _ignore_eos(path, line_no, row)))
    return Workload(path.name, tuple(requests), description=f"jsonl trace {path}")


def _ignore_eos(path: Path, line_no: int, row: dict) -> bool | None:
    """The row's `ignore_eos` (true/false), None when absent or null (the run's setting)."""
    value = row.get("ignore_eos")
    if value is None or isinstance(value, bool):
        return value
    raise TraceError(str(path), line_no, "ignore_eos", f"{value!r}: must be true or false")


def _rid(path: Path, line_no: int, row: dict, seen: dict[str, int]) -> str:
    if "rid" not in row:
        rid = f"j{line_no}"
    elif isinstance(row["rid"], str) and row["rid"] or (
            isinstance(row["rid"], int) and not isinstance(row["rid"], bool)):
        rid = str(row["rid"])
    else:
        raise TraceError(str(path), line_no, "rid",
                         f"{row['rid']!r}: must be a non-empty string or an integer")
    if rid in seen:
        raise TraceError(str(path), line_no, "rid",
                         f"{rid!r} is also the rid at line {seen[rid]}; rids must be unique")
    seen[rid] = line_no
    return rid


def load_trace(path: str | Path, fmt: str, *, time_scale: float = 1.0, offset_s: float = 0.0,
               limit: int | None = None) -> Workload:
    """Read a trace; keep requests from `offset_s` seconds in, shifted to start at 0, gaps
    multiplied by `time_scale`, at most `limit` of them. Rows out of time order are sorted
    (the workload's `notes` say so), never dropped."""
    read = READERS.get(fmt)
    time_scale = float(check("--trace-time-scale", time_scale, Rule(lo=0, lo_open=True, hi=1e6)))
    offset_s = float(check("--trace-offset", offset_s, Rule(lo=0, hi=MAX_TIME_S)))
    limit = None if limit is None else int(check("--trace-limit", limit, COUNT))
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--trace {path}: no such file")
    w = read(p)
    notes = list(w.notes)
    late = sum(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(w.requests))
    if late:
        notes.append(f"{path}: {late} row(s) earlier than the row before them; requests "
                     "sorted by arrival time (file order breaks ties)")
    reqs = sorted(w.requests, key=lambda r: r.arrival_s)  # stable: file order breaks ties
    reqs = [r for r in reqs if r.arrival_s >= offset_s][:limit]
    if not reqs:
        raise ConfigError(f"--trace {path}: no request at or after --trace-offset {offset_s}")
    reqs = [Request(r.rid, (r.arrival_s - offset_s) * time_scale, r.segments, r.output_tokens,
                    r.priority, r.prompt_tokens, r.ignore_eos) for r in reqs]
    if reqs[-1].arrival_s > MAX_TIME_S:
        raise ConfigError(f"--trace {path}: arrivals span {reqs[-1].arrival_s:.3g} s after "
                          f"--trace-time-scale; at most {MAX_TIME_S:g} s")
    ref = {r.rid: w.reference[r.rid] for r in reqs if r.rid in w.reference}
    return Workload(w.name, tuple(reqs), w.concurrency, ref, w.description, tuple(notes))
