"""Issue 12's examples: bad input gets one clear error (exit code 2), never a traceback, a
hang or numbers from nonsense. The CLI runs in-process (`servetwin.cli.main`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from servetwin.cli import main
from twin.errors import ConfigError, TraceError
from twin.inputs import read_text
from twin.traces import load_trace
from twin.workload import Workload, from_spec, get_workload

BASE = ["--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "1", "--gpu", "a100-sxm-80gb"]
SMALL = "n=5,prompt=fixed:100,output=fixed:10"


def cli_error(capsys, *args: str) -> str:
    """Run `servetwin ARGS`; assert exit code 2 and one error line; return that line."""
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "error:" in err, err
    return err


def simulate_error(capsys, *args: str) -> str:
    return cli_error(capsys, "simulate", *BASE, *args)


# ---- workload specs ----------------------------------------------------------------------
@pytest.mark.parametrize("spec,msg", [
    # used to hang: 0.5 passed the > 0 check, then became 0 clients
    ("arrival=closed,concurrency=0.5,n=5,prompt=fixed:100,output=fixed:10",
     "concurrency=0.5: must be an integer >= 1"),
    ("rate=nan,n=5", "rate=nan: must be a finite number > 0"),
    ("rate=inf,n=5", "rate=inf"),
    ("arrival=ramp,steps=", "steps='': fraction ''"),
    ("arrival=ramp,steps=0:0", "expects 0 requests"),
    ("arrival=ramp,steps=1:-1", "fraction '-1'"),
    ("n=0.5", "n=0.5: must be an integer"),
    ("n=2.5", "n=2.5: must be an integer"),
    ("n=0", "n=0: must be an integer in [1, "),
    ("share=2", "share=2: must be a finite number in [0, 1]"),
    ("templates=-3", "templates=-3: must be an integer"),
    ("templates=1.5", "templates=1.5"),
    ("system_prompt=-50", "system_prompt=-50: must be an integer"),
    ("template_len=0,templates=2", "template_len=0"),
    ("prompt=fixed:2.5", "'2.5': must be an integer"),
    ("prompt=fixed:nan", "'nan'"),
    ("prompt=uniform:1:1e12", "'1e12'"),
    ("prompt=lognormal:800:-1", "'-1'"),
    ("prompt=lognormal:800:50", "'50'"),
    ("output=empirical:5:0", "'0'"),
    ("tiers=0:nan", "weight 'nan'"),
    ("tiers=0:0/1:0", "must not all be 0"),
    ("tiers=0.5:1", "priority '0.5'"),
    ("tiers=0:1:2", "PRIORITY:WEIGHT"),
    ("arrival=gamma,cv=0", "cv=0"),
    ("rate=1e-300,n=5", "would span"),
    ("n=5,n=6", "given twice"),
    ("arrival=closed,rate=2", "rate has no effect with arrival=closed"),
    ("arrival=poisson,concurrency=4", "concurrency has no effect"),
    ("arrival=ramp,n=4", "n has no effect"),
])
def test_bad_workload_keys_are_refused_naming_key_and_value(spec, msg):
    with pytest.raises(ConfigError) as exc:
        get_workload(spec, 0)
    assert msg in str(exc.value)


@pytest.mark.parametrize("seed", [-1, 2**40, 1.5])
def test_bad_seed_is_refused(seed):
    with pytest.raises(ConfigError, match=r"--seed .*: must be an integer in \[0, 4294967295\]"):
        from_spec(SMALL, seed)
    with pytest.raises(ConfigError, match="--seed"):
        get_workload("finance-qa", seed)


def test_seed_minus_one_on_the_command_line(capsys):
    assert "--seed -1: must be an integer" in simulate_error(capsys, "--seed", "-1",
                                                             "--workload", SMALL)


def test_ramp_with_an_idle_step_still_runs():
    w = from_spec("arrival=ramp,rate=10,steps=1:0:1,step_s=10", 1)
    t = [r.arrival_s for r in w.requests]
    assert t and not any(10 <= x < 20 for x in t) and any(x >= 20 for x in t)


# ---- traces ------------------------------------------------------------------------------
DATA = Path(__file__).parent / "data"
REAL = {"azure": DATA / "azure_conv_300.csv", "mooncake": DATA / "mooncake_300.jsonl",
        "bench_serving": DATA / "bench_serving_cpu.jsonl"}


def _own_jsonl(tmp_path: Path) -> Path:
    p = tmp_path / "own.jsonl"
    p.write_text('{"rid": "a", "arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n'
                 '{"rid": "b", "arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2}\n')
    return p


def _trace(tmp_path: Path, fmt: str) -> Path:
    return _own_jsonl(tmp_path) if fmt == "jsonl" else REAL[fmt]


@pytest.mark.parametrize("fmt", ["azure", "mooncake", "bench_serving", "jsonl"])
def test_non_utf8_trace_names_file_and_byte_offset(tmp_path, capsys, fmt):
    data = _trace(tmp_path, fmt).read_bytes()
    two_lines = data.count(b"\n") > 1
    cut = data.index(b"\n") + 5 if two_lines else 5  # inside line 2 (or 1)
    bad = tmp_path / f"bad.{fmt}"
    bad.write_bytes(data[:cut] + b"\xff\xfe" + data[cut:])
    with pytest.raises(TraceError) as exc:
        load_trace(bad, fmt)
    line = 2 if two_lines else 1
    assert f"{bad}:{line}:" in str(exc.value) and f"byte offset {cut}" in str(exc.value)
    err = simulate_error(capsys, "--trace", str(bad), "--trace-format", fmt)
    assert f"byte offset {cut}" in err


def test_unreadable_trace_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_text(tmp_path, "--trace")  # a directory: read_bytes fails with an OSError


def test_azure_rows_earlier_than_the_first_are_sorted_not_dropped(tmp_path, capsys):
    lines = REAL["azure"].read_text().splitlines()
    header, rows = lines[0], lines[1:21]
    shuffled = rows[10:] + rows[:10]  # the first row is now later than 10 others
    p = tmp_path / "unsorted.csv"
    p.write_text("\n".join([header, *shuffled]) + "\n")
    w = load_trace(p, "azure")
    assert len(w.requests) == 20
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert w.requests[0].arrival_s == 0
    assert w.notes and "sorted" in w.notes[0]
    main(["simulate", *BASE, "--trace", str(p), "--trace-format", "azure"])
    out = capsys.readouterr()
    assert "requests 20:" in out.out and "warning:" in out.err and "sorted" in out.err


@pytest.mark.parametrize("rows,msg", [
    (['{"rid": "x", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}',
      '{"rid": "y", "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1}',
      '{"rid": "x", "arrival_s": 2, "prompt_tokens": 5, "output_tokens": 1}'],
     ":3: field 'rid': 'x' is also the rid at line 1"),
    (['{"rid": null, "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}'],
     ":1: field 'rid': None: must be a non-empty string or an integer"),
    (['{"rid": [1], "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}'], "'rid'"),
    (['{"rid": 7, "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}',
      '{"rid": "7", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}'],
     ":2: field 'rid': '7' is also the rid at line 1"),
    (['{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": Infinity}'], "output_tokens"),
    (['{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 1}'], "arrival_s"),
    (['{"arrival_s": true, "prompt_tokens": 5, "output_tokens": 1}'], "arrival_s"),
    (['{"arrival_s": 0, "prompt_tokens": 1e12, "output_tokens": 1}'], "prompt_tokens"),
    (['{"arrival_s": 0, "segments": [[1, true]], "output_tokens": 1}'], "segments"),
    (['{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "priority": 0.5}'],
     "priority"),
    (["[" * 100_000], "not JSON"),
])
def test_bad_jsonl_rows_name_line_and_field(tmp_path, rows, msg):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(p, "jsonl")
    assert msg in str(exc.value)


def _bench(tmp_path: Path, **fields) -> Path:
    run = json.loads(REAL["bench_serving"].read_text().splitlines()[-1])
    run.update(fields)
    p = tmp_path / "bench.jsonl"
    p.write_text(json.dumps(run) + "\n")
    return p


@pytest.mark.parametrize("fields,msg", [
    ({"max_concurrency": -3}, "'max_concurrency': -3 is not an integer >= 1"),  # hung
    ({"max_concurrency": 0}, "'max_concurrency': 0"),  # was silently open loop
    ({"max_concurrency": 1.5}, "'max_concurrency': 1.5"),
    ({"request_rate": 0}, "'request_rate': 0 is not a finite number > 0"),  # ZeroDivision
    ({"request_rate": -1}, "'request_rate'"),
    ({"request_rate": "fast"}, "'request_rate'"),
    ({"ttfts": ["x"]}, "'ttfts'"),
    ({"itls": [[0.1, -1]]}, "'itls'"),
    ({"input_lens": [5, 0], "output_lens": [1, 1], "ttfts": None, "itls": None},
     "'input_lens[1]'"),
])
def test_bad_bench_serving_runs_are_refused(tmp_path, fields, msg):
    with pytest.raises(TraceError) as exc:
        load_trace(_bench(tmp_path, **fields), "bench_serving")
    assert msg in str(exc.value)


def test_bench_serving_max_concurrency_minus_three_on_the_command_line(tmp_path, capsys):
    err = simulate_error(capsys, "--trace", str(_bench(tmp_path, max_concurrency=-3)),
                         "--trace-format", "bench_serving")
    assert "max_concurrency" in err


def test_workload_with_zero_clients_is_refused():
    with pytest.raises(ConfigError, match="concurrency"):
        Workload("w", (), concurrency=0)


@pytest.mark.parametrize("opts,msg", [
    ({"time_scale": float("nan")}, "--trace-time-scale nan"),
    ({"time_scale": float("inf")}, "--trace-time-scale inf"),
    ({"offset_s": -1.0}, "--trace-offset -1.0"),
    ({"offset_s": float("nan")}, "--trace-offset nan"),
    ({"limit": 0}, "--trace-limit 0"),
])
def test_bad_trace_options(opts, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_trace(REAL["azure"], "azure", **opts)


def test_csv_with_an_oversized_field_is_a_trace_error(tmp_path):
    p = tmp_path / "big.csv"
    p.write_text('TIMESTAMP,ContextTokens,GeneratedTokens\n"' + "x" * 200_000 + '",1,1\n')
    with pytest.raises(TraceError, match="not CSV"):
        load_trace(p, "azure")


# ---- server arguments and SGLang's start-up checks ------------------------------------
@pytest.mark.parametrize("args,msg", [
    (["--tp-size", "3"], "'32 is not divisible by 3'"),
    (["--context-length", "1000000"], "greater than the derived context_length (131072)"),
    (["--schedule-conservativeness", "nan"], "--schedule-conservativeness nan"),
    (["--schedule-conservativeness", "-1"], "--schedule-conservativeness -1.0"),
    (["--mem-fraction-static", "nan"], "--mem-fraction-static nan"),
    (["--chunked-prefill-size", "-5"], "--chunked-prefill-size -5: must be an integer in [-1, "),
    (["--chunked-prefill-size", "1000", "--page-size", "16"],
     "chunked_prefill_size must be divisible by page_size"),
    (["--enable-mixed-chunk", "--chunked-prefill-size", "-1"], "needs chunked prefill"),
])
def test_server_args_sglang_would_refuse(capsys, args, msg):
    assert msg in simulate_error(capsys, *args, "--workload", SMALL)


def test_kv_heads_that_neither_split_nor_replicate_evenly(tmp_path, capsys):
    cfg = {"hidden_size": 1536, "num_attention_heads": 24, "num_key_value_heads": 8,
           "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = cli_error(capsys, "simulate", "--model-path", str(tmp_path), "--tp-size", "12",
                    "--gpu", "a100-sxm-80gb", "--workload", SMALL)
    assert "8 KV heads" in err and "'12 is not divisible by 8'" in err


def test_longer_context_allowed_with_sglangs_override_variable(monkeypatch):
    from twin.config import ALLOW_LONGER_CONTEXT_ENV, ServerArgs, derive_capacity

    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=200_000)
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    assert derive_capacity(args, "a100-sxm-80gb").context_len == 200_000


# ---- twin-only flags -----------------------------------------------------------------------
@pytest.mark.parametrize("args,msg", [
    (["--slo-ttft", "nan"], "--slo-ttft nan"),
    (["--slo-tpot", "-1"], "--slo-tpot -1.0"),
    (["--slo-e2e", "0"], "--slo-e2e 0.0"),
    (["--horizon", "-1"], "--horizon -1.0"),
    (["--horizon", "nan"], "--horizon nan"),
    (["--preemption-threshold", "nan"], "--preemption-threshold nan"),
    (["--priority-weights", "nan,1,1"], "--priority-weights tier nan"),
    (["--priority-weights", "1,-1,1"], "--priority-weights wait -1.0"),
    (["--time-slice-ms", "nan"], "--time-slice-ms nan"),
    (["--kv-allocator", "buddy", "--buddy-min-block", "0"], "--buddy-min-block 0.0"),
    (["--kv-allocator", "buddy", "--buddy-min-block", "inf"], "--buddy-min-block inf"),
    (["--kv-allocator", "buddy", "--buddy-min-block", "1e14"], "larger than"),
    (["--kv-reserve-fraction", "1"], "--kv-reserve-fraction 1.0"),
    (["--host-kv-bytes", "nan"], "--host-kv-bytes nan"),
])
def test_twin_only_flags_are_checked(capsys, args, msg):
    assert msg in simulate_error(capsys, *args, "--workload", SMALL)


@pytest.mark.parametrize("args,msg", [
    (["--prompt-len", "-5"], "--prompt-len -5"),  # printed a negative concurrency
    (["--output-len", "0"], "--output-len 0"),
    (["--decode", "99999999x10"], "count 99999999"),
    (["--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "3"], "not divisible by 3"),
])
def test_perf_inputs_are_checked(capsys, args, msg):
    assert msg in cli_error(capsys, "perf", *args)


# ---- output ----------------------------------------------------------------------------------
def test_out_naming_an_existing_file_is_refused_before_the_run(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("keep me")
    err = simulate_error(capsys, "--workload", SMALL, "--out", str(f))
    assert "exists and is not a directory" in err
    assert f.read_text() == "keep me"


def test_out_under_a_file_is_refused_before_the_run(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    err = simulate_error(capsys, "--workload", SMALL, "--out", str(f / "sub"))
    assert "cannot write there" in err


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path):
    from twin.outputs import atomic_writer

    p = tmp_path / "requests.jsonl"
    p.write_text("old\n")
    with pytest.raises(KeyboardInterrupt), atomic_writer(p) as fh:
        fh.write("half a rec")
        raise KeyboardInterrupt
    assert p.read_text() == "old\n"
    assert [x.name for x in tmp_path.iterdir()] == ["requests.jsonl"]  # no temp file left


def test_records_written_atomically_by_a_run(tmp_path):
    from twin.metrics import read_records, write_records

    p = tmp_path / "requests.jsonl"
    recs = [{"rid": "a", "arrival_s": 0, "prompt_tokens": 1, "cached_tokens": 0,
             "output_tokens": 1, "priority": 0, "ttft_s": 0.1, "tpot_s": None, "itl_s": [],
             "e2e_s": 0.1, "queue_s": 0.0, "retractions": 0, "preemptions": 0,
             "status": "ok", "error": None}]
    write_records(p, recs)
    assert read_records(p) == recs


# ---- calibration profiles and record files ------------------------------------------------
@pytest.mark.parametrize("step_time,msg", [
    ({"form": "linear", "coefficients": {"step": "fast"}}, "coefficient step = 'fast'"),
    ({"form": "linear", "coefficients": {"step": float("nan")}}, "coefficient step = nan"),
    ({"form": "linear", "coefficients": {"step": -1}}, "coefficient step = -1"),
    ({"form": "linear", "coefficients": [1, 2]}, "must be an object"),
    ({"form": "roofline-correction", "coefficients": {"offset": 0.1}}, "offset and scale"),
    ({"form": "roofline-correction", "base": "roofline",
      "coefficients": {"offset": 0.1, "scale": None}}, "coefficient scale = None"),
])
def test_bad_profiles_are_refused(tmp_path, step_time, msg):
    from twin.config import ServerArgs, derive_capacity
    from twin.perf.fitted import profile_step_time

    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"step_time": step_time}))  # NaN as Python's json writes it
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
    with pytest.raises(ConfigError) as exc:  # used to be a ValueError/KeyError traceback
        profile_step_time(p, derive_capacity(args, "a100-sxm-80gb"), args)
    assert msg in str(exc.value)


def test_non_utf8_profile_and_records(tmp_path, capsys):
    p = tmp_path / "profile.json"
    p.write_bytes(b'{"step_time": {"form": "linear"\xff}}')
    assert "byte offset 31" in simulate_error(capsys, "--workload", SMALL, "--calibration",
                                              str(p))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "requests.jsonl").write_bytes(b'{"rid": "\xc3"}\n')
    err = cli_error(capsys, "live", "compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert "requests.jsonl:1:" in err and "byte offset 9" in err


def test_record_with_a_garbage_value_is_refused(tmp_path):
    from twin.metrics import RECORD_FIELDS, read_records

    rec = {"rid": "a", "arrival_s": 0, "prompt_tokens": 1, "cached_tokens": 0,
           "output_tokens": 1, "priority": 0, "ttft_s": "x", "tpot_s": None, "itl_s": [],
           "e2e_s": 0.1, "queue_s": 0.0, "retractions": 0, "preemptions": 0,
           "status": "ok", "error": None}
    assert set(rec) == set(RECORD_FIELDS)
    p = tmp_path / "requests.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceError, match="'ttft_s': 'x' is not a valid value"):
        read_records(p)


def test_non_utf8_bench_serving_for_calibrate(tmp_path, capsys):
    data = REAL["bench_serving"].read_bytes()
    p = tmp_path / "bench.jsonl"
    p.write_bytes(data[:10] + b"\xff" + data[10:])
    err = cli_error(capsys, "calibrate", "--from-bench-serving", str(p), "--out",
                    str(tmp_path / "prof.json"))
    assert "byte offset 10" in err


# ---- a local model's config.json and calibrate's own flags ---------------------------------
@pytest.mark.parametrize("change,msg", [
    ({"num_attention_heads": 0}, "field num_attention_heads 0: must be an integer"),
    ({"hidden_size": "abc"}, "field hidden_size 'abc'"),
    ({"num_hidden_layers": 2.5}, "field num_hidden_layers 2.5"),
    ({"max_position_embeddings": -1}, "field max_position_embeddings -1"),
    ({"quantization_config": "fp8", "torch_dtype": ["x"]}, None),  # odd types: defaults
])
def test_local_model_config_is_checked(tmp_path, change, msg):
    from twin.models import get_model

    cfg = {"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 2,
           "vocab_size": 4096, "max_position_embeddings": 2048} | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if msg is None:
        assert get_model(str(tmp_path)).num_heads == 8
        return
    with pytest.raises(ConfigError) as exc:  # used to be a ValueError/ZeroDivisionError
        get_model(str(tmp_path))
    assert msg in str(exc.value)


def test_calibrate_budget_and_out_are_checked_first(tmp_path, capsys):
    bench = str(REAL["bench_serving"])
    assert "--budget-s nan" in cli_error(capsys, "calibrate", "--from-bench-serving", bench,
                                         "--budget-s", "nan", "--out", str(tmp_path / "p.json"))
    assert "is a directory" in cli_error(capsys, "calibrate", "--from-bench-serving", bench,
                                         "--out", str(tmp_path))


# ---- deployment files (servetwin simulate --deployment) ----------------------------------
DEPLOYMENT = {"name": "t", "router": "round_robin",
              "replicas": [{"name": "a", "count": 2,
                            "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}


def _with(base: dict, path: str, value) -> dict:
    """`base` (deep-copied) with `value` at the dotted `path` ("replicas.0.twin")."""
    doc = json.loads(json.dumps(base))
    node, *keys = [doc, *path.split(".")]
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[keys[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,msg", [
    # used to crash (int("x"), a negative seed in numpy, SimPy's negative delay) or to
    # truncate 1.5 silently
    ("seed", "x", "seed: 'x': must be an integer in [0, 4294967295]"),
    ("seed", -1, "seed: -1: must be an integer"),
    ("seed", 1.5, "seed: 1.5: must be an integer"),
    ("poll_interval_s", -1, "poll_interval_s: -1: must be a finite number > 0"),
    ("poll_interval_s", "x", "poll_interval_s: 'x'"),
    ("failover", [1], "failover: must be a mapping"),
    ("faults", {"a": 1}, "faults: must be a list"),
    ("failover", {"health_check_timeout_secs": -1}, "failover.health_check_timeout_secs: "),
    # were accepted and failed only once the run was built, without file or line
    ("gpu", "h999", "gpu: 'h999': allowed values"),
    ("replicas.0.gpu", "h999", "replicas[0].gpu: 'h999'"),
    ("replicas.0.step_time_backend", "nope", "replicas[0].step_time_backend: 'nope'"),
    ("replicas.0.twin", {"kv_allocator": "nope"}, "replicas[0].twin.kv_allocator: 'nope'"),
    ("replicas.0.twin", {"time_slice_ms": -5}, "replicas[0].twin.time_slice_ms: "
     "--time-slice-ms -5: must be a finite number > 0"),
    ("replicas.0.twin", {"horizon_s": 5}, "replicas[0].twin.horizon_s: allowed:"),
    ("replicas.0.twin", [1], "replicas[0].twin: must be a mapping"),
    ("replicas.0.name", [1], "replicas[0].name: [1]: must be a name"),
    ("replicas.0.server_args.max_running_requests", -1,
     "replicas[0].server_args.max_running_requests: --max-running-requests -1"),
    # router parameters: were taken as they came
    ("router", {"name": "least_load", "poll_interval_s": -1},
     "router.poll_interval_s: -1: must be a finite number > 0"),
    ("router", {"name": "cache_aware", "cache_threshold": 2},
     "router.cache_threshold: 2: must be a finite number in [0, 1]"),
    ("router", {"name": "cache_aware", "balance_abs_threshold": -1},
     "router.balance_abs_threshold: -1: must be an integer >= 0"),
    ("router", {"name": "cache_aware", "cache_threshold": "0.5"},
     "router.cache_threshold: '0.5'"),
    ("router", {"name": "prefix_hash", "virtual_nodes": 0}, "router.virtual_nodes: 0"),
    ("faults", [{"kind": "crash", "replica": "a0", "at_s": -1}], "at_s -1: must be a finite number >= 0"),
])
def test_deployment_numbers_are_checked_with_file_line_and_key(tmp_path, capsys, path, value,
                                                              msg):
    f = tmp_path / "dep.json"
    f.write_text(json.dumps(_with(DEPLOYMENT, path, value), indent=1))
    err = cli_error(capsys, "simulate", "--deployment", str(f), "--workload", SMALL)
    assert re.search(rf"{re.escape(str(f))}:\d+: ", err), err
    assert msg in err, err


def test_deployment_error_names_the_line_of_the_key(tmp_path, capsys):
    f = tmp_path / "dep.yaml"
    f.write_text("name: t\nseed: 3\nrouter:\n  name: cache_aware\n  cache_threshold: 7\n"
                 "replicas:\n  - name: a\n    server_args: {model_path: meta-llama/Llama-3.1-8B}\n")
    err = cli_error(capsys, "simulate", "--deployment", str(f), "--workload", SMALL)
    assert f"{f}:5: router.cache_threshold: 7" in err, err


# ---- policy specs (--policy FILE) --------------------------------------------------------
@pytest.mark.parametrize("name,params,msg", [
    # were accepted: a negative seed, a zero TPOT target, negative or infinite score
    # weights, a threshold outside SGLang's priority range
    ("random", {"seed": -1}, "params.seed = -1: must be an integer >= 0"),
    ("menu", {"tpot_s": 0.0}, "params.tpot_s = 0.0: must be > 0"),
    ("slices", {"weights": [1, -1, 0]}, "params.weights = [1, -1, 0]: must be [tier, wait, "
     "speed], three numbers >= 0"),
    ("slices", {"weights": [1, 1e999, 0]}, "every number must be finite"),
    ("fcfs", {"preemption_threshold": 2**40}, "must be an integer in [-2147483648, "),
    ("slices", {"time_slice_ms": 0.0}, "params.time_slice_ms = 0.0: must be > 0"),
    # were refused with Python's own words ("cannot unpack non-iterable int object")
    ("menu", {"tier_ttft_s": [-1, 2]}, "must be a list of [priority, ttft_s] pairs"),
    ("deadline", {"tier_ttft_s": [[0, -2.0]]}, "a TTFT target > 0"),
    ("menu", {"prefill": [0.01, 0.001, 0, 0]}, "chunk an integer >= 1"),
    ("deadline", {"chunk": 0}, "params.chunk = 0: must be an integer >= 1"),
])
def test_policy_spec_numbers_are_checked_with_file_line_and_key(tmp_path, capsys, name, params,
                                                               msg):
    f = tmp_path / "policy.json"
    f.write_text(json.dumps({"name": name, "params": params}, indent=2).replace(
        "Infinity", "1e999"))
    err = simulate_error(capsys, "--workload", SMALL, "--policy", str(f))
    assert f"{f}:4: " in err and msg in err, err


@pytest.mark.parametrize("fault,msg", [
    ("slow:sg0:1:inf:5", "factor inf: must be a finite number > 0"),  # was accepted
    ("crash:sg0:1:2:3:4", "crash takes at most 2 numbers"),  # the extra ones were ignored
    ("crash:sg0:nan:5", "at_s nan: must be a finite number >= 0"),
    ("hang:sg0:1e400:1", "at_s inf: must be a finite number >= 0"),
])
def test_fault_flags_are_checked(capsys, fault, msg):
    err = cli_error(capsys, "simulate", "--deployment", "finance-sglang-pool", "--workload",
                    SMALL, "--fault", fault)
    assert msg in err, err


@pytest.mark.parametrize("args,msg", [  # found by the deployment fuzzer: a crash, a "yes"
    ({"page_size": None}, "replicas[0].server_args.page_size: --page-size None: must be "
     "given (default 1), not null"),
    ({"enable_mixed_chunk": "yes"}, "--enable-mixed-chunk 'yes': must be true or false"),
])
def test_deployment_server_args_of_the_wrong_kind(tmp_path, capsys, args, msg):
    f = tmp_path / "dep.json"
    doc = _with(DEPLOYMENT, "replicas.0.server_args", {**DEPLOYMENT["replicas"][0][
        "server_args"], **args})
    f.write_text(json.dumps(doc, indent=1))
    err = cli_error(capsys, "simulate", "--deployment", str(f), "--workload", SMALL)
    assert msg in err, err
