"""`servetwin calibrate` against a real vLLM 0.32 CPU server, and the calibrated vLLM replica
of a deployment (`calibration: FILE`) against the same server.

One server with the small limits of experiments/vllm_live.py; a short profile (25 s of
runs: a calibration that takes minutes is benchmarks/vllm_live.py). Asserted: what vLLM's
API cannot say is asked for by name; the profile records engine, model, device and the
server's own limits and has samples from both token gaps and vLLM's own histograms; a
resumed calibration with no new runs refits to the same step times; the calibrated
replica runs the `seqs` scenario as the server does (4 at a time, first tokens in arrival
order). Latencies are the benchmark's, not the test's (the 2-core machine is shared).
Needs the vLLM harness (tests/conftest.py's `vllm_harness`: a failure in CI, else a skip).
"""

from __future__ import annotations

import json

import pytest

from experiments import vllm_live as vl

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_harness):
    from runtime.vllm_cpu.serve import VllmServer

    logs = tmp_path_factory.mktemp("vllmcal")
    with VllmServer(vl.cli_args(), log_path=logs / "vllm.log") as engine:
        yield engine, logs


@pytest.fixture(scope="module")
def calibrated(server):
    from servetwin.cli import main

    engine, logs = server
    out = logs / "profile.json"
    rc = main(["calibrate", "--url", engine.url, "--out", str(out), "--budget-s", "25",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "512"])
    assert rc == 0
    return out


def test_calibrate_asks_for_what_vllm_does_not_report(server, capsys, tmp_path):
    from servetwin.cli import main

    engine, _ = server
    assert main(["calibrate", "--url", engine.url, "--out", str(tmp_path / "p.json"),
                 "--max-num-seqs", "4"]) != 0
    err = capsys.readouterr().err
    assert "is a vLLM server" in err and "--max-num-batched-tokens N" in err
    assert "--max-num-seqs N" not in err  # given


def test_the_profile_is_vllms_with_samples_from_gaps_and_histograms(calibrated):
    prof = json.loads(calibrated.read_text())
    assert prof["engine"] == {"name": "vllm", "version": "0.32.0"}
    assert prof["model"]["name"] == "tiny-llama-l6-h512-v4096" and prof["device"]["kind"] == "cpu"
    args = prof["server_args"]
    assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["block_size"],
            args["num_gpu_blocks_override"], args["max_model_len"]) == (4, 512, 128, 24, 2048)
    sources = prof["fit"]["samples_by_source"]
    assert sources.get("token-gap", 0) > 20 and sources.get("vllm-prefill-time", 0) >= 3
    assert prof["fit"]["held_out_samples"] > 0 and prof["step_time"]["form"] == "linear"
    coef = prof["step_time"]["coefficients"]
    assert coef["step"] > 0 and coef["prefill_token"] > 0
    assert 0 < prof["request_path"]["total_s"] < 1.0


def test_a_resumed_calibration_without_new_runs_refits_the_same(calibrated, server, capsys):
    from servetwin.cli import main

    engine, _ = server
    first = json.loads(calibrated.read_text())
    assert main(["calibrate", "--url", engine.url, "--out", str(calibrated), "--budget-s",
                 "0", "--max-num-seqs", "4", "--max-num-batched-tokens", "512"]) == 0
    assert f"resuming after {first['runs']} runs" in capsys.readouterr().out
    again = json.loads(calibrated.read_text())
    assert again["step_time"] == first["step_time"] and again["fit"] == first["fit"]


def test_the_calibrated_replica_of_a_deployment_runs_seqs_as_the_server(calibrated, server,
                                                                         tmp_path):
    from runtime.length_router import LengthRouterProcess, Pool

    engine, logs = server
    work = vl.workload("seqs")
    with LengthRouterProcess([Pool("vllm", engine.url, "vllm", None)],
                             log_path=logs / "front.log") as front:
        live, delta = vl.replay_scenario(front.url, engine.url, work)
    twin = vl.simulate(work, str(engine.harness.model_dir), calibrated)  # calibration: FILE
    lrow, trow = vl.live_row("seqs", live, delta), vl.twin_row("seqs", twin)
    assert lrow["ok"] == trow["ok"] == 10
    assert lrow["max_running"] == trow["max_running"] == 4, (lrow, trow)
    assert lrow["fcfs"] and trow["fcfs"]
    assert vl.first_token_order(twin.records) == vl.arrival_order(twin.records)
