"""The summary's `memory` section (twin/memory_stats.py): hand-computed layouts for every
allocator, and the same numbers as benchmarks/allocators.py for the same run."""

import importlib.util
import json
from pathlib import Path

import pytest

from twin.config import ServerArgs
from twin.memory import AllocResult, TokenPool
from twin.memory.buddy import BuddyAllocator
from twin.memory.contiguous import ContiguousAllocator
from twin.memory.paged import PagedAllocator
from twin.memory_stats import memory_summary
from twin.metrics import SERIES_FIELDS, format_summary
from twin.sim import simulate
from twin.workload import from_spec

ROOT = Path(__file__).parent.parent


def approx(x: float):
    return pytest.approx(x, abs=1e-6)  # the summary rounds to 6 digits


def row(t: float, alloc, waiting: int = 0, cached: int = 0) -> tuple:
    """A series row as the replica samples it (twin.replica.Replica._sample)."""
    stored, allocated, largest, internal, external = alloc.series_columns()
    return (t, 0, waiting, stored, allocated, largest, cached, 0.7, internal, external)


def summary(rows, alloc, counters=None) -> dict:
    return memory_summary(rows, SERIES_FIELDS, alloc.stats(), alloc.name, 1000.0,
                          counters or {})


def test_token_pool_by_hand():
    a = TokenPool(100)
    a.alloc(0, 30)
    rows = [row(0, a, cached=15)]
    a.alloc(1, 50)
    rows.append(row(1, a, waiting=2, cached=40))
    a.free(0)
    assert a.alloc(2, 60) is AllocResult.OOM
    rows.append(row(2, a))
    m = summary(rows, a, {"swap_outs": 2, "swap_ins": 1, "swapped_bytes": 3e9})
    assert m["capacity_tokens"] == 100 and m["samples"] == 3
    assert m["stored_tokens"] == {"mean": approx(160 / 3), "peak": 80}
    assert m["allocated_tokens"] == m["stored_tokens"]
    assert m["effective_utilization"] == {"mean": approx(0.533333),
                                          "while_waiting": 0.8, "peak": 0.8}
    assert m["internal_fragmentation"] == m["external_fragmentation"] == {
        "mean": 0.0, "p99": 0.0, "max": 0.0}
    assert m["largest_free_run_tokens"] == {"min": 20, "mean": approx(140 / 3),
                                            "final": 50}
    assert m["alloc_failures"] == {"oom": 1, "fragmentation": 0}
    assert m["swap"] == {"outs": 2, "ins": 1, "bytes": 3_000_000_000}
    # cached / stored per sample: 15/30, 40/80, 0/50
    assert m["radix_cache"] == {"mean_tokens": approx(55 / 3),
                                "peak_tokens": 40, "share_of_stored": approx(1 / 3)}


def test_paged_by_hand():
    a = PagedAllocator(64, page_size=16)  # 4 pages
    a.alloc(0, 20)  # 2 pages
    a.alloc(1, 10)  # 1 page
    rows = [row(0, a)]  # stored 30, allocated 48, free 16
    a.free(0)
    rows.append(row(1, a))  # stored 10, allocated 16, free 48
    m = summary(rows, a)
    assert m["stored_tokens"] == {"mean": 20, "peak": 30}
    assert m["allocated_tokens"] == {"mean": 32, "peak": 48}
    assert m["internal_fragmentation"] == {"mean": approx((18 / 48 + 6 / 16) / 2),
                                           "p99": 0.375, "max": 0.375}
    assert m["external_fragmentation"]["max"] == 0  # any free page serves any owner
    assert m["idle_share"] == approx((18 + 6) / 64 / 2)
    assert m["largest_free_run_tokens"]["min"] == 16


def test_buddy_by_hand():
    a = BuddyAllocator(128, min_block_tokens=16)  # 8 minimum blocks
    for o in range(8):
        a.alloc(o, 10)  # a 16-token block each, 10 stored
    rows = [row(0, a)]  # full: stored 80, allocated 128, nothing free
    for o in (0, 2, 4, 6):
        a.free(o)
    rows.append(row(1, a))  # 64 free in four 16-token blocks: external 1 - 16/64
    assert a.alloc(9, 32) is AllocResult.FRAGMENTED
    assert a.alloc(9, 80) is AllocResult.OOM
    assert a.compact() == 40  # the four live blocks move, 10 stored tokens each
    rows.append(row(2, a))  # one free run of 64
    m = summary(rows, a)
    assert m["stored_tokens"] == {"mean": approx(160 / 3), "peak": 80}
    assert m["internal_fragmentation"] == {"mean": 0.375, "p99": 0.375, "max": 0.375}
    # external per sample: 0 (nothing free), 0.75, 0; P99 interpolates 0.75 at 98% of 0..0.75
    assert m["external_fragmentation"] == {"mean": 0.25, "p99": 0.735, "max": 0.75}
    assert m["alloc_failures"] == {"oom": 1, "fragmentation": 1}
    assert (m["compactions"], m["tokens_moved"], m["bytes_moved"]) == (1, 40, 40_000)
    assert m["largest_free_run_tokens"] == {"min": 0, "mean": approx(80 / 3),
                                            "final": 64}


