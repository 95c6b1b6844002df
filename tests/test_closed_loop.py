"""The twin's closed-loop client models (twin/workload.py CLIENTS, twin/source.py): servetwin's
replay client (`clients=replay`, the default) and SGLang bench_serving's (`clients=bench`:
its warm-up copy of the first request, left in the radix cache, then 1 s, then the loop),
and bench_serving's own random-ids draw (runtime/emulator/agreement.py `bench_prompts`).

The live tests run the CPU harness's real bench_serving: its sampler against our copy of
it, and its closed loop of 8 clients against `servetwin emulate` beside `simulate` with both
client models (benchmarks/closed_loop.py measures 1/4/8/16 clients)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from runtime.emulator.agreement import HARNESS, ClosedLoop, bench_serving, simulated
from twin.config import ServerArgs
from twin.errors import ConfigError
from twin.metrics import write_records
from twin.request_path import RequestPath
from twin.sim import SimConfig, simulate
from twin.source import Source
from twin.workload import BENCH_WARMUP_GAP_S, BENCH_WARMUP_OUTPUT, WARMUP_RID, Workload, from_spec

SPEC = "arrival=closed,concurrency=8,n=24,prompt=fixed:512,output=fixed:40"
# the emulator's default deployment: DeepSeek-R1-Distill-Qwen-32B on 2x A100-80GB PCIe
CFG = SimConfig(args=ServerArgs(model_path="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
                                tp_size=2))


@pytest.mark.offline
def test_clients_key_is_checked():
    assert from_spec(SPEC, 0).clients == "replay"
    assert from_spec(SPEC + ",clients=bench", 0).clients == "bench"
    with pytest.raises(ConfigError, match=r"clients='vllm'.*allowed values: replay, bench"):
        from_spec(SPEC + ",clients=vllm", 0)
    with pytest.raises(ConfigError, match="clients has no effect with arrival=poisson"):
        from_spec("arrival=poisson,rate=1,n=4,clients=bench", 0)
    with pytest.raises(ConfigError, match="is for a closed loop"):
        Workload("open", (), None, clients="bench")


@pytest.mark.offline
def test_bench_source_sends_the_warmup_first_then_waits_a_second():
    wl = from_spec(SPEC + ",clients=bench", 0)
    path = RequestPath(egress_s=0.002)
    src = Source(wl, path)
    first = src.pop_ready(0.0)
    assert [(t, r.rid) for t, r in first] == [(0.0, f"{WARMUP_RID}0")]
    warm = first[0][1]
    assert warm.segments == wl.requests[0].segments  # the same prompt: a cache hit later
    assert warm.output_tokens == min(40, BENCH_WARMUP_OUTPUT)
    assert src.next_time() is None and not src.exhausted  # nothing until it is back
    src.finished(0.5)
    start = 0.5 + 0.002 + BENCH_WARMUP_GAP_S
    assert src.next_time() == pytest.approx(start)
    assert src.pop_ready(start - 1e-9) == []
    sent = src.pop_ready(start)
    assert [r.rid for _, r in sent] == [f"r{i}" for i in range(8)]
    assert all(t == pytest.approx(start) for t, _ in sent)
    src.finished(start + 1.0)  # the first measured one back: the next client sends
    assert [r.rid for _, r in src.pop_ready(start + 2.0)] == ["r8"]


@pytest.mark.offline
def test_replay_source_is_unchanged():
    src = Source(from_spec(SPEC, 0))
    assert [r.rid for _, r in src.pop_ready(0.0)] == [f"r{i}" for i in range(8)]


@pytest.mark.offline
def test_bench_clients_desynchronise_the_first_wave(tmp_path):
    """The warm-up leaves r0's prompt cached: r0's prefill is one token, the scheduler
    takes it alone, and the rest of the first wave splits into the requests that reached
    the scheduler by then and the later ones; the warm-up has no record."""
    rep, bench = simulate(from_spec(SPEC, 0), CFG), simulate(from_spec(SPEC + ",clients=bench",
                                                                       0), CFG)
    rb = {r["rid"]: r for r in bench.records}
    rr = {r["rid"]: r for r in rep.records}
    assert sorted(rb) == sorted(rr) and not any(k.startswith(WARMUP_RID) for k in rb)
    assert bench.summary["warmup"] == {"requests": 1, "measured": False}
    assert "warmup" not in rep.summary
    assert rb["r0"]["cached_tokens"] == 511 and rr["r0"]["cached_tokens"] == 0
    wave = [rb[f"r{i}"]["ttft_s"] for i in range(8)]
    assert wave[0] < 0.1 * wave[-1]
    assert len(set(wave[1:])) == 2  # two prefill batches, not one
    assert len({rr[f"r{i}"]["ttft_s"] for i in range(1, 8)}) == 1  # lock-step
    assert rb["r0"]["arrival_s"] > BENCH_WARMUP_GAP_S  # after the warm-up and the sleep
    assert bench.summary["ttft_s"]["mean"] < rep.summary["ttft_s"]["mean"]
    # deterministic: the same inputs give the same bytes
    again = simulate(from_spec(SPEC + ",clients=bench", 0), CFG)
    write_records(tmp_path / "a.jsonl", bench.records)
    write_records(tmp_path / "b.jsonl", again.records)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


@pytest.mark.offline
def test_fleet_refuses_bench_clients():
    from twin.fleet import simulate_fleet
    from twin.fleet_presets import PRESETS

    with pytest.raises(ConfigError, match="clients=bench is for one server"):
        simulate_fleet(next(iter(PRESETS)), from_spec(SPEC + ",clients=bench", 0))


@pytest.mark.offline
def test_bench_workload_repeats_a_prompt_when_bench_serving_does():
    """Seed 108 draws prompt 21 starting at the same id as prompt 2 (147): the same prompt,
    a full cache hit on the server, and in the twin's copy."""
    work = ClosedLoop(concurrency=8, seed=108)
    firsts = [p[0] for p in work.bench_prompts()]
    assert firsts[2] == firsts[21] == 147 and len(set(firsts)) == 23
    wl = work.bench_workload()
    assert wl.requests[2].segments == wl.requests[21].segments
    assert wl.requests[2].segments != wl.requests[3].segments
    recs = {r["rid"]: r for r in simulate(wl, CFG).records}
    assert recs["r21"]["cached_tokens"] == 511 and recs["r3"]["cached_tokens"] == 0


