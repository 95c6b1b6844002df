"""Offline pieces of live replay: token ids, stream arithmetic, the comparison math."""

from __future__ import annotations

import json

import pytest

from runtime.client import build_body, percentiles_ms
from runtime.recording import StreamLog
from runtime.token_ids import FIRST_ID, MAX_ID, SegmentTokens
from twin.compare import Row, compare_records, format_markdown, format_table, join_by_rid
from twin.metrics import RECORD_FIELDS
from twin.workload import Request

pytestmark = pytest.mark.offline


# ---- token ids ----------------------------------------------------------------------------
def test_same_hash_gives_same_ids_across_instances_and_requests():
    a, b = SegmentTokens(4096, seed=3), SegmentTokens(4096, seed=3)
    assert a.segment(1001, 200) == b.segment(1001, 200)
    p1 = a.prompt(((1001, 200), (5, 40)))
    p2 = b.prompt(((1001, 200), (6, 40)))
    assert p1[:200] == p2[:200] and p1[200:] != p2[200:]


def test_shorter_segment_is_a_prefix_of_the_longer():
    t = SegmentTokens(4096)
    assert t.segment(77, 512)[:100] == t.segment(77, 100)


def test_ids_stay_in_the_ordinary_range():
    small = SegmentTokens(4096).segment(9, 5000)
    assert min(small) >= FIRST_ID and max(small) < 4096
    big = SegmentTokens(152_064).segment(9, 5000)
    assert min(big) >= FIRST_ID and max(big) < MAX_ID


def test_seed_and_hash_change_the_ids():
    t0, t1 = SegmentTokens(4096, seed=0), SegmentTokens(4096, seed=1)
    assert t0.segment(5, 50) != t1.segment(5, 50)
    assert t0.segment(5, 50) != t0.segment(6, 50)


def test_odd_hashes_are_accepted():
    t = SegmentTokens(4096)
    for h in (-1, 0, 1 << 40, (1 << 70) + 3):
        assert len(t.segment(h, 8)) == 8
    assert t.segment(1 << 70, 8) != t.segment(0, 8)  # bits above 64 count


def test_tiny_vocab_is_refused():
    with pytest.raises(ValueError, match="no ordinary token ids"):
        SegmentTokens(4)


def test_body_carries_the_request():
    req = Request.make("r7", 0.0, [(1, 10), (2, 5)], 12, priority=10)
    tokens = SegmentTokens(4096)
    body = json.loads(build_body(req, tokens, priority=True))
    assert body["rid"] == "r7" and body["stream"] is True
    assert body["input_ids"] == tokens.prompt(req.segments) and len(body["input_ids"]) == 15
    assert body["sampling_params"] == {"max_new_tokens": 12, "ignore_eos": True,
                                       "temperature": 0.0}
    assert body["priority"] == 10
    assert "priority" not in json.loads(build_body(req, tokens, priority=False))


# ---- stream arithmetic ----------------------------------------------------------------------
def _meta(done: int, finish: bool = False, **extra) -> dict:
    meta = {"completion_tokens": done, "prompt_tokens": 15, "cached_tokens": 4,
            "queue_time": 0.01, "num_retractions": 0}
    if finish:
        meta["finish_reason"] = {"type": "length", "length": done}
    return meta | extra


def test_chunk_with_several_tokens_gives_zero_gaps():
    req = Request.make("r", 0.0, [(1, 15)], 5)
    log = StreamLog(req, arrival_s=1.0, sent_at=10.0)
    log.on_chunk(10.5, _meta(1))
    log.on_chunk(10.6, _meta(3))  # two tokens at once
    log.on_chunk(10.8, _meta(5, finish=True))
    rec = log.record()
    assert rec["status"] == "ok" and rec["error"] is None
    assert rec["ttft_s"] == pytest.approx(0.5)
    assert rec["e2e_s"] == pytest.approx(0.8)
    assert rec["itl_s"] == pytest.approx([0.1, 0.0, 0.2, 0.0])
    assert len(rec["itl_s"]) == rec["output_tokens"] - 1
    assert sum(rec["itl_s"]) == pytest.approx(rec["e2e_s"] - rec["ttft_s"])
    assert rec["tpot_s"] == pytest.approx(0.3 / 4)
    assert (rec["cached_tokens"], rec["queue_s"], rec["prompt_tokens"]) == (4, 0.01, 15)
    assert rec["arrival_s"] == 1.0 and rec["preemptions"] == 0
    assert tuple(rec) == RECORD_FIELDS  # exactly the twin's shared schema, in its order


def test_first_chunk_with_several_tokens():
    log = StreamLog(Request.make("r", 0.0, [(1, 15)], 3), 0.0, 0.0)
    log.on_chunk(0.2, _meta(3, finish=True))
    rec = log.record()
    assert rec["ttft_s"] == pytest.approx(0.2) and rec["itl_s"] == [0.0, 0.0]


def test_short_output_and_unfinished_streams_fail():
    log = StreamLog(Request.make("r", 0.0, [(1, 15)], 5), 0.0, 0.0)
    log.on_chunk(0.1, _meta(3, finish=True))
    assert log.record()["status"] == "failed" and "3 output tokens, 5" in log.record()["error"]
    log = StreamLog(Request.make("r", 0.0, [(1, 15)], 5), 0.0, 0.0)
    log.on_chunk(0.1, _meta(1))
    rec = log.record()
    assert rec["status"] == "failed" and "without a finished response" in rec["error"]
    assert rec["e2e_s"] is None and rec["ttft_s"] == pytest.approx(0.1)


