"""The records of a fixed set of runs are byte-identical to the stored digests.

Speed work must not change a single byte of `requests.jsonl`, `summary.json` or
`timeseries.csv`. A behaviour change that is intended regenerates the digests
(`python -m tests.record_digests --update`, see tests/record_digests.py) in its own commit.
"""

from __future__ import annotations

import pytest
from record_digests import RUNS, run_digests, stored

STORED = stored()


@pytest.mark.parametrize("name", list(RUNS))
def test_records_match_stored_digests(name: str) -> None:
    assert name in STORED, f"no stored digest for {name}: python -m tests.record_digests --update"
    got = run_digests(name)
    differ = [f for f in STORED[name] if got.get(f) != STORED[name][f]]
    assert not differ, (f"{name}: {', '.join(differ)} changed; if intended, regenerate with "
                        "`python -m tests.record_digests --update` and say why in the commit")
