"""Per-request records, their summary, and time series, shared by the twin and live replays.

A record is one JSON object per line with the fields of `RECORD_FIELDS`; the twin and the
live recorder write the same schema, so `summarize` and comparisons treat both alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

RECORD_FIELDS = (
    "rid", "arrival_s", "prompt_tokens", "cached_tokens", "output_tokens", "priority",
    "ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "retractions", "preemptions",
    "status", "error",
)
# The twin's records also carry `lost_s` and `kv_moved_bytes` after these (live ones may not),
# and `"ignore_eos": false` last for a request that may stop at EOS (absent: it ignored EOS,
# as servetwin's replay and bench_serving send every request).
STATUSES = ("ok", "rejected", "aborted", "failed")
PERCENTILES = (50, 90, 99)


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def twin_records(finished: Sequence, step_end: Sequence[float]) -> list[dict]:
    """Records from the replica's finished requests, in order of arrival (then rid).
    Token times are rebuilt from each request's emission events over the replica's
    step-end timeline. Built from columns (twin/record_table.py): the same dicts as
    `records_one_by_one`, the reference it is tested against."""
    from twin.record_table import RecordTable

    return list(RecordTable(finished, step_end))


def records_one_by_one(finished: Sequence, step_end: Sequence[float]) -> list[dict]:
    """`twin_records` the plain way: each request's token times concatenated, differenced
    and rounded on their own (the reference for the column path)."""
    ends = np.asarray(step_end, dtype=float)
    out = []
    for r in sorted(finished, key=lambda r: (r.arrival_s, r.index)):
        times = _token_times(r.tok_events, ends)
        itl = np.diff(times) if len(times) > 1 else np.empty(0)
        ok = r.status == "ok"
        ttft = r.first_token_s - r.arrival_s if r.first_token_s is not None else None
        e2e = r.finish_s - r.arrival_s if ok else None
        n_out = len(times)
        out.append({
            "rid": r.rid,
            "arrival_s": _r(r.arrival_s),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": n_out,
            "priority": r.priority,
            "ttft_s": _r(ttft),
            "tpot_s": _r((e2e - ttft) / (n_out - 1)) if ok and n_out > 1 else None,
            "itl_s": np.round(itl, 6).tolist(),
            "e2e_s": _r(e2e),
            # as SGLang's meta_info queue_time: from the scheduler taking the request in
            # (the step boundary after its arrival) to its first forward pass, summed over
            # every round (a retracted or preempted request waits again)
            "queue_s": _r(r.queued_s) if r.first_admit_s is not None
            else None,
            "retractions": r.retractions,
            "preemptions": r.preemptions,
            "status": r.status,
            "error": r.error,
            "lost_s": _r(r.lost_s),
            "kv_moved_bytes": round(r.moved_bytes),
            **({} if r.ignore_eos else {"ignore_eos": False}),
        })
    return out


def _token_times(events: list, ends: np.ndarray) -> np.ndarray:
    parts = []
    for ev in events:
        if isinstance(ev, tuple):
            parts.append(ends[ev[0]:ev[1]])
        else:
            parts.append(np.array([ev]))
    return np.concatenate(parts) if parts else np.empty(0)


def _pcts(values: Iterable[float | None] | np.ndarray,
          scratch: bool = False) -> dict[str, float | None]:
    """P50/P90/P99 and mean of the values that are not None (None when there are none).
    `scratch`: the array is the caller's to lose (percentiles partition it in place
    instead of copying it; the mean is taken first, over the order given)."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(
        [v for v in values if v is not None], dtype=float)
    if not arr.size:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    mean = round(float(arr.mean()), 6)
    out: dict[str, float | None] = {
        f"p{p}": round(float(v), 6) for p, v in
        zip(PERCENTILES, np.percentile(arr, PERCENTILES, overwrite_input=scratch),
            strict=True)}
    out["mean"] = mean
    return out


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        from twin.inputs import POSITIVE, check_optional

        for key in ("ttft_s", "tpot_s", "e2e_s"):
            check_optional(f"--slo-{key[:-2]}", getattr(self, key), POSITIVE)

    def met(self, rec: dict) -> bool:
        if rec["status"] != "ok":
            return False
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            target = getattr(self, key)
            if target is not None and rec[key] is not None and rec[key] > target:
                return False
        return True

    def count_met(self, status: list, cols: dict[str, list]) -> int:
        """How many records meet every target: `met` of each, from columns (a null meets
        a target, as in `met`; numpy reads None as NaN, which exceeds nothing)."""
        return self.count_met_of(np.array([s == "ok" for s in status], dtype=bool), cols)

    def count_met_of(self, ok: np.ndarray, cols: dict) -> int:
        """`count_met` of the rows `ok` marks (columns as lists with None or numpy
        arrays with NaN for null)."""
        met = ok.copy()
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            target = getattr(self, key)
            if target is not None:
                met &= ~(np.asarray(cols[key], dtype=float) > target)
        return int(met.sum())

    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))


