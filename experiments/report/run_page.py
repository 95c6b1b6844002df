"""The report of one `servetwin simulate --out` run: a header with the run's configuration and
summary, TTFT/TPOT/E2E CDFs, running/waiting/KV use over time (a line per replica for a
fleet) and latency per class (priority tier, prompt length, replica)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from experiments.report import page as P
from experiments.report.inputs import Run, read_run

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
# Prompt-length classes (tokens): the users' short questions sit in the first two, their
# 10k-128k-token documents in the last two.
PROMPT_CLASSES = ((1024, "<1k"), (4096, "1k-4k"), (10240, "4k-10k"), (32768, "10k-32k"),
                  (None, ">=32k"))


def write_run_report(run_dir: Path, html: Path | None = None) -> Path:
    """Write `run_dir/report.html` (or `html`) for a simulate output directory."""
    from twin.outputs import atomic_write_text

    run = read_run(Path(run_dir))
    out = Path(html) if html is not None else Path(run_dir) / "report.html"
    atomic_write_text(out, render_run(run))
    return out


def render_run(run: Run) -> str:
    name = run.summary.get("deployment") or run.path.name
    live = bool((run.summary.get("engine") or {}).get("live"))
    parts = [_header(run), "<h2>Latency distributions</h2>", _cdf_figure(run.records),
             "<h2>Over time</h2>", _series_figure(run),
             "<h2>Latency per class</h2>", _class_figure(run.records), _class_table(run.records)]
    return P.page(f"servetwin {'live replay' if live else 'simulate'} report: {name}", parts)


def ok_values(records: Sequence[dict], key: str) -> list[float]:
    return [r[key] for r in records if r["status"] == "ok" and r[key] is not None]


def _header(run: Run) -> str:
    s, recs = run.summary, run.records
    status = Counter(r["status"] for r in recs)
    engine = s.get("engine") or {}
    config = [f"run directory: {run.path.name}"]
    if s.get("deployment"):
        config.append(f"deployment: {s['deployment']} ({s.get('gpus', '?')} GPUs)")
    if engine.get("live"):
        config.append(f"live server: {engine['live']} (SGLang {engine.get('version') or '?'})")
    if s.get("partial"):
        config.append(f"partial run: {s['partial']}")
    if engine.get("gpu"):
        config.append(f"GPU: {engine['gpu']}; step-time backend: {engine.get('backend', '?')}")
    memory = s.get("memory") or {}
    if memory.get("allocator"):
        config.append(f"KV allocator: {memory['allocator']}, "
                      f"{memory.get('capacity_tokens', 0):,} tokens")
    slo = s.get("slo") or {}
    lines = ["<p class='note'>" + "<br>".join(P.esc(c) for c in config) + "</p>"]
    if run.launch:
        lines.append("<p class='note'>the same deployment on the real engine:</p>"
                     f"<pre>{P.esc(run.launch.strip())}</pre>")
    tp = s.get("throughput") or {}
    lines.append(
        "<p class='note'>"
        + P.esc(f"requests {len(recs)}: " + ", ".join(f"{k} {status.get(k, 0)}" for k in
                                                     ("ok", "rejected", "aborted", "failed"))
                + f"; duration {s.get('duration_s', 0):.1f} s; throughput "
                f"{tp.get('requests_per_s', 0):.3f} req/s, "
                f"{tp.get('output_tokens_per_s', 0):.1f} output tok/s; SLO "
                + (", ".join(f"{k} <= {v}" for k, v in sorted((slo.get("targets") or {})
                                                               .items())) or "none")
                + ": attainment "
                + ("-" if slo.get("attainment") is None else f"{slo['attainment']:.1%}"))
        + "</p>")
    rows = [[name] + [(s.get(key) or {}).get(q) for q in ("p50", "p90", "p99", "mean")]
            for key, name in (("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"),
                              ("itl_s", "ITL (s)"), ("e2e_s", "E2E (s)"),
                              ("queue_s", "queue (s)"))]
    lines.append(P.table("summary", ["metric", "p50", "p90", "p99", "mean"], rows,
                         text_cols=(0,)))
    lines.append(_not_ok(recs))
    if s.get("replicas"):
        lines.append(_replica_table(s["replicas"]))
    return "\n".join(lines)


def _not_ok(records: Sequence[dict]) -> str:
    errors = Counter((r["status"], r["error"] or "") for r in records if r["status"] != "ok")
    if not errors:
        return "<p class='note'>every request finished ok; the charts show all of them.</p>"
    rows = [[st, err, n] for (st, err), n in sorted(errors.items(), key=lambda e: (-e[1], e[0]))]
    return ("<p class='note'>the latency charts show ok requests only; the others, by "
            "error:</p>" + P.table("not-ok", ["status", "error", "requests"], rows,
                                   text_cols=(0, 1)))


def _replica_table(replicas: dict) -> str:
    rows = []
    for rid in sorted(replicas):
        r = replicas[rid]
        st = r.get("status") or {}
        rows.append([rid, r.get("kind"), r.get("pool"), r.get("gpus"), r.get("requests"),
                     st.get("ok"), (r.get("ttft_s") or {}).get("p50"),
                     (r.get("ttft_s") or {}).get("p99"), (r.get("e2e_s") or {}).get("p99"),
                     (r.get("slo") or {}).get("attainment")])
    return P.table("replicas", ["replica", "kind", "pool", "GPUs", "requests", "ok",
                                "TTFT p50 (s)", "TTFT p99 (s)", "E2E p99 (s)", "SLO attainment"],
                   rows, text_cols=(0, 1, 2))


def cdf_traces(fig, groups: Sequence[tuple[str, Sequence[dict]]]) -> None:
    """One CDF line per (label, records) group in each of the three columns."""
    import plotly.graph_objects as go

    for n, (label, recs) in enumerate(groups):
        color = P.COLORS[n % len(P.COLORS)]
        for col, (key, name) in enumerate(METRICS, 1):
            x, y = P.cdf(ok_values(recs, key))
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=label, legendgroup=label,
                                     showlegend=col == 1, line={"color": color},
                                     hovertemplate=f"{name} %{{x:.1f}} ms: %{{y:.3f}}"),
                          row=1, col=col)
    for col, (_, name) in enumerate(METRICS, 1):
        fig.update_xaxes(title_text=f"{name} (ms)", type="log", row=1, col=col)
    fig.update_yaxes(title_text="share of requests", row=1, col=1)


def _cdf_figure(records: Sequence[dict]) -> str:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=[f"{n} CDF" for _, n in METRICS])
    pools = sorted({r["pool"] for r in records if r.get("pool")})
    groups = [("all requests", records)]
    if len(pools) > 1:
        groups += [(f"pool {p}", [r for r in records if r.get("pool") == p]) for p in pools]
    cdf_traces(fig, groups)
    fig.update_layout(height=380, width=1300, margin={"t": 40})
    return P.figure_div(fig, "cdf")


def kv_use(run: Run, replica: str, cols: dict[str, list[float]]) -> list[float]:
    """KV allocated as a share of the pool: the summary's capacity, or (a fleet replica) the
    pool free at the first sample."""
    cap = (run.summary.get("memory") or {}).get("capacity_tokens") if not replica else None
    alloc = cols.get("kv_allocated_tokens") or []
    if not cap and alloc:
        cap = alloc[0] + (cols.get("kv_largest_free_run") or [0])[0]
    return [None if a is None else round(a / cap, 5) for a in alloc] if cap else []


def series_figure(run: Run, div_id: str, title_prefix: str = "") -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[f"{title_prefix}running requests",
                                        f"{title_prefix}waiting (queue length)",
                                        f"{title_prefix}KV use (share of the pool)"])
    for n, replica in enumerate(sorted(run.series)):
        cols, label = run.series[replica], replica or "server"
        color = P.COLORS[n % len(P.COLORS)]
        for row, ys in ((1, cols.get("running")), (2, cols.get("waiting")),
                        (3, kv_use(run, replica, cols))):
            xs, ys = thin_max(cols["t_s"], ys or [])
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label,
                                     legendgroup=label, showlegend=row == 1,
                                     line={"color": color, "shape": "hv"}), row=row, col=1)
    fig.update_yaxes(tickformat=".0%", row=3, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=3, col=1)
    fig.update_layout(height=620, width=1300, margin={"t": 40})
    return P.figure_div(fig, div_id)


SERIES_POINTS = 3000  # a longer series is drawn as the maximum of each run of samples


def thin_max(xs: list, ys: list, points: int = SERIES_POINTS) -> tuple[list, list]:
    """At most `points` samples: each the first time and the largest value of a run of
    consecutive samples (peaks survive; a day at one sample a second stays a few MB)."""
    if len(ys) <= points:
        return list(xs), list(ys)
    per = -(-len(ys) // points)
    out_x, out_y = [], []
    for i in range(0, len(ys), per):
        chunk = [y for y in ys[i:i + per] if y is not None]
        out_x.append(xs[i])
        out_y.append(max(chunk) if chunk else None)
    return out_x, out_y


def _series_figure(run: Run) -> str:
    if not run.series:
        return ("<p class='note'>no timeseries.csv in this directory (a live replay writes "
                "none): no time series.</p>")
    return series_figure(run, "series")


def prompt_class(tokens: int) -> str:
    for bound, label in PROMPT_CLASSES:
        if bound is None or tokens < bound:
            return label
    return PROMPT_CLASSES[-1][1]


def _classes(records: Sequence[dict]) -> list[tuple[str, str, Callable[[dict], bool]]]:
    """(kind, label, member test) for each class present, in a fixed order."""
    out = [("priority", f"tier {p}", lambda r, p=p: r["priority"] == p)
           for p in sorted({r["priority"] for r in records})]
    present = {prompt_class(r["prompt_tokens"]) for r in records}
    out += [("prompt", f"prompt {label}", lambda r, label=label: prompt_class(
        r["prompt_tokens"]) == label) for _, label in PROMPT_CLASSES if label in present]
    out += [("replica", f"replica {x}", lambda r, x=x: r.get("replica") == x)
            for x in sorted({r["replica"] for r in records if r.get("replica")})]
    return out


def _class_figure(records: Sequence[dict]) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    kinds = [k for k in ("priority", "prompt") if any(c[0] == k for c in _classes(records))]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["by priority tier",
                                                        "by prompt length (tokens)"])
    for col, kind in enumerate(kinds, 1):
        classes = [c for c in _classes(records) if c[0] == kind]
        labels = [c[1] for c in classes]
        for n, (key, name, q) in enumerate((("ttft_s", "TTFT", 50), ("ttft_s", "TTFT", 99),
                                            ("e2e_s", "E2E", 99))):
            ys = [P.pct(ok_values([r for r in records if c[2](r)], key), q) for c in classes]
            fig.add_trace(go.Bar(x=labels, y=[None if y is None else y * 1e3 for y in ys],
                                 name=f"{name} p{q}", legendgroup=f"{name}{q}",
                                 showlegend=col == 1, marker={"color": P.COLORS[n]}),
                          row=1, col=col)
        fig.update_yaxes(title_text="ms", type="log", row=1, col=col)
    fig.update_layout(height=380, width=1300, barmode="group", margin={"t": 40})
    return P.figure_div(fig, "classes")


def class_rows(records: Sequence[dict]) -> list[list]:
    rows = []
    for _, label, member in _classes(records):
        recs = [r for r in records if member(r)]
        ok = [r for r in recs if r["status"] == "ok"]
        row: list = [label, len(recs), len(ok), len(recs) - len(ok)]
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            vals = ok_values(ok, key)
            row += [None if (v := P.pct(vals, q)) is None else round(v * 1e3, 3)
                    for q in (50, 99)]
        rows.append(row)
    return rows


def _class_table(records: Sequence[dict]) -> str:
    headers = ["class", "requests", "ok", "not ok"] + [
        f"{m} p{q} (ms)" for m in ("TTFT", "TPOT", "E2E", "queue") for q in (50, 99)]
    return ("<p class='note'>click a column header to sort.</p>"
            + P.table("class-table", headers, class_rows(records), text_cols=(0,)))
