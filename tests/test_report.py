"""The HTML reports (experiments/report) offline: real `servetwin simulate --out` runs and a
real plan directory built from them, rendered, checked for every chart's data, byte-identical
output and clear errors on bad input. The browser test is tests/test_report_browser.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from experiments.report import write_plan_report, write_run_report
from experiments.report.inputs import ReportInputError
from experiments.report.run_page import class_rows, prompt_class, thin_max
from servetwin.cli import main

pytestmark = pytest.mark.offline

SPEC = "arrival=poisson,rate={rate},n={n},prompt={prompt},output=uniform:20:60,tiers=0:0.8/10:0.2"
SHORT = "lognormal:800:0.7"
TARGET_RPS, SLO_S, RAMP_STEP_S, WINDOW_S = 8.0, 1.5, 8.0, 2.0
RAMP_STEPS = (0.25, 0.5, 1.0, 1.5, 2.0)
PRICES = {"a100-pcie-80gb": 1.6, "h100-sxm-80gb": 3.0}
# (id, gpu, tp, model): the candidates of the test plan; DeepSeek-V3 at TP 1 does not fit.
CANDIDATES = (("c0001", "a100-pcie-80gb", 2, "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
              ("c0002", "a100-pcie-80gb", 1, "Qwen/Qwen3-8B"),
              ("c0003", "h100-sxm-80gb", 2, "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
              ("c0004", "a100-pcie-80gb", 1, "deepseek-ai/DeepSeek-V3"),
              ("c0005", "h100-sxm-80gb", 1, "Qwen/Qwen3-8B"))


def simulate(out: Path, *args: str) -> str:
    """`servetwin simulate ... --out out` in this process; its stdout, or raises on failure."""
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(["simulate", *args, "--out", str(out)])
    if rc:
        raise ReportInputError(err.getvalue().strip().splitlines()[-1].split(" error: ", 1)[-1])
    return buf.getvalue()


def sim_args(gpu: str, tp: int, model: str, workload: str) -> list[str]:
    return ["--gpu", gpu, "--tp-size", str(tp), "--model-path", model, "--workload", workload,
            "--seed", "1", "--slo-ttft", str(SLO_S)]


def figures(page: str) -> dict[str, list[dict]]:
    """Each `Plotly.newPlot(id, data, ...)` of the page: its div id and its traces."""
    out, dec = {}, json.JSONDecoder()
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', page):
        out[m.group(1)], _ = dec.raw_decode(page, m.end())
    return out


def _p99(values: list[float]) -> float | None:
    return round(float(np.percentile(values, 99)), 6) if values else None


def _at_target(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    recs = [json.loads(x) for x in (run / "requests.jsonl").read_text().splitlines()]
    good = sum(r["status"] == "ok" and r["ttft_s"] <= SLO_S for r in recs)
    return {"ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
            "tpot_p50_s": s["tpot_s"]["p50"], "tpot_p99_s": s["tpot_s"]["p99"],
            "e2e_p99_s": s["e2e_s"]["p99"], "throughput_rps": s["throughput"]["requests_per_s"],
            "goodput_rps": round(good / s["duration_s"], 6),
            "slo_attainment": s["slo"]["attainment"],
            "meets_slo": s["ttft_s"]["p99"] is not None and s["ttft_s"]["p99"] <= SLO_S}


def _candidate(root: Path, scratch: Path, cid: str, gpu: str, tp: int, model: str) -> dict:
    """Run the candidate at 0.5x, 1x and 2x the target (the 1x run into candidates/<id>)."""
    args = sim_args(gpu, tp, model, SPEC.format(rate=TARGET_RPS, n=60, prompt=SHORT))
    cand = {"id": cid, "label": f"1x {gpu} TP{tp} {model.split('/')[-1]} fcfs",
            "config": {"gpu": gpu, "tp": tp, "replicas": 1, "model": model,
                       "quantization": None, "server_args": {}, "policy": "fcfs",
                       "kv_allocator": "token", "router": "round_robin"},
            "gpus": tp, "cost_per_hour": round(PRICES[gpu] * tp, 6),
            "simulate_command": "servetwin simulate " + " ".join(args), "launch_command": None}
    try:
        simulate(root / "candidates" / cid, *args)
    except Exception as exc:  # the twin refused it: infeasible, with its numbers
        return {**cand, "status": "infeasible", "reason": str(exc), "at_target": None,
                "max_load": {"scale": None, "rps": None}, "headroom": None, "artifacts": None}
    at = _at_target(root / "candidates" / cid)
    ok_scales = [1.0] if at["meets_slo"] else []
    for scale in (0.5, 2.0):
        out = scratch / f"{cid}-{scale}"
        simulate(out, *sim_args(gpu, tp, model, SPEC.format(rate=TARGET_RPS * scale, n=60,
                                                             prompt=SHORT)))
        if _at_target(out)["meets_slo"]:
            ok_scales.append(scale)
    best = max(ok_scales, default=None)
    rps = None if best is None else round(best * TARGET_RPS, 6)
    return {**cand, "status": "ok", "reason": None, "at_target": at,
            "max_load": {"scale": best, "rps": rps},
            "headroom": None if rps is None else round(rps / TARGET_RPS - 1, 6),
            "artifacts": f"candidates/{cid}"}


def _front(cands: list[dict], key: str, lower: bool) -> list[str]:
    """Ids not dominated in (cost, key): lower cost and lower (or higher) key."""
    ok = [c for c in cands if c["at_target"]]
    sign = 1 if lower else -1

    def dominated(c):
        return any(o["cost_per_hour"] <= c["cost_per_hour"]
                   and sign * o["at_target"][key] <= sign * c["at_target"][key]
                   and o is not c and (o["cost_per_hour"], sign * o["at_target"][key])
                   != (c["cost_per_hour"], sign * c["at_target"][key]) for o in ok)
    return sorted(c["id"] for c in ok if not dominated(c))


def _ramp(root: Path, winner: dict) -> dict:
    """The winner through a stepped ramp to 200 % of the target: P99 per step, per window,
    and the alert "P99 TTFT > SLO in three windows in a row"."""
    steps = ":".join(str(s) for s in RAMP_STEPS)
    spec = (f"arrival=ramp,rate={TARGET_RPS},steps={steps},step_s={RAMP_STEP_S},"
            f"prompt={SHORT},output=uniform:20:60,tiers=0:0.8/10:0.2")
    cfg = winner["config"]
    simulate(root / "ramp", *sim_args(cfg["gpu"], cfg["tp"], cfg["model"], spec))
    recs = [json.loads(x) for x in (root / "ramp" / "requests.jsonl").read_text().splitlines()]
    out = []
    for i, frac in enumerate(RAMP_STEPS):
        sel = [r for r in recs if i * RAMP_STEP_S <= r["arrival_s"] < (i + 1) * RAMP_STEP_S]
        ok = [r for r in sel if r["status"] == "ok"]
        row = {"load_pct": round(frac * 100), "rps": round(len(sel) / RAMP_STEP_S, 6)}
        for key in ("ttft", "tpot", "e2e"):
            row[f"{key}_p99_s"] = _p99([r[f"{key}_s"] for r in ok if r[f"{key}_s"] is not None])
        row["meets"] = {"ttft_p99": row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= SLO_S}
        out.append(row)
    broken = [s["load_pct"] for s in out if not s["meets"]["ttft_p99"]]
    n_win = math.ceil(len(RAMP_STEPS) * RAMP_STEP_S / WINDOW_S)
    windows = []
    for w in range(n_win):
        t0, t1 = w * WINDOW_S, (w + 1) * WINDOW_S
        ttft = [r["ttft_s"] for r in recs if t0 <= r["arrival_s"] < t1 and r["status"] == "ok"]
        windows.append({"start_s": t0, "end_s": t1, "ttft_p99_s": _p99(ttft)})
    return {"candidate": winner["id"], "slo_s": SLO_S, "steps": out,
            "first_break": {"ttft_p99": broken[0] if broken else None},
            "windows": windows, "alerts": _alerts(windows)}


def _alerts(windows: list[dict]) -> list[dict]:
    """Each run of three or more windows in a row over the SLO: from its first window's start
    to its last window's end (None while it lasts to the end)."""
    alerts, run = [], 0
    for n, w in enumerate(windows):
        run = run + 1 if (w["ttft_p99_s"] or 0) > SLO_S else 0
        if run == 3:
            alerts.append({"rule": "ttft_p99 > 1.5 s in 3 windows in a row",
                           "start_s": windows[n - 2]["start_s"], "end_s": None})
        if run == 0 and alerts and alerts[-1]["end_s"] is None:
            alerts[-1]["end_s"] = windows[n - 1]["end_s"]
    return alerts


