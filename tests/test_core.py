"""The typed core (twin/_corec.pyx) gives the Python replica's bytes.

`Replica.run` (twin/replica.py) is the specification. Each test runs the same `servetwin
simulate` with the typed core on and off (`twin.core._CORE` unset: the Python replica,
with its compiled decode pass) and compares every file it writes byte for byte, on runs
drawn by hypothesis over what the core reproduces: pools small enough to retract, to fail
a step's growth and to abort a prefill, the overlap loop on and off, chunk sizes,
EOS-stopping clients, a horizon, prompts SGLang rejects and outputs it clips, both
step-time backends. A counter checks that the core ran (a run outside its coverage runs
the Python replica, and equal bytes alone would not show which ran). Without the
extension built these skip, except under SERVETWIN_CI=1, where the install must build it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.cli import main
from twin import core, sim

pytestmark = pytest.mark.offline

CORE = core._CORE
if CORE is None:
    if os.environ.get("SERVETWIN_CI") == "1":
        raise RuntimeError(f"CI must build the typed core: {core.WHY_NO_CORE}")
    pytest.skip(f"not built: {core.WHY_NO_CORE}", allow_module_level=True)

LLAMA = ["--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "a100-sxm-80gb"]
FILES = ("requests.jsonl", "summary.json", "timeseries.csv")


def run(argv: list[str], on: bool, monkeypatch) -> tuple[dict[str, bytes], int]:
    """The files a run writes, and how many runs the typed core took."""
    monkeypatch.setattr(core, "_CORE", CORE if on else None)
    took = []

    def counting(rep):
        took.append(1)
        return core.run(rep)

    monkeypatch.setattr(sim, "run_core", counting)
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["simulate", *argv, "--out", tmp])
        assert rc == 0
        return {f: (Path(tmp) / f).read_bytes() for f in FILES}, len(took)


def both(argv: list[str], monkeypatch) -> int:
    typed, took = run(argv, True, monkeypatch)
    python, none = run(argv, False, monkeypatch)
    assert none == 0
    for f in FILES:
        assert typed[f] == python[f], f"{f} differs: {' '.join(argv)}"
    return took


def test_the_users_closed_loop(monkeypatch) -> None:
    """The default run's workload (finance-qa: 50 clients, 10k-128k-token documents
    behind shared system prompts, on the users' deployment), shorter: the core runs it
    with the request path's tokenizer queue and egress, the same bytes."""
    assert both(["--workload", "finance-qa,n=200"], monkeypatch) == 1


def test_shortest_prefill_first_caps_the_documents_chunks(monkeypatch) -> None:
    """SGLang's shortest-prefill-first over the users' mix: the short questions first, and
    a document's active chunk capped to leave room for those waiting behind it (the cap
    applies to about one chunk in six here)."""
    assert both(["--schedule-policy", "shortest-prefill-first", "--workload",
                 "finance-qa,n=400"], monkeypatch) == 1


def test_vidur_without_the_radix_cache(monkeypatch) -> None:
    """Vidur's shapes on the opdb backend with the overlap loop (the speed benchmark's
    run, radix cache off): the core runs it, the same bytes."""
    assert both([*LLAMA, "--step-time-backend", "opdb", "--disable-radix-cache",
                 "--workload", "arrival=poisson,rate=1.5,n=300,prompt=uniform:1000:4000,"
                 "output=uniform:100:500"], monkeypatch) == 1


def test_shared_prefixes_in_the_radix_cache(monkeypatch) -> None:
    """The radix cache on (the default) over prompts that share a system prompt and
    templates, in a pool small enough to evict cached prefixes, retract (evicting for the
    rest) and cache a chunked prompt's finished chunks: the core runs it, the same bytes."""
    assert both([*LLAMA, "--step-time-backend", "roofline", "--max-total-tokens", "12000",
                 "--no-ignore-eos", "--chunked-prefill-size", "512", "--workload",
                 "arrival=poisson,rate=30,n=300,prompt=uniform:100:3000,output=uniform:1:700,"
                 "templates=5,template_len=1024,share=0.7,system_prompt=256"],
                monkeypatch) == 1


