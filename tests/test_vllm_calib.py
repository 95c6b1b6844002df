"""vLLM calibration without a server: token gaps read under vLLM's one-budget rules, vLLM's
own histograms as samples, the resumable store, the profile (engine kind refused for
another engine), and deployments whose replicas name a profile (`calibration: FILE`).

Real data: `tests/data/vllm_cpu_runs.jsonl` holds 8 profiling runs made against a real vLLM
0.32 CPU server (tests/data/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration import vllm_derive as vd
from calibration.derive import Timeline
from calibration.session import CalibrationError
from calibration.vllm import (
    Store,
    cache_config,
    fit_profile,
    samples_of,
    sglang_rule_samples,
)
from experiments import vllm_live as vl
from twin.errors import ConfigError

pytestmark = pytest.mark.offline
RUNS = Path(__file__).parent / "data" / "vllm_cpu_runs.jsonl"
MODEL = "tiny-llama-l6-h512-v4096"
IDENTITY = {"engine": "vllm", "version": "0.32.0", "model": MODEL}


def rows() -> list[dict]:
    return [json.loads(x) for x in RUNS.read_text().splitlines() if x.strip()]


def tl(rid, sent, prompt, tokens, tag="t"):
    return Timeline(rid, sent, prompt, 0, tuple(tokens), tag=tag)


# ---- token gaps under vLLM's rules ---------------------------------------------------------
def decoding(n=8, step=0.02, start=0.1):
    """A request decoding one token per `step` from `start`."""
    return tl("d", 0.0, 64, [start + step * i for i in range(n)])


def test_a_prompt_that_overflows_the_budget_beside_a_decode_is_not_one_step():
    # 512 prompt tokens + 1 decode > 512: vLLM ran 511 of them in an earlier (silent) step
    lines = [decoding(), tl("p", 0.165, 512, [0.2, 0.22])]
    budget_gaps = [s for s in vd.token_gap_samples(lines, 512, 4) if s["kind"] == "mixed"]
    assert budget_gaps == []
    lines = [decoding(), tl("p", 0.165, 500, [0.2, 0.22])]  # 500 + 1 fits: one mixed step
    (mixed,) = [s for s in vd.token_gap_samples(lines, 512, 4) if s["kind"] == "mixed"]
    assert mixed["steps"] == [[[[500, 0]], [1, 64 + 5]]] and mixed["dur_s"] == 0.02


def test_a_prompt_sent_earlier_counts_only_if_it_would_have_fit_the_step_before():
    # sent at 0.125, before the cluster at 0.14 that precedes `prev` (0.16): it could have
    # been in the step that ended at 0.16, but then (64 + 1 tokens fit) it would have
    # emitted its first token there; so it was not, and the step 0.16 -> 0.18 is it
    lines = [decoding(), tl("p", 0.125, 64, [0.18, 0.2])]
    assert any(s["kind"] == "mixed" for s in vd.token_gap_samples(lines, 512, 4))
    # beside 3 decodes and a 510-token prompt in `prev` (513 tokens), its 64 would not
    # have fit a 560-token budget whole: it may have had a chunk there
    busy = [tl(f"d{i}", 0.0, 64, [0.1 + 0.02 * k for k in range(8)]) for i in range(3)]
    lines = busy + [tl("q", 0.13, 510, [0.16, 0.18, 0.2]), tl("p", 0.125, 64, [0.18, 0.2])]

    def has_p(budget):
        return any(s["kind"] == "mixed" and [64, 0] in s["steps"][0][0]
                   for s in vd.token_gap_samples(lines, budget, 8))
    assert has_p(1024) and not has_p(560)


def test_a_request_waiting_across_a_gap_spoils_it_unless_the_sequences_are_full():
    # `w` waits from 0.125 to its first token at 0.2: it may have had silent chunks
    lines = [decoding(), tl("w", 0.125, 900, [0.2, 0.22])]
    gaps = [s for s in vd.token_gap_samples(lines, 512, 4) if s["kind"] == "decode"]
    # the gaps 0.14-0.16-0.18 (w waiting) and 0.18-0.2 (900 tokens: chunked) are dropped
    assert [s["steps"][0][1][1] for s in gaps] == [65, 66, 64 + 6 + 901, 71]
    full = [s for s in vd.token_gap_samples(lines, 512, 1) if s["kind"] == "decode"]
    assert len(full) == 6  # max_num_seqs 1: it could not have been running


def test_on_real_runs_vllm_rules_drop_the_overflowing_prompts_sglang_rules_took():
    lim = vl.limits()
    first = RUNS.with_name("vllm_cpu_runs_first.jsonl")
    for line in first.read_text().splitlines():
        run = json.loads(line)  # a 512-token prompt arrived beside 1 (3) decodes: 511 (509) + 1
        sg = [s["steps"][0] for s in sglang_rule_samples(run, lim) if s["kind"] == "mixed"]
        vr = [s["steps"][0] for s in samples_of(run, lim) if s["kind"] == "mixed"]
        over = [st for st in sg if st[0] == [[512, 0]] and st[1][0] >= 1]
        assert over, run["tag"]
        assert not any(st[0] == [[512, 0]] and st[1][0] >= 1 for st in vr), run["tag"]
        # the measured step was the prompt's 1-3 token tail: far shorter than a 512 prefill
        (dur,) = [s["dur_s"] for s in sglang_rule_samples(run, lim) if s["steps"][0] == over[0]]
        assert dur < 0.05


# ---- vLLM's own histograms -------------------------------------------------------------------
def test_engine_samples_from_the_prefill_and_decode_histograms():
    lone = [tl("a", 0.0, 1000, [0.5 + 0.02 * k for k in range(4)])]
    delta = {vd.PREFILL + "_sum": 0.4, vd.PREFILL + "_count": 1, vd.DECODE + "_sum": 0.06,
             vd.DECODE + "_count": 1}
    pre, dec = vd.engine_samples(lone, delta, 512, "r")
    assert pre["kind"] == "chunked-prefill" and len(pre["steps"]) == 2 and pre["dur_s"] == 0.4
    assert dec["source"] == "vllm-decode-time" and dec["dur_s"] == 0.06
    assert [s[1] for s in dec["steps"]] == [[1, 1001], [1, 1002], [1, 1003]]
    # two requests whose first tokens came in different steps: no lock-step, no decode run
    apart = [tl("a", 0.0, 64, [0.1, 0.12]), tl("b", 0.0, 64, [0.13, 0.15])]
    two = {k: 2 * v for k, v in delta.items() if k.endswith("_count")} | {
        vd.DECODE + "_sum": 0.04, vd.PREFILL + "_sum": 0.2}
    assert vd.engine_samples(apart, two, 512, "r") == []
    together = [tl("a", 0.0, 64, [0.1, 0.12]), tl("b", 0.0, 64, [0.101, 0.121])]
    kinds = [s["kind"] for s in vd.engine_samples(together, two, 512, "r")]
    assert kinds == ["prefill", "decode-run"]


def test_real_runs_give_decode_runs_and_the_request_path():
    from calibration.vllm import request_path_s

    lim = vl.limits()
    samples = [s for r in rows() for s in samples_of(r, lim)]
    sources = {s["source"] for s in samples}
    assert sources == {"token-gap", "vllm-prefill-time", "vllm-decode-time"}
    runs = [s for s in samples if s["kind"] == "decode-run"]
    assert len(runs) == 2 and all(len(s["steps"]) == 31 for s in runs)  # b1, 32 tokens
    assert 0.001 < request_path_s(rows()) < 0.2


def test_cache_config_labels_are_read_from_metrics():
    text = ('# HELP x\nvllm:cache_config_info{block_size="128",engine="0",'
            'num_gpu_blocks="24",enable_prefix_caching="True"} 1.0\n')
    assert cache_config(text) == {"block_size": "128", "engine": "0", "num_gpu_blocks": "24",
                                  "enable_prefix_caching": "True"}
    assert cache_config("vllm:other 1\n") == {}


# ---- the store and the profile ------------------------------------------------------------
def test_the_store_resumes_and_refuses_runs_of_another_server(tmp_path):
    out = tmp_path / "p.json"
    out.with_suffix(".runs.jsonl").write_text(RUNS.read_text())
    store = Store(out, IDENTITY)
    store.load()
    assert len(store.rows) == 8
    other = Store(out, IDENTITY | {"model": "Qwen3-8B"})
    with pytest.raises(CalibrationError, match=r"p\.runs\.jsonl:1 was profiled on another"):
        other.load()
    out.with_suffix(".runs.jsonl").write_text("{}\n")
    with pytest.raises(CalibrationError, match=r"p\.runs\.jsonl:1: not a vLLM profiling run"):
        Store(out, IDENTITY).load()


def profile_of(tmp_path: Path) -> Path:
    """A profile fitted on the real runs, its model a local copy of the harness's tiny
    Llama config (the twin sizes the KV pool from it)."""
    from runtime.cpu.model import write_config

    model_dir = tmp_path / MODEL
    model_dir.mkdir(exist_ok=True)
    write_config(model_dir)
    prof = fit_profile(rows(), vl.limits(), vl.SERVER_ARGS)
    prof["model"] = {"name": MODEL, "path": str(model_dir)}
    path = tmp_path / "vllm-profile.json"
    path.write_text(json.dumps(prof))
    return path


def test_the_profile_records_engine_model_and_device_and_fits_deterministically(tmp_path):
    a = fit_profile(rows(), vl.limits(), vl.SERVER_ARGS)
    b = fit_profile(rows(), vl.limits(), vl.SERVER_ARGS)
    assert a["engine"]["name"] == "vllm" and a["device"]["kind"] == "cpu"
    assert a["step_time"] == b["step_time"] and a["fit"] == b["fit"]
    assert a["server_args"]["num_gpu_blocks_override"] == 24
    assert a["fit"]["held_out_samples"] > 0 and a["step_time"]["coefficients"]["step"] > 0


def test_simulate_refuses_a_vllm_profile_even_with_force(tmp_path, capsys):
    from servetwin.cli import main

    path = profile_of(tmp_path)
    for extra in ([], ["--force"]):
        assert main(["simulate", "--calibration", str(path), "--workload",
                     "arrival=poisson,rate=1,n=3", *extra]) != 0
        err = capsys.readouterr().err
        assert "engine: profile 'vllm', asked 'sglang'" in err and "calibration: FILE" in err


# ---- deployments with calibration: FILE ------------------------------------------------
def deploy(tmp_path: Path, replica: str, pool_extra: str = "") -> Path:
    path = tmp_path / "dep.yaml"
    path.write_text("name: t\nrouter: {name: length, thresholds: [100]}\npools:\n"
                    "  - name: short\n    replicas:\n"
                    "      - {name: s, engine: sglang, server_args: {model_path: "
                    "Qwen/Qwen3-8B, tp_size: 1}}\n"
                    f"  - name: long{pool_extra}\n    replicas:\n      - {replica}\n")
    return path


def test_a_vllm_replica_takes_the_profiles_step_times_and_server(tmp_path):
    from twin.fleet import load_spec, simulate_fleet
    from twin.workload import from_spec

    profile_of(tmp_path)
    spec = load_spec(str(deploy(tmp_path, "{name: v, engine: vllm, calibration: "
                                          "vllm-profile.json}")))
    (v,) = [r for r in spec.replicas if r.name == "v"]
    args = dict(v.server_args)
    assert v.calibration == str(tmp_path / "vllm-profile.json")  # relative to the file
    assert args["num_gpu_blocks_override"] == 24 and args["max_num_batched_tokens"] == 512
    assert args["model"] == str(tmp_path / MODEL) and v.gpu == "a100-pcie-80gb"
    work = from_spec("arrival=poisson,rate=4,n=30,prompt=uniform:40:400,output=fixed:8", 1)
    a, b = simulate_fleet(spec, work), simulate_fleet(spec, work)
    assert a.records == b.records
    vr = [r for r in a.records if r["replica"] == "v"]
    assert vr and all(r["status"] == "ok" for r in vr)
    st = a.deployment.workers[1].replica.st
    coef = json.loads((tmp_path / "vllm-profile.json").read_text())["step_time"]["coefficients"]
    assert st.step_time([], [100]) == pytest.approx(
        coef["step"] + coef["decode_request"] + 100 * coef["decode_kv_token"])


def test_a_pools_calibration_applies_to_its_replicas(tmp_path):
    from twin.fleet import load_spec

    profile_of(tmp_path)
    path = deploy(tmp_path, "{name: v, engine: vllm, count: 2}",
                  "\n    calibration: vllm-profile.json")
    spec = load_spec(str(path))
    assert [r.calibration is not None for r in spec.replicas] == [False, True, True]


@pytest.mark.parametrize("replica, line_key, message", [
    ("{name: v, engine: sglang, calibration: vllm-profile.json}",
     "replicas[0].calibration", "a calibration profile of a vllm server, for a replica of "
     "engine sglang"),
    ("{name: v, engine: vllm, calibration: missing.json}", "replicas[0].calibration",
     "missing.json: cannot read"),
    ("{name: v, engine: vllm, calibration: vllm-profile.json, server_args: {model: "
     "Qwen/Qwen3-8B}}", "replicas[0].calibration", "model: profile "
     "'tiny-llama-l6-h512-v4096', replica 'Qwen3-8B'"),
    ("{name: v, engine: vllm, calibration: vllm-profile.json, gpu: h100-sxm-80gb}",
     "replicas[0].gpu", "measured a CPU server"),
    ("{name: v, engine: vllm, calibration: vllm-profile.json, step_time_backend: opdb}",
     "replicas[0].step_time_backend", "drop step_time_backend"),
    ("{name: v, engine: vllm, calibration: [a]}", "replicas[0].calibration",
     "must be the path of a calibration profile"),
])
def test_a_bad_calibration_is_named_by_file_line_and_key(tmp_path, replica, line_key,
                                                         message):
    from twin.fleet import load_spec

    profile_of(tmp_path)
    path = deploy(tmp_path, replica)
    with pytest.raises(ConfigError) as exc:
        load_spec(str(path))
    assert f"{path}:9: pools[1].{line_key}" in str(exc.value) and message in str(exc.value)


def test_an_sglang_profile_is_refused_for_a_vllm_replica(tmp_path):
    from twin.fleet import load_spec

    sg = {"servetwin_calibration": 1, "engine": {"name": "sglang", "version": "0.5.23"},
          "step_time": {"backend": "fitted", "form": "linear", "coefficients": {"step": 0.01}}}
    (tmp_path / "sg.json").write_text(json.dumps(sg))
    with pytest.raises(ConfigError, match="profile of a sglang server, for a replica of "
                                          "engine vllm"):
        load_spec(str(deploy(tmp_path, "{name: v, engine: vllm, calibration: sg.json}")))


def test_an_sglang_replica_takes_an_sglang_profiles_step_times(tmp_path, capsys):
    from runtime.cpu.model import write_config
    from servetwin.cli import main
    from twin.fleet import load_spec, simulate_fleet
    from twin.workload import from_spec

    bench = Path(__file__).parent / "data" / "bench_serving_cpu.jsonl"
    assert main(["calibrate", "--from-bench-serving", str(bench), "--out",
                 str(tmp_path / "sg.json")]) == 0
    capsys.readouterr()
    (tmp_path / MODEL).mkdir()
    write_config(tmp_path / MODEL)
    rep = ("{name: s, engine: sglang, %s server_args: {model_path: " + str(tmp_path / MODEL)
           + ", tp_size: 1, max_total_tokens: 16384, disable_cuda_graph: true}}")
    work = from_spec("arrival=poisson,rate=4,n=20,prompt=uniform:40:400,output=fixed:8", 2)
    runs = {}
    for name, cal in (("fitted", "calibration: sg.json,"), ("default", "")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: t\nreplicas:\n  - {rep % cal}\n")
        spec = load_spec(str(path))
        assert spec.replicas[0].calibration == (str(tmp_path / "sg.json") if cal else None)
        runs[name] = simulate_fleet(spec, work).records
    assert all(r["status"] == "ok" for r in runs["fitted"])
    # the CPU's fitted steps (tens of ms) against the GPU's step-time tables
    assert sum(r["e2e_s"] for r in runs["fitted"]) > 3 * sum(r["e2e_s"] for r in runs["default"])


def test_a_vllm_server_that_cannot_reset_its_prefix_cache_is_refused():
    """vLLM resets its prefix cache only in dev mode; a server answering 404 there (as
    vLLM without VLLM_SERVER_DEV_MODE does) is refused before any run, not profiled on a
    warm cache."""
    import http.server
    import threading

    from calibration.vllm import _check_reset

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(CalibrationError, match="VLLM_SERVER_DEV_MODE=1"):
            _check_reset(f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
        srv.server_close()
