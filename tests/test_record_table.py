"""RecordTable (twin/record_table.py) gives exactly the dict path's records, lines and summary."""

from __future__ import annotations

import json

import pytest
from helpers import GPU, MODEL

from twin.config import ServerArgs
from twin.metrics import SLO, summarize
from twin.record_table import RecordTable
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

CASES = {
    "plain": ({}, {}, "arrival=poisson,rate=4,n=120,prompt=uniform:100:3000,output=uniform:1:200"),
    "retractions": ({"max_total_tokens": 12000}, {"ignore_eos": False},
                    "arrival=poisson,rate=10,n=120,prompt=uniform:500:3000,output=uniform:50:400"),
    "swap+slices": ({"max_total_tokens": 30000},
                    {"preemption_mode": "aggressive", "swap_min_tokens": 100},
                    "arrival=poisson,rate=8,n=100,prompt=uniform:500:3000,output=uniform:50:300,"
                    "tiers=0:0.8/20:0.2"),
    "mixed+horizon": ({"enable_mixed_chunk": True}, {"horizon_s": 10.0},
                      "arrival=poisson,rate=12,n=200,prompt=uniform:100:9000,"
                      "output=uniform:1:300"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_table_matches_the_dict_path(name: str) -> None:
    server, twin, spec = CASES[name]
    args = ServerArgs(model_path=MODEL, **server)
    res = simulate(from_spec(spec, seed=1), SimConfig(args=args, gpu=GPU,
                                                      step_time_backend="roofline", **twin))
    table = res.records
    assert isinstance(table, RecordTable)
    records = list(table)
    assert len(records) == len(table) and table[0] == records[0]
    assert table[1:3] == records[1:3]
    assert list(table.lines()) == [json.dumps(r, separators=(",", ":")) + "\n"
                                   for r in records]
    for slo in (None, SLO(ttft_s=0.5, tpot_s=0.05)):
        assert summarize(table, slo) == summarize(records, slo)
    assert summarize(table, None, 100.0) == summarize(records, None, 100.0)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALUE = st.one_of(st.none(), st.floats(allow_nan=True), st.integers(0, 10**6),
                   st.sampled_from([0.5, 0.05, 1.5, 0.4999999999999999, 0.5000000000000001]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ok", "ok", "aborted", "rejected"]), _VALUE,
                          _VALUE, _VALUE), max_size=30),
       st.sampled_from([SLO(ttft_s=0.5), SLO(tpot_s=0.05, e2e_s=1.5),
                        SLO(ttft_s=0.5, tpot_s=0.05, e2e_s=1.5)]))
def test_slo_attainment_from_columns_counts_what_met_counts(rows, slo) -> None:
    keys = ("status", "ttft_s", "tpot_s", "e2e_s")
    cols = {k: [r[i] for r in rows] for i, k in enumerate(keys)}
    want = sum(slo.met(dict(zip(keys, r, strict=True))) for r in rows)
    assert slo.count_met(cols["status"], cols) == want


def test_summary_from_numpy_columns_is_the_list_summary():
    """A streamed run summarises numpy columns (status codes, NaN for null): the same
    summary, value for value and type for type, as the lists of the same records, with
    nulls, zero and nonzero lost seconds, every status and an SLO."""
    import numpy as np

    from twin.metrics import STATUSES, summary_from_columns

    rng = np.random.default_rng(21)
    for trial in range(200):
        n = int(rng.integers(0, 40))
        status = rng.choice(len(STATUSES), n, p=[0.7, 0.1, 0.1, 0.1]).astype(np.int8)
        ok = status == 0

        def floats(null_share: float, n: int = n) -> np.ndarray:
            v = np.round(rng.exponential(1.0, n), int(rng.integers(1, 7)))
            v[rng.random(n) < null_share] = np.nan
            return v

        arrays = {"status": status, "arrival_s": np.sort(floats(0.0)),
                  "ttft_s": floats(0.2), "tpot_s": floats(0.3),
                  "queue_s": floats(0.2), "lost_s": np.where(rng.random(n) < 0.5, 0.0,
                                                             floats(0.3))}
        e2e = floats(0.0)
        e2e[~ok] = np.nan
        arrays["e2e_s"] = e2e
        for key in ("prompt_tokens", "output_tokens", "cached_tokens", "retractions",
                    "preemptions", "kv_moved_bytes"):
            arrays[key] = rng.integers(0, 5000, n).astype(np.int64)
        lists = {k: [None if x != x else x for x in v.tolist()] for k, v in arrays.items()
                 if v.dtype.kind == "f"}
        lists.update({k: v.tolist() for k, v in arrays.items() if v.dtype.kind == "i"})
        lists["status"] = [STATUSES[i] for i in status.tolist()]
        itl = {"p50": 0.1, "p90": 0.2, "p99": 0.3, "mean": 0.15}
        slo = SLO(ttft_s=1.0, e2e_s=2.0) if trial % 2 else None
        want = summary_from_columns(lists, itl, slo)
        got = summary_from_columns(arrays, itl, slo)
        assert json.dumps(got) == json.dumps(want) and got == want