def test_priority_preemption(monkeypatch) -> None:
    """SGLang's priority scheduling: the queue by priority, and a full batch's
    lower-priority requests preempted for a waiting one more than 10 above them (this run
    preempts 23 times)."""
    assert both([*LLAMA, "--step-time-backend", "roofline", "--enable-priority-scheduling",
                 "--max-running-requests", "4", "--workload",
                 "arrival=poisson,rate=30,n=400,prompt=uniform:10:3000,output=uniform:1:300,"
                 "tiers=0:0.6/20:0.3/40:0.1"], monkeypatch) == 1


@pytest.mark.parametrize("policy", ["lpm", "hrrn"])
def test_cache_aware_above_the_queue_limit(monkeypatch, policy) -> None:
    """lpm and hrrn with a queue that grows past 128 (where SGLang falls back to fcfs and
    matches request by request) and drains below it again."""
    assert both([*LLAMA, "--step-time-backend", "roofline", "--schedule-policy", policy,
                 "--max-total-tokens", "20000", "--workload",
                 "arrival=poisson,rate=300,n=1500,prompt=uniform:10:3000,output=uniform:1:300,"
                 "templates=4,template_len=20,share=0.8"], monkeypatch) == 1


def test_outside_the_coverage_runs_the_python_replica(monkeypatch) -> None:
    """A paged pool, the users' preemption design, time slices: the Python replica runs
    each, and `why_not` says why."""
    for extra in (["--page-size", "16"], ["--preemption-mode", "conservative"],
                  ["--policy", "slices"]):
        assert both([*LLAMA, "--step-time-backend", "roofline", *extra, "--workload",
                     "arrival=poisson,rate=5,n=60,prompt=uniform:100:3000,"
                     "output=uniform:1:300"], monkeypatch) == 0


@pytest.mark.parametrize("spec", [
    "deadline",  # laxity: documents held while short questions wait or run
    '{"name": "deadline", "params": {"withhold": "hopeless", "chunk_cap": true}}',
    # chunk questions: a document's chunk capped while short questions wait, decode-only
    # passes before each chunk while they decode; the cap as a time budget
    '{"name": "deadline", "params": {"chunk_tokens": 512, "park_steps": 4}}',
    '{"name": "deadline", "params": {"withhold": "hopeless", "chunk_budget_s": 0.3, '
    '"park_steps": 8, "chunk_cap": true}}',
    '{"name": "menu", "params": {"rule": "edf"}}',
    '{"name": "menu", "params": {"rule": "spf", "chunk_cap": true}}',
    "priority",  # the tier order without SGLang's priority scheduling
    "learned:finance-qa-v2"])
def test_policies_asked_of_python(monkeypatch, spec) -> None:
    """A policy the core has no order of its own for is asked pass by pass, as the
    Python replica asks it (a snapshot built from the core's columns; its plan's order,
    admission limit and shortest-prefill-first chunk cap applied, its chunk questions
    asked and their caps and parks applied): the users' mix with
    its documents, and a drawn mix in a small pool, the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        if spec.startswith("{"):
            path = Path(tmp) / "policy.json"
            path.write_text(spec)
            spec = str(path)
        assert both(["--policy", spec, "--workload", "finance-qa,n=150"],
                    monkeypatch) == 1
        # tiers, shared prefixes, chunks and a pool small enough to retract
        assert both(["--policy", spec, *LLAMA, "--step-time-backend", "roofline",
                     "--max-total-tokens", "20000", "--chunked-prefill-size", "2048",
                     "--no-ignore-eos",
                     "--workload", "arrival=poisson,rate=20,n=300,prompt=uniform:100:12000,"
                     "output=uniform:1:700,templates=4,template_len=500,share=0.6,"
                     "tiers=0:0.6/5:0.4"], monkeypatch) == 1


def test_retractions_failed_growth_and_aborted_prefills(monkeypatch) -> None:
    """A pool so small that steps fail to grow, requests are retracted and a chunked
    prompt's next chunk finds no room even after every retraction."""
    assert both([*LLAMA, "--step-time-backend", "roofline", "--max-total-tokens", "6000",
                 "--no-ignore-eos", "--disable-radix-cache", "--chunked-prefill-size", "512",
                 "--workload", "arrival=poisson,rate=30,n=200,prompt=uniform:100:5900,"
                 "output=uniform:1:700"], monkeypatch) == 1


