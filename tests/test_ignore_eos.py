"""`ignore_eos` per request: the Request field, the jsonl reader, the record field, and
admission reserving by each running request's own setting (SGLang 0.5.23's
`PrefillAdder._get_running_request_total_token_offset`: ratio 1.0 for `ignore_eos`,
`new_token_ratio` otherwise)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_replica
from tests.stepmodels import FixedStepTime
from twin.admission import Adder
from twin.errors import TraceError
from twin.policy import reservation
from twin.traces import load_trace
from twin.workload import Request

pytestmark = pytest.mark.offline
ST = FixedStepTime()


def _pair(a_eos: bool | None) -> list[Request]:
    return [Request.make("A", 0.0, [(11, 40)], 30, ignore_eos=a_eos),
            Request.make("B", 3.5, [(12, 8)], 25, ignore_eos=True)]


@pytest.mark.parametrize("a_eos, run_eos, admitted_at", [
    (None, True, None), (True, False, None),  # A reserves all 27 of its tokens left
    (False, True, 4.0), (None, False, 4.0),  # A reserves 0.7 x 27
])
def test_a_running_request_reserves_by_its_own_ignore_eos(a_eos, run_eos, admitted_at):
    # At t=4 A holds 42 of 95 tokens and has 27 to go; B needs 8 + 25 = 33. Reserving
    # A's 27 leaves 26 (B waits for A's finish at 31); 0.7 x 27 = 18.9 leaves 34.1.
    # The request's own setting wins over the run's (`--no-ignore-eos`).
    rep, recs = run_replica(_pair(a_eos), ST, max_total_tokens=95, ignore_eos=run_eos)
    b_prefill = [s for s in rep.step_log if s[0] == "prefill" and s[2][0][0] == "B"]
    if admitted_at is None:
        assert b_prefill[0][1] == 31.0 and recs["B"]["queue_s"] == 27.0
    else:
        assert b_prefill[0][1] == admitted_at
    assert ("ignore_eos" in recs["A"]) == (admitted_at is not None)
    assert "ignore_eos" not in recs["B"]  # B ignores EOS: the field is absent


def test_the_adder_offset_sums_each_requests_own_reservation():
    reqs = [Request.make("A", 0.0, [(1, 40)], 300, ignore_eos=False),
            Request.make("B", 0.0, [(2, 40)], 200, ignore_eos=True),
            Request.make("C", 0.0, [(3, 40)], 9000, ignore_eos=False)]
    rep, _ = run_replica(reqs, ST, max_total_tokens=100_000)
    running = sorted(rep.finished, key=lambda r: r.rid)
    for r, gen in zip(running, (10, 20, 30), strict=True):
        r.generated_tokens = gen
    rep.running, rep.new_token_ratio = running, 0.5
    adder = Adder(rep, 0)
    # 0.5 x (300 - 10) + 1.0 x (200 - 20) + 0.5 x min(9000 - 30, 4096)
    assert adder.total_offset == 0.5 * 290 + 180 + 0.5 * 4096
    assert adder.total_offset == sum(reservation(r.max_new_tokens, r.generated_tokens,
                                                 r.ignore_eos, 0.5) for r in running)


def test_jsonl_reads_ignore_eos_and_refuses_a_non_boolean(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"rid": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, '
                 '"ignore_eos": false}\n'
                 '{"rid": "b", "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 3}\n'
                 '{"rid": "c", "arrival_s": 2, "prompt_tokens": 5, "output_tokens": 3, '
                 '"ignore_eos": true}\n')
    w = load_trace(p, "jsonl", time_scale=2.0)
    assert [r.ignore_eos for r in w.requests] == [False, None, True]
    p.write_text('{"rid": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, '
                 '"ignore_eos": "no"}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: field .ignore_eos.: .no.: must be true or false"):
        load_trace(p, "jsonl")


def test_the_twins_records_read_back_with_their_ignore_eos(tmp_path):
    """The record field and the reader agree: a run's requests.jsonl, read as a jsonl
    trace, gives each request its setting back (absent: ignored EOS)."""
    from twin.metrics import write_records

    _, recs = run_replica(_pair(False), ST, max_total_tokens=95)
    path = tmp_path / "requests.jsonl"
    write_records(path, list(recs.values()))
    assert json.loads(path.read_text().splitlines()[0])["ignore_eos"] is False
    back = {r.rid: r.ignore_eos for r in load_trace(path, "jsonl").requests}
    assert back == {"A": False, "B": None}
