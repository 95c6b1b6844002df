"""SGLang's per-step scheduler CPU cost (twin/perf/step_cpu.py): a + b x requests, charged
by the measured-free backends, hidden under the GPU by the overlap loop only up to the GPU's
time; and the measurement's arithmetic (calibration/step_cpu.py, `servetwin live step-cpu`).
Hand-worked numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from calibration.step_cpu import fit, step_cpu
from twin.config import ServerArgs, derive_capacity
from twin.errors import ConfigError
from twin.overlap import OverlapStepTime
from twin.perf import make_step_time
from twin.perf.roofline import RooflineParams, RooflineStepTime
from twin.perf.step_cpu import SGLANG_0_5_23, StepCpu, load

pytestmark = pytest.mark.offline

ARGS = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
# 1 ms per step + 20 us per request, no kernel-launch overhead: the CPU part alone
PARAMS = RooflineParams(scheduler_overhead_s=1e-3, scheduler_per_request_s=20e-6,
                        launch_per_layer_s=0.0, graph_launch_per_layer_s=0.0)


@pytest.fixture(scope="module")
def roof():
    return RooflineStepTime(derive_capacity(ARGS, "h100-sxm-80gb"), ARGS, PARAMS)


def test_cpu_part_is_per_step_plus_per_request(roof):
    assert StepCpu(1e-3, 20e-6).seconds(100) == pytest.approx(3e-3)
    assert roof.breakdown([], [500] * 100)["overhead"] == pytest.approx(3e-3)
    # a prefill step counts its chunks' requests too: 2 chunks + 3 decoding = 5 requests
    assert roof.breakdown([(256, 0), (64, 0)], [10] * 3)["overhead"] == pytest.approx(1.1e-3)
    # the plain loop adds it to the GPU's time; decode_times agrees with step_time
    parts = roof.breakdown([], [500] * 100)
    assert roof.step_time([], [500] * 100) == pytest.approx(sum(parts.values()))
    assert roof.decode_times(100, np.array([50000.0]))[0] == pytest.approx(
        roof.step_time([], [500] * 100))


def test_overlap_step_is_max_of_gpu_and_the_batch_dependent_cpu(roof):
    st = OverlapStepTime(roof)
    for b in (1, 64, 512):
        gpu = roof.step_time([], [1000] * b) - PARAMS.scheduler_overhead_s - 20e-6 * b
        cpu = 1e-3 + 20e-6 * b
        assert st.step_time([], [1000] * b) == pytest.approx(max(gpu, cpu))
        assert st.decode_times(b, np.array([1000.0 * b]))[0] == pytest.approx(max(gpu, cpu))
    # Llama-3.1-8B on an H100 at 512 requests: 50 us each is 26.6 ms of CPU, longer than
    # the GPU's step (about 12 ms), which it then sets
    slow = RooflineStepTime(roof.capacity, ARGS, replace(PARAMS, scheduler_per_request_s=5e-5))
    gpu = slow.step_time([], [100] * 512) - 1e-3 - 5e-5 * 512
    assert 0.010 < gpu < 0.015
    assert OverlapStepTime(slow).step_time([], [100] * 512) == pytest.approx(26.6e-3)


def test_defaults_are_the_measured_cost_on_both_backends():
    assert RooflineParams().scheduler_overhead_s == SGLANG_0_5_23.per_step_s
    assert RooflineParams().scheduler_per_request_s == SGLANG_0_5_23.per_request_s
    cap = derive_capacity(ARGS, "h100-sxm-80gb")
    for name in ("roofline", "opdb"):
        st = make_step_time(name, cap, ARGS)
        # 64 and 128 requests both replay a CUDA graph: only the per-request part differs
        d = st.breakdown([], [100] * 128)["overhead"] - st.breakdown([], [100] * 64)["overhead"]
        assert d == pytest.approx(64 * SGLANG_0_5_23.per_request_s), name


def test_opdb_step_time_charges_the_per_request_part():
    cap = derive_capacity(ARGS, "h100-sxm-80gb")
    base = make_step_time("opdb", cap, ARGS)
    zero = type(base)(cap, ARGS, replace(base.params, overhead=replace(
        base.params.overhead, scheduler_per_request_s=0.0)))
    chunks, lens = [(512, 0), (128, 0)], [300] * 10
    assert base.step_time(chunks, lens) - zero.step_time(chunks, lens) == pytest.approx(
        12 * SGLANG_0_5_23.per_request_s)
    assert base.decode_times(40, np.array([12000.0]))[0] - zero.decode_times(
        40, np.array([12000.0]))[0] == pytest.approx(40 * SGLANG_0_5_23.per_request_s)


def test_load_reads_the_benchmark_json_and_a_profile_section(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"points": [], "per_step_s": 0.002, "per_request_s": 1e-5}))
    assert load(bench) == StepCpu(0.002, 1e-5)
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"step_cpu": {"per_step_s": 0.001, "per_request_s": 0}}))
    assert load(prof) == StepCpu(0.001, 0.0)
    prof.write_text(json.dumps({"step_cpu": {"per_step_s": 0.001, "per_request_s": -1}}))
    with pytest.raises(ConfigError, match=r"profile.json: step_cpu: per_request_s=-1"):
        load(prof)
    with pytest.raises(ConfigError, match="per_step_s=None"):
        bench.write_text("{}")
        load(bench)


def test_benchmark_takes_the_forward_out_and_fits_a_line():
    # ns, [wall, thread]: 0.1 + 0.3 + 15 + 0.5 ms of loop, 14 ms forward + 0.2 ms sampling
    rec = {"mode": "decode", "bs": 4, "ingest": [100_000, 90_000], "sched": [300_000, 300_000],
           "run": [15_000_000, 15_000_000], "fwd": [14_000_000, 14_000_000],
           "sample": [200_000, 200_000], "proc": [500_000, 400_000]}
    assert step_cpu(rec, 0) == pytest.approx(1.7e-3)
    assert step_cpu(rec, 1) == pytest.approx(1.59e-3)
    pts = [{"batch": b, "cpu_s": 1e-3 + 2e-5 * b} for b in (1, 8, 64, 256)]
    a, b, res = fit(pts)
    assert (a, b) == (pytest.approx(1e-3), pytest.approx(2e-5)) and res < 1e-12


def test_step_cpu_override_reaches_the_step_time_and_the_cli(tmp_path):
    from servetwin.cli import main
    from twin.perf.step_cpu import charged
    from twin.sim import SimConfig, step_time_for

    cap = derive_capacity(ARGS, "h100-sxm-80gb")
    slow = StepCpu(per_step_s=2e-3, per_request_s=40e-6)
    for name in ("roofline", "opdb"):
        base = make_step_time(name, cap, ARGS)
        st = step_time_for(SimConfig(args=ARGS, gpu="h100-sxm-80gb", step_time_backend=name,
                                     step_cpu=slow), cap)
        d = SGLANG_0_5_23.seconds(64)
        # the same GPU work; the CPU part is the given one (64 requests: 4.56 ms, was 2.29)
        assert st.breakdown([], [100] * 64)["overhead"] - base.breakdown(
            [], [100] * 64)["overhead"] == pytest.approx(slow.seconds(64) - d), name
        assert st.step_time([(300, 0)], [100] * 3) - base.step_time(
            [(300, 0)], [100] * 3) == pytest.approx(slow.seconds(4) - SGLANG_0_5_23.seconds(4))
        assert st.decode_times(64, np.array([6400.0]))[0] - base.decode_times(
            64, np.array([6400.0]))[0] == pytest.approx(slow.seconds(64) - d), name
    fitted = type("Fitted", (), {"name": "fitted"})()
    assert charged(fitted, slow) is fitted  # a fitted step time measured its own CPU part
    with pytest.raises(ConfigError, match="step_cpu"):
        SimConfig(step_cpu={"per_step_s": 1})
    f = tmp_path / "cpu.json"
    f.write_text(json.dumps({"per_step_s": 0.002, "per_request_s": "x"}))
    assert main(["simulate", "--model-path", "meta-llama/Llama-3.1-8B", "--gpu",
                 "h100-sxm-80gb", "--workload", "arrival=poisson,rate=1,n=3,prompt=fixed:8,"
                 "output=fixed:4", "--step-cpu", str(f)]) != 0
