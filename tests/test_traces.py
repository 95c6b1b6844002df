"""Trace readers on real trace slices, and their errors."""

import json

import pytest

from twin.errors import ConfigError, TraceError
from twin.traces import load_trace

DATA = __import__("pathlib").Path(__file__).parent / "data"


def test_azure_conv_slice():
    w = load_trace(DATA / "azure_conv_300.csv", "azure")
    assert len(w.requests) == 300
    first = w.requests[0]
    assert first.arrival_s == 0 and first.prompt_tokens == 374 and first.output_tokens == 44
    assert w.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert len({r.segments[0][0] for r in w.requests}) == 300  # no sharing info: unique


def test_mooncake_blocks_become_segments_and_share_prefixes():
    w = load_trace(DATA / "mooncake_300.jsonl", "mooncake")
    r0 = w.requests[0]
    assert r0.prompt_tokens == 40160 and r0.segments[0] == (0, 512)
    assert r0.segments[-1] == (78, 40160 - 78 * 512)  # the last block is partial
    firsts = [r.segments[0][0] for r in w.requests]
    assert len(set(firsts)) < len(firsts)  # real shared prefixes


def test_time_scale_offset_limit():
    base = load_trace(DATA / "mooncake_300.jsonl", "mooncake")
    w = load_trace(DATA / "mooncake_300.jsonl", "mooncake", time_scale=2.0, offset_s=10.0,
                   limit=50)
    assert len(w.requests) == 50 and w.requests[0].arrival_s >= 0
    kept = [r for r in base.requests if r.arrival_s >= 10.0][:50]
    assert [r.rid for r in w.requests] == [r.rid for r in kept]
    assert w.requests[-1].arrival_s == pytest.approx((kept[-1].arrival_s - 10.0) * 2)


def test_own_jsonl_with_segments(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"rid": "a", "arrival_s": 0.5, "output_tokens": 3,
                             "segments": [[1, 10], [2, 5]], "priority": 4}) + "\n"
                 + json.dumps({"arrival_s": 1, "output_tokens": 2, "prompt_tokens": 9}) + "\n")
    w = load_trace(p, "jsonl")
    assert w.requests[0].segments == ((1, 10), (2, 5)) and w.requests[0].priority == 4
    assert w.requests[1].prompt_tokens == 9


@pytest.mark.parametrize("fmt,text,line,field", [
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
     2, "timestamp"),
    ("mooncake", '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n',
     1, "hash_ids"),
    ("jsonl", '{"arrival_s": 0, "output_tokens": 2}\n', 1, "prompt_tokens"),
    ("jsonl", 'not json\n', 1, "<line>"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n", 2,
     "GeneratedTokens"),
    ("azure", "TIMESTAMP,ContextTokens\n", 1, "GeneratedTokens"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, fmt, text, line, field):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(TraceError) as err:
        load_trace(p, fmt)
    assert err.value.line == line and err.value.field == field
    assert str(p) in str(err.value)


def test_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="allowed values"):
        load_trace(DATA / "mooncake_300.jsonl", "csv")
    with pytest.raises(ConfigError, match="no such file"):
        load_trace(tmp_path / "missing", "jsonl")
    with pytest.raises(ConfigError, match="time-scale"):
        load_trace(DATA / "mooncake_300.jsonl", "mooncake", time_scale=0)


def test_bench_serving_real_output():
    path = DATA / "bench_serving_cpu.jsonl"
    if not path.exists():
        pytest.skip("bench_serving_cpu.jsonl not recorded yet")
    w = load_trace(path, "bench_serving")
    run = json.loads(path.read_text().splitlines()[-1])
    assert [r.prompt_tokens for r in w.requests] == run["input_lens"]
    assert [r.output_tokens for r in w.requests] == run["output_lens"]
    assert w.reference["bs0"]["ttft_s"] == run["ttfts"][0]