def summarize(records: Sequence[dict], slo: SLO | None = None,
              duration_s: float | None = None) -> dict:
    """Latency percentiles (over `ok` requests; ITL over every token gap), throughput,
    cached-token share, retractions and SLO attainment."""
    if hasattr(records, "summary"):  # a RecordTable (twin/record_table.py): from columns
        return records.summary(slo, duration_s)
    cols = {k: [r.get(k) for r in records] for k in _SUMMARY_COLUMNS}
    ok = [r for r in records if r["status"] == "ok"]
    # the same array as concatenating each record's gaps, built from one flat list
    itl = np.array(list(chain.from_iterable(r["itl_s"] or () for r in ok)), dtype=float)
    return summary_from_columns(cols, itl, slo, duration_s)


_SUMMARY_COLUMNS = ("status", "arrival_s", "e2e_s", "ttft_s", "tpot_s", "queue_s",
                    "prompt_tokens", "output_tokens", "cached_tokens", "retractions",
                    "preemptions", "lost_s", "kv_moved_bytes")


def summary_from_columns(cols: dict[str, list], itl: np.ndarray | dict, slo: SLO | None = None,
                         duration_s: float | None = None) -> dict:
    """`summarize` over records given as columns (lists in record order, fields of
    `_SUMMARY_COLUMNS`) and the token gaps of the `ok` ones, concatenated in order
    (`itl` is consumed: its percentiles partition it in place), or their statistics
    already computed (a dict as `_pcts` returns). The columns may instead be numpy arrays
    in record order (a streamed run's, twin/record_sink.py): "status" an index into
    `STATUSES`, floats NaN where the record has null; the same summary."""
    if isinstance(cols["status"], np.ndarray):
        agg = _aggregate_arrays(cols, slo)
    else:
        agg = _aggregate_lists(cols, slo)
    n, ok_n, pct = agg["n"], agg["ok"], agg["pct"]
    if duration_s is None:
        duration_s = (agg["end"] - agg["start"]) if ok_n else 0.0
    prompt, out_tokens = agg["prompt"], agg["out"]
    summary = {
        "requests": n,
        "status": agg["status"],
        "duration_s": round(duration_s, 6),
        "throughput": {
            "requests_per_s": round(ok_n / duration_s, 6) if duration_s else None,
            "input_tokens_per_s": round(prompt / duration_s, 3) if duration_s else None,
            "output_tokens_per_s": round(out_tokens / duration_s, 3) if duration_s else None,
        },
        "ttft_s": pct("ttft_s"),
        "tpot_s": pct("tpot_s"),
        # a dict: computed without the array (twin/record_table.py, `itl_stats`)
        "itl_s": itl if isinstance(itl, dict) else _pcts(itl, scratch=True),
        "e2e_s": pct("e2e_s"),
        "queue_s": pct("queue_s"),
        "cached_token_share": round(agg["cached"] / prompt, 6) if prompt else None,
        "retractions": agg["retractions"],
        "preemptions": agg["preemptions"],
        "preemption_lost_s": round(agg["lost"], 6),
        "kv_moved_bytes": agg["moved"],
    }
    if slo is not None and slo.any():
        met = agg["met"]
        summary["slo"] = {
            "targets": {k: v for k, v in slo.__dict__.items() if v is not None},
            "attainment": round(met / n, 6) if n else None,
        }
    return summary