def test_rejected_and_clipped_requests(monkeypatch) -> None:
    """Prompts at or over SGLang's input limit are rejected as they arrive, outputs beyond
    the request length clipped (the record says so)."""
    assert both([*LLAMA, "--step-time-backend", "roofline", "--context-length", "3000",
                 "--disable-radix-cache", "--workload",
                 "arrival=poisson,rate=5,n=120,prompt=uniform:100:4000,output=uniform:1:2000"],
                monkeypatch) == 1


#: policies the core asks of Python (`--policy` spec files): the twin's deadline, with
#: chunk answers and spf's cap, and a menu rule with spf's cap
ASKED = {"py:deadline": {"name": "deadline"},
         "py:deadline-chunks": {"name": "deadline", "params": {
             "withhold": "hopeless", "chunk_tokens": 256, "park_steps": 3, "chunk_cap": True}},
         "py:menu-spf": {"name": "menu", "params": {"rule": "spf", "chunk_cap": True}}}


@settings(max_examples=int(os.environ.get("CORE_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(backend=st.sampled_from(["roofline", "opdb"]),
       pool=st.sampled_from([None, 6000, 12000, 40000]),
       overlap=st.booleans(), eos=st.booleans(),
       chunk=st.sampled_from([None, 512, 2048]),
       horizon=st.sampled_from([None, 5.0, 20.0]),
       rate=st.sampled_from([0.5, 2, 8, 30, "closed:2", "closed:8", "closed:40", "bench:8"]),
       seed=st.integers(0, 5),
       running=st.sampled_from([None, 3]),
       radix=st.sampled_from([None, "", ",templates=3,template_len=700,share=0.6",
                              ",templates=8,template_len=300,share=0.9,system_prompt=200",
                              ",templates=4,template_len=20,share=0.8"]),
       policy=st.sampled_from([None, "lpm", "dfs-weight", "hrrn", "lof", "random",
                               "shortest-prefill-first", *ASKED]),
       prio=st.sampled_from([None, "high", "low"]),
       mixed=st.booleans())
def test_drawn_runs_are_byte_identical(monkeypatch, backend, pool, overlap, eos, chunk,
                                       horizon, rate, seed, running, radix, policy,
                                       prio, mixed) -> None:
    """`rate`: Poisson arrivals, or closed-loop clients ("closed:CONCURRENCY", "bench:..."
    for bench_serving's); `radix`:
    None, the cache off; else on, over prompts sharing what it names (20-token templates:
    prompts whose first 32 tokens match with short cached prefixes, which lpm defers);
    `policy`: another of SGLang's policies instead of fcfs, or one the core asks of
    Python (`ASKED`);
    `prio`: SGLang's priority scheduling
    (high or low values first) over three tiers 20 apart (each preempts the one below: the
    threshold is 10), with fcfs; `mixed`: --enable-mixed-chunk (the running batch decodes
    in each prefill step its tokens fit in)."""
    arrival = (f"arrival=closed,concurrency={rate.split(':')[1]}" if isinstance(rate, str)
               else f"arrival=poisson,rate={rate}")
    if isinstance(rate, str) and rate.startswith("bench"):
        arrival += ",clients=bench"  # bench_serving's warm-up first, left out of the records
    argv = [*LLAMA, "--step-time-backend", backend, "--seed", str(seed), "--workload",
            f"{arrival},n=80,prompt=uniform:100:5000,output=uniform:1:700" + (radix or "")
            + (",tiers=0:0.6/20:0.3/40:0.1" if prio else "")]
    if radix is None:
        argv.append("--disable-radix-cache")
    specs = tempfile.TemporaryDirectory()
    if policy in ASKED:  # asked of Python, priority scheduling's preemption included
        spec = Path(specs.name) / "policy.json"
        spec.write_text(json.dumps(ASKED[policy]))
        argv += ["--policy", str(spec)]
    elif policy and (not prio or policy == "lof") and (
            radix is not None or policy != "shortest-prefill-first"):
        # (SGLang refuses spf without the cache, and priority scheduling but with fcfs or
        # lof; lof under it is asked of Python for its victims)
        argv += ["--schedule-policy", policy]
    if prio:
        argv.append("--enable-priority-scheduling")
    if prio == "low":
        argv.append("--schedule-low-priority-values-first")
    if mixed:
        argv.append("--enable-mixed-chunk")
    if pool is not None:
        argv += ["--max-total-tokens", str(pool)]
    if overlap:
        argv.append("--disable-overlap-schedule")
    if eos:
        argv.append("--no-ignore-eos")
    if chunk is not None:
        argv += ["--chunked-prefill-size", str(chunk)]
    if horizon is not None:
        argv += ["--horizon", str(horizon)]
    if running is not None:
        argv += ["--max-running-requests", str(running)]
    with specs:
        assert both(argv, monkeypatch) == 1


@settings(max_examples=int(os.environ.get("CORE_EXAMPLES", "30")) * 3, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["match"] * 4 + ["insert", "lock", "unlock",
                                                                "evict"]),
                              st.lists(st.integers(0, 3), min_size=1, max_size=4),
                              st.integers(0, 3000)), max_size=300))
