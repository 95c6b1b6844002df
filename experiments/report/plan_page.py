"""The report of a `servetwin plan --out` directory: the question and the winner, the Pareto
fronts (cost per hour against P99 TTFT and against goodput, SLO line drawn, winner marked),
capacity per candidate, CDFs of the best few, the winner's queue and KV use over time, the
load ramp (P99 per step against the SLO, first break marked, alert windows shaded) and a
sortable table of every candidate with its status and reason."""

from __future__ import annotations

from pathlib import Path

from experiments.report import page as P
from experiments.report.inputs import read_run
from experiments.report.plan_inputs import read_plan
from experiments.report.run_page import cdf_traces, series_figure

GOOD, BAD, FRONT, WIN = "#2ca02c", "#ff7f0e", "#1f77b4", "#d62728"


def write_plan_report(plan_dir: Path, html: Path | None = None) -> Path:
    """Write `plan_dir/report.html` (or `html`) from its plan.json and candidates/ (the
    contract in docs/reports.md); returns the path."""
    from twin.outputs import atomic_write_text

    plan_dir = Path(plan_dir)
    out = Path(html) if html is not None else plan_dir / "report.html"
    atomic_write_text(out, render_plan(plan_dir, read_plan(plan_dir)))
    return out


def render_plan(plan_dir: Path, plan: dict) -> str:
    by_id = {c["id"]: c for c in plan["candidates"]}
    parts = [_header(plan_dir, plan, by_id),
             "<h2>Cost against latency and goodput at the target load</h2>", _pareto(plan),
             "<h2>Capacity: the largest load meeting every SLO</h2>", _capacity(plan),
             "<h2>Latency distributions of the best candidates at the target load</h2>",
             _best_cdfs(plan_dir, plan, by_id),
             "<h2>The winner over time at the target load</h2>", _winner_series(plan_dir, plan),
             "<h2>Load ramp</h2>", _ramp(plan),
             "<h2>Every candidate</h2>", _table(plan)]
    return P.page("servetwin plan report: " + str(plan["question"].get("workload", "")), parts)


def ttft_slo(plan: dict) -> float | None:
    """The P99 TTFT threshold over all tiers (the Pareto chart's SLO line), else the ramp's."""
    for slo in plan["question"]["slos"]:
        if slo["metric"] == "ttft" and slo["stat"] == "p99" and slo.get("tier") is None:
            return float(slo["threshold_s"])
    return (plan.get("ramp") or {}).get("slo_s")


def slo_text(slo: dict) -> str:
    tier = "" if slo.get("tier") is None else f" (tier {slo['tier']})"
    if slo["stat"] == "attainment":
        return (f"{slo['metric'].upper()} <= {slo['threshold_s']} s for at least "
                f"{slo.get('target')} of requests{tier}")
    return f"{slo['metric'].upper()} {slo['stat']} <= {slo['threshold_s']} s{tier}"


def _header(plan_dir: Path, plan: dict, by_id: dict) -> str:
    q = plan["question"]
    target = q["target"]
    counts = {s: sum(c["status"] == s for c in plan["candidates"])
              for s in ("ok", "infeasible", "error")}
    lines = [f"workload: {q.get('workload')}; target: {target.get('kind')} "
             f"{target.get('value')} ({target['rps']:.3f} req/s); seed {q.get('seed')}; "
             f"load precision {q.get('precision')}",
             "SLOs: " + "; ".join(slo_text(s) for s in q["slos"]),
             f"candidates: {len(plan['candidates'])} (ok {counts['ok']}, infeasible "
             f"{counts['infeasible']}, error {counts['error']})"]
    prices = plan.get("prices") or {}
    if prices:
        lines.append("GPU prices (USD per GPU-hour): " + ", ".join(
            f"{k} {v}" for k, v in sorted(prices.items()) if k != "source")
            + f"; source: {prices.get('source', '?')}")
    win = by_id.get(plan["winner"]) if plan["winner"] else None
    if win:
        at = win.get("at_target") or {}
        head = (f"winner: {win['id']}, {win['label']}: ${win['cost_per_hour']:.2f}/h, "
                f"P99 TTFT {_ms(at.get('ttft_p99_s'))} at the target, max load "
                f"{_num(win['max_load'].get('rps'))} req/s, headroom {_pct(win.get('headroom'))}")
    else:
        head = "no candidate meets every SLO at the target load"
    html = [f"<p class='note'><b>{P.esc(head)}</b><br>"
            + "<br>".join(P.esc(x) for x in lines) + "</p>"]
    winner_txt = plan_dir / "winner.txt"
    if winner_txt.is_file():
        html.append(f"<pre>{P.esc(winner_txt.read_text(encoding='utf-8').strip())}</pre>")
    return "\n".join(html)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f} ms"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _measured(plan: dict) -> list[dict]:
    return [c for c in plan["candidates"] if c["status"] == "ok" and c.get("at_target")]