def build_plan_dir(root: Path) -> Path:
    """A real plan directory per the plan output contract: each candidate simulated by the
    twin (the infeasible one refused by it), plan.json written from their summaries."""
    root.mkdir(parents=True, exist_ok=True)
    cands = [_candidate(root, root / "scratch", *c) for c in CANDIDATES]
    meeting = [c for c in cands if c["at_target"] and c["at_target"]["meets_slo"]]
    winner = min(meeting, key=lambda c: (c["cost_per_hour"], c["id"]), default=None)
    plan = {"version": 1,
            "question": {"workload": "test-poisson", "seed": 1, "precision": 0.5,
                         "target": {"kind": "rps", "value": TARGET_RPS, "rps": TARGET_RPS},
                         "slos": [{"metric": "ttft", "stat": "p99", "threshold_s": SLO_S,
                                   "target": None, "tier": None}]},
            "prices": {**PRICES, "source": "tests/test_report.py (test prices)"},
            "candidates": cands, "winner": winner["id"] if winner else None,
            "pareto": {"cost_vs_ttft_p99": _front(cands, "ttft_p99_s", True),
                       "cost_vs_goodput": _front(cands, "goodput_rps", False)},
            "ramp": _ramp(root, winner) if winner else None}
    (root / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
    if winner:
        (root / "winner.txt").write_text(winner["simulate_command"] + "\n")
    return root


def run_real_plan(out: Path) -> Path:
    """A tiny real `servetwin plan` (experiments/plan): Qwen3-8B and DeepSeek-V3 (which does
    not fit) on A100 PCIe at TP 1 and 2, its ramp to 200 % breaking the SLO; it writes
    report.html itself through write_plan_report."""
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(["plan", "--workload", SPEC.format(rate=8, n=60, prompt=SHORT).replace(
            ",n=60", ""), "--target-rps", "14", "--requests", "60", "--gpus", "a100-pcie-80gb",
            "--tp", "1,2", "--replicas", "1", "--models", "Qwen/Qwen3-8B,deepseek-ai/DeepSeek-V3",
            "--ramp-step-s", "5", "--window-s", "1", "--jobs", "1", "--quiet", "--out", str(out)])
    assert rc == 0, err.getvalue()
    return out


@pytest.fixture(scope="module")
def real_plan_dir(tmp_path_factory) -> Path:
    return run_real_plan(tmp_path_factory.mktemp("real") / "plan")


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    return build_plan_dir(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A single server with some prompts longer than Qwen3-8B's context: rejected ones."""
    out = tmp_path_factory.mktemp("run") / "sim"
    simulate(out, *sim_args("a100-pcie-80gb", 1, "Qwen/Qwen3-8B", SPEC.format(
        rate=4, n=50, prompt="empirical:300:2000:6000:50000")))
    return out


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet") / "f"
    simulate(out, "--deployment", "finance-hybrid", "--seed", "1", "--workload",
             SPEC.format(rate=3, n=40, prompt=SHORT))
    return out


def test_simulate_report_every_chart_has_the_runs_data(run_dir):
    page = write_run_report(run_dir).read_text()
    recs = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in recs if r["status"] == "ok"]
    assert 0 < len(ok) < len(recs)  # the long prompts were rejected
    figs = figures(page)
    assert sorted(figs) == ["cdf", "classes", "series"]
    ttft = next(t for t in figs["cdf"] if t["xaxis"] == "x")
    assert len(ttft["x"]) == len(ok) and ttft["y"][-1] == 1.0
    assert sorted(ttft["x"]) == ttft["x"]
    series = figs["series"]
    assert {t["name"] for t in series} == {"server"} and all(len(t["y"]) > 1 for t in series)
    kv = series[2]["y"]
    assert all(0 <= v <= 1 for v in kv) and max(kv) > 0
    assert "<script src" not in page and "plotly.js v" in page  # plotly.js inline
    not_ok = len(recs) - len(ok)
    assert f"rejected {not_ok}" in page and "<table id='not-ok'" in page


def test_class_rows_count_every_request_once_per_kind(run_dir):
    recs = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    rows = class_rows(recs)
    tiers = [r for r in rows if r[0].startswith("tier")]
    prompts = [r for r in rows if r[0].startswith("prompt")]
    assert sum(r[1] for r in tiers) == sum(r[1] for r in prompts) == len(recs)
    assert [r[0] for r in tiers] == ["tier 0", "tier 10"]
    assert all(r[1] == r[2] + r[3] for r in rows)
    long = next(r for r in prompts if r[0] == "prompt >=32k")
    assert long[2] == 0 and long[4] is None  # rejected: no latency, not a zero


def test_prompt_classes():
    assert [prompt_class(n) for n in (10, 1023, 1024, 10239, 10240, 40000)] == [
        "<1k", "<1k", "1k-4k", "4k-10k", "10k-32k", ">=32k"]


def test_long_series_keep_their_peaks():
    xs, ys = list(range(10)), [0, 5, 1, None, None, 2, 9, 0, 3, 0]
    assert thin_max(xs, ys, 10) == (xs, ys)
    assert thin_max(xs, ys, 4) == ([0, 3, 6, 9], [5, 2, 9, 0])


def test_fleet_report_draws_a_line_per_replica(fleet_dir):
    page = write_run_report(fleet_dir, fleet_dir / "other.html").read_text()
    series = figures(page)["series"]
    replicas = sorted(json.loads((fleet_dir / "summary.json").read_text())["replicas"])
    assert sorted({t["name"] for t in series}) == replicas
    assert "<table id='replicas'" in page
    assert not (fleet_dir / "report.html").exists()


def test_same_inputs_byte_identical_html(run_dir, tmp_path):
    """The same simulation run again (same seed, same directory name) gives the same page."""
    a = write_run_report(run_dir, tmp_path / "a.html").read_bytes()
    again = tmp_path / "again" / run_dir.name
    simulate(again, *sim_args("a100-pcie-80gb", 1, "Qwen/Qwen3-8B", SPEC.format(
        rate=4, n=50, prompt="empirical:300:2000:6000:50000")))
    assert write_run_report(again, tmp_path / "b.html").read_bytes() == a


def test_plan_report_has_every_chart_and_candidate(plan_dir):
    plan = json.loads((plan_dir / "plan.json").read_text())
    page = write_plan_report(plan_dir).read_text()
    figs = figures(page)
    assert sorted(figs) == ["capacity", "pareto", "plan-cdf", "ramp", "winner-series"]
    assert all(t.get("x") or t.get("y") for f in figs.values() for t in f)
    assert plan["winner"] == "c0002"  # the cheapest meeting the SLO at 8 req/s
    ok = [c for c in plan["candidates"] if c["status"] == "ok"]
    bars = figs["capacity"][0]
    assert len(bars["x"]) == len(ok)
    winner_marks = [t for t in figs["pareto"] if t["name"] == "winner"]
    assert [t["text"] for t in winner_marks] == [["c0002"], ["c0002"]]
    rows = re.findall(r"<tr class='(\w*)'><td class='t'>(c\d+)</td>", page)
    assert [cid for _, cid in rows] == [c["id"] for c in plan["candidates"]]
    assert ("win", "c0002") in rows and ("bad", "c0004") in rows
    infeasible = next(c for c in plan["candidates"] if c["status"] == "infeasible")
    assert "does not fit" in infeasible["reason"] or "weights" in infeasible["reason"]
    assert infeasible["reason"][:40] in page.replace("&#x27;", "'")
    ramp = plan["ramp"]
    assert ramp["first_break"]["ttft_p99"] is not None and ramp["alerts"]
    layout_shapes = page.count('"type":"rect"')
    assert layout_shapes >= len(ramp["alerts"])


def test_plan_report_byte_identical(plan_dir, tmp_path):
    a = write_plan_report(plan_dir, tmp_path / "a.html").read_bytes()
    b = write_plan_report(plan_dir, tmp_path / "b.html").read_bytes()
    assert a == b


def test_cli_report_picks_the_page_by_directory(plan_dir, run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "--html", str(tmp_path / "r.html")]) == 0
    assert "simulate report" in capsys.readouterr().out
    assert "servetwin simulate report" in (tmp_path / "r.html").read_text()[-200000:]
    assert main(["report", str(plan_dir), "--html", str(tmp_path / "p.html")]) == 0
    assert "plan report" in capsys.readouterr().out
    assert "id='candidates'" in (tmp_path / "p.html").read_text()