def test_typed_radix_tree_is_twin_prefix(ops) -> None:
    """The core's radix tree (`CTree`) against twin/prefix.py's `RadixCache` on the same
    operations: the same matches, nodes made, evictions (least recently used, ties by
    creation), totals and locks. Paths are drawn from a few segments so that they share
    prefixes; a lock is taken on a matched node and released later, as requests do. Times
    repeat (ties broken by creation order), and matches outnumber the rest, so stale heap
    entries pile up until an eviction rebuilds the heap."""
    from twin.prefix import RadixCache
    py, ty = RadixCache(), CORE.CTree()
    held_py, held_ty = [], []
    for i, (op, path, n) in enumerate(ops):
        segs, t = tuple((h, 100 * (h + 1)) for h in path), i // 3
        if op == "match":
            (a, na), (b, nb) = py.match(segs, float(t)), ty.match(segs, float(t))
            assert a == b and na.nid == nb.nid
        elif op == "insert":
            (na, ca), (nb, cb) = py.insert(segs, float(t)), ty.insert(segs, float(t))
            assert na.nid == nb.nid and [c.nid for c in ca] == [c.nid for c in cb]
        elif op == "lock":
            (_, na), (_, nb) = py.match(segs, float(t)), ty.match(segs, float(t))
            py.lock(na)
            ty.lock(nb)
            held_py.append(na)
            held_ty.append(nb)
        elif op == "unlock" and held_py:
            py.unlock(held_py.pop(n % len(held_py)))
            ty.unlock(held_ty.pop(n % len(held_ty)))
        elif op == "evict":
            assert py.evict(n) == ty.evict(n)
        assert (py.total_tokens, py.evictable_tokens, py.n_nodes) == (
            ty.total_tokens, ty.evictable_tokens, ty.n_nodes)
        ty.check_integrity()


# ---- fleets: each SGLang replica's passes in the core, SimPy between them ----------------
def fleet_files(doc: dict, workload: str, horizon, chunk: int, on: bool, monkeypatch
                ) -> tuple[dict[str, bytes], list]:
    """What a fleet run writes (records streamed `chunk` at a time), and each worker's
    loop (None: the typed core)."""
    import simpy

    from twin.fleet import build_fleet, parse_spec, run_deployment
    from twin.workload import from_spec

    monkeypatch.setattr(core, "_CORE", CORE if on else None)
    env = simpy.Environment()
    dep = build_fleet(env, parse_spec(doc, "<drawn>"), from_spec(workload, seed=0),
                      horizon_s=horizon)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_deployment(dep, out=Path(tmp), record_chunk=chunk)
        res.write(Path(tmp))
        files = {f: (Path(tmp) / f).read_bytes() for f in FILES}
    return files, [w.loop for w in dep.workers]