def _aggregate_lists(cols: dict[str, list], slo: SLO | None) -> dict:
    """`summary_from_columns`'s sums, extremes and percentile sources over lists."""
    status_col = cols["status"]
    ok = [i for i, s in enumerate(status_col) if s == "ok"]

    def ok_of(key: str) -> list:
        col = cols[key]
        return [col[i] for i in ok]

    arrival, e2e = cols["arrival_s"], cols["e2e_s"]
    ends = [arrival[i] + e2e[i] for i in ok]
    return {
        "n": len(status_col), "ok": len(ok),
        "status": {s: sum(1 for x in status_col if x == s) for s in STATUSES},
        "start": min(arrival, default=0.0), "end": max(ends) if ends else 0.0,
        "prompt": sum(ok_of("prompt_tokens")), "out": sum(ok_of("output_tokens")),
        "pct": lambda key: _pcts(ok_of(key)),
        "cached": sum(ok_of("cached_tokens")),
        "retractions": sum(cols["retractions"]), "preemptions": sum(cols["preemptions"]),
        "lost": sum(x or 0 for x in cols["lost_s"]),
        "moved": sum(x or 0 for x in cols["kv_moved_bytes"]),
        "met": slo.count_met(status_col, cols) if slo is not None and slo.any() else 0,
    }


def _aggregate_arrays(cols: dict[str, np.ndarray], slo: SLO | None) -> dict:
    """`_aggregate_lists` over numpy columns: the same numbers (the same float additions
    in the same order where the order counts: the lost seconds' running sum, the
    percentiles' arrays in record order)."""
    code = cols["status"]
    ok = code == STATUSES.index("ok")
    n, ok_n = len(code), int(ok.sum())
    counts = np.bincount(code, minlength=len(STATUSES)).tolist()
    arrival = cols["arrival_s"]
    ends = arrival[ok] + cols["e2e_s"][ok]

    def pct(key: str) -> dict:
        a = cols[key][ok]
        return _pcts(a[~np.isnan(a)])

    def total(key: str, rows=None) -> int:
        col = cols[key] if rows is None else cols[key][rows]
        return int(col.sum())

    lost = cols["lost_s"]
    # `sum(x or 0 ...)`: nulls and zeros add nothing; the rest in order, from the int 0
    lost_sum = sum(lost[~np.isnan(lost) & (lost != 0)].tolist())
    return {
        "n": n, "ok": ok_n, "status": dict(zip(STATUSES, counts, strict=False)),
        "start": float(arrival.min()) if n else 0.0,
        "end": float(ends.max()) if ok_n else 0.0,
        "prompt": total("prompt_tokens", ok), "out": total("output_tokens", ok),
        "pct": pct, "cached": total("cached_tokens", ok),
        "retractions": total("retractions"), "preemptions": total("preemptions"),
        "lost": lost_sum, "moved": total("kv_moved_bytes"),
        "met": slo.count_met_of(ok, cols) if slo is not None and slo.any() else 0,
    }


def write_records(path: Path, records: Sequence[dict]) -> None:
    """One JSON line per record, written atomically: an interrupted write leaves the old
    file (or none), never a half-written one that reads as whole."""
    from twin.outputs import atomic_writer

    if hasattr(records, "blocks"):  # a RecordTable: its lines are formatted in bulk
        with atomic_writer(path, binary=True, blocks=True) as fh:
            for data, _ in records.blocks(into=fh):
                if data is not None:  # (the Python writer's bytes)
                    fh.write(data)
        return
    with atomic_writer(path) as fh:
        if hasattr(records, "lines"):
            fh.writelines(records.lines())
            return
        for rec in records:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")


