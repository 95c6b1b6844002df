"""The compiled decode pass (twin/_loopc.pyx) gives the Python pass's bytes.

`Replica._run_decode` (twin/replica.py) is the specification. Each test runs the same
`servetwin simulate` with `replica._LOOP_C` set and unset and compares every file it writes
byte for byte, on runs drawn by hypothesis over what changes the pass: KV pools small
enough to retract and to fail a step's growth, the radix cache on and off, the overlap
loop on and off, chunk sizes, EOS-stopping clients, a horizon, both step-time backends,
the invariant checks.
A counter checks that the compiled pass ran (a pass it declines changes nothing, so
equal bytes alone would not show it). Without the extension built these skip, except
under SERVETWIN_CI=1, where the install must have built it.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.cli import main
from twin import core as typed_core
from twin import replica

pytestmark = pytest.mark.offline

COMPILED = replica._LOOP_C
if COMPILED is None:
    if os.environ.get("SERVETWIN_CI") == "1":
        raise RuntimeError(f"CI must build the compiled loop: {replica.WHY_LOOP_PYTHON}")
    pytest.skip(f"not built: {replica.WHY_LOOP_PYTHON}", allow_module_level=True)

LLAMA = ["--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "a100-sxm-80gb"]
FILES = ("requests.jsonl", "summary.json", "timeseries.csv")


class Counting:
    """`_loopc` with counts of the decode passes it took (not None), declined and
    retracted in, and of the admission budgets' reserved sums it computed."""

    def __init__(self) -> None:
        self.took = self.declined = self.retracted = self.sums = 0

    def reserved_sum(self, running, clip):
        got = COMPILED.reserved_sum(running, clip)
        self.sums += got is not None
        return got

    def decode(self, rep):
        got = COMPILED.decode(rep)
        if got is None:
            self.declined += 1
        elif got is False:
            self.retracted += 1
        else:
            self.took += 1
        return got


def run(argv: list[str], core, monkeypatch) -> dict[str, bytes]:
    monkeypatch.setattr(replica, "_LOOP_C", core)
    monkeypatch.setattr(typed_core, "_CORE", None)  # the Python replica's loop (twin/core.py)
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["simulate", *argv, "--out", tmp])
        assert rc == 0
        return {f: (Path(tmp) / f).read_bytes() for f in FILES}


def both(argv: list[str], monkeypatch) -> Counting:
    counting = Counting()
    compiled = run(argv, counting, monkeypatch)
    python = run(argv, None, monkeypatch)
    for f in FILES:
        assert compiled[f] == python[f], f"{f} differs: {' '.join(argv)}"
    return counting


def test_default_run_takes_the_compiled_pass(monkeypatch) -> None:
    """Vidur's shapes on the opdb backend (the speed benchmark's run): every decode pass
    compiled, the same bytes."""
    c = both([*LLAMA, "--step-time-backend", "opdb", "--workload",
              "arrival=poisson,rate=1.5,n=200,prompt=uniform:1000:4000,output=uniform:100:500"],
             monkeypatch)
    assert c.took > 200 and c.declined == 0 and c.sums > 100


def test_retractions_and_failed_growth(monkeypatch) -> None:
    """A pool so small that decode steps fail to grow and requests are retracted."""
    c = both([*LLAMA, "--step-time-backend", "roofline", "--max-total-tokens", "9000",
              "--no-ignore-eos", "--workload",
              "arrival=poisson,rate=20,n=120,prompt=uniform:500:3000,output=uniform:50:600"],
             monkeypatch)
    assert c.took > 0 and c.retracted > 0


def test_block_allocators_decline(monkeypatch) -> None:
    """Outside the coverage (a paged pool) the Python pass runs, with the same bytes."""
    c = both([*LLAMA, "--step-time-backend", "roofline", "--page-size", "16",
              "--max-total-tokens", "50000", "--workload",
              "arrival=poisson,rate=5,n=100,prompt=uniform:1000:4000,output=uniform:100:500"],
             monkeypatch)
    assert c.took == 0 and c.declined > 0


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(backend=st.sampled_from(["roofline", "opdb"]),
       pool=st.sampled_from([None, 6000, 12000, 40000]),
       radix=st.booleans(), overlap=st.booleans(), eos=st.booleans(),
       chunk=st.sampled_from([None, 512, 2048]),
       horizon=st.sampled_from([None, 20.0]),
       rate=st.sampled_from([2, 8, 30]), seed=st.integers(0, 5), debug=st.booleans())