def fleet_both(doc: dict, workload: str, monkeypatch, horizon=None, chunk: int = 7) -> list:
    """The streamed files of the fleet with and without the core, compared; and the run
    kept in memory (its records' dicts and summary from the columns) against the same
    run summarised over the dicts (twin/fleet.py `IN_MEMORY_COLUMNS`)."""
    import simpy

    import twin.fleet
    from twin.fleet import build_fleet, parse_spec, run_deployment
    from twin.workload import from_spec

    typed, loops = fleet_files(doc, workload, horizon, chunk, True, monkeypatch)
    python, none = fleet_files(doc, workload, horizon, chunk, False, monkeypatch)
    assert None not in none
    for f in FILES:
        assert typed[f] == python[f], f"{f} differs: {doc} {workload} horizon {horizon}"
    kept = []
    for columns in (True, False):
        monkeypatch.setattr(twin.fleet, "IN_MEMORY_COLUMNS", columns)
        dep = build_fleet(simpy.Environment(), parse_spec(doc, "<drawn>"),
                          from_spec(workload, seed=0), horizon_s=horizon)
        res = run_deployment(dep)
        kept.append((list(res.records), res.summary))
    assert kept[0] == kept[1]
    return loops


def test_a_fleet_of_four_behind_each_router(monkeypatch) -> None:
    """Four replicas behind sglang-router's round_robin and cache_aware: every replica
    in the core, runs cut by submits, the same bytes."""
    for router in ("round_robin", "cache_aware"):
        doc = {"gpu": "a100-sxm-80gb", "router": {"name": router}, "replicas": [
            {"name": "r", "count": 4, "step_time_backend": "roofline",
             "server_args": {"model_path": "meta-llama/Llama-3.1-8B"}}]}
        loops = fleet_both(doc, "arrival=poisson,rate=6,n=300,prompt=uniform:1000:4000,"
                           "output=uniform:100:500", monkeypatch)
        assert loops == [None] * 4


@pytest.mark.parametrize("policy", [["--schedule-policy", "lof"], ["--policy", "deadline"],
                                    ["--policy", "learned:finance-qa-v2"]])
def test_python_policies_under_priority_scheduling(monkeypatch, policy) -> None:
    """SGLang's priority scheduling with a policy asked of Python: its preempt questions
    (the waiting request that found no slot, what it needs) asked from the core's
    snapshot, its victims leaving the batch (lof's are SGLang's priority victims: 19
    preemptions here; deadline and the learned selector name none); three tiers 20 apart
    in a batch of four."""
    argv = [*policy, *LLAMA, "--step-time-backend", "roofline", "--enable-priority-scheduling",
            "--max-running-requests", "4", "--workload", "arrival=poisson,rate=30,n=400,"
            "prompt=uniform:10:3000,output=uniform:1:300,tiers=0:0.6/20:0.3/40:0.1"]
    typed, took = run(argv, True, monkeypatch)
    python, none = run(argv, False, monkeypatch)
    assert (took, none) == (1, 0)
    assert typed == python
    if policy[-1] == "lof":
        assert json.loads(typed["summary.json"])["preemptions"] > 0


@pytest.mark.parametrize("spec", [
    "deadline", "learned:finance-qa-v2",
    '{"name": "deadline", "params": {"withhold": "hopeless", "chunk_tokens": 512, '
    '"park_steps": 4, "chunk_cap": true}}'])
