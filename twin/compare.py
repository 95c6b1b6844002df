"""Compare two runs of one workload (twin vs live, or any two), record for record.

Pure: records in, rows out, no I/O and no SGLang, so `servetwin live compare` and
calibration use the same arithmetic. Both sides are summarised by `twin.metrics.summarize`
from their records (never from a stored summary), so they are treated alike.

Relative errors are signed and taken against B, the reference: `(A - B) / B`. With the
twin as A and the live server as B, +20 % means the twin predicts 20 % higher than measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twin.metrics import PERCENTILES, summarize

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"),
             ("queue_s", "queue"))
THROUGHPUTS = (("requests_per_s", "throughput", "req/s"),
               ("input_tokens_per_s", "input throughput", "tok/s"),
               ("output_tokens_per_s", "output throughput", "tok/s"))


@dataclass(frozen=True)
class Row:
    metric: str  # e.g. "TTFT p99"
    unit: str
    a: float | None
    b: float | None

    @property
    def rel_err(self) -> float | None:
        """(A - B) / B; None when either side is missing or B is 0."""
        if self.a is None or self.b is None or self.b == 0:
            return None
        return (self.a - self.b) / self.b


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    matched: int  # requests present (by rid) on both sides
    only_a: int
    only_b: int
    prompt_mismatch: int  # matched requests whose prompt lengths differ
    status_a: dict
    status_b: dict

    def row(self, metric: str) -> Row:
        return next(r for r in self.rows if r.metric == metric)

    def warnings(self) -> list[str]:
        out = []
        if self.only_a or self.only_b:
            out.append(f"the runs differ in requests: {self.only_a} only in A, {self.only_b} "
                       f"only in B ({self.matched} in both)")
        if self.prompt_mismatch:
            out.append(f"{self.prompt_mismatch} matched requests have different prompt lengths")
        for side, status in (("A", self.status_a), ("B", self.status_b)):
            bad = {k: v for k, v in status.items() if k != "ok" and v}
            if bad:
                out.append(f"{side} has requests that are not ok: {bad} (latencies are over "
                           "ok requests only)")
        return out


def summary_rows(sa: dict, sb: dict) -> list[Row]:
    """Rows from two `summarize` results: latency percentiles in ms, throughputs, cache."""
    rows = []
    for key, name in LATENCIES:
        for p in PERCENTILES:
            rows.append(Row(f"{name} p{p}", "ms", _ms(sa[key][f"p{p}"]), _ms(sb[key][f"p{p}"])))
    for key, name, unit in THROUGHPUTS:
        rows.append(Row(name, unit, sa["throughput"][key], sb["throughput"][key]))
    rows.append(Row("cached-token share", "", sa["cached_token_share"],
                    sb["cached_token_share"]))
    rows.append(Row("retractions", "", sa["retractions"], sb["retractions"]))
    return rows


def compare_records(records_a: Sequence[dict], records_b: Sequence[dict]) -> Comparison:
    """Compare two record lists of the same workload."""
    sa, sb = summarize(records_a), summarize(records_b)
    by_a = {r["rid"]: r for r in records_a}
    by_b = {r["rid"]: r for r in records_b}
    both = [rid for rid in by_a if rid in by_b]
    mismatch = sum(1 for rid in both if by_a[rid]["prompt_tokens"] != by_b[rid]["prompt_tokens"])
    return Comparison(tuple(summary_rows(sa, sb)), len(both), len(by_a) - len(both),
                      len(by_b) - len(both), mismatch, sa["status"], sb["status"])


def join_by_rid(records_a: Sequence[dict], records_b: Sequence[dict],
                fields: Sequence[str] = ("prompt_tokens", "cached_tokens", "ttft_s", "e2e_s",
                                         "status")) -> list[dict]:
    """One row per request present on both sides, in A's order: `rid` and `FIELD_a`,
    `FIELD_b` for each field."""
    by_b = {r["rid"]: r for r in records_b}
    out = []
    for ra in records_a:
        rb = by_b.get(ra["rid"])
        if rb is None:
            continue
        row = {"rid": ra["rid"]}
        for f in fields:
            row[f"{f}_a"], row[f"{f}_b"] = ra.get(f), rb.get(f)
        out.append(row)
    return out


def format_table(cmp: Comparison, label_a: str = "A", label_b: str = "B") -> str:
    """A fixed-width table; the last column is the signed relative error (A - B) / B."""
    width = max(12, len(label_a), len(label_b))
    head = f"{'metric':<22} {label_a:>{width}} {label_b:>{width}} {'(A-B)/B':>9}"
    lines = [head, "-" * len(head)]
    for r in cmp.rows:
        name = f"{r.metric} ({r.unit})" if r.unit else r.metric
        err = f"{r.rel_err:+.1%}" if r.rel_err is not None else "-"
        lines.append(f"{name:<22} {_fmt(r.a):>{width}} {_fmt(r.b):>{width}} {err:>9}")
    lines.append(f"requests: {cmp.matched} in both; status A {_status(cmp.status_a)}; "
                 f"B {_status(cmp.status_b)}")
    lines += [f"warning: {w}" for w in cmp.warnings()]
    return "\n".join(lines)


def format_markdown(cmp: Comparison, label_a: str = "A", label_b: str = "B") -> str:
    lines = [f"| metric | {label_a} | {label_b} | ({label_a} - {label_b}) / {label_b} |",
             "| --- | ---: | ---: | ---: |"]
    for r in cmp.rows:
        name = f"{r.metric} ({r.unit})" if r.unit else r.metric
        err = f"{r.rel_err:+.1%}" if r.rel_err is not None else "-"
        lines.append(f"| {name} | {_fmt(r.a)} | {_fmt(r.b)} | {err} |")
    return "\n".join(lines)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 1:
        return f"{x:,.0f}"
    return f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"


def _status(status: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in status.items() if v) or "none"
