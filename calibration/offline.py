"""Samples from runs already made: `servetwin live replay` record directories and SGLang
`bench_serving --output-details` files, so a benchmark history calibrates without
re-running anything. Both give token-gap samples only (no forward stamps are kept), and
the server's `/server_info` comes with them (`server_info_before.json` in a record
directory, the `server_info` object of a bench_serving run)."""

from __future__ import annotations

import json
from pathlib import Path

from calibration.derive import (
    Timeline,
    samples_from_timelines,
    timelines_from_bench_serving,
    timelines_from_records,
)
from calibration.profile import ServerLimits
from calibration.session import CalibrationError
from twin.errors import ServetwinError
from twin.inputs import read_text, text_lines


def _samples(lines: list[Timeline], info: dict) -> list[dict]:
    return samples_from_timelines(lines, ServerLimits.from_info(info).derive_limits())


def from_record_dir(path: Path) -> tuple[list[dict], dict]:
    """(samples, server info) of one `servetwin live replay --out` directory."""
    from twin.metrics import read_records

    records_path, info_path = path / "requests.jsonl", path / "server_info_before.json"
    if not records_path.is_file():
        raise CalibrationError(f"{path}: no requests.jsonl (a `servetwin live replay --out` "
                               "directory expected)")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        raise CalibrationError(f"{path}: no readable server_info_before.json; the server's "
                               "limits and identity are needed") from None
    try:
        records = read_records(records_path)
    except ServetwinError as exc:
        raise CalibrationError(f"{records_path}: {exc}") from None
    return _samples(timelines_from_records(records, tag=f"records:{path.name}"), info), info


def from_bench_serving(path: Path) -> tuple[list[dict], dict]:
    """(samples, server info) of every run in a `bench_serving --output-details` file."""
    samples: list[dict] = []
    info: dict = {}
    for line_no, line in enumerate(text_lines(read_text(path, "--from-bench-serving")), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except (ValueError, RecursionError):
            raise CalibrationError(f"{path}:{line_no}: not JSON") from None
        if not isinstance(run, dict) or not isinstance(run.get("input_lens"), list) \
                or "ttfts" not in run:
            raise CalibrationError(f"{path}:{line_no}: not a bench_serving --output-details "
                                   "run (no input_lens / ttfts)")
        info = run.get("server_info") or info
        lines = timelines_from_bench_serving(run, tag=f"bench:{path.name}:{line_no}")
        samples += _samples(lines, info)
    if not info:
        raise CalibrationError(f"{path}: no server_info in any run; cannot tell which server "
                               "it measured")
    return samples, info
