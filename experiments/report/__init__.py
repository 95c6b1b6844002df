"""HTML reports: one self-contained plotly page (plotly.js inline, no CDN) per run.

`write_run_report(run_dir)` for a `servetwin simulate --out` directory (CDFs, time series,
per-class latency); `write_plan_report(plan_dir)` for a `servetwin plan --out` directory
(Pareto front, capacity, the winner's CDFs and series, the load ramp, the candidate table).
Both are byte-identical for the same inputs (explicit div ids, no clock). docs/reports.md.
"""

from experiments.report.plan_page import write_plan_report
from experiments.report.run_page import write_run_report

__all__ = ["write_plan_report", "write_run_report"]
