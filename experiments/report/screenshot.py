"""A PNG screenshot of a report page in headless Chromium (Debian's, through Playwright), for
the docs: `python -m experiments.report.screenshot REPORT.html OUT.png [--height PX]`.

The docs' pictures (docs/reports.md, README) were made with it from `servetwin report` pages.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def screenshot(html: Path, png: Path, width: int = 1360, height: int | None = None) -> Path:
    """The page's top `height` pixels (the whole page if None) as a PNG."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if not chromium:
        raise SystemExit("chromium not found: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": height or 900})
        page.goto(Path(html).resolve().as_uri(), wait_until="load")
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length")
        page.screenshot(path=str(png), full_page=height is None)
        browser.close()
    return Path(png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--width", type=int, default=1360)
    ap.add_argument("--height", type=int, help="the top PX pixels only (default: whole page)")
    ns = ap.parse_args(argv)
    out = screenshot(ns.html, ns.png, ns.width, ns.height)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
