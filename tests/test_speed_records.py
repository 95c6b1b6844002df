"""RecordTable's records built from its columns (twin/record_table.py, `_record`), and so
`twin_records`, are the plain per-request path's (`twin.metrics.records_one_by_one`), field
for field and type for type."""

from __future__ import annotations

import pytest
from helpers import GPU, MODEL

from twin.config import ServerArgs
from twin.metrics import records_one_by_one, twin_records
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

pytestmark = pytest.mark.offline

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


def _typed(rec: dict) -> list:
    return [(k, type(v), v if not isinstance(v, list) else [(type(x), x) for x in v])
            for k, v in rec.items()]


@pytest.mark.parametrize("name", list(CASES))
def test_records_from_columns_are_the_dict_path(name: str) -> None:
    server, twin, spec = CASES[name]
    args = ServerArgs(model_path=MODEL, **server)
    res = simulate(from_spec(spec, seed=1), SimConfig(args=args, gpu=GPU,
                                                      step_time_backend="roofline", **twin))
    table = res.records
    want = records_one_by_one(table._reqs, table._ends)
    got = list(table)
    assert [_typed(r) for r in got] == [_typed(r) for r in want]
    assert [_typed(r) for r in twin_records(table._reqs, table._ends)] == [
        _typed(r) for r in want]
    assert table[-1] == want[-1] and table[2:7:2] == want[2:7:2]
    with pytest.raises(IndexError):
        table[len(table)]