def _point_traces(fig, plan: dict, ykey: str, col: int, front_key: str) -> None:
    import plotly.graph_objects as go

    scale = 1e3 if ykey.endswith("_s") else 1.0
    cands = [c for c in _measured(plan) if c["at_target"].get(ykey) is not None]
    for meets, color, name in ((True, GOOD, "meets every SLO"), (False, BAD, "misses an SLO")):
        sel = [c for c in cands if bool(c["at_target"]["meets_slo"]) is meets]
        fig.add_trace(go.Scatter(
            x=[c["cost_per_hour"] for c in sel], y=[c["at_target"][ykey] * scale for c in sel],
            mode="markers", name=name, legendgroup=name, showlegend=col == 1,
            marker={"color": color, "size": 8}, text=[f"{c['id']}: {c['label']}" for c in sel],
            hovertemplate="%{text}<br>$%{x:.2f}/h, %{y:.3f}<extra></extra>"), row=1, col=col)
    by_id = {c["id"]: c for c in cands}
    front = sorted((by_id[i] for i in plan["pareto"][front_key] if i in by_id),
                   key=lambda c: (c["cost_per_hour"], c["id"]))
    fig.add_trace(go.Scatter(
        x=[c["cost_per_hour"] for c in front], y=[c["at_target"][ykey] * scale for c in front],
        mode="lines+markers", name="Pareto front", legendgroup="front", showlegend=col == 1,
        line={"color": FRONT, "shape": "hv"},
        marker={"color": FRONT, "size": 12, "symbol": "circle-open", "line": {"width": 2}},
        text=[c["id"] for c in front], hoverinfo="text"), row=1, col=col)
    win = by_id.get(plan["winner"] or "")
    if win:
        fig.add_trace(go.Scatter(
            x=[win["cost_per_hour"]], y=[win["at_target"][ykey] * scale], mode="markers+text",
            name="winner", legendgroup="winner", showlegend=col == 1, text=[win["id"]],
            textposition="top center", marker={"color": WIN, "size": 18, "symbol": "star"}),
            row=1, col=col)