def _harness_ok():
    if os.environ.get("SERVETWIN_NO_LIVE") == "1":
        pytest.skip("live tests switched off by SERVETWIN_NO_LIVE=1")
    if not (HARNESS.expanduser() / "bin" / "python").exists():
        pytest.skip("the CPU harness is not installed (servetwin live install-cpu)")


DRAW = """
import json, sys, random, numpy as np
from sglang.benchmark.datasets.random import sample_random_requests
class Tok:
    vocab_size = 4096
seed, n = int(sys.argv[1]), int(sys.argv[2])
random.seed(seed); np.random.seed(seed)
rows = sample_random_requests(512, 32, n, 1.0, Tok(), "", random_sample=False,
                              return_text=False)
print(json.dumps([[r.prompt[0], r.prompt_len, r.output_len, r.prompt[-1]] for r in rows]))
"""


@pytest.mark.live
def test_bench_prompts_are_bench_servings_own_draw():
    from runtime.cpu.install import harness_env

    _harness_ok()
    work = ClosedLoop(concurrency=8, requests=24, seed=108)
    res = subprocess.run([str(HARNESS.expanduser() / "bin" / "python"), "-c", DRAW, "108",
                          "24"], env=harness_env(dict(os.environ)), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    ours = work.bench_prompts()
    assert [t[:3] for t in theirs] == [list(p) for p in ours]
    assert all(t[3] == (t[0] + t[1] - 1) % 4096 for t in theirs)  # a run of ids


@pytest.mark.live
def test_bench_serving_against_the_emulator_matches_bench_clients(tmp_path):
    """8 clients, where the replay model was 13 % off (docs/emulator.md): with bench's
    clients the twin is within 6 % on TTFT and 4 % on TPOT, and closer than the replay
    model on both."""
    from runtime.emulator.process import EmulatorProcess
    from servetwin.cli import build_parser
    from servetwin.cmd_emulate import config_from

    _harness_ok()
    work = ClosedLoop(concurrency=8, requests=24, seed=108)
    with EmulatorProcess(["--speed", "1"], log_path=tmp_path / "emulator.log") as em:
        got = bench_serving(em.url, work)
    assert got["completed"] == 24
    cfg = config_from(build_parser("emulate").parse_args(["emulate"]))
    bench, rep = simulated(cfg, work, "bench"), simulated(cfg, work, "replay")
    for key, tol in (("mean_ttft_ms", 0.06), ("mean_tpot_ms", 0.04)):
        assert got[key] == pytest.approx(bench[key], rel=tol), (key, got[key], bench[key])
        assert abs(got[key] - bench[key]) < abs(got[key] - rep[key]), (key, got, bench, rep)