def _copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("requests.jsonl", "summary.json", "timeseries.csv"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.mark.parametrize("name, edit, message", [
    ("summary.json", None, "summary.json: missing"),
    ("summary.json", lambda t: t[:-3], "summary.json:"),
    ("timeseries.csv", lambda t: t.replace("\n0,", "\nzero,", 1), "column 't_s': 'zero'"),
    ("timeseries.csv", lambda t: t.replace("\n0,", "\n0,1,", 1), ":2: 11 cells, the header has 10"),
    ("requests.jsonl", lambda t: t.replace("{", "[", 1), "requests.jsonl:1"),
    ("requests.jsonl", lambda t: t.replace('"status":"ok"', '"status":"fine"', 1), "status"),
])
def test_bad_run_directory_names_file_line_and_key(run_dir, tmp_path, name, edit, message,
                                                   capsys):
    d = _copy_run(run_dir, tmp_path / "bad")
    if edit is None:
        (d / name).unlink()
    else:
        (d / name).write_text(edit((d / name).read_text()))
    assert main(["report", str(d)]) == 2
    assert message in capsys.readouterr().err


def _edit_plan(plan_dir: Path, tmp_path: Path, change) -> Path:
    d = tmp_path / "p"
    d.mkdir()
    plan = json.loads((plan_dir / "plan.json").read_text())
    change(plan)
    (d / "plan.json").write_text(json.dumps(plan))
    return d


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("pareto"), "key 'pareto': missing"),
    (lambda p: p["candidates"][1].pop("cost_per_hour"), "'candidates[1].cost_per_hour'"),
    (lambda p: p["candidates"][0].update(status="fine"), "is not one of ok, infeasible, error"),
    (lambda p: p.update(winner="c9999"), "key 'winner': 'c9999' is not a candidate id"),
    (lambda p: p["ramp"]["steps"][0].update(ttft_p99_s="slow"), "'ramp.steps[0].ttft_p99_s'"),
    (lambda p: p["candidates"][1]["at_target"].update(meets_slo=1), "meets_slo"),
    (lambda p: p.update(version=2), "key 'version': 2"),
])
def test_bad_plan_json_names_the_key(plan_dir, tmp_path, change, message, capsys):
    d = _edit_plan(plan_dir, tmp_path, change)
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err
    assert "plan.json" in err and message in err