def test_drawn_runs_are_byte_identical(monkeypatch, backend, pool, radix, overlap, eos, chunk,
                                       horizon, rate, seed, debug) -> None:
    """(--debug-checks: the replica's invariants, KV owners' tokens among them, checked at
    every pass, so a count the records do not show is checked too.)"""
    argv = [*LLAMA, "--step-time-backend", backend, "--seed", str(seed), "--workload",
            f"arrival=poisson,rate={rate},n=80,prompt=uniform:100:5000,output=uniform:1:700"]
    if pool is not None:
        argv += ["--max-total-tokens", str(pool)]
    if radix:
        argv.append("--disable-radix-cache")
    if overlap:
        argv.append("--disable-overlap-schedule")
    if eos:
        argv.append("--no-ignore-eos")
    if chunk is not None:
        argv += ["--chunked-prefill-size", str(chunk)]
    if horizon is not None:
        argv += ["--horizon", str(horizon)]
    if debug:
        argv.append("--debug-checks")
    c = both(argv, monkeypatch)
    assert c.took > 0


def test_overlap_holds_what_finished_one_pass(monkeypatch) -> None:
    """Under the overlap loop a finished request's KV is held one pass (`FreedLater`):
    with EOS-stopping clients (SGLang reserves a ratio of their outputs) a pool this small
    runs out, and the decode runs' length depends on what is held."""
    c = both([*LLAMA, "--step-time-backend", "roofline", "--no-ignore-eos",
              "--max-total-tokens", "4000", "--seed", "1", "--workload",
              "arrival=poisson,rate=1,n=100,prompt=uniform:100:900,output=uniform:300:900"],
             monkeypatch)
    assert c.took > 0


def test_fleet_runs_that_a_submit_cuts(monkeypatch) -> None:
    """A fleet's replicas plan runs that ignore arrivals and are cut by their own submits
    (twin/decode_cut.py): the compiled pass plans them, `_wait_or_cut` waits."""
    c = both(["--deployment", "finance-sglang-pool", "--workload",
              "arrival=poisson,rate=6,n=200,prompt=uniform:200:6000,output=uniform:20:300"],
             monkeypatch)
    assert c.took > 100 and c.declined == 0


def test_numpy_lengths_go_through_getattr(monkeypatch) -> None:
    """Lengths that are numpy integers (a trace read with numpy) are not exact ints: the
    compiled pass reads and adds them as Python does, with the same records."""
    import dataclasses

    import numpy as np

    from twin.config import ServerArgs
    from twin.sim import SimConfig, simulate
    from twin.workload import from_spec

    wl = from_spec("arrival=poisson,rate=8,n=60,prompt=uniform:100:3000,output=uniform:1:400",
                   seed=2)
    wl = dataclasses.replace(wl, requests=tuple(
        dataclasses.replace(r, prompt_tokens=np.int64(r.prompt_tokens),
                            output_tokens=np.int32(r.output_tokens)) for r in wl.requests))
    cfg = SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B",
                                    max_total_tokens=12000),
                    gpu="a100-sxm-80gb", step_time_backend="roofline")
    out = []
    monkeypatch.setattr(typed_core, "_CORE", None)
    for core in (Counting(), None):
        monkeypatch.setattr(replica, "_LOOP_C", core)
        res = simulate(wl, cfg)
        out.append(([dict(r) for r in res.records], res.summary))
        if core is not None:
            assert core.took > 0
    assert out[0] == out[1]


def test_reserved_outputs_beyond_the_clip(monkeypatch) -> None:
    """Outputs longer than SGLang's 4,096-token reservation clip: the admission budget's
    reserved sum clips each running request's remaining tokens (mutation-checked: an
    unclipped sum, or the plain sum whatever the longest, fails this run)."""
    c = both([*LLAMA, "--step-time-backend", "roofline", "--max-total-tokens", "40000",
              "--workload",
              "arrival=poisson,rate=2,n=40,prompt=uniform:100:2000,output=uniform:2000:9000"],
             monkeypatch)
    assert c.sums > 0
