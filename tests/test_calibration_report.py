"""calibration/report.py's validation page: the same live and twin records give the same
bytes (plotly's random div id is fixed), with both sides' data in the figure."""

from __future__ import annotations

import json
import re

import pytest

from calibration.report import write_report

pytestmark = pytest.mark.offline


def _records(scale: float) -> list[dict]:
    return [{"rid": f"r{i}", "status": "ok", "ttft_s": 0.1 * scale * (i + 1),
             "tpot_s": 0.02 * scale, "e2e_s": 0.5 * scale * (i + 1),
             "itl_s": [0.02 * scale] * 3} for i in range(5)]


def test_validation_page_is_byte_identical_and_carries_both_sides(tmp_path):
    live, twin = _records(1.0), _records(1.1)
    a, b = tmp_path / "a.html", tmp_path / "b.html"
    write_report(a, live, twin, "validate", "table")
    write_report(b, live, twin, "validate", "table")
    assert a.read_bytes() == b.read_bytes()
    page = a.read_text()
    assert 'id="validation-report"' in page
    spec = re.search(r'Plotly\.newPlot\(\s*"validation-report",\s*(\[.*?\]),\s*\{', page, re.S)
    traces = json.loads(spec.group(1))
    names = {t.get("name") for t in traces}
    assert {"live TTFT", "twin TTFT"} <= names