def _pareto(plan: dict) -> str:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=[
        "cost per hour vs P99 TTFT (lower left is better)",
        "cost per hour vs goodput (upper left is better)"])
    _point_traces(fig, plan, "ttft_p99_s", 1, "cost_vs_ttft_p99")
    _point_traces(fig, plan, "goodput_rps", 2, "cost_vs_goodput")
    slo = ttft_slo(plan)
    if slo is not None:
        fig.add_hline(y=slo * 1e3, line={"color": WIN, "dash": "dash"}, row=1, col=1,
                      annotation_text=f"SLO {slo * 1e3:.0f} ms", annotation_position="top left")
    target = plan["question"]["target"]["rps"]
    fig.add_hline(y=target, line={"color": "gray", "dash": "dot"}, row=1, col=2,
                  annotation_text=f"target {target:.2f} req/s", annotation_position="top left")
    fig.update_xaxes(title_text="cost (USD per hour)", type="log")
    fig.update_yaxes(title_text="P99 TTFT (ms)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="goodput (req/s meeting the SLOs)", row=1, col=2)
    fig.update_layout(height=460, width=1300, margin={"t": 40})
    return P.figure_div(fig, "pareto")


def _capacity(plan: dict) -> str:
    """Max sustainable load per candidate (when any has one) and SLO attainment at the
    target, bars by cost."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cands = sorted((c for c in plan["candidates"] if c["status"] == "ok"),
                   key=lambda c: (c["cost_per_hour"], c["id"]))
    loads = [c["max_load"].get("rps") for c in cands]
    rows = 2 if any(v is not None for v in loads) else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=(["max sustainable load (req/s)"] if rows == 2 else [])
                        + ["SLO attainment at the target load"])
    colors = [WIN if c["id"] == plan["winner"] else
              (GOOD if (c.get("at_target") or {}).get("meets_slo") else BAD) for c in cands]
    ids = [c["id"] for c in cands]
    hover = [f"{c['label']}<br>${c['cost_per_hour']:.2f}/h, max load "
             f"{_num(c['max_load'].get('rps'))} req/s"
             + (f" ({c['max_load_bound']})" if c.get("max_load_bound") else "") for c in cands]
    target = plan["question"]["target"]["rps"]
    if rows == 2:
        fig.add_trace(go.Bar(x=ids, y=loads, marker={"color": colors}, hovertext=hover,
                             hoverinfo="text", name="max load", showlegend=False,
                             text=[f"${c['cost_per_hour']:.2f}/h" for c in cands],
                             textposition="outside", textangle=0, cliponaxis=False),
                      row=1, col=1)
        fig.add_hline(y=target, line={"color": "gray", "dash": "dash"}, row=1, col=1)
        fig.update_yaxes(type="log", range=_log_range(loads + [target]), row=1, col=1,
                         title_text=f"req/s (dashed: target {target:.2f})")
    fig.add_trace(go.Bar(x=ids, y=[(c.get("at_target") or {}).get("slo_attainment")
                                   for c in cands], marker={"color": colors}, hovertext=hover,
                         hoverinfo="text", name="SLO attainment", showlegend=False),
                  row=rows, col=1)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=rows, col=1)
    fig.update_xaxes(title_text="candidate (by cost; red: the winner, green: meets the SLOs "
                     "at the target, orange: misses)", row=rows, col=1)
    fig.update_layout(height=560 if rows == 2 else 360, width=1300, margin={"t": 30})
    note = "" if rows == 2 else ("<p class='note'>no candidate meets every SLO at any load "
                                 "the search tried: no max-load bars.</p>")
    return P.figure_div(fig, "capacity") + note


def _log_range(values: list) -> list[float]:
    """A log axis's range (log10 units) around the positive values, with room for labels."""
    import math

    vals = [v for v in values if v]
    lo, hi = (min(vals), max(vals)) if vals else (1.0, 10.0)
    return [round(math.log10(lo / 2), 6), round(math.log10(hi * 3), 6)]


def best_ids(plan_dir: Path, plan: dict, by_id: dict) -> list[str]:
    """Candidates with their runs on disk: the winner first, then by cost."""
    have = [c for c in plan["candidates"] if c.get("artifacts")
            and (plan_dir / c["artifacts"] / "requests.jsonl").is_file()]
    have.sort(key=lambda c: (c["id"] != plan["winner"], c["cost_per_hour"], c["id"]))
    return [c["id"] for c in have]


def _best_cdfs(plan_dir: Path, plan: dict, by_id: dict) -> str:
    from plotly.subplots import make_subplots

    ids = best_ids(plan_dir, plan, by_id)
    missing = [c["id"] for c in plan["candidates"] if c.get("artifacts") and c["id"] not in ids]
    gone = ("" if not missing else "<p class='note'>" + P.esc(
        "listed in plan.json but with no requests.jsonl on disk: " + ", ".join(missing))
        + "</p>")
    if not ids:
        return "<p class='note'>no candidate runs in candidates/.</p>" + gone
    groups = []
    for cid in ids:
        tag = " (winner)" if cid == plan["winner"] else ""
        run = read_run(plan_dir / by_id[cid]["artifacts"])
        groups.append((f"{cid}{tag}", run.records))
    fig = make_subplots(rows=1, cols=3, subplot_titles=["TTFT CDF", "TPOT CDF", "E2E CDF"])
    cdf_traces(fig, groups)
    slo = ttft_slo(plan)
    if slo is not None:
        fig.add_vline(x=slo * 1e3, line={"color": WIN, "dash": "dash"}, row=1, col=1)
    fig.update_layout(height=400, width=1300, margin={"t": 40})
    return ("<p class='note'>" + P.esc("; ".join(f"{cid}: {by_id[cid]['label']}" for cid in ids))
            + "</p>" + gone + P.figure_div(fig, "plan-cdf"))


def shown_candidate(plan_dir: Path, plan: dict) -> dict | None:
    """The winner, else (none meets the SLOs) the ramp's candidate, if its run is on disk."""
    by_id = {c["id"]: c for c in plan["candidates"]}
    for cid in (plan["winner"], (plan.get("ramp") or {}).get("candidate")):
        c = by_id.get(cid or "")
        if c and c.get("artifacts") and (plan_dir / c["artifacts"] / "requests.jsonl").is_file():
            return c
    return None


def _winner_series(plan_dir: Path, plan: dict) -> str:
    shown = shown_candidate(plan_dir, plan)
    if shown is None:
        return "<p class='note'>no winner (or ramped candidate) with a run in candidates/.</p>"
    note = "" if shown["id"] == plan["winner"] else (
        f"<p class='note'>no candidate meets every SLO: {P.esc(shown['id'])}, the candidate "
        "the planner ramped, instead.</p>")
    return note + series_figure(read_run(plan_dir / shown["artifacts"]), "winner-series",
                                f"{shown['id']}: ")


def _ramp(plan: dict) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ramp = plan.get("ramp")
    if not ramp:
        return ("<p class='note'>no ramp in this plan (run with --no-ramp, or no candidate to "
                "ramp).</p>")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], subplot_titles=[
        "P99 per load step", "P99 TTFT per window (shaded: while the alert fires)"])
    steps = ramp["steps"]
    xs = [s["load_pct"] for s in steps]
    for n, (key, name) in enumerate((("ttft_p99_s", "TTFT p99"), ("tpot_p99_s", "TPOT p99"),
                                     ("e2e_p99_s", "E2E p99"))):
        fig.add_trace(go.Scatter(x=xs, y=[_scaled(s[key]) for s in steps], name=name,
                                 mode="lines+markers", line={"color": P.COLORS[n]}),
                      row=1, col=1)
    fig.add_hline(y=ramp["slo_s"] * 1e3, line={"color": WIN, "dash": "dash"}, row=1, col=1,
                  annotation_text=f"SLO {ramp['slo_s'] * 1e3:.0f} ms",
                  annotation_position="top left")
    notes = []
    for name, pct in sorted(ramp["first_break"].items()):
        notes.append(f"{name}: " + ("holds at every step" if pct is None else
                                    f"first breaks at {pct}% of the target"))
        if pct is not None:
            fig.add_vline(x=pct, line={"color": WIN, "width": 1}, row=1, col=1,
                          annotation_text=f"{name} breaks", annotation_position="bottom right")
    windows = ramp["windows"]
    fig.add_trace(go.Scatter(x=[(w["start_s"] + w["end_s"]) / 2 for w in windows],
                             y=[_scaled(w.get("ttft_p99_s")) for w in windows],
                             mode="lines+markers", name="TTFT p99 per window",
                             line={"color": P.COLORS[4]}), row=1, col=2)
    fig.add_hline(y=ramp["slo_s"] * 1e3, line={"color": WIN, "dash": "dash"}, row=1, col=2)
    step_s = ramp.get("step_s")
    if isinstance(step_s, (int, float)) and step_s > 0:
        for i, step in enumerate(steps):  # the load steps along the ramp's time axis
            fig.add_vline(x=i * step_s, line={"color": "gray", "width": 1, "dash": "dot"},
                          row=1, col=2, annotation_text=f"{step['load_pct']}%",
                          annotation_position="top right", annotation_font_size=10)
    last = max((w["end_s"] for w in windows), default=0.0)
    for alert in ramp["alerts"]:
        end = alert.get("end_s")
        fig.add_vrect(x0=alert["start_s"], x1=last if end is None else end, row=1, col=2,
                      fillcolor=WIN, opacity=0.15, line_width=0)
        notes.append(f"alert {alert.get('rule')}: {alert['start_s']:.0f} s to "
                     + ("the end" if end is None else f"{end:.0f} s"))
    fig.update_xaxes(title_text="load (% of the target)", row=1, col=1)
    fig.update_xaxes(title_text="ramp time (s)", row=1, col=2)
    fig.update_yaxes(title_text="ms", type="log")
    fig.update_layout(height=440, width=1300, margin={"t": 40})
    note = P.esc(f"candidate {ramp['candidate']}; " + "; ".join(notes))
    return f"<p class='note'>{note}</p>" + P.figure_div(fig, "ramp")


