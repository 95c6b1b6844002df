"""SGLang's way out (twin/request_path.py `OutputPath`, `through_output_path`): the
detokenizer and the tokenizer manager as two first-come-first-served servers of one
message per scheduler step, the client seeing a message's tokens at its mean request.
Hand-worked timelines."""

from __future__ import annotations

import pytest

from twin.errors import ConfigError
from twin.request_path import OutputPath, steps_of, through_output_path

pytestmark = pytest.mark.offline

# detokenizer 1 ms a message; tokenizer manager 2 ms a message + 1 ms per request
PATH = OutputPath(detok_per_message_s=1e-3, tm_per_message_s=2e-3, tm_per_request_s=1e-3)


def test_two_servers_in_a_row_hand_worked():
    # steps end at 10, 13, 14 ms with 2, 2, 1 requests
    # detokenizer: done at 11, 14, 15 ms
    # tokenizer manager: message 0 from 11 to 15 (seen at 11 + 2 + 1.5 = 14.5),
    # message 1 waits for it: 15 to 19 (seen 18.5), message 2: 19 to 22 (seen 22)
    seen, busy = PATH.visible([0.010, 0.013, 0.014], [2, 2, 1])
    assert seen == pytest.approx([0.0145, 0.0185, 0.022])
    assert busy == pytest.approx(0.011)


def test_a_path_faster_than_the_steps_adds_a_constant_lag():
    seen, _ = PATH.visible([0.0, 0.1, 0.2, 0.3], [4, 4, 4, 4])
    lag = [s - t for s, t in zip(seen, [0.0, 0.1, 0.2, 0.3], strict=True)]
    assert lag == pytest.approx([1e-3 + 2e-3 + 2.5e-3] * 4)


def test_a_slower_path_falls_behind_by_the_difference_every_step():
    # 2 + 1 x 8 = 10 ms per message against 5 ms steps: 5 ms later every step
    path = OutputPath(tm_per_message_s=2e-3, tm_per_request_s=1e-3)
    ends = [0.005 * k for k in range(5)]
    seen, busy = path.visible(ends, [8] * 5)
    assert [b - a for a, b in zip(seen, seen[1:], strict=False)] == pytest.approx([0.010] * 4)
    assert busy == pytest.approx(0.050)


def rec(rid, arrival, ttft, itl, ok=True):
    e2e = ttft + sum(itl)
    return {"rid": rid, "arrival_s": arrival, "ttft_s": ttft, "itl_s": itl,
            "e2e_s": e2e if ok else None, "status": "ok" if ok else "aborted",
            "tpot_s": e2e / len(itl) if itl else None}


def test_records_through_the_path_hand_worked():
    # A's tokens at 10 and 13 ms, B's at 10, 13 and 14 ms: the steps above
    a, b = rec("a", 0.0, 0.010, [0.003]), rec("b", 0.0, 0.010, [0.003, 0.001])
    (la, lb), util = through_output_path([a, b], PATH)
    assert la["ttft_s"] == pytest.approx(0.0145) and la["e2e_s"] == pytest.approx(0.0185)
    assert la["itl_s"] == pytest.approx([0.004]) and la["tpot_s"] == pytest.approx(0.004)
    assert lb["ttft_s"] == pytest.approx(0.0145) and lb["e2e_s"] == pytest.approx(0.022)
    assert lb["itl_s"] == pytest.approx([0.004, 0.0035])
    assert lb["tpot_s"] == pytest.approx(0.00375)
    assert util == pytest.approx(0.011 / (0.022 - 0.010))
    assert a["ttft_s"] == 0.010  # the input is not changed


def test_rounded_token_times_of_one_step_are_one_message():
    # the records' times are rounded to the microsecond: 1 us apart is the same step
    times, counts, index = steps_of([rec("a", 0.0, 0.010, [0.003]),
                                     rec("b", 0.000001, 0.010, [0.002999])])
    assert counts == [2, 2] and index == [[0, 1], [0, 1]]
    assert times == pytest.approx([0.010, 0.013], abs=2e-6)


def test_requests_without_tokens_pass_unchanged_and_aborted_keep_no_e2e():
    gone = {"rid": "x", "arrival_s": 0.0, "ttft_s": None, "itl_s": [], "e2e_s": None,
            "status": "rejected", "tpot_s": None}
    cut = rec("c", 0.0, 0.010, [0.003], ok=False)
    (g, c), _ = through_output_path([gone, cut], PATH)
    assert g == gone
    assert c["e2e_s"] is None and c["ttft_s"] > 0.010


def test_no_path_changes_nothing():
    recs = [rec("a", 0.0, 0.010, [0.003]), rec("b", 0.001, 0.009, [0.003, 0.001])]
    out, util = through_output_path(recs, OutputPath())
    assert util == 0.0
    for x, y in zip(recs, out, strict=True):
        assert y["ttft_s"] == pytest.approx(x["ttft_s"]) and y["e2e_s"] == pytest.approx(
            x["e2e_s"])


def test_negative_cost_names_the_key():
    with pytest.raises(ConfigError, match="tm_per_request_s"):
        OutputPath(tm_per_request_s=-1e-6)