def test_real_plan_writes_its_report(real_plan_dir, tmp_path):
    plan = json.loads((real_plan_dir / "plan.json").read_text())
    page = (real_plan_dir / "report.html").read_bytes()
    assert write_plan_report(real_plan_dir, tmp_path / "again.html").read_bytes() == page
    figs = figures(page.decode())
    assert sorted(figs) == ["capacity", "pareto", "plan-cdf", "ramp", "winner-series"]
    assert plan["winner"] and len(figs["capacity"][0]["x"]) == sum(
        c["status"] == "ok" for c in plan["candidates"])
    text = page.decode().replace("&#x27;", "'")
    for c in plan["candidates"]:
        if c["status"] != "ok":
            assert c["reason"] and c["reason"] in text
    ramp = plan["ramp"]
    assert any(v is not None for v in ramp["first_break"].values()) and ramp["alerts"]
    assert text.count('"type":"rect"') >= len(ramp["alerts"])


def test_run_without_timeseries_says_so(run_dir, tmp_path):
    d = _copy_run(run_dir, tmp_path / "no-series")
    (d / "timeseries.csv").unlink()
    page = write_run_report(d).read_text()
    assert sorted(figures(page)) == ["cdf", "classes"] and "no timeseries.csv" in page


def test_plan_with_no_winner_shows_the_ramped_candidate(plan_dir, tmp_path):
    """None meets the SLOs (the users' question at peak): no star, attainment bars only,
    the ramp's candidate over time instead of a winner."""
    import shutil

    d = tmp_path / "none"
    shutil.copytree(plan_dir, d)
    plan = json.loads((d / "plan.json").read_text())
    for c in plan["candidates"]:
        c["max_load"] = {"scale": None, "rps": None}
        if c["at_target"]:
            c["at_target"]["meets_slo"] = False
    plan["winner"], plan["ramp"]["candidate"] = None, "c0003"
    (d / "plan.json").write_text(json.dumps(plan))
    page = write_plan_report(d).read_text()
    figs = figures(page)
    assert not [t for t in figs["pareto"] if t["name"] == "winner"]
    assert len(figs["capacity"]) == 1 and "no max-load bars" in page
    assert "c0003: running requests" in page and "no candidate meets every SLO" in page


def test_plan_says_which_listed_runs_are_missing(plan_dir, tmp_path):
    import shutil

    d = tmp_path / "gone"
    shutil.copytree(plan_dir, d)
    (d / "candidates" / "c0005" / "requests.jsonl").unlink()
    page = write_plan_report(d).read_text()
    cdf_names = {t["name"] for t in figures(page)["plan-cdf"]}
    assert "c0005" not in cdf_names and "c0003" in cdf_names
    assert "no requests.jsonl on disk: c0005" in page
