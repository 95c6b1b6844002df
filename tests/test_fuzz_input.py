"""Fuzzing where input enters: workload specs, every trace format (structured rows and raw
bytes), calibration profiles and record files. The property everywhere: a clear
`ServetwinError` or a valid result, never another exception.

A hang cannot happen by construction here: parsing has no unbounded loop (counts and spans
are capped in `twin.inputs`), and simulated workloads are small. Hypothesis's deadline is
off (no wall-clock bounds); CI runs these derandomized (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.config import ServerArgs, derive_capacity
from twin.errors import ServetwinError
from twin.metrics import RECORD_FIELDS, read_records
from twin.traces import load_trace
from twin.workload import SPEC_KEYS, Workload, get_workload


def fuzz(examples: int) -> settings:
    """Settings for one property: the loaded profile (CI: derandomized) with `examples`
    examples and no deadline."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
DATA = Path(__file__).parent / "data"

# Numbers as users type them, the edges included.
NUMBER_TEXT = st.one_of(
    st.sampled_from(["0", "-1", "0.5", "1", "2", "3", "10", "nan", "inf", "-inf", "1e400",
                     "1e-300", "", "abc", "1e7", "2.5", "-0", "0x10", "1_000"]),
    st.integers(-5, 300).map(str),
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(repr),
)
LENGTH_TEXT = st.one_of(
    st.tuples(st.sampled_from(["fixed", "uniform", "lognormal", "empirical", "weird", ""]),
              st.lists(NUMBER_TEXT, max_size=4)).map(lambda t: ":".join([t[0], *t[1]])),
    st.text(max_size=12),
)
VALUE_TEXT = {
    "arrival": st.sampled_from(["poisson", "gamma", "closed", "ramp", "bogus", ""]),
    "prompt": LENGTH_TEXT, "output": LENGTH_TEXT,
    "steps": st.lists(NUMBER_TEXT, max_size=5).map(":".join),
    "tiers": st.lists(st.tuples(NUMBER_TEXT, NUMBER_TEXT).map(":".join), max_size=3)
    .map("/".join),
}


@st.composite
def specs(draw) -> str:
    keys = draw(st.lists(st.sampled_from([*SPEC_KEYS, "bogus"]), max_size=8))
    items = [f"{k}={draw(VALUE_TEXT.get(k, NUMBER_TEXT))}" for k in keys]
    if draw(st.booleans()):
        items.append(draw(st.text(max_size=10)))
    return ",".join(items)


def assert_valid(w: Workload, *, sorted_arrivals: bool = True) -> None:
    assert isinstance(w, Workload)
    assert w.concurrency is None or w.concurrency >= 1
    arrivals = [r.arrival_s for r in w.requests]
    assert all(math.isfinite(t) and t >= 0 for t in arrivals)
    if sorted_arrivals:
        assert arrivals == sorted(arrivals)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in w.requests)
    assert all(n >= 1 for r in w.requests for _, n in r.segments)
    assert len({r.rid for r in w.requests}) == len(w.requests)


@fuzz(400)
@given(spec=specs(), seed=st.one_of(st.integers(-3, 2**33), st.just(0)))
def test_workload_specs_give_an_error_or_a_valid_workload(spec, seed):
    try:
        w = get_workload(spec, seed)
    except ServetwinError:
        return
    assert_valid(w)


@fuzz(30)
@given(spec=specs(), seed=st.integers(0, 100))
def test_small_spec_workloads_simulate_without_crashing(spec, seed):
    from twin.sim import SimConfig, simulate

    try:
        w = get_workload(spec, seed)
    except ServetwinError:
        return
    if len(w.requests) > 40 or max(r.prompt_tokens + r.output_tokens for r in w.requests) > 20_000:
        return  # keep each example small; the spec parser is the subject here
    cfg = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B"), gpu="a100-sxm-80gb",
                    step_time_backend="roofline", debug_checks=True)
    result = simulate(w, cfg)
    assert len(result.records) == len(w.requests)  # every request that entered, once


