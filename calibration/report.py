"""The validation report: one self-contained plotly HTML page.

Top row: live and twin CDFs overlaid for TTFT, TPOT, E2E and ITL. Bottom row: per request,
the twin's TTFT and E2E against the live ones, with the line y = x (points above it are
requests the twin predicts slower than they were). The fidelity table is printed above.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LIVE, TWIN = "#1f77b4", "#d62728"


def _values(records: Sequence[dict], key: str) -> np.ndarray:
    ok = [r for r in records if r["status"] == "ok"]
    if key == "itl_s":
        parts = [np.asarray(r["itl_s"] or [], float) for r in ok]
        return np.concatenate(parts) if parts else np.empty(0)
    return np.asarray([r[key] for r in ok if r[key] is not None], float)


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(values) * 1e3
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def write_report(path: Path, live: Sequence[dict], twin: Sequence[dict], title: str,
                 table: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    metrics = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"), ("itl_s", "ITL"))
    fig = make_subplots(rows=2, cols=4, subplot_titles=[f"{n} CDF (ms)" for _, n in metrics]
                        + ["TTFT per request (ms)", "E2E per request (ms)", "", ""],
                        vertical_spacing=0.14)
    for col, (key, name) in enumerate(metrics, 1):
        for recs, label, color in ((live, "live", LIVE), (twin, "twin", TWIN)):
            x, y = _cdf(_values(recs, key))
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=f"{label} {name}",
                                     line={"color": color}, legendgroup=label,
                                     showlegend=col == 1), row=1, col=col)
    by_rid = {r["rid"]: r for r in live}
    for col, key in ((1, "ttft_s"), (2, "e2e_s")):
        pairs = [(by_rid[t["rid"]][key] * 1e3, t[key] * 1e3, t["rid"]) for t in twin
                 if t["rid"] in by_rid and t[key] is not None and by_rid[t["rid"]][key]
                 is not None]
        if not pairs:
            continue
        xs, ys, rids = zip(*pairs, strict=True)
        top = max(max(xs), max(ys))
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", text=rids, showlegend=False,
                                 marker={"color": TWIN, "size": 5}), row=2, col=col)
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", showlegend=False,
                                 line={"color": "gray", "dash": "dash"}), row=2, col=col)
        fig.update_xaxes(title_text="live (ms)", row=2, col=col)
        fig.update_yaxes(title_text="twin (ms)", row=2, col=col)
    fig.update_layout(title=title, height=800, width=1400)
    # a fixed div id: plotly would draw a random one, and the same inputs must give the same page
    body = fig.to_html(full_html=False, include_plotlyjs=True, div_id="validation-report")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title></head><body><h2>{html.escape(title)}</h2><pre>{html.escape(table)}</pre>"
            f"{body}</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    from twin.outputs import atomic_write_text

    atomic_write_text(path, page)