def test_server_abort_and_explicit_failures():
    log = StreamLog(Request.make("r", 0.0, [(1, 15)], 5), 0.0, 0.0)
    log.on_chunk(0.1, _meta(1, finish_reason={"type": "abort", "message": "gone"}))
    assert log.record()["status"] == "aborted" and "gone" in log.record()["error"]
    log = StreamLog(Request.make("r", 0.0, [(1, 15)], 5), 0.0, 0.0)
    log.fail("failed", "connection error: reset")
    log.fail("aborted", "later reasons do not overwrite the first")
    rec = log.record()
    assert (rec["status"], rec["error"]) == ("failed", "connection error: reset")
    assert rec["output_tokens"] == 0 and rec["itl_s"] == [] and rec["prompt_tokens"] == 15


def test_lateness_percentiles():
    assert percentiles_ms([]) == {"p50": None, "p99": None, "max": None, "n": 0}
    out = percentiles_ms([0.001] * 99 + [0.5])
    assert out["p50"] == pytest.approx(1.0) and out["max"] == pytest.approx(500.0)


# ---- comparison math ------------------------------------------------------------------------
def _rec(rid: str, ttft: float, e2e: float, out: int = 3, cached: int = 0,
         status: str = "ok", t: float = 0.0) -> dict:
    gap = (e2e - ttft) / (out - 1)
    return {"rid": rid, "arrival_s": t, "prompt_tokens": 100, "cached_tokens": cached,
            "output_tokens": out, "priority": 0, "ttft_s": ttft, "tpot_s": gap,
            "itl_s": [gap] * (out - 1), "e2e_s": e2e, "queue_s": 0.0, "retractions": 0,
            "preemptions": 0, "status": status, "error": None}


def test_relative_error_is_signed_against_b():
    assert Row("x", "ms", 120.0, 100.0).rel_err == pytest.approx(0.2)
    assert Row("x", "ms", 80.0, 100.0).rel_err == pytest.approx(-0.2)
    assert Row("x", "ms", 1.0, 0.0).rel_err is None
    assert Row("x", "ms", None, 1.0).rel_err is None


def test_compare_records_hand_arithmetic():
    a = [_rec("r0", 0.2, 1.2, cached=50), _rec("r1", 0.2, 1.2)]
    b = [_rec("r0", 0.1, 1.0), _rec("r1", 0.1, 1.0)]
    cmp = compare_records(a, b)
    assert cmp.matched == 2 and cmp.only_a == cmp.only_b == 0 and not cmp.warnings()
    ttft = cmp.row("TTFT p50")
    assert (ttft.a, ttft.b) == pytest.approx((200.0, 100.0)) and ttft.rel_err == pytest.approx(1)
    assert cmp.row("ITL p99").rel_err == pytest.approx(0.5 / 0.45 - 1)
    thr = cmp.row("throughput")  # 2 requests over the last end (1.2 s vs 1.0 s)
    assert thr.a == pytest.approx(2 / 1.2) and thr.b == pytest.approx(2.0)
    share = cmp.row("cached-token share")
    assert share.a == pytest.approx(0.25) and share.b == 0 and share.rel_err is None


def test_compare_reports_mismatched_runs():
    a = [_rec("r0", 0.2, 1.2), _rec("r1", 0.2, 1.2)]
    b = [_rec("r1", 0.1, 1.0), _rec("r2", 0.1, 1.0, status="failed")]
    cmp = compare_records(a, b)
    assert (cmp.matched, cmp.only_a, cmp.only_b) == (1, 1, 1)
    text = format_table(cmp, "twin", "live")
    assert "only in A" in text and "not ok" in text and "TTFT p99" in text
    assert "| TTFT p50 (ms) |" in format_markdown(cmp, "twin", "live")
    joined = join_by_rid(a, b)
    assert [j["rid"] for j in joined] == ["r1"] and joined[0]["ttft_s_b"] == 0.1


# ---- clear errors before anything is sent ------------------------------------------------------
def test_wrong_url_says_so_and_leaves_empty_records(tmp_path, capsys):
    from runtime.cpu.serve import free_port
    from servetwin.cli import main

    out = tmp_path / "nowhere"
    code = main(["live", "replay", "--url", f"http://127.0.0.1:{free_port()}", "--workload",
                 "arrival=poisson,rate=1,n=3,prompt=fixed:10,output=fixed:2", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot reach an SGLang server" in err and "nothing was sent" in err
    assert (out / "requests.jsonl").read_text() == ""


def test_malformed_trace_names_file_line_and_field(tmp_path, capsys):
    from servetwin.cli import main

    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n'
                     '{"arrival_s": 1, "prompt_tokens": "many", "output_tokens": 2}\n')
    out = tmp_path / "out"
    code = main(["live", "replay", "--url", "http://127.0.0.1:9", "--trace", str(trace),
                 "--trace-format", "jsonl", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: field 'prompt_tokens': 'many' is not an integer" in err
    assert not (out / "requests.jsonl").exists()  # read before anything is sent


def test_real_bench_serving_file_reads_as_a_workload():
    """tests/data/bench_serving_cpu.jsonl is a real `bench_serving --output-details` run
    against the CPU harness server (tests/data/README.md)."""
    from pathlib import Path

    from twin.traces import load_trace

    path = Path(__file__).parent / "data" / "bench_serving_cpu.jsonl"
    run = json.loads(path.read_text().splitlines()[-1])
    w = load_trace(path, "bench_serving")
    assert len(w.requests) == 20 == run["completed"]
    assert [r.prompt_tokens for r in w.requests] == run["input_lens"]
    assert [r.output_tokens for r in w.requests] == run["output_lens"]
    assert all(r.arrival_s == 0.0 for r in w.requests)  # request_rate inf
    assert len(w.reference) == 20
    assert all(ref["ttft_s"] > 0 for ref in w.reference.values())
