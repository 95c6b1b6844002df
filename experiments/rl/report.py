"""The training report: one self-contained plotly HTML page (learning curve against the
heuristics' levels, and the final comparison)."""

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
    body = fig.to_html(full_html=False, include_plotlyjs=True)
    targets = cfg.targets.to_json()
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>servetwin rl "
                    f"train</title></head><body><h2>servetwin rl train</h2><p>SLO targets: "
                    f"{targets}</p>{body}</body></html>\n")
    return path
