"""Exact memo of a step-time model's answers (issue 14), shared by the replicas on one backend.

A decode run of b requests from KV sum kv0 needs `decode_times(b, [kv0, kv0 + b, ...])`.
Every element is a function of its own KV sum only (the backend contract, and each backend
computes it elementwise: the same inputs give the same float, whatever array they come in),
so the answers are kept in blocks: the block (b, r, q) holds the times of the KV sums
r + b * j for j in [q * BLOCK, (q + 1) * BLOCK), r = kv0 mod b. A run reads a slice of one
block (or joins two); only a run longer than a block asks the backend directly. A prefill
step without decodes is memoised by its chunks.

Only for a model whose answers never change during a run (no fault's `factor` in its
chain) and only where asking has no side effect: a backend warns once when a lookup leaves
its measured data (`opdb`), so blocks are computed only up to the mean KV length below
which it stays silent (`quiet_kv_mean`, absent: no blocks); beyond it the run's own steps
are asked for, as before. Both memos are cleared when they hold `max_entries` (the answers
are the same either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twin.perf import PrefillChunk, StepTimeModel

BLOCK = 256  # decode steps per block


def quiet_kv_mean(st: StepTimeModel) -> float:
    """The mean KV length up to which `st.decode_times` has no side effect (-inf:
    unknown). Wrappers (overlap, fitted correction) pass their inner model's on."""
    while st is not None:
        q = getattr(st, "quiet_kv_mean", None)
        if q is not None:
            return float(q)
        st = getattr(st, "inner", None) or getattr(st, "base", None)
    return float("-inf")


class StepTimeCache:
    """`decode(b, kv0, k)` == `st.decode_times(b, np.arange(kv0, kv0 + b * k, b))`,
    `prefill(chunks)` == `st.step_time(chunks, [])`, bit for bit."""

    __slots__ = ("st", "_blocks", "_prefill", "quiet", "max_entries")

    def __init__(self, st: StepTimeModel, max_entries: int = 1 << 14) -> None:
        self.st = st
        self._blocks: dict[tuple[int, int, int], np.ndarray] = {}
        self._prefill: dict[tuple[PrefillChunk, ...], float] = {}
        self.quiet = quiet_kv_mean(st)  # blocks only up to this mean KV length
        self.max_entries = max_entries

    def _block(self, b: int, r: int, q: int) -> np.ndarray | None:
        key = (b, r, q)
        blk = self._blocks.get(key)
        if blk is None:
            start = r + b * q * BLOCK
            if (start + b * (BLOCK - 1)) / b > self.quiet:
                return None  # asking there may warn: only a run's own steps are asked for
            if len(self._blocks) >= self.max_entries:
                self._blocks.clear()
            blk = self._blocks[key] = self.st.decode_times(
                b, np.arange(start, start + b * BLOCK, b))
        return blk

    def decode(self, b: int, kv0: int, k: int) -> np.ndarray:
        """Durations of k decode steps of b requests from KV sum kv0."""
        if b > 0 and k <= BLOCK:
            j, r = divmod(kv0, b)
            q, i = divmod(j, BLOCK)
            blk = self._block(b, r, q)
            if blk is not None:
                if i + k <= BLOCK:
                    return blk[i:i + k]
                nxt = self._block(b, r, q + 1)
                if nxt is not None:
                    return np.concatenate((blk[i:], nxt[:i + k - BLOCK]))
        return self.st.decode_times(b, np.arange(kv0, kv0 + b * k, b))

    def run(self, b: int, kv0: int, k: int, span: float) -> np.ndarray:
        """The step times of a decode run of b requests from KV sum kv0 that ends by
        `span` seconds: at most k steps, and (k > 1) no more than `int(span / first
        step) + 1` (steps only lengthen as KV grows)."""
        if b > 0:
            j, r = divmod(kv0, b)
            q, i = divmod(j, BLOCK)
            blk = self._blocks.get((b, r, q))
            if blk is None:
                blk = self._block(b, r, q)
            if blk is not None:
                if k > 1:
                    bound = int(span / float(blk[i])) + 1
                    if bound < k:
                        k = bound
                if i + k <= BLOCK:
                    return blk[i:i + k]
                return self.decode(b, kv0, k)
        times = self.st.decode_times(b, np.arange(kv0, kv0 + b * k, b))
        if k > 1:
            bound = int(span / float(times[0])) + 1
            if bound < k:
                times = times[:bound]
        return times

    def first(self, b: int, kv0: int) -> float:
        """The duration of the first step of a decode run (`decode(b, kv0, 1)[0]`)."""
        return float(self.decode(b, kv0, 1)[0])

    def prefill(self, chunks: Sequence[PrefillChunk]) -> float:
        """`st.step_time(chunks, [])`: a prefill step without decodes."""
        key = tuple(chunks)
        t = self._prefill.get(key)
        if t is None:
            if len(self._prefill) >= self.max_entries:
                self._prefill.clear()
            t = self._prefill[key] = self.st.step_time(chunks, [])
        return t


# one memo per backend object (and chain of overlap wrappers around it): the replicas of a
# fleet, and the runs of a planner that passes the same model to every simulation, share it.
# It hangs on the backend itself (a module-level table would keep every backend alive:
# the memo refers to its model), so it goes with the backend.


def memo_for(st: StepTimeModel) -> StepTimeCache:
    """The memo for `st`: shared with every other model that is the same backend object
    under the same number of `OverlapStepTime` wrappers (which add nothing but a function
    of the backend's answers), else a memo of its own."""
    from twin.overlap import OverlapStepTime

    inner, depth = st, 0
    while type(inner) is OverlapStepTime:
        inner, depth = inner.inner, depth + 1
    memos = getattr(inner, "_step_memos", None)
    if not isinstance(memos, dict):
        try:
            memos = inner._step_memos = {}
        except AttributeError:  # slots or frozen: nothing to share by
            return StepTimeCache(st)
    memo = memos.get(depth)
    if memo is None:
        memo = memos[depth] = StepTimeCache(st)
    return memo
