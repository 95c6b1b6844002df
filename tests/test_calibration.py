"""Calibration: sample derivation, the fit, the fitted backend, bad input, and (live) the
whole pipeline on the CPU SGLang server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest

from calibration.derive import (
    Limits,
    Timeline,
    chunk_steps,
    forward_samples,
    timelines_from_records,
    token_gap_samples,
)
from calibration.fit import fit_step_time, linear_rows, robust_nnls
from calibration.profiles import check_profile
from calibration.session import CalibrationError, server_facts
from servetwin.cli import main
from twin.perf.fitted import TERMS, CorrectedStepTime, LinearStepTime

DELAY = 0.0015  # client-side delivery delay of every token


# ---- synthetic timelines ---------------------------------------------------------------
def run_server(sent: dict[str, float], prompt: dict[str, int], steps, delay=DELAY,
               jitter: dict[str, float] | None = None):
    """Token times of a scripted server: `steps` are `(duration, prefilled rids, decoding
    rids)` run back to back from t=0; every token reaches the client `delay` (plus the
    request's own constant `jitter`) after its step ends."""
    jitter = jitter or {}
    t, tokens = 0.0, {rid: [] for rid in sent}
    for dur, pre, dec in steps:
        t += dur
        for rid in (*pre, *dec):
            tokens[rid].append(t + delay + jitter.get(rid, 0.0))
    return [Timeline(rid, sent[rid], prompt[rid], 0, tuple(tokens[rid])) for rid in sent]


SCRIPT = [
    (0.200, ("a", "b"), ()),  # prefill of a and b together
    (0.030, (), ("a", "b")),
    (0.031, (), ("a", "b")),  # c is sent during this step: it waits for the next
    (0.100, ("c",), ()),  # prefill of c alone (a and b wait)
    (0.040, (), ("a", "b", "c")),
    (0.041, (), ("a", "b", "c")),
]
SENT = {"a": 0.0, "b": 0.001, "c": 0.25}
PROMPT = {"a": 100, "b": 50, "c": 300}


def test_token_gaps_exact_on_a_scripted_timeline():
    lines = run_server(SENT, PROMPT, SCRIPT)
    got = [(s["kind"], s["steps"], round(s["dur_s"], 9)) for s in token_gap_samples(lines)]
    assert got == [
        ("decode", [[[], [2, 100 + 1 + 50 + 1]]], 0.030),
        ("decode", [[[], [2, 100 + 2 + 50 + 2]]], 0.031),
        ("prefill", [[[[300, 0]], [0, 0]]], 0.100),
        ("decode", [[[], [3, 100 + 3 + 50 + 3 + 300 + 1]]], 0.040),
        ("decode", [[[], [3, 100 + 4 + 50 + 4 + 300 + 2]]], 0.041),
    ]


def test_token_gaps_per_request_offsets_cancel_in_decode_steps():
    lines = run_server(SENT, PROMPT, SCRIPT, jitter={"a": 0.0, "b": 0.0008, "c": 0.0004})
    decode = [s["dur_s"] for s in token_gap_samples(lines) if s["kind"] == "decode"]
    assert decode == pytest.approx([0.030, 0.031, 0.040, 0.041], abs=1e-12)


def test_token_gaps_skip_what_cannot_be_seen():
    # c's prompt needs two chunks: the first chunk step emits nothing, so the gap of a and
    # b across it is two steps and must not become a sample
    steps = [(0.2, ("a", "b"), ()), (0.03, (), ("a", "b")), (0.05, (), ()),
             (0.06, ("c",), ()), (0.04, (), ("a", "b", "c"))]
    sent = {"a": 0.0, "b": 0.0, "c": 0.21}
    lines = run_server(sent, {"a": 10, "b": 10, "c": 600}, steps)
    got = [(s["kind"], round(s["dur_s"], 9)) for s in token_gap_samples(lines, Limits(512, 8))]
    assert got == [("decode", 0.03), ("decode", 0.04)]


def test_a_short_prompt_waiting_does_not_hide_a_step():
    # d waits (sent at 0.21, prefilled later) but its prompt fits a chunk: no silent step
    steps = [(0.2, ("a",), ()), (0.03, (), ("a",)), (0.031, (), ("a",)), (0.05, ("d",), ())]
    lines = run_server({"a": 0.0, "d": 0.21}, {"a": 10, "d": 100}, steps)
    got = [(s["kind"], round(s["dur_s"], 9)) for s in token_gap_samples(lines, Limits(512, 8))]
    assert got == [("decode", 0.03), ("decode", 0.031), ("prefill", 0.05)]


def test_token_gaps_skip_an_idle_server():
    # b is sent after a finished: the server idled, so the step's start is unknown
    steps = [(0.1, ("a",), ()), (0.02, (), ("a",)), (0.5, (), ()), (0.1, ("b",), ())]
    lines = run_server({"a": 0.0, "b": 0.5}, {"a": 10, "b": 10}, steps)
    assert [s["kind"] for s in token_gap_samples(lines)] == ["decode"]


def test_chunked_prefill_steps_and_forward_samples():
    assert chunk_steps(2500, 100, 1024) == [
        [[[1024, 100]], [0, 0]], [[[1024, 1124]], [0, 0]], [[[452, 2148]], [0, 0]]]
    meta = {"forward_entry_time": 1000.0, "prefill_finished_time": 1000.25, "queue_time": 0.001}
    tl = Timeline("x", 5.0, 2500, 100, (5.27,), meta, sent_wall=999.99)
    (s,) = forward_samples([tl], Limits(1024))
    assert s["dur_s"] == pytest.approx(0.25) and len(s["steps"]) == 3
    assert s["overhead_s"] == pytest.approx(0.27 - 0.001 - 0.25)
    assert s["ingress_s"] == pytest.approx(1000.0 - 0.001 - 999.99)
    assert s["egress_s"] == pytest.approx(999.99 + 0.27 - 1000.25)


def test_timelines_from_records_rebuild_token_times():
    rec = {"rid": "r", "arrival_s": 1.0, "prompt_tokens": 20, "cached_tokens": 4,
           "ttft_s": 0.5, "itl_s": [0.1, 0.2], "status": "ok"}
    (tl,) = timelines_from_records([rec])
    assert tl.tokens == pytest.approx((1.5, 1.6, 1.8)) and tl.extend == 16


# ---- the fit -------------------------------------------------------------------------
TRUE = {"step": 0.014, "prefill_token": 4.6e-4, "prefill_token_ctx": 2e-7,
        "prefill_ctx_sq": 1e-7, "prefill_request": 4e-3, "decode_batched": 6e-3,
        "decode_request": 1e-3,
        "decode_kv_token": 3e-6}


def synthetic_samples(model, n: int, noise: float, seed: int = 0,
                      outliers: float = 0.05) -> list[dict]:
    """Samples of a known model: decode, prefill (with and without cached prefixes) and
    mixed steps; multiplicative Gaussian noise, and `outliers` of them at twice the
    duration."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = ("decode", "prefill", "mixed")[i % 3]
        pre = [] if kind == "decode" else [
            (int(np.exp(rng.uniform(np.log(8), np.log(1024)))),
             int(rng.choice([0, 0, 256, 1024, 2048])))
            for _ in range(int(rng.integers(1, 4)))]
        b = 0 if kind == "prefill" else int(rng.integers(1, 17))
        kv = int(b * rng.integers(32, 2048))
        lens = [kv // b] * b if b else []
        kv = sum(lens)
        dur = model.step_time(pre, lens) * (1 + noise * rng.standard_normal())
        if rng.random() < outliers:
            dur *= 2.0
        out.append({"steps": [[[list(c) for c in pre], [b, kv]]], "dur_s": dur, "kind": kind,
                    "tag": f"run{i % 12}", "source": "synthetic"})
    return out


def test_fit_recovers_known_coefficients_within_10_percent():
    samples = synthetic_samples(LinearStepTime(TRUE), 900, noise=0.03, outliers=0.0)
    fitted = fit_step_time(samples)
    coef = fitted["step_time"]["coefficients"]
    for name, value in TRUE.items():  # stated tolerance: 10 % per term
        assert coef[name] == pytest.approx(value, rel=0.10), name
    assert coef["tp_comm_token"] == 0.0
    assert fitted["step_time"]["not_identifiable"] == ["tp_comm_token"]
    assert fitted["step_time"]["form"] == "linear"
    assert fitted["fit"]["held_out"]["linear/mean"]["median_abs_rel"] < 0.04
    assert all(fitted["step_time"]["uncertainty"][n] > 0 for n in TRUE)


def test_the_median_target_ignores_slow_outliers():
    # 5 % of the steps at twice their duration (another job took the core): the robust
    # fit still finds the model within 10 %; the mean fit follows the outliers up
    samples = synthetic_samples(LinearStepTime(TRUE), 900, noise=0.03, outliers=0.05)
    rows, y = linear_rows(samples), np.array([s["dur_s"] for s in samples])
    median = robust_nnls(rows, y, target="median", names=TERMS).as_dict()
    for name, value in TRUE.items():
        assert median[name] == pytest.approx(value, rel=0.10), name
    mean = robust_nnls(rows, y, target="mean", names=TERMS)
    assert np.median(rows @ mean.coef / (rows @ robust_nnls(rows, y).coef)) > 1.02


def test_fit_is_non_negative_and_exact_without_noise():
    true = dict(TRUE, prefill_token_ctx=0.0, prefill_request=0.0)
    fitted = fit_step_time(synthetic_samples(LinearStepTime(true), 300, noise=0.0, seed=1,
                                                   outliers=0.0))
    coef = fitted["step_time"]["coefficients"]
    assert all(v >= 0 for v in coef.values())
    for name, value in true.items():
        if value:
            assert coef[name] == pytest.approx(value, rel=0.02), name
    # the absent terms stay negligible: under 0.1 ms for one request or a 1k x 1k chunk
    assert coef["prefill_request"] < 1e-4 and coef["prefill_token_ctx"] * 1024**2 < 1e-4


def test_rows_sum_over_the_steps_of_a_sample():
    one = {"steps": [[[[100, 0]], [0, 0]]], "dur_s": 1, "kind": "prefill"}
    two = {"steps": [[[[100, 0]], [0, 0]], [[], [4, 400]]], "dur_s": 1, "kind": "mixed"}
    dec = {"steps": [[[], [4, 400]]], "dur_s": 1, "kind": "decode"}
    rows = linear_rows([one, two, dec])
    assert np.allclose(rows[1], rows[0] + rows[2])


@pytest.mark.parametrize("model", [
    LinearStepTime(dict(TRUE, tp_comm_token=1e-5), tp_size=2),
    CorrectedStepTime(LinearStepTime(TRUE), 0.002, 1.7),
])
def test_fitted_backends_honour_the_decode_contract(model):
    rng = np.random.default_rng(3)
    for b in (1, 3, 16):
        lens = [rng.integers(1, 3000, size=b).tolist() for _ in range(4)]
        sums = np.array([sum(x) for x in lens])
        fast = model.decode_times(b, sums)
        assert fast == pytest.approx([model.step_time([], x) for x in lens], rel=1e-12)
    parts = model.breakdown([(64, 128)], [10, 20])
    assert sum(parts.values()) == pytest.approx(model.step_time([(64, 128)], [10, 20]))


# ---- bad input -----------------------------------------------------------------------
def test_an_empty_sample_set_is_refused():
    with pytest.raises(CalibrationError, match="empty"):
        fit_step_time([])


def test_an_empty_bench_serving_run_is_refused(tmp_path, capsys):
    run = {"input_lens": [10], "output_lens": [5], "ttfts": [0.0], "itls": [[]],
           "server_info": {"version": "0.5.23", "model_path": "/m/x"}}
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(run) + "\n")
    assert main(["calibrate", "--from-bench-serving", str(path), "--out",
                 str(tmp_path / "p.json")]) == 2
    assert "sample set is empty" in capsys.readouterr().err


def test_offline_bench_serving_file_gives_a_profile(tmp_path):
    data = Path(__file__).parent / "data" / "bench_serving_cpu.jsonl"
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-bench-serving", str(data), "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert profile["fit"]["samples"] > 0
    assert set(profile["step_time"]["coefficients"]) in (set(TERMS), {"offset", "scale"})


class _NotSGLang(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b'{"hello": "world"}' if self.path == "/server_info" else b"nope"
        self.send_response(200 if self.path == "/server_info" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def not_sglang():
    server = HTTPServer(("127.0.0.1", 0), _NotSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_url_that_is_not_sglang_is_refused(not_sglang, tmp_path, capsys):
    with pytest.raises(CalibrationError, match="not an SGLang server"):
        server_facts(not_sglang)
    assert main(["calibrate", "--url", not_sglang, "--out", str(tmp_path / "p.json")]) == 2
    assert "not an SGLang server" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_nothing_listening_is_refused(tmp_path, capsys):
    from runtime.cpu.serve import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["calibrate", "--url", url, "--out", str(tmp_path / "p.json")]) == 2
    assert "cannot reach an SGLang server" in capsys.readouterr().err


def test_a_profile_of_another_model_or_version_is_refused_or_forced():
    profile = {"engine": {"name": "sglang", "version": "0.5.22"}, "model": {"name": "llama"}}
    info = {"version": "0.5.23", "model_path": "/models/tiny"}
    with pytest.raises(CalibrationError, match=r"version: profile '0\.5\.22', server '0\.5\.23'"):
        check_profile(profile, info)
    warnings = check_profile(profile, info, force=True)
    assert len(warnings) == 2 and all("--force" in w for w in warnings)
    same = {"engine": {"name": "sglang", "version": "0.5.23"}, "model": {"name": "tiny"}}
    assert check_profile(same, info) == []


def test_simulate_refuses_the_fitted_backend_without_a_profile(capsys):
    assert main(["simulate", "--step-time-backend", "fitted", "--workload",
                 "n=3,prompt=fixed:10,output=fixed:2"]) == 2
    assert "--calibration" in capsys.readouterr().err


# ---- live: the whole pipeline on the CPU server ---------------------------------------
@pytest.mark.live
def test_profile_fit_validate_on_the_cpu_server(sglang_server, tmp_path, capsys):
    url, out = sglang_server.url, tmp_path / "profile.json"
    assert main(["calibrate", "--url", url, "--out", str(out), "--budget-s", "40"]) == 0
    profile = json.loads(out.read_text())
    assert profile["engine"]["version"] and profile["model"]["name"]
    assert profile["fit"]["samples"] > 20
    assert profile["fit"]["samples_by_source"].get("forward-timestamps", 0) > 0
    assert profile["request_path"]["overhead_samples"] > 0
    runs = out.with_suffix(".runs.jsonl").read_text().splitlines()
    assert len(runs) >= 3 and out.with_suffix(".samples.jsonl").stat().st_size > 0
    # resumable: a second call keeps the runs done (and with no budget adds none)
    assert main(["calibrate", "--url", url, "--out", str(out), "--budget-s", "0"]) == 0
    assert f"{len(runs)} resumed" in capsys.readouterr().out
    assert len(out.with_suffix(".runs.jsonl").read_text().splitlines()) == len(runs)

    workload = "arrival=poisson,rate=2,n=10,prompt=uniform:32:256,output=uniform:4:16"
    vout = tmp_path / "validate"
    assert main(["validate", "--url", url, "--calibration", str(out), "--workload", workload,
                 "--out", str(vout)]) == 0
    text = capsys.readouterr().out
    assert "TTFT p50 (ms)" in text and "requests: 10 in both" in text
    assert (vout / "report.html").stat().st_size > 10_000
    assert len((vout / "twin" / "requests.jsonl").read_text().splitlines()) == 10

    other = dict(profile, engine={"name": "sglang", "version": "0.4.0"})
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(other))
    args = ["validate", "--url", url, "--calibration", str(bad), "--workload",
            "n=2,prompt=fixed:16,output=fixed:2", "--out", str(tmp_path / "v2")]
    assert main(args) == 2
    assert "another server" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0
    assert "--force" in capsys.readouterr().out


def test_simulate_with_a_calibration_profile_uses_its_step_time(tmp_path):
    from twin.sim import SimConfig, simulate
    from twin.workload import from_spec

    coef = {"step": 0.01, "prefill_token": 0.001, "decode_request": 0.002}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"step_time": {"backend": "fitted", "form": "linear",
                                              "coefficients": coef}}))
    wl = from_spec("arrival=poisson,rate=1,n=1,prompt=fixed:100,output=fixed:3", 0)
    res = simulate(wl, SimConfig(calibration=str(path)))
    (rec,) = res.records
    assert res.backend == "fitted"
    assert rec["ttft_s"] == pytest.approx(0.01 + 100 * 0.001)
    assert rec["e2e_s"] == pytest.approx(0.11 + 2 * (0.01 + 0.002))
    out = tmp_path / "sim"
    assert main(["simulate", "--calibration", str(path), "--workload",
                 "n=2,prompt=fixed:100,output=fixed:3", "--json", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["engine"]["backend"] == "fitted"