# ---- traces: structured rows ---------------------------------------------------------------
JSON_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.integers(-3, 2**20), max_size=4),
    st.lists(st.lists(st.integers(-3, 600), max_size=3), max_size=3),
)
FIELDS = {
    "mooncake": ["timestamp", "input_length", "output_length", "hash_ids"],
    "jsonl": ["rid", "arrival_s", "output_tokens", "priority", "segments", "prompt_tokens"],
    "bench_serving": ["input_lens", "output_lens", "request_rate", "max_concurrency", "ttfts",
                      "itls"],
}
GOOD = {  # a good value per field, so that rows get deep into the readers
    "timestamp": st.integers(0, 10_000), "input_length": st.integers(1, 2000),
    "output_length": st.integers(1, 50),
    "hash_ids": st.lists(st.integers(0, 5), min_size=1, max_size=4),
    "rid": st.sampled_from(["a", "b", "c", 1, 2]), "arrival_s": st.floats(0, 100),
    "output_tokens": st.integers(1, 50), "priority": st.integers(-3, 3),
    "segments": st.lists(st.tuples(st.integers(0, 3), st.integers(1, 99)).map(list),
                         min_size=1, max_size=3),
    "prompt_tokens": st.integers(1, 500),
    "input_lens": st.lists(st.integers(1, 300), min_size=1, max_size=4),
    "output_lens": st.lists(st.integers(1, 30), min_size=1, max_size=4),
    "request_rate": st.sampled_from([1.0, 2.5, "inf", None]),
    "max_concurrency": st.sampled_from([None, 1, 4]),
    "ttfts": st.lists(st.floats(0, 2), max_size=4),
    "itls": st.lists(st.lists(st.floats(0, 1), max_size=3), max_size=4),
}


@st.composite
def json_rows(draw, fmt: str) -> list[dict]:
    rows = []
    for _ in range(draw(st.integers(0, 5))):
        row = {}
        for key in FIELDS[fmt]:
            choice = draw(st.integers(0, 9))
            if choice < 6:
                row[key] = draw(GOOD[key])
            elif choice < 9:
                row[key] = draw(JSON_VALUE)
        rows.append(row)
    return rows


def _load(path: Path, fmt: str) -> None:
    try:
        w = load_trace(path, fmt)
    except ServetwinError:
        return
    assert_valid(w)


@fuzz(150)
@given(data=st.data(), fmt=st.sampled_from(sorted(FIELDS)))
def test_structured_json_traces(tmp_path, data, fmt):
    rows = data.draw(json_rows(fmt))
    p = tmp_path / f"t.{fmt}"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")  # NaN/Infinity as Python writes
    _load(p, fmt)


CSV_CELL = st.one_of(
    st.sampled_from(["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:40", "2023-13-40 99:00",
                     "", "x", "1", "-5", "1e9", "nan", '"', "a,b"]),
    st.integers(-5, 5000).map(str), st.text(max_size=8),
)


@fuzz(150)
@given(header=st.sampled_from(["TIMESTAMP,ContextTokens,GeneratedTokens",
                               "TIMESTAMP,ContextTokens", "GeneratedTokens,ContextTokens,TIMESTAMP",
                               "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens", ""]),
       rows=st.lists(st.lists(CSV_CELL, min_size=0, max_size=4), max_size=6))
def test_structured_azure_csv(tmp_path, header, rows):
    p = tmp_path / "t.csv"
    p.write_text("\n".join([header, *(",".join(r) for r in rows)]) + "\n")
    _load(p, "azure")


# ---- traces: raw bytes -----------------------------------------------------------------------
def _mutated(real: bytes):
    """Raw bytes near a real file: cut, spliced with random bytes, or wholly random."""
    return st.one_of(
        st.binary(max_size=300),
        st.tuples(st.integers(0, len(real)), st.binary(max_size=8), st.integers(0, 40)).map(
            lambda t: real[:t[0]] + t[1] + real[t[0] + t[2]:]),
    )


REAL = {"azure": DATA / "azure_conv_300.csv", "mooncake": DATA / "mooncake_300.jsonl",
        "bench_serving": DATA / "bench_serving_cpu.jsonl"}
HEADS = {fmt: path.read_bytes()[:3000] for fmt, path in REAL.items()}
HEADS["jsonl"] = (b'{"rid": "a", "arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n'
                  b'{"rid": "b", "arrival_s": 1, "segments": [[1, 5], [2, 7]], '
                  b'"output_tokens": 2}\n')