def _scaled(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _table(plan: dict) -> str:
    headers = ["id", "label", "status", "reason", "GPUs", "cost ($/h)", "max load (req/s)",
               "max load (scale)", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p99 (s)",
               "E2E p99 (s)", "goodput (req/s)", "SLO attainment", "meets SLO", "headroom"]
    bound = any("max_load_bound" in c for c in plan["candidates"])
    if bound:
        headers.append("load search")
    rows, classes = [], []
    for c in plan["candidates"]:
        at = c.get("at_target") or {}
        rows.append([c["id"], c["label"], c["status"], c.get("reason") or "", c["gpus"],
                     c["cost_per_hour"], c["max_load"].get("rps"), c["max_load"].get("scale"),
                     at.get("ttft_p50_s"), at.get("ttft_p99_s"), at.get("tpot_p99_s"),
                     at.get("e2e_p99_s"), at.get("goodput_rps"), at.get("slo_attainment"),
                     at.get("meets_slo"), c.get("headroom")]
                    + ([c.get("max_load_bound") or ""] if bound else []))
        classes.append("win" if c["id"] == plan["winner"] else
                       ("" if c["status"] == "ok" else "bad"))
    return ("<p class='note'>click a column header to sort (again to reverse); the winner is "
            "highlighted, infeasible and failed candidates are grey with their reason.</p>"
            + P.table("candidates", headers, rows, classes, text_cols=(0, 1, 2, 3, 14, 16)))
