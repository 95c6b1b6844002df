"""`ignore_eos` admission and the prompt re-admission after a finish, on the real CPU
SGLang server and in the twin (issue 10): small hand-built scenarios, queue times held
side by side.

A server with a 2,048-token KV pool; a closed loop of five clients. Four send A0-A3
(300-token prompts, 120 tokens out), the fifth a small T (8 + 12) and, when T is done
(the A's then decode, in the twin and live alike whatever the step times), B (380 + 40).
When B comes (the A's about 10 tokens in) the pool has about 790 tokens free. If the A's
ignore EOS, admission reserves all of their remaining output (about 4 x 110 = 440;
SGLang's `PrefillAdder` ratio 1.0): about 350 left < B's 420, so B waits; the room stays
the same while they decode (each step takes one token of KV and one of the reservation),
so B is admitted in the pass after the A's finish (the prompt re-admission after a
finish: SGLang clears `batch_is_full` when the batch shrinks). If the A's may stop at
EOS (`ignore_eos` false, held to their length by `min_new_tokens`), they reserve
`new_token_ratio` (0.7 at the start) of it: about 310, 480 left, and B is admitted at
once (that half is not checked live yet: see the test). The twin's step times are the CPU guess (twin/perf/cpu_guess.py), not this loaded
machine's, so time is compared in units of the A's own latency.
"""

from __future__ import annotations

import pytest

from runtime.client import ReplayConfig, replay
from runtime.server_api import flush_cache, probe, twin_server_args
from twin.config import derive_capacity
from twin.perf.cpu_guess import cpu_step_time
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload

pytestmark = pytest.mark.live
SERVER_ARGS = ["--max-total-tokens", "2048", "--context-length", "2048"]


def scenario(a_ignore_eos: bool, base: int) -> Workload:
    reqs = [Request.make(f"A{i}", 0.0, [(base + i, 300)], 120, ignore_eos=a_ignore_eos)
            for i in range(4)]
    reqs.append(Request.make("T", 0.0, [(base + 8, 8)], 12))
    reqs.append(Request.make("B", 0.0, [(base + 9, 380)], 40, ignore_eos=True))
    return Workload(f"ignore-eos-{a_ignore_eos}", tuple(reqs), concurrency=5)


def b_phase(records: list[dict]) -> dict:
    """B's start against the A's: when its first token came (from t=0, in units of the
    A's mean E2E) and whether it came after every A had finished."""
    by = {r["rid"]: r for r in records}
    assert all(r["status"] == "ok" for r in records), [
        (r["rid"], r["status"], r["error"]) for r in records]
    # B was sent while the A's decode (after their prefills)
    assert by["B"]["arrival_s"] > max(by[f"A{i}"]["arrival_s"] + by[f"A{i}"]["ttft_s"]
                                      for i in range(4))
    a_end = [by[f"A{i}"]["arrival_s"] + by[f"A{i}"]["e2e_s"] for i in range(4)]
    scale = sum(by[f"A{i}"]["e2e_s"] for i in range(4)) / 4
    b_first = by["B"]["arrival_s"] + by["B"]["ttft_s"]
    return {"first": b_first / scale, "after_all": b_first >= max(a_end)}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    from runtime.cpu.serve import CpuServer

    log = tmp_path_factory.mktemp("sglang-small") / "server.log"
    with CpuServer(SERVER_ARGS, log_path=log) as server:
        yield server


def test_ignore_eos_admission_and_readmission_after_a_finish_match_live(small_server):
    facts = probe(small_server.url)
    args = twin_server_args(facts.info)
    assert args.max_total_tokens == 2048
    step = cpu_step_time(derive_capacity(args, "a100-pcie-80gb"), args)
    wl = scenario(True, 7_000_000)
    flush_cache(small_server.url)
    live = replay(wl, ReplayConfig(url=small_server.url, seed=0), facts=facts)
    twin = simulate(wl, SimConfig(args=args), step_time=step)
    live_t, twin_t = b_phase(live.records), b_phase(twin.records)
    print("B phase (live, twin), the A's ignoring EOS:", live_t, twin_t)
    # ignore_eos: B waits for the A's to finish, then is admitted in the next pass
    assert live_t["after_all"] and twin_t["after_all"], (live_t, twin_t)
    assert live_t["first"] == pytest.approx(twin_t["first"], rel=0.15), (live_t, twin_t)
    # measured (20:15 UTC, load ~6): 1.04 live / 1.11 twin. The other half of the
    # scenario (the A's may stop at EOS, `min_new_tokens` holding them to length: B runs
    # beside them, 0.26 live / 0.47 twin at 20:15) is not checked live: at 21:04 the real
    # server aborted the four A's ("Aborted") 16 tokens in, once B was admitted beside
    # them; the cause is not found yet (issue 10's notes)
