"""The training report: one self-contained plotly HTML page (learning curve against the
heuristics' levels, and the final comparison), assembled like the other reports
(experiments/report/page.py)."""

from __future__ import annotations

from pathlib import Path


def write_report(path: Path, history: list[dict], heuristics: dict[str, dict], tc,
                 cfg) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45],
                        subplot_titles=("held-out return while training",
                                        "final: SLO attainment by policy"))
    xs = [h["timesteps"] for h in history]
    fig.add_trace(go.Scatter(x=xs, y=[h["return"] for h in history], mode="lines+markers",
                             name="learned (numpy export)"), row=1, col=1)
    best = sorted(heuristics, key=lambda k: -heuristics[k]["return"])[:4]
    for label in best:
        fig.add_trace(go.Scatter(x=[xs[0], xs[-1]] if xs else [0, 1],
                                 y=[heuristics[label]["return"]] * 2, mode="lines",
                                 line={"dash": "dash"}, name=label), row=1, col=1)
    rows = {"learned": history[-1], **heuristics} if history else dict(heuristics)
    order = sorted(rows, key=lambda k: rows[k]["slo_attainment"] or 0)
    fig.add_trace(go.Bar(x=[rows[k]["slo_attainment"] for k in order], y=order,
                         orientation="h", name="SLO attainment", showlegend=False),
                  row=1, col=2)
    fig.update_xaxes(title_text="timesteps (decisions)", row=1, col=1)
    fig.update_yaxes(title_text="return (balanced SLO goodput)", row=1, col=1)
    fig.update_layout(height=520, width=1200,
                      title=f"servetwin rl train: env {tc.env}, {tc.timesteps} steps, "
                            f"{len(history)} evaluations")
    from experiments.report.page import esc, figure_div, page

    # the reports' page: plotly.js inline, a fixed div id (the same run, the same bytes)
    path.write_text(page("servetwin rl train", [
        f"<p class='note'>SLO targets: {esc(cfg.targets.to_json())}</p>",
        figure_div(fig, "rl-train")]))
    return path
