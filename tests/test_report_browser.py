"""The reports in a real headless browser: Debian's Chromium driven by Playwright for Python
(through its executable path: Playwright's own browser download cannot be reached here).

For a simulate report (a fleet run), a plan report of twin runs assembled here and one of a
real `servetwin plan`: the page loads with no JavaScript
error, every plotly chart has traces with data, the candidate table sorts when a header is
clicked, and a screenshot is not blank (decoded by the browser itself onto a canvas; a blank
page's screenshot is checked to fail the same test). Without chromium the tests skip with
the reason, except under SERVETWIN_CI=1, where they fail.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import pytest
from test_report import SHORT, SPEC, build_plan_dir, run_real_plan, simulate

from experiments.report import write_plan_report, write_run_report

pytestmark = pytest.mark.offline

# Distinct colours and the share of pixels that are not the page background, in the
# browser's own decoding of a screenshot.
_PIXELS_JS = """async (b64) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data;
  const seen = new Set(); let ink = 0;
  for (let i = 0; i < d.length; i += 4) {
    seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
    if (d[i] + d[i + 1] + d[i + 2] < 720) ink++;
  }
  return {width: c.width, height: c.height, colors: seen.size, ink: ink / (d.length / 4)};
}"""

# Every plotly div: its id and, per trace, how many points it has.
_CHARTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => ({
  id: el.id, points: (el.data || []).map(t => Math.max((t.x || []).length, (t.y || []).length))
}))"""

_COLUMN_JS = """([table, col]) => Array.from(document.querySelectorAll('#' + table + ' tbody tr'))
  .map(r => r.cells[col].getAttribute('data-v'))"""


def _chromium() -> str:
    path = shutil.which("chromium")
    if path:
        return path
    if os.environ.get("SERVETWIN_CI") == "1":
        pytest.fail("chromium is missing (.ci/run installs Debian's chromium package)")
    pytest.skip("Debian's chromium is not installed (apt-get install chromium); CI installs it")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    path = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"],
                              timeout=120_000)
        yield b
        b.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("browser")
    fleet = root / "fleet"
    simulate(fleet, "--deployment", "finance-hybrid", "--seed", "1", "--workload",
             SPEC.format(rate=3, n=40, prompt=SHORT))
    return {"simulate": write_run_report(fleet),
            "plan": write_plan_report(build_plan_dir(root / "plan")),
            "real-plan": run_real_plan(root / "real-plan") / "report.html"}


def _open(browser, path: Path):
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error"
            else None)
    page.goto(path.as_uri(), wait_until="load")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
    return page, errors


@pytest.fixture(scope="module")
def opened(browser, pages):
    """Each page opened once (a 5 MB page takes seconds to load on a busy machine)."""
    tabs = {kind: _open(browser, path) for kind, path in pages.items()}
    yield tabs
    for page, _ in tabs.values():
        page.close()


def _not_blank(page, png: bytes) -> dict:
    return page.evaluate(_PIXELS_JS, base64.b64encode(png).decode())


@pytest.mark.parametrize("kind, charts", [
    ("simulate", ["cdf", "series", "classes"]),
    ("plan", ["pareto", "capacity", "plan-cdf", "winner-series", "ramp"]),
    ("real-plan", ["pareto", "capacity", "plan-cdf", "winner-series", "ramp"]),
])
def test_page_loads_with_data_in_every_chart(opened, kind, charts):
    page, errors = opened[kind]
    found = page.evaluate(_CHARTS_JS)
    assert [c["id"] for c in found] == charts
    for chart in found:
        assert chart["points"] and max(chart["points"]) > 0, chart
    pixels = _not_blank(page, page.screenshot(full_page=False))
    assert pixels["colors"] > 50 and pixels["ink"] > 0.02, pixels
    assert errors == []


def test_a_blank_screenshot_is_judged_blank(browser):
    page = browser.new_page(viewport={"width": 400, "height": 300})
    try:
        page.set_content("<html><body style='background:#fff'></body></html>")
        pixels = _not_blank(page, page.screenshot())
        assert pixels["colors"] <= 50 or pixels["ink"] <= 0.02
    finally:
        page.close()


def _numbers(values: list) -> list[float]:
    return [float(v) for v in values if v not in (None, "")]


@pytest.mark.parametrize("kind, table, header", [
    ("plan", "candidates", "cost ($/h)"),
    ("plan", "candidates", "TTFT p99 (s)"),
    ("real-plan", "candidates", "max load (req/s)"),
    ("simulate", "class-table", "TTFT p99 (ms)"),
])
def test_table_sorts_by_the_clicked_header(opened, kind, table, header):
    page, errors = opened[kind]
    headers = page.eval_on_selector_all(f"#{table} th", "hs => hs.map(h => h.textContent)")
    col = headers.index(header)
    before = page.evaluate(_COLUMN_JS, [table, col])
    assert len(set(_numbers(before))) > 1  # so ascending and descending differ
    th = page.locator(f"#{table} th").nth(col)
    th.click()
    asc = page.evaluate(_COLUMN_JS, [table, col])
    assert _numbers(asc) == sorted(_numbers(before))
    assert asc[len(_numbers(asc)):] == [""] * (len(asc) - len(_numbers(asc)))  # blanks last
    th.click()
    desc = _numbers(page.evaluate(_COLUMN_JS, [table, col]))
    assert desc == sorted(_numbers(before), reverse=True)
    assert errors == []


def test_a_script_error_is_caught(browser, tmp_path):
    """The error listeners see a failing script (so a clean report's empty list means it)."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><div class='js-plotly-plot'><svg class='main-svg'></svg></div>"
                   "<script>console.error('broken'); undefinedFunction();</script></body></html>")
    page, errors = _open(browser, bad)
    page.close()
    assert any("undefinedFunction" in e for e in errors) and "console: broken" in errors
