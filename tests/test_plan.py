"""`servetwin plan` (experiments/plan): the load search on a toy space with a known answer,
infeasible candidates refused with numbers, serial == parallel plan.json, resume, bad space
files and SLOs, the ramp's alert rule, and the winner's simulate command replaying it."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.plan.evaluate import Runner, infeasible_reason, measure, search
from experiments.plan.plan import PlanSettings, run_plan
from experiments.plan.prices import DEFAULT_PRICES, load_prices
from experiments.plan.question import WorkloadSource, build_question, parse_slo
from experiments.plan.ramp import three_in_a_row
from experiments.plan.space import Candidate, parse_space
from servetwin.cli import main
from twin.config import ServerArgs
from twin.errors import ConfigError
from twin.monitoring import Window
from twin.sim import SimConfig, simulate

pytestmark = pytest.mark.offline

RATE = 8  # the target: one replica cannot sustain it, two can
SPEC = f"arrival=poisson,rate={RATE},n=300,prompt=uniform:1000:3000,output=uniform:20:60"
MODEL = "meta-llama/Llama-3.1-8B"
GPU = "a100-sxm-80gb"
TOY = {"gpus": [GPU], "tp": [1], "replicas": [1, 2, 3, 4], "models": [MODEL]}


def toy_question(slo: str = "ttft:p99:0.5", precision: float = 0.05):
    src = WorkloadSource("spec", SPEC, 0)
    return src, build_question(src, None, "scale", 1.0, (parse_slo(slo),), precision)


def settings(out: Path, jobs: int = 1, **kw) -> PlanSettings:
    prices, source = load_prices(None, [GPU])
    return PlanSettings(out, jobs, None, prices, source, quiet=True, report=False, **kw)


def direct_meets(q, scale: float) -> bool:
    """The SLO at `scale` from a plain `twin.sim.simulate` run (not the planner's runner)."""
    cfg = SimConfig(args=ServerArgs(model_path=MODEL, tp_size=1), gpu=GPU)
    res = simulate(q.at(scale), cfg)
    return measure(res.records, res.summary, q.slos)["meets_slo"]


def test_the_bisection_finds_the_boundary_within_its_precision():
    _, q = toy_question()
    cand = parse_space(TOY).candidates()[0]  # one replica
    found = search(Runner(cand, q), 0.05)
    lo = found["max_load"]["scale"]
    assert found["at_target"]["meets_slo"] is False and 0 < lo < 1
    hi = found["fails_at"]["scale"]
    assert lo < hi <= lo * 1.05  # the boundary is bracketed within 5 %
    assert direct_meets(q, lo) and not direct_meets(q, hi)
    assert found["max_load"]["rps"] == pytest.approx(lo * RATE)


def test_capacity_grows_with_replicas_and_the_cheapest_meeting_one_wins(tmp_path):
    src, q = toy_question()
    plan = run_plan(q, src, parse_space(TOY), settings(tmp_path, ramp=False))
    rows = plan["candidates"]
    loads = [r["max_load"]["rps"] for r in rows]
    assert loads == sorted(loads) and loads[0] < RATE < loads[1]
    assert [r["at_target"]["meets_slo"] for r in rows] == [False, True, True, True]
    assert plan["winner"] == "c0002"  # two replicas: the cheapest that meets the target
    assert rows[1]["cost_per_hour"] == 2 * DEFAULT_PRICES[GPU]
    assert rows[1]["headroom"] == pytest.approx(loads[1] / RATE - 1, abs=1e-6)
    assert plan["pareto"]["cost_vs_goodput"][0] == "c0001"
    assert (tmp_path / "candidates" / "c0002" / "requests.jsonl").is_file()
    assert "--replicas" not in (tmp_path / "winner.txt").read_text()


def test_infeasible_candidates_are_refused_with_the_numbers():
    _, q = toy_question()
    big = Candidate("c0001", "a100-pcie-80gb", 1, 1, "deepseek-ai/DeepSeek-V3")
    reason = infeasible_reason(big, q)
    assert "does not fit on 1x a100-pcie-80gb" in reason and "GiB" in reason
    short = Candidate("c0002", GPU, 1, 1, MODEL, server_args=(("context_length", 2048),))
    reason = infeasible_reason(short, q)
    assert reason.startswith("context too long:") and "2047 tokens" in reason
    assert infeasible_reason(Candidate("c0003", GPU, 1, 1, MODEL), q) is None


def test_serial_and_parallel_plans_are_byte_identical_and_resume_skips(tmp_path):
    src, q = toy_question()
    space = parse_space({**TOY, "replicas": [1, 2], "policies": ["fcfs", "lpm"]})
    a, b = tmp_path / "serial", tmp_path / "parallel"
    run_plan(q, src, space, settings(a, ramp_step_s=10, window_s=5))
    run_plan(q, src, space, settings(b, jobs=2, ramp_step_s=10, window_s=5))
    text_a = (a / "plan.json").read_text()
    assert text_a.replace(str(a), "DIR") == (b / "plan.json").read_text().replace(str(b), "DIR")
    assert json.loads(text_a)["ramp"]["steps"][-1]["load_pct"] == 200
    before = {p.name: p.stat().st_mtime_ns for p in (a / "candidates").glob("*.json")}
    assert len(before) == 4
    run_plan(q, src, space, settings(a, ramp_step_s=10, window_s=5))
    after = {p.name: p.stat().st_mtime_ns for p in (a / "candidates").glob("*.json")}
    assert after == before  # nothing re-evaluated
    assert (a / "plan.json").read_text() == text_a
    _, other = toy_question(slo="ttft:p99:0.4")
    with pytest.raises(ConfigError, match=r"another question \(slo_names: .*0\.5.*0\.4"):
        run_plan(other, src, space, settings(a))
    with pytest.raises(ConfigError, match="candidate c0002 there is .* the search space"):
        run_plan(q, src, parse_space({**TOY, "replicas": [1, 3]}), settings(a))


def test_a_plan_on_a_local_ray_is_byte_identical_to_the_serial_one(tmp_path):
    """`--ray local`: the same groups as Ray tasks on a Ray started on loopback."""
    if os.environ.get("SERVETWIN_CI") != "1":  # in CI the test extra must have brought it
        pytest.importorskip("ray", reason="the ray extra is not installed")
    src, q = toy_question()
    space = parse_space({**TOY, "replicas": [1, 2], "policies": ["fcfs", "lpm"]})
    a, b = tmp_path / "serial", tmp_path / "ray"
    run_plan(q, src, space, settings(a, ramp_step_s=10, window_s=5))
    run_plan(q, src, space, replace(settings(b, ramp_step_s=10, window_s=5), ray="local"))
    import ray

    assert not ray.is_initialized()  # the run shut down the Ray it started
    text_a = (a / "plan.json").read_text()
    assert text_a.replace(str(a), "DIR") == (b / "plan.json").read_text().replace(str(b), "DIR")
    assert len(json.loads(text_a)["candidates"]) == 4


@pytest.mark.parametrize("doc,where", [
    ("gpus: [a100-pcie-80gb]\ntpp: [1]\n", r"space.yaml:2: tpp: unknown key; allowed: gpus"),
    ("gpus: [a100-pcie-80gb, b200]\n", r"space.yaml:1: gpus\[1\]: 'b200': allowed values: "
     r"a100-pcie-80gb"),
    ("tp: [2]\nserver_args:\n  chunk_size: [1024]\n",
     r"space.yaml:3: server_args.chunk_size: not an SGLang server argument .*"
     r"chunked_prefill_size"),
    ("server_args:\n  max_running_requests: [8, -1]\n",
     r"space.yaml:2: server_args.max_running_requests\[1\]: --max-running-requests -1"),
    ("policies: [fcfs, fifo]\n", r"policies\[1\]: 'fifo': allowed values: .*lpm"),
    ("replicas: [0]\n", r"replicas\[0\]: 0: must be an integer from 1 to 1024"),
    ("server_args:\n  tp_size: [2]\n", r"server_args.tp_size: set by the space's own key 'tp'"),
])
def test_bad_space_files_name_the_file_line_and_key(tmp_path, doc, where):
    from experiments.plan.space import load_space

    path = tmp_path / "space.yaml"
    path.write_text(doc)
    with pytest.raises(ConfigError, match=where):
        load_space(path)


@pytest.mark.parametrize("text,problem", [
    ("ttft:p95:1.5", "stat 'p95': allowed values: p50, p90, p99, attainment"),
    ("latency:p99:1.5", "metric 'latency': allowed values: ttft, tpot, e2e"),
    ("ttft:attainment:1.5", "attainment needs a TARGET"),
    ("ttft:p99:1.5:vip=1", "allowed qualifiers: tier=N, prompt<N"),
])
def test_bad_slos_are_refused(text, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_slo(text)


def test_an_slo_covers_its_tier_and_prompt_range_and_counts_misses():
    s = parse_slo("ttft:attainment:1:0.5:tier=10:prompt<100")
    assert (s.share, s.tier, s.max_prompt_tokens, s.name) == (
        0.5, 10, 100, "ttft:attainment:1:0.5:tier=10:prompt<100")
    rec = {"priority": 10, "prompt_tokens": 50, "status": "ok", "ttft_s": 0.9}
    assert s.covers(rec) and s.met_by(rec)
    assert not s.covers({**rec, "priority": 0}) and not s.covers({**rec, "prompt_tokens": 100})
    assert not s.met_by({**rec, "status": "rejected"})


def test_three_windows_in_a_row_fire_and_resolve():
    p99s = [0.5, 2.0, 2.0, None, 2.0, 2.0, 1.0, 2.0]
    windows = [Window(60.0 * i, 60.0 * (i + 1), v, 0 if v is None else 5)
               for i, v in enumerate(p99s)]
    # the monitoring's rule: an empty window is not above (Prometheus' NaN), so the first
    # run of two high windows does not fire; the second fires at the end of its third
    assert three_in_a_row(windows, 1.5) == []
    p99s[3] = 2.0
    windows = [Window(60.0 * i, 60.0 * (i + 1), v, 5) for i, v in enumerate(p99s)]
    alerts = three_in_a_row(windows, 1.5)
    assert [(a["since_s"], a["start_s"], a["end_s"]) for a in alerts] == [(60.0, 240.0, 420.0)]
    assert alerts[0]["rule"] == "ttft_p99_three_windows" and alerts[0]["peak_s"] == 2.0


def test_the_cli_plan_and_the_winners_simulate_command_replay_the_same_records(tmp_path,
                                                                            capsys):
    space = tmp_path / "space.json"
    space.write_text(json.dumps({**TOY, "replicas": [1, 2]}))
    out = tmp_path / "plan"
    rc = main(["plan", "--workload", SPEC, "--space", str(space), "--slo", "ttft:p99:0.5",
               "--out", str(out), "--jobs", "1", "--quiet", "--ramp-step-s", "10",
               "--no-report"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "winner: c0002 2x a100-sxm-80gb TP1 fcfs" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["question"]["target"] == {"kind": "scale", "value": 1.0, "rps": float(RATE)}
    lines = (out / "winner.txt").read_text().splitlines()
    cmd = shlex.split(next(x for x in lines if x.startswith("servetwin simulate")))
    assert "--deployment" in cmd
    cmd[cmd.index("--out") + 1] = str(tmp_path / "again")
    assert main(cmd[1:]) == 0
    assert (tmp_path / "again" / "requests.jsonl").read_bytes() == \
        (out / "candidates" / "c0002" / "requests.jsonl").read_bytes()
    assert any(x.startswith("python -m sglang_router.launch_router") for x in lines)


def test_prices_file_must_cover_the_space(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"h100-sxm-80gb": 2.5}))
    with pytest.raises(ConfigError, match="no price for a100-sxm-80gb"):
        load_prices(path, [GPU, "h100-sxm-80gb"])
    path.write_text(json.dumps({"h100": 2.5}))
    with pytest.raises(ConfigError, match="key 'h100': not a GPU"):
        load_prices(path, [GPU])


def test_a_twin_only_policy_launches_through_the_plugin():
    from experiments.plan.commands import launch_command

    cand = replace(Candidate("c0001", GPU, 1, 1, MODEL), policy="slices")
    text = launch_command(cand)
    assert "SERVETWIN_POLICY=slices" in text and "sglang.launch_server" in text


def test_the_ramp_reads_each_step_against_the_slo_it_covers():
    from types import SimpleNamespace

    from experiments.plan.ramp import analyse

    def rec(t: float, prompt: int, ttft: float) -> dict:
        return {"arrival_s": t, "prompt_tokens": prompt, "priority": 0, "status": "ok",
                "ttft_s": ttft, "tpot_s": 0.01, "e2e_s": ttft + 1}

    records = [rec(1.0 + i, 500, 0.1) for i in range(5)] + [rec(2.5, 20_000, 5.0)]
    records += [rec(11.0 + i, 500, 2.0) for i in range(5)]
    q = SimpleNamespace(slos=(parse_slo("ttft:p99:1.5:prompt<10000"),), target_rps=1.0)
    ramp = analyse(records, q, step_s=10, window_s=5, pcts=(25, 50))
    assert [s["meets"]["ttft:p99:1.5:prompt<10000"] for s in ramp["steps"]] == [True, False]
    assert ramp["first_break"] == {"ttft:p99:1.5:prompt<10000": 50}
    assert ramp["steps"][0]["ttft_p99_s"] == 0.1 and ramp["steps"][0]["ttft_p99_all_s"] == 5.0
    assert [w["ttft_p99_s"] for w in ramp["windows"]] == [0.1, 0.1, 2.0, 2.0]  # shorts only
