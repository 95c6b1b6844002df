"""`--calibration PROFILE`: the twin is the calibrated server unless told otherwise.

The profile is made by the real calibration code path (`servetwin calibrate
--from-bench-serving` on the CPU harness's bench_serving run in tests/data), with the
server's model directory written here (the harness's tiny Llama config)."""

import json
from pathlib import Path

import pytest

from calibration.deployment import check, profile_deployment, server_identity
from calibration.session import CalibrationError
from runtime.cpu.model import DEFAULT_SPEC, write_config
from servetwin.cli import main

DATA = Path(__file__).parent / "data"
WORKLOAD = "arrival=poisson,rate=2,n=6,prompt=uniform:32:256,output=uniform:4:16"


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("profile")
    model = tmp / DEFAULT_SPEC.name
    write_config(model)
    run = json.loads((DATA / "bench_serving_cpu.jsonl").read_text())
    run["server_info"]["model_path"] = str(model)
    bench = tmp / "bench.jsonl"
    bench.write_text(json.dumps(run) + "\n")
    out = tmp / "profile.json"
    assert main(["calibrate", "--from-bench-serving", str(bench), "--out", str(out)]) == 0
    return out


def simulate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["simulate", "--workload", WORKLOAD, *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_a_calibrated_run_is_the_profiles_server(profile, capsys, tmp_path):
    server = json.loads(profile.read_text())["server_args"]
    code, out, _ = simulate(capsys, "--calibration", str(profile), "--out", str(tmp_path / "o"))
    assert code == 0
    # SGLang's own start-up line, as the twin derives it, is the server's
    assert (f"max_total_num_tokens={server['max_total_num_tokens']}, "
            f"chunked_prefill_size={server['chunked_prefill_size']}, "
            f"max_prefill_tokens={server['max_prefill_tokens']}, "
            f"max_running_requests={server['max_running_requests']}, "
            f"context_len={server['context_length']}") in out
    head = out[:out.index("workload:")]
    assert "from the profile:" in head and "overridden" not in head
    assert f"model_path {server['model_path']}, tp_size 1" in head
    assert "gpu: a100-pcie-80gb (the profile measured a CPU server" in head
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["memory"]["capacity_tokens"] == server["max_total_num_tokens"]
    assert summary["engine"]["backend"] == "fitted"


def test_an_override_wins_and_is_reported(profile, capsys):
    code, out, _ = simulate(capsys, "--calibration", str(profile), "--max-running-requests",
                            "4", "--chunked-prefill-size", "512")
    assert code == 0
    assert "max_running_requests=4" in out and "chunked_prefill_size=512" in out
    head = out[:out.index("workload:")]
    assert "overridden on the command line: chunked_prefill_size 512 (profile 1024)," in head
    assert "max_running_requests 4 (profile 16)" in head
    taken = head[head.index("from the profile:"):head.index("overridden")]
    assert "max_running_requests" not in taken and "max_total_tokens 16384" in taken


def test_a_flag_equal_to_the_profile_is_not_an_override(profile, capsys):
    code, out, _ = simulate(capsys, "--calibration", str(profile), "--tp-size", "1")
    assert code == 0 and "overridden" not in out[:out.index("workload:")]


@pytest.mark.parametrize("flags,msg", [
    (["--model-path", "Qwen/Qwen3-8B"],
     "model: profile 'tiny-llama-l6-h512-v4096', asked 'Qwen3-8B'"),
    (["--gpu", "h100-sxm-80gb"], "device: profile 'cpu', asked 'h100-sxm-80gb'"),
])
def test_a_mismatched_profile_is_refused_naming_both_sides(profile, capsys, flags, msg):
    code, _, err = simulate(capsys, "--calibration", str(profile), *flags)
    assert code == 2 and msg in err and "--force" in err


def test_force_uses_a_mismatched_profile_with_a_warning(profile, capsys):
    code, out, err = simulate(capsys, "--calibration", str(profile), "--gpu",
                              "h100-sxm-80gb", "--force")
    assert code == 0 and "mismatch ignored (--force): device" in err
    assert "gpu: h100-sxm-80gb (command line;" in out


def test_a_profile_of_another_engine_version_is_refused(profile, capsys, tmp_path):
    other = json.loads(profile.read_text())
    other["engine"]["version"] = "0.4.9"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(other))
    code, _, err = simulate(capsys, "--calibration", str(path))
    assert code == 2 and "version: profile '0.4.9', asked '0.5'" in err


def test_validate_and_simulate_share_one_check(profile):
    prof = json.loads(profile.read_text())
    info = dict(prof["server_args"], version="0.5.23")
    assert check(prof, server_identity(info), False, "server", "") == []
    with pytest.raises(CalibrationError, match="device: profile 'cpu', server 'cuda'"):
        check(prof, server_identity(dict(info, device="cuda")), False, "server", "")


def test_a_profile_without_a_deployment_keeps_the_defaults(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"step_time": {"backend": "fitted", "form": "linear",
                                              "coefficients": {"step": 0.01}}}))
    dep = profile_deployment(json.loads(path.read_text()))
    assert dep.server_args == {} and dep.device == "cuda"
    code, out, _ = simulate(capsys, "--calibration", str(path), "--model-path",
                            "Qwen/Qwen3-8B", "--tp-size", "1")
    assert code == 0 and "the profile does not name its GPU" in out


def test_validate_twin_is_the_live_server_and_reports_what_differs(profile):
    from calibration.deployment import server_differences
    from calibration.validate import simulate_like
    from twin.workload import from_spec

    prof = json.loads(profile.read_text())
    info = dict(prof["server_args"], version="0.5.23", max_running_requests=32)
    assert server_differences(prof, info) == ["max_running_requests: profile 16, server 32"]
    records, _ = simulate_like(from_spec(WORKLOAD, 0), info, prof)
    assert len(records) == 6 and records.memory["capacity_tokens"] == 16384


def test_a_gpu_profile_names_its_gpu_and_simulate_takes_it(tmp_path, capsys):
    """A GPU server's profile (the real fit on the bench_serving run, the server's info
    changed to a GPU server's) records the GPU given to `calibrate --gpu`."""
    from calibration.offline import from_bench_serving
    from calibration.profiles import build_profile

    samples, info = from_bench_serving(DATA / "bench_serving_cpu.jsonl")
    info = dict(info, device="cuda", model_path="meta-llama/Llama-3.1-8B",
                max_total_tokens=50000, max_running_requests=64)
    prof = build_profile(samples, info, ["test"], gpu="h100-sxm-80gb")
    assert prof["device"]["gpu"] == "h100-sxm-80gb"
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(prof))
    code, out, _ = simulate(capsys, "--calibration", str(path))
    assert code == 0 and "on h100-sxm-80gb" in out and "max_running_requests=64" in out
    assert "gpu: h100-sxm-80gb (the profile's GPU)" in out
    code, _, err = simulate(capsys, "--calibration", str(path), "--gpu", "a100-sxm-80gb")
    assert code == 2 and "device: profile 'h100-sxm-80gb', asked 'a100-sxm-80gb'" in err
