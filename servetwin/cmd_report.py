"""`servetwin report DIR`: one self-contained HTML page (plotly.js inline) for a simulate or
plan output directory."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Write one self-contained plotly HTML page (plotly.js inline: it opens with no network) for
an output directory, byte-identical for the same inputs:

- a `servetwin simulate --out DIR` directory (requests.jsonl, summary.json, timeseries.csv;
  a fleet run's per-replica columns too): the run's configuration and summary, TTFT/TPOT/E2E
  CDFs, running requests, queue length and KV use over time (a line per replica), latency
  per priority tier, prompt-length class and replica, and the requests that were not ok
  (a `servetwin live replay --out` directory too: the same page without time series);
- a `servetwin plan --out DIR` directory (it has plan.json): the Pareto fronts of cost
  against P99 TTFT and goodput with the SLO line and the winner, capacity per candidate, the
  best candidates' CDFs, the winner's queue and KV use, the load ramp with the first SLO break
  and alert windows, and a table of every candidate (click a header to sort).

How to read each chart: docs/reports.md."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="an HTML report of a simulate or plan output directory",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", type=Path,
                   help="a `servetwin simulate --out`, `servetwin live replay --out` or "
                   "`servetwin plan --out` directory")
    p.add_argument("--html", metavar="FILE", type=Path,
                   help="where to write the page (default DIR/report.html)")
    p.set_defaults(func=run, _parser=p)


def run(ns: argparse.Namespace) -> int:
    import sys

    from experiments.report import write_plan_report, write_run_report
    from twin.outputs import check_out_file

    html = check_out_file(ns.html, "--html") if ns.html is not None else None
    plan = (ns.dir / "plan.json").is_file()
    files = "plan.json, candidates/" if plan else "requests.jsonl, summary.json, timeseries.csv"
    print(f"reading {ns.dir} ({files}) ...", file=sys.stderr, flush=True)
    if plan:
        out = write_plan_report(ns.dir, html)
        print(f"wrote {out} (plan report: {ns.dir}/plan.json)")
    else:
        out = write_run_report(ns.dir, html)
        print(f"wrote {out} (simulate report: {ns.dir})")
    return 0