def read_records(path: Path) -> list[dict]:
    """Records of a `requests.jsonl`, each checked for the schema's fields and types."""
    from twin.errors import TraceError
    from twin.inputs import read_text, text_lines

    out = []
    for line_no, text in enumerate(text_lines(read_text(path, "records")), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise TraceError(str(path), line_no, "<line>", f"not JSON: {exc}") from None
        if not isinstance(rec, dict):
            raise TraceError(str(path), line_no, "<line>", "not a JSON object")
        missing = [f for f in RECORD_FIELDS if f not in rec]
        if missing:
            raise TraceError(str(path), line_no, missing[0], "missing from the record")
        bad = _bad_record_field(rec)
        if bad:
            raise TraceError(str(path), line_no, bad, f"{rec[bad]!r} is not a valid value")
        out.append(rec)
    return out


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and bool(np.isfinite(x))


# Record fields that are always numbers (the rest may be null: a request that never got
# a token has no TTFT); an `ok` record also has its TTFT and E2E.
_ALWAYS_NUMBERS = ("arrival_s", "prompt_tokens", "cached_tokens", "output_tokens", "priority",
                   "retractions", "preemptions")


def _bad_record_field(rec: dict) -> str | None:
    """The first field of `rec` with a value of the wrong type, or None."""
    if rec["status"] not in STATUSES:
        return "status"
    if not isinstance(rec["rid"], str):
        return "rid"
    if rec["error"] is not None and not isinstance(rec["error"], str):
        return "error"
    if rec["itl_s"] is not None and not (isinstance(rec["itl_s"], list)
                                         and all(map(_number, rec["itl_s"]))):
        return "itl_s"
    required = _ALWAYS_NUMBERS + (("ttft_s", "e2e_s") if rec["status"] == "ok" else ())
    for key in RECORD_FIELDS:
        if key in ("rid", "status", "error", "itl_s"):
            continue
        if not (_number(rec[key]) or rec[key] is None and key not in required):
            return key
    return None


SERIES_FIELDS = ("t_s", "running", "waiting", "kv_stored_tokens", "kv_allocated_tokens",
                 "kv_largest_free_run", "radix_cached_tokens", "new_token_ratio",
                 "kv_internal_fragmentation", "kv_external_fragmentation")


def format_summary(s: dict) -> str:
    """A readable block for the terminal."""

    def ms(d: dict) -> str:
        return "  ".join(f"{k} {v * 1e3:9.1f}" if v is not None else f"{k}      -"
                         for k, v in d.items())

    st = s["status"]
    lines = [
        f"requests {s['requests']}: " + ", ".join(f"{k} {v}" for k, v in st.items()),
        f"duration {s['duration_s']:.1f} s; throughput {s['throughput']['requests_per_s']} "
        f"req/s, {s['throughput']['input_tokens_per_s']} input tok/s, "
        f"{s['throughput']['output_tokens_per_s']} output tok/s",
        "latency (ms):",
    ]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        lines.append(f"  {key[:-2]:6s} {ms(s[key])}")
    lines.append(f"cached-token share {s['cached_token_share']}; retractions "
                 f"{s['retractions']}; preemptions {s['preemptions']}")
    if "slo" in s:
        lines.append(f"SLO {s['slo']['targets']}: attainment {s['slo']['attainment']:.1%}")
    hc = s.get("engine", {}).get("hicache")
    if hc:  # --enable-hierarchical-cache (twin/hicache.py)
        lines.append(f"hierarchical cache ({hc['write_policy']}, host pool "
                     f"{hc['host_capacity_tokens']:,} tokens): {hc['host_hits']} host hits, "
                     f"{hc['loaded_back_tokens']:,} tokens loaded back in "
                     f"{hc['load_back_s']:.3f} s ({hc['load_back_wait_s']:.3f} s of it in "
                     f"steps), {hc['written_tokens']:,} tokens written, "
                     f"{hc['host_evictions']} host evictions")
    if "memory" in s:
        from twin.memory_stats import format_memory

        lines += format_memory(s["memory"])
    return "\n".join(lines)