@fuzz(300)
@given(data=st.data(), fmt=st.sampled_from(sorted(HEADS)))
def test_raw_bytes_in_every_trace_format(tmp_path, data, fmt):
    blob = data.draw(_mutated(HEADS[fmt] if fmt != "bench_serving" else
                              REAL[fmt].read_bytes()))
    p = tmp_path / f"raw.{fmt}"
    p.write_bytes(blob)
    _load(p, fmt)


# ---- calibration profiles and record files ------------------------------------------------
@st.composite
def profiles(draw) -> object:
    from twin.perf.fitted import FORMS, TERMS

    coef = {t: draw(st.one_of(st.floats(0, 0.01), JSON_VALUE))
            for t in draw(st.lists(st.sampled_from([*TERMS, "offset", "scale", "bogus"]),
                                   max_size=5))}
    section = {"form": draw(st.sampled_from([*FORMS, "cubic", None])),
               "coefficients": draw(st.one_of(st.just(coef), JSON_VALUE)),
               "base": draw(st.sampled_from(["roofline", "roofline-cpu", "nope", 3]))}
    profile = {"step_time": section, "model": {"name": draw(st.sampled_from(
        ["Llama-3.1-8B", "tiny", None]))}, "device": {"tp_size": draw(JSON_VALUE)}}
    return draw(st.one_of(st.just(profile), JSON_VALUE))


CAP_ARGS = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
CAP = derive_capacity(CAP_ARGS, "a100-sxm-80gb")


@fuzz(200)
@given(profile=profiles(), raw=st.one_of(st.none(), st.binary(max_size=60)))
def test_profiles_give_an_error_or_a_usable_step_time(tmp_path, profile, raw):
    from twin.perf.fitted import profile_step_time

    p = tmp_path / "profile.json"
    p.write_bytes(raw if raw is not None else json.dumps(profile).encode())
    try:
        st_model = profile_step_time(p, CAP, CAP_ARGS)
    except ServetwinError:
        return
    t = st_model.step_time([(100, 0)], [50, 60])
    assert math.isfinite(t) and t >= 0


RECORD = {"rid": "a", "arrival_s": 0.0, "prompt_tokens": 5, "cached_tokens": 0,
          "output_tokens": 2, "priority": 0, "ttft_s": 0.1, "tpot_s": 0.01, "itl_s": [0.01],
          "e2e_s": 0.11, "queue_s": 0.0, "retractions": 0, "preemptions": 0, "status": "ok",
          "error": None}


@fuzz(150)
@given(changes=st.lists(st.tuples(st.sampled_from(RECORD_FIELDS), JSON_VALUE), max_size=3),
       drop=st.lists(st.sampled_from(RECORD_FIELDS), max_size=1),
       raw=st.one_of(st.none(), st.binary(max_size=80)))
def test_record_files_for_compare(tmp_path, changes, drop, raw):
    from twin.compare import compare_records

    rec = dict(RECORD) | dict(changes)
    for key in drop:
        rec.pop(key, None)
    p = tmp_path / "requests.jsonl"
    p.write_bytes(raw if raw is not None else (json.dumps(rec) + "\n").encode())
    try:
        recs = read_records(p)
    except ServetwinError:
        return
    compare_records(recs, [dict(RECORD)])


