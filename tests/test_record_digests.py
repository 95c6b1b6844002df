"""The records of a fixed set of runs are byte-identical to the stored digests.

Speed work must not change a single byte of `requests.jsonl`, `summary.json` or
`timeseries.csv`. A behaviour change that is intended regenerates the digests
(`python -m tests.record_digests --update`, see tests/record_digests.py) in its own commit.
"""

from __future__ import annotations

import os

import pytest
from record_digests import RUNS, run_digests, stored

from twin import core as typed_core
from twin import record_table, replica

STORED = stored()


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize("name", list(RUNS))
def test_records_match_stored_digests(name: str, core: str, monkeypatch) -> None:
    """Both cores: the compiled modules (the records' writer, twin/_recordsc.pyx, the
    loop's decode pass, twin/_loopc.pyx, and the typed core, twin/_corec.pyx, where a run
    is in its coverage) and the Python code they were written from."""
    assert name in STORED, f"no stored digest for {name}: python -m tests.record_digests --update"
    if core == "python":
        monkeypatch.setattr(record_table, "_C", None)
        monkeypatch.setattr(replica, "_LOOP_C", None)
        monkeypatch.setattr(typed_core, "_CORE", None)
    elif record_table._C is None or replica._LOOP_C is None or typed_core._CORE is None:
        why = record_table.WHY_PYTHON or replica.WHY_LOOP_PYTHON or typed_core.WHY_NO_CORE
        if os.environ.get("SERVETWIN_CI") == "1":
            pytest.fail(f"CI must build the compiled modules: {why}")
        pytest.skip(f"not built: {why}")
    got = run_digests(name)
    differ = [f for f in STORED[name] if got.get(f) != STORED[name][f]]
    assert not differ, (f"{name}: {', '.join(differ)} changed; if intended, regenerate with "
                        "`python -m tests.record_digests --update` and say why in the commit")
