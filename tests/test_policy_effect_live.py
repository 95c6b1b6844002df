"""A policy's effect, live and in the twin (experiments/policy_effect.py).

The same tiered workload (70 % tier 0, 30 % tier 20) runs on the real CPU SGLang server
with fcfs and with the users' `slices` scheduler (conservative: it only reorders, VIP
first) inside SGLang through servetwin's plugin; the twin, calibrated on the fcfs server,
simulates both runs with the same spec at the live send times.

Checked: every request comes back `ok` with no plugin fallback; the VIP advantage (tier
20's mean queue time over tier 0's, within one run, so the shared machine's load cancels)
shrinks with slices live and in the twin, in both by at least 40 %; and the favoured
class's mean queue time under slices is predicted within 0.5 s of live (the stated
tolerance: VIP queues are a few hundred milliseconds) by the twin run at the live run's
own measured step speed (`Effect.rescaled`: the twin x the drift of the run's isolated
steps against the profile). On a loaded 2-core machine the live server's own speed moves
between runs by more than any scheduling model can know: a CI run measured the slices
server 23 % slower than its profile, which at 90 % load puts it past capacity (live VIP
queue 0.82 s, the twin at the profile's speed 0.18 s, at the run's speed 0.40 s).
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.live


def test_slices_favours_vips_live_and_in_the_twin(tmp_path):
    if os.environ.get("SERVETWIN_NO_LIVE") == "1":
        pytest.skip("live SGLang tests switched off by SERVETWIN_NO_LIVE=1")
    from experiments.policy_effect import PRIORITY_FLAGS, run
    from twin.workload import from_spec

    spec = tmp_path / "slices.json"
    spec.write_text(json.dumps({"name": "slices", "params": {"mode": "conservative"}}))

    def make(rate: float):
        return from_spec(f"arrival=poisson,rate={rate:.4f},n=40,prompt=uniform:64:384,"
                         "output=uniform:16:64,tiers=0:0.7/20:0.3", seed=3, name="tiers")

    effects, _ = run([(str(spec), PRIORITY_FLAGS)], make, 0.9, tmp_path / "out", budget_s=30,
                     log=lambda m: None)
    fcfs, slices = effects
    for e in effects:
        # no fallback; decisions over the 5 ms budget are applied all the same, only
        # counted ("slow"), and a loaded machine makes some
        assert e.not_ok == 0 and e.fallbacks["raised"] == e.fallbacks["invalid"] == 0, e
        assert set(e.live) == {0, 20} and set(e.twin) == {0, 20}
    assert slices.advantage("live") < 0.6 * fcfs.advantage("live"), (fcfs, slices)
    assert slices.advantage("twin") < 0.6 * fcfs.advantage("twin"), (fcfs, slices)
    predicted = slices.rescaled.get(20, slices.twin[20]) if slices.drift else slices.twin[20]
    assert abs(predicted - slices.live[20]) <= 0.5, slices
