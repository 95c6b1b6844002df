"""`servetwin claims` (experiments/claims.py): the head-of-line check on the users'
deployment, with the mitigations side by side."""

from __future__ import annotations

import re

import pytest

from experiments.claims import head_of_line
from servetwin.cli import main

pytestmark = pytest.mark.offline


def test_the_chunk_answer_shortens_the_stall_not_the_work():
    rows = {c.config.rsplit("; ", 1)[1]: c for c in head_of_line()}
    assert len(rows) == 4

    def nums(c):  # (mean added E2E ms, longest gap ms, the 32k prompt's TTFT s)
        added, gap, ttft = re.findall(r"([\d,.]+) (?:ms|s)\b", c.twin)[:3]
        return tuple(float(x.replace(",", "")) for x in (added, gap, ttft))

    default = nums(rows["chunked prefill 8192 (SGLang default)"])
    mixed = nums(rows["chunked 8192 + --enable-mixed-chunk"])
    answer = nums(next(c for k, c in rows.items() if "chunk answer" in k))
    assert answer[1] < mixed[1] < default[1]  # the longest token gap
    assert answer[2] > 1.5 * default[2]  # the 32k prompt pays in TTFT
    assert abs(answer[0] - default[0]) < 0.1 * default[0]  # the added E2E stays


def test_cli_prints_the_table(capsys):
    assert main(["claims", "--only", "head-of-line"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| claim | users | twin | configuration |")
    assert out.count("one 32k request adds delay") == 4
