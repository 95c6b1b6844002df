"""Reading what the reports draw: a `servetwin simulate --out` directory (requests.jsonl,
summary.json, timeseries.csv) and a plan's `plan.json`, each checked with errors that name
the file, the line and the key."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from twin.errors import ServetwinError


class ReportInputError(ServetwinError):
    """A report's input that is missing or malformed: the message names the file and key."""


@dataclass(frozen=True)
class Run:
    """One simulate output directory, read and checked."""

    path: Path
    records: list[dict]
    summary: dict
    # replica ("" for a single server) -> column; empty without timeseries.csv (a live replay)
    series: dict[str, dict[str, list[float | None]]]
    launch: str | None  # sglang_launch.txt, when the run wrote one


def read_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ReportInputError(f"{path}: not a directory (expected a `servetwin simulate "
                               "--out` directory with requests.jsonl, summary.json, "
                               "timeseries.csv)")
    from twin.metrics import read_records

    records = read_records(_need(path, "requests.jsonl"))
    summary = read_json(_need(path, "summary.json"))
    # a live replay (`servetwin live replay --out`) writes no time series: the page says so
    series_csv = path / "timeseries.csv"
    series = read_series(series_csv) if series_csv.is_file() else {}
    launch = path / "sglang_launch.txt"
    return Run(path, records, summary, series,
               launch.read_text(encoding="utf-8") if launch.is_file() else None)


def _need(directory: Path, name: str) -> Path:
    p = directory / name
    if not p.is_file():
        raise ReportInputError(f"{p}: missing (a `servetwin simulate --out` directory has "
                               "requests.jsonl, summary.json and timeseries.csv; a `servetwin "
                               "live replay --out` one the first two)")
    return p


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportInputError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}:1: a JSON object expected, got {type(data).__name__}")
    return data


def read_series(path: Path) -> dict[str, dict[str, list[float | None]]]:
    """timeseries.csv by replica (a fleet run's first column), every column but `replica`
    as floats; an empty cell (a column a vLLM replica does not have) is None, any other cell
    that is not a number is an error naming line and column."""
    out: dict[str, dict[str, list[float | None]]] = {}
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header or "t_s" not in header:
            raise ReportInputError(f"{path}:1: header without the column 't_s'")
        for line_no, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) != len(header):
                raise ReportInputError(f"{path}:{line_no}: {len(row)} cells, the header has "
                                       f"{len(header)}")
            replica = row[header.index("replica")] if "replica" in header else ""
            cols = out.setdefault(replica, {k: [] for k in header if k != "replica"})
            for key, text in zip(header, row, strict=True):
                if key != "replica":
                    cols[key].append(_float(text, path, line_no, key))
    return out


def _float(text: str, path: Path, line_no: int, key: str) -> float | None:
    if text == "" and key != "t_s":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ReportInputError(f"{path}:{line_no}: column {key!r}: {text!r} is not a number")
    return value