# ---- what a live server streams back (runtime/recording.py) -------------------------------
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 40),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5))
META_VALUE = st.recursive(JSON_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
META_KEYS = st.sampled_from(["completion_tokens", "prompt_tokens", "cached_tokens",
                             "num_retractions", "queue_time", "finish_reason",
                             "weight_version", "other"])
META = st.one_of(META_VALUE, st.dictionaries(META_KEYS, META_VALUE, max_size=6),
                 st.fixed_dictionaries({"completion_tokens": st.integers(-2, 12)},
                                       optional={"queue_time": JSON_SCALAR,
                                                 "finish_reason": META_VALUE}))


@fuzz(300)
@given(st.lists(META, min_size=0, max_size=8))
def test_any_streamed_meta_info_gives_a_valid_record(tmp_path_factory, metas):
    """Chunks of any shape: each is taken or refused (ValueError, the request fails), and
    the record is always one `read_records` accepts, with strict JSON (no NaN)."""
    from runtime.recording import StreamLog
    from twin.workload import Request

    log = StreamLog(Request.make("r", 0.0, [(1, 8)], 10), 0.0, 100.0)
    for i, meta in enumerate(metas):
        try:
            log.on_chunk(100.0 + 0.01 * (i + 1), meta)
        except ValueError as exc:
            log.fail("failed", f"unreadable stream from the server: {exc}")
            break
    rec = log.record()
    path = tmp_path_factory.mktemp("rec") / "requests.jsonl"
    path.write_text(json.dumps(rec, allow_nan=False) + "\n")
    assert read_records(path) == [rec]
    assert rec["status"] != "ok" or rec["output_tokens"] == 10


# ---- deployment files (twin/fleet.py) -----------------------------------------------------
_DEP_PATHS = st.sampled_from([
    ("seed",), ("poll_interval_s",), ("gpu",), ("name",), ("failover",), ("faults",),
    ("router",), ("router", "cache_threshold"), ("router", "poll_interval_s"),
    ("router", "balance_abs_threshold"), ("router", "virtual_nodes"),
    ("replicas", 0, "count"), ("replicas", 0, "gpu"), ("replicas", 0, "name"),
    ("replicas", 0, "twin"), ("replicas", 0, "twin", "time_slice_ms"),
    ("replicas", 0, "twin", "kv_allocator"), ("replicas", 0, "server_args", "page_size"),
    ("replicas", 0, "server_args", "max_running_requests"), ("replicas", 0, "engine"),
    ("failover", "retry_max_retries"), ("failover", "health_check_interval_secs"),
    ("router", "name"), ("replicas", 0, "server_args", "enable_mixed_chunk"),
])
_ROUTERS = st.sampled_from(["round_robin", "cache_aware", "least_load", "prefix_hash",
                            "power_of_two", "random"])


@fuzz(150)
@given(_ROUTERS, st.lists(st.tuples(_DEP_PATHS, META_VALUE), max_size=3))
def test_any_deployment_file_gives_a_clear_error_or_a_fleet(router, changes):
    import simpy

    from twin.fleet import build_fleet, parse_spec

    doc = {"name": "f", "router": {"name": router},
           "replicas": [{"name": "a", "count": 2,
                         "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}
    for path, value in changes:
        node = doc
        for key in path[:-1]:
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
            if not isinstance(node, dict | list):
                break
        else:
            if isinstance(node, dict):
                node[path[-1]] = value
    try:
        spec = parse_spec(json.dumps(doc), "dep.json")
        build_fleet(simpy.Environment(), spec, get_workload(
            "n=3,prompt=fixed:20,output=fixed:2", 0))
    except ServetwinError:
        pass


# ---- policy specs (twin/policy/registry.py) -----------------------------------------------
@fuzz(120)
@given(st.data())
def test_any_policy_spec_gives_a_clear_error_or_a_policy_that_keeps_the_contract(data):
    from twin.policy import PolicyError, build_policy, policy_names, spec_from_dict
    from twin.policy.check import check_policy, sample_snapshots
    from twin.policy.registry import policy_params

    name = data.draw(st.sampled_from([n for n in policy_names() if n != "learned"]))
    keys = sorted(policy_params(name))
    number = st.one_of(st.integers(-3, 10**6), st.floats(-1e6, 1e12), st.sampled_from(
        [0, 0.0, 1e-300, 2**31, 1e308]))
    value = st.one_of(META_VALUE, number, st.lists(number, max_size=4),
                      st.lists(st.lists(number, min_size=2, max_size=2), max_size=3),
                      st.sampled_from(["edf", "laxity", "fcfs", "spf", "moderate", "off"]))
    params = data.draw(st.dictionaries(st.sampled_from(keys), value, max_size=3)
                       if keys else st.just({}))
    try:
        policy = build_policy(spec_from_dict({"name": name, "params": params}, "p.json"))
    except PolicyError:
        return
    check_policy(policy, sample_snapshots()[:20])