def test_a_fleet_of_replicas_asking_python_policies(monkeypatch, spec, tmp_path) -> None:
    """Three replicas behind cache_aware, each asking a policy the core has no order of
    its own for (the twin's deadline policy, the shipped learned one, deadline with chunk
    answers): every replica in the core, the same bytes."""
    if spec.startswith("{"):
        path = tmp_path / "policy.json"
        path.write_text(spec)
        spec = str(path)
    doc = {"gpu": "a100-pcie-80gb", "router": {"name": "cache_aware"}, "replicas": [
        {"name": "r", "count": 3, "twin": {"policy": spec},
         "server_args": {"model_path": "Qwen/Qwen3-8B"}}]}
    loops = fleet_both(doc, "finance-qa,n=200,clients=replay", monkeypatch)
    assert loops == [None] * 3


def test_the_users_hybrid_fleet(monkeypatch) -> None:
    """The users' design (finance-hybrid: length routing to an SGLang pool behind
    cache_aware and two vLLM pools): the SGLang replicas in the core beside the vLLM
    replicas' Python loops."""
    from twin.fleet_presets import PRESETS

    loops = fleet_both(PRESETS["finance-hybrid"](), "finance-qa,n=120,clients=replay",
                       monkeypatch)
    assert loops == [None, None, "not an SGLang replica", "not an SGLang replica"]


