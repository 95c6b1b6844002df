"""benchmarks/cost_split.py on a tiny run: every part is timed, the loop and the records are
among them, the parts add up to the whole process's CPU time, and the records' parts to
the records' time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_split_names_each_part_and_adds_up():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost_split.py"),
                          "--n", "300"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    total = float(re.search(r"whole process ([0-9.]+) CPU-s", out).group(1))
    whole, by_part = out.split("by part:")
    rows, parts = ({m.group(1): float(m.group(2))
                    for m in re.finditer(r"^\| ([^|]+?) \| ([0-9.]+) \|", text, re.M)}
                   for text in (whole, by_part))
    # per request, to 0.1 us: a 300-request loop can take under 0.005 CPU-s (0.00 above)
    micros = {m.group(1): float(m.group(2))
              for m in re.finditer(r"^\| ([^|]+?) \| [0-9.]+ \| ([0-9.]+) \|", whole, re.M)}
    assert set(rows) == {
        "the workload (generated)", "the replica and its step-time tables",
        "the scheduler loop", "the records and summary", "summary.json and timeseries.csv",
        "everything else (imports, the command line)"}, out
    assert micros["the scheduler loop"] > 0 and micros["the records and summary"] > 0, out
    # each row is rounded to 0.01 s
    assert abs(sum(rows.values()) - total) <= 0.005 * len(rows) + 0.005, out
    # one chunk (300 requests): the in-memory path's lines and summary, and the rest
    assert {"token-gap pieces per request (`RecordTable._plan`)",
            "lines formatted and written, one chunk (`write_records`)",
            "summary of one chunk (`summarize`)"} <= set(parts), out
    assert abs(sum(parts.values()) - rows["the records and summary"]) <= \
        0.005 * len(parts) + 0.005, out


def test_side_by_side_with_a_base_commit():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost_split.py"),
                          "--n", "200", "--base", "HEAD", "--rounds", "1"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "against HEAD, side by side" in out, out
    rows = {m.group(1): m.group(2)
            for m in re.finditer(r"^\| ([^|*]+?) \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+x) \|$",
                                 out, re.M)}
    assert {"the scheduler loop", "the records and summary",
            "token-gap pieces per request (`RecordTable._plan`)"} <= set(rows), out
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                            text=True, check=True).stdout
    assert "servetwin-cost-base" not in listed  # the base's worktree is removed