def test_contiguous_by_hand():
    a = ContiguousAllocator(100, reserve_fraction=0.15)  # 15 reserved, 85 usable
    a.reserve(0, 30)
    a.reserve(1, 40)
    a.alloc(0, 10)
    a.alloc(1, 25)
    rows = [row(0, a)]  # stored 35, allocated 70, free 15 in one run
    a.grow_all([0, 1], 15)
    a.free(0)
    rows.append(row(1, a))  # owner 1: 40 of its 40; free 45 = 30 at 0 + 15 at 70
    assert a.reserve(2, 40) is AllocResult.FRAGMENTED
    assert a.reserve(2, 50) is AllocResult.OOM
    assert a.compact() == 40
    rows.append(row(2, a))
    m = summary(rows, a)
    assert (m["capacity_tokens"], m["reserved_tokens"]) == (100, 15)
    assert m["internal_fragmentation"] == {"mean": approx(0.5 / 3),
                                           "p99": approx(0.49), "max": 0.5}
    assert m["external_fragmentation"]["max"] == approx(1 / 3)
    assert m["effective_utilization"]["mean"] == approx((0.35 + 0.4 + 0.4) / 3)
    assert m["idle_share"] == approx((0.5 + 0.15 + 0.15) / 3)
    assert m["alloc_failures"] == {"oom": 1, "fragmentation": 1}
    assert m["compactions"] == 1 and m["tokens_moved"] == 40


def _benchmark():
    spec = importlib.util.spec_from_file_location("allocators_bench",
                                                  ROOT / "benchmarks" / "allocators.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["token", "buddy", "contiguous"])
def test_the_summary_equals_the_benchmark_for_the_same_run(name):
    bench = _benchmark()
    w = from_spec("arrival=poisson,rate=4,n=40,prompt=uniform:2000:9000,"
                  "output=uniform:50:300", seed=1)
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", tp_size=1, max_total_tokens=60000)
    defrag = (10, 0.25) if name != "token" else None
    r = bench.run(w, name, 0.25, args, "a100-sxm-80gb", 256, defrag)
    res = simulate(w, bench.config(name, 0.25, args, "a100-sxm-80gb", 256, defrag))
    m = res.summary["memory"]
    assert r["memory"] == m
    assert (r["util"], r["int"], r["ext"], r["oom"], r["frag"], r["moved"]) == (
        m["effective_utilization"]["mean"], m["internal_fragmentation"]["mean"],
        m["external_fragmentation"]["mean"], m["alloc_failures"]["oom"],
        m["alloc_failures"]["fragmentation"], m["tokens_moved"])
    assert m["samples"] == len(res.series) > 10
    assert "memory (" + name in format_summary(res.summary)


def test_the_cli_writes_the_memory_section_and_fragmentation_columns(tmp_path):
    from servetwin.cli import main

    out = tmp_path / "o"
    assert main(["simulate", "--kv-allocator", "buddy", "--workload",
                 "arrival=poisson,rate=2,n=10,prompt=uniform:500:3000,output=fixed:20",
                 "--model-path", "Qwen/Qwen3-8B", "--tp-size", "1", "--out", str(out)]) == 0
    m = json.loads((out / "summary.json").read_text())["memory"]
    assert m["allocator"] == "buddy" and m["internal_fragmentation"]["max"] > 0
    header = (out / "timeseries.csv").read_text().splitlines()[0].split(",")
    assert header[-2:] == ["kv_internal_fragmentation", "kv_external_fragmentation"]


def test_a_sample_stands_for_every_instant_since_the_previous_one():
    a = TokenPool(100)
    a.alloc(0, 10)
    rows = [row(0, a)]
    a.alloc(1, 30)
    rows.append(row(3.2, a))  # a long step: instants 1, 2 and 3 see 40 stored
    m = summary(rows, a)
    assert m["samples"] == 2 and m["stored_tokens"] == {"mean": 32.5, "peak": 40}
    half = memory_summary(rows, SERIES_FIELDS, a.stats(), "token", 1.0, {}, 0.5)
    assert half["stored_tokens"]["mean"] == approx((10 + 6 * 40) / 7)  # instants 0.5..3


@pytest.mark.parametrize("name", ["token", "paged", "buddy", "contiguous"])
def test_series_columns_are_the_stats_sample(name):
    """Every allocator's series sample is its `stats()` rounded as the series writes it
    (TokenPool answers from its counts; KVAllocator.series_columns is the rule)."""
    from twin.memory import KVAllocator, make_allocator
    a = make_allocator(name, 4096, page_size=16, bytes_per_token=131072.0)
    seen = [a.series_columns()]
    for owner, n in [(1, 100), (2, 37), (3, 1000), (1, 5)]:
        a.alloc(owner, n)
        seen.append(a.series_columns())
        assert seen[-1] == KVAllocator.series_columns(a)
    a.free(2)
    assert a.series_columns() == KVAllocator.series_columns(a)
    assert a.series_columns() != seen[0]  # the sample moves with the allocations
    a.free(1)
    a.free(3)
    assert a.series_columns() == KVAllocator.series_columns(a) == seen[0]
