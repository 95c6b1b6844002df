"""KV memory over a run: the `memory` section of every summary, from the time series.

One implementation for `servetwin simulate` (summary.json and the printed summary) and
`benchmarks/allocators.py`. The replica samples its allocator's `stats()` into the series
(`twin.metrics.SERIES_FIELDS`) at the first scheduling pass at or after every
`sample_every_s` of simulated time. Means and percentiles here are over the sampling
instants: a sample stands for every instant since the previous one (a long prefill step
or an idle stretch crosses several), so they are time averages at that resolution; a
peak between two samples is not seen. Counts (failures, compactions, copies, swaps) are the
allocator's and the replica's running totals at the end. Definitions: docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twin.memory import AllocatorStats

# appended to each series row by the replica (twin.replica.Replica._sample)
FRAGMENTATION_FIELDS = ("kv_internal_fragmentation", "kv_external_fragmentation")


def _spread(values: np.ndarray) -> dict[str, float | None]:
    if not values.size:
        return {"mean": None, "p99": None, "max": None}
    return {"mean": round(float(values.mean()), 6),
            "p99": round(float(np.percentile(values, 99)), 6),
            "max": round(float(values.max()), 6)}


def _mean(values: np.ndarray) -> float | None:
    return round(float(values.mean()), 6) if values.size else None


def _peak(values: np.ndarray) -> int | None:
    return int(values.max()) if values.size else None


def _low(values: np.ndarray) -> int | None:
    return int(values.min()) if values.size else None


def sample_weights(t: np.ndarray, every_s: float) -> np.ndarray:
    """How many sampling instants (multiples of `every_s`) each sample stands for: those
    since the previous sample (a long step or an idle stretch crosses several)."""
    ticks = np.floor(t / every_s + 1e-9)
    return np.maximum(np.diff(ticks, prepend=-1.0), 1).astype(int)


def _rows(series: Sequence[tuple], width: int) -> np.ndarray:
    """`np.asarray(series, dtype=float).reshape(-1, width)`, in one compiled pass where
    the records writer is built and the rows are tuples of numbers (a day has ~10**5)."""
    from twin.record_table import _C

    got = _C.rows_array(series, width) if _C is not None and type(series) is list else None
    return np.asarray(series, dtype=float).reshape(-1, width) if got is None else got


def memory_summary(series: Sequence[tuple], fields: Sequence[str], final: AllocatorStats,
                   allocator: str, bytes_per_token: float, counters: dict,
                   sample_every_s: float = 1.0) -> dict:
    """The `memory` section: `series` rows laid out as `fields` (sampled every
    `sample_every_s`), `final` the allocator's statistics at the end, `counters` the
    replica's (`swap_outs`, `swap_ins`, `swapped_bytes`, `stall_s`)."""
    rows = _rows(series, len(fields))
    a = np.repeat(rows, sample_weights(rows[:, 0], sample_every_s), axis=0)
    col = {name: a[:, i] for i, name in enumerate(fields)}
    cap, reserved = final.capacity, final.reserved
    stored, allocated = col["kv_stored_tokens"], col["kv_allocated_tokens"]
    cached = col["radix_cached_tokens"]
    util = stored / cap if cap else np.zeros_like(stored)
    share = np.divide(cached, stored, out=np.zeros_like(cached), where=stored > 0)
    return {
        "allocator": allocator,
        "capacity_tokens": cap,
        "reserved_tokens": reserved,
        "samples": len(rows),
        "stored_tokens": {"mean": _mean(stored), "peak": _peak(stored)},
        "allocated_tokens": {"mean": _mean(allocated), "peak": _peak(allocated)},
        "effective_utilization": {"mean": _mean(util),
                                  "while_waiting": _mean(util[col["waiting"] > 0]),
                                  "peak": round(float(util.max()), 6) if util.size else None},
        "allocated_share": _mean(allocated / cap) if cap else None,
        "idle_share": _mean((allocated - stored + reserved) / cap) if cap else None,
        "internal_fragmentation": _spread(col["kv_internal_fragmentation"]),
        "external_fragmentation": _spread(col["kv_external_fragmentation"]),
        "largest_free_run_tokens": {"min": _low(col["kv_largest_free_run"]),
                                    "mean": _mean(col["kv_largest_free_run"]),
                                    "final": final.largest_free_run},
        "alloc_failures": {"oom": final.failures_oom,
                           "fragmentation": final.failures_fragmented},
        "reallocations": final.reallocations,
        "compactions": final.compactions,
        "tokens_moved": final.tokens_moved,
        "bytes_moved": round(final.tokens_moved * bytes_per_token),
        "copy_stall_s": round(counters.get("stall_s", 0.0), 6),
        "swap": {"outs": counters.get("swap_outs", 0), "ins": counters.get("swap_ins", 0),
                 "bytes": round(counters.get("swapped_bytes", 0.0))},
        "radix_cache": {"mean_tokens": _mean(cached), "peak_tokens": _peak(cached),
                        "share_of_stored": _mean(share)},
    }


def format_memory(m: dict) -> list[str]:
    """The printed summary's memory lines."""

    def f(x: float | None, pct: bool = True) -> str:
        return "-" if x is None else (f"{x:.1%}" if pct else f"{x:,.0f}")

    u, i, e = m["effective_utilization"], m["internal_fragmentation"], m["external_fragmentation"]
    fails, swap, radix = m["alloc_failures"], m["swap"], m["radix_cache"]
    return [
        f"memory ({m['allocator']}, {m['capacity_tokens']:,} KV tokens"
        + (f", {m['reserved_tokens']:,} reserved" if m["reserved_tokens"] else "")
        + f"; {m['samples']} samples):",
        f"  stored tokens     mean {f(m['stored_tokens']['mean'], False)}  peak "
        f"{f(m['stored_tokens']['peak'], False)};  allocated mean "
        f"{f(m['allocated_tokens']['mean'], False)}  peak "
        f"{f(m['allocated_tokens']['peak'], False)}",
        f"  effective utilization  mean {f(u['mean'])}  while requests wait "
        f"{f(u['while_waiting'])}  peak {f(u['peak'])};  idle {f(m['idle_share'])}",
        f"  fragmentation     internal  mean {f(i['mean'])}  p99 {f(i['p99'])}  max "
        f"{f(i['max'])}",
        f"                    external  mean {f(e['mean'])}  p99 {f(e['p99'])}  max "
        f"{f(e['max'])}",
        f"  largest free run  min {f(m['largest_free_run_tokens']['min'], False)}  mean "
        f"{f(m['largest_free_run_tokens']['mean'], False)} tokens",
        f"  failed allocations: OOM {fails['oom']}, fragmentation {fails['fragmentation']}; "
        f"reallocations {m['reallocations']}; compactions {m['compactions']}",
        f"  moved {m['tokens_moved']:,} tokens ({m['bytes_moved'] / 2**30:.2f} GiB), copy "
        f"stall {m['copy_stall_s']:.3f} s; swaps out {swap['outs']}, in {swap['ins']} "
        f"({swap['bytes'] / 2**30:.2f} GiB)",
        f"  radix cache       mean {f(radix['mean_tokens'], False)} tokens "
        f"({f(radix['share_of_stored'])} of stored), peak {f(radix['peak_tokens'], False)}",
    ]