@settings(max_examples=int(os.environ.get("CORE_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(n_rep=st.integers(1, 4),
       router=st.sampled_from(["round_robin", "cache_aware", "random", "power_of_two",
                               "least_load", "least_load:polled", "length"]),
       backend=st.sampled_from(["roofline", "opdb"]),
       pool=st.sampled_from([None, 6000, 12000, 40000]),
       overlap=st.booleans(), chunk=st.sampled_from([None, 512, 2048]),
       horizon=st.sampled_from([None, 5.0, 20.0]),
       rate=st.sampled_from([1, 4, 16, 60, "closed:3", "closed:16"]),
       running=st.sampled_from([None, 3]),
       radix=st.sampled_from([None, "", ",templates=3,template_len=700,share=0.6",
                              ",templates=4,template_len=20,share=0.8"]),
       policy=st.sampled_from([None, "lpm", "dfs-weight", "hrrn", "lof", "random",
                               "shortest-prefill-first", *ASKED]),
       prio=st.booleans(), mixed=st.booleans(), records=st.sampled_from([3, 50, 100000]),
       faults=st.sampled_from([None, "crash", "crash-streaming", "crashes", "hang", "slow"]))
def test_drawn_fleets_are_byte_identical(monkeypatch, n_rep, router, backend, pool, overlap,
                                         chunk, horizon, rate, running, radix, policy, prio,
                                         mixed, records, faults) -> None:
    """Fleets drawn over the replica counts, sglang-router's and the gateway's routers
    (length: two pools by prompt length; least_load over the engines' queues polled every
    half second), open and closed loops and the single-replica options above, records
    streamed in chunks of `records`, faults (a crash with retries or with streaming
    clients, two crashes, a hung health check, a slowed replica, which runs the Python
    replica beside the others' cores), policies the core asks of Python (`ASKED`): the
    core's bytes are the Python replicas'."""
    args = {"model_path": "meta-llama/Llama-3.1-8B"}
    if radix is None:
        args["disable_radix_cache"] = True
    specs = tempfile.TemporaryDirectory()
    twin = {}
    if policy in ASKED:  # a replica's own policy, asked of Python
        spec = Path(specs.name) / "policy.json"
        spec.write_text(json.dumps(ASKED[policy]))
        twin["policy"] = str(spec)
    elif policy and (not prio or policy == "lof") and (
            radix is not None or policy != "shortest-prefill-first"):
        args["schedule_policy"] = policy
    if prio:
        args["enable_priority_scheduling"] = True
    for key, on in (("enable_mixed_chunk", mixed), ("disable_overlap_schedule", overlap)):
        if on:
            args[key] = True
    for key, value in (("max_total_tokens", pool), ("chunked_prefill_size", chunk),
                       ("max_running_requests", running)):
        if value is not None:
            args[key] = value
    replica = {"step_time_backend": backend, "server_args": args}
    if twin:
        replica["twin"] = twin
    doc: dict = {"gpu": "a100-sxm-80gb", "router": {"name": router.split(":")[0]}}
    if router.endswith(":polled"):
        doc["router"].update(load="polled", poll_interval_s=0.5)
    if router == "length":
        doc["router"]["thresholds"] = [2500]
        doc["pools"] = [{"name": "short", "replicas": [{**replica, "name": "s", "count": n_rep}]},
                        {"name": "long", "router": {"name": "cache_aware"},
                         "replicas": [{**replica, "name": "l", "count": 2}]}]
    else:
        doc["replicas"] = [{**replica, "name": "r", "count": n_rep}]
    first = ("s" if router == "length" else "r") + ("0" if n_rep > 1 else "")
    if faults:
        doc["failover"] = {"health_check_interval_secs": 1.0, "health_failure_threshold": 2,
                           "health_check_timeout_secs": 0.5,
                           "streaming": faults == "crash-streaming"}
        kind = faults if faults in ("hang", "slow") else "crash"
        doc["faults"] = [{"kind": kind, "replica": first, "at_s": 3.3, "repair_s": 4.0,
                          "duration_s": 5.0, "factor": 3.0}]
        if faults == "crashes":
            doc["faults"].append({"kind": "crash", "replica": first, "at_s": 9.1,
                                  "repair_s": 2.0})
    arrival = (f"arrival=closed,concurrency={rate.split(':')[1]},clients=replay"
               if isinstance(rate, str) else f"arrival=poisson,rate={rate}")
    workload = (f"{arrival},n=90,prompt=uniform:100:5000,output=uniform:1:700" + (radix or "")
                + (",tiers=0:0.6/20:0.3/40:0.1" if prio else ""))
    with specs:
        loops = fleet_both(doc, workload, monkeypatch, horizon, records)
    if faults == "slow":  # (a slowed replica's step times change: no memo)
        assert loops[0] == "no step-time memo" and set(loops[1:]) <= {None}
    else:
        assert set(loops) == {None}


def test_the_fleet_command_says_which_loop_ran(capsys) -> None:
    """`servetwin simulate --deployment` names the replicas the core ran and why the others
    ran the Python replica."""
    assert main(["simulate", "--deployment", "finance-hybrid", "--workload",
                 "finance-qa,n=30,clients=replay"]) == 0
    assert ("scheduler loop: the typed core (twin/_corec.pyx) on sg0, sg1; the Python "
            "replica on vm, vh (not an SGLang replica)") in capsys.readouterr().out


def test_leaving_requests_have_every_slot_the_python_replica_gives(monkeypatch) -> None:
    """The core writes a leaving request's SimRequest slots straight into the object
    (`set_slot`, where SimRequest's slots are plain object slots, as they are): every
    slot is set, to the value the Python replica leaves there (the radix nodes aside:
    the core's are its own)."""
    from twin.config import ServerArgs
    from twin.request_state import SimRequest
    from twin.workload import from_spec

    assert CORE._find_slots()  # the direct path is the one that runs
    cfg = sim.SimConfig(args=ServerArgs(model_path="meta-llama/Llama-3.1-8B"),
                        gpu="a100-sxm-80gb", step_time_backend="roofline")
    wl = from_spec("arrival=poisson,rate=4,n=120,prompt=uniform:100:2000,"
                   "output=uniform:10:300,templates=3,template_len=512,share=0.5", seed=4)
    got = {}
    for on in (True, False):
        monkeypatch.setattr(core, "_CORE", CORE if on else None)
        res = sim.simulate(wl, cfg)
        assert (res.loop_core is None) is on
        got[on] = sorted(res.records._reqs, key=lambda r: r.rid)
    assert len(got[True]) == len(got[False]) == 120
    for a, b in zip(got[True], got[False], strict=True):
        for name in SimRequest.__slots__:
            if name in ("node", "matched_node", "head", "view_cache"):
                assert hasattr(a, name)
                continue
            assert repr(getattr(a, name)) == repr(getattr(b, name)), (a.rid, name)
