"""RecordTable's records built from its columns (twin/record_table.py, `_record`), and so
`twin_records`, are the plain per-request path's (`twin.metrics.records_one_by_one`), field
for field and type for type."""

from __future__ import annotations

import pytest
from helpers import GPU, MODEL
from test_record_table import CASES  # the same runs as the table's own test

from twin.config import ServerArgs
from twin.metrics import records_one_by_one, twin_records
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

pytestmark = pytest.mark.offline



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
