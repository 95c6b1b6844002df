"""Decode runs that a submit cuts short: how a replica in a fleet is woken only by its own
requests (issue 14).

Alone, a replica ends each batched decode run at the next arrival, because every arrival
is its own. In a fleet the next arrival is usually another replica's: ending the run there
cost a scheduling pass per replica per arrival, for nothing. Instead, when its feed says
so (`Feed.cuts_runs`), the replica plans the run without the arrivals and waits on the
run's end *or* a submit; a submit at time t keeps the steps that end by the first step end
at or after t (the steps a run bounded by t would have run) and gives the rest back: their
tokens, their KV and their counters. SGLang's scheduler, too, sees a request at the first
step boundary after it came.

A cut gives back only what it can undo exactly, so a run is planned this way only when no
cached prefix must be evicted for it and the KV pool is SGLang's token pool (which never
moves KV); otherwise the run ends at the fleet's next arrival, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import simpy


class CutRuns:
    """Mixed into `Replica` (twin/replica.py), whose state it reads and gives back."""

    def _may_cut(self, b: int, k: int) -> bool:
        """Whether the decode run about to be planned (b requests, at most k steps) may
        ignore arrivals and be cut by a submit instead."""
        return (self.feed.cuts_runs and (not self.batch_full or self.preempt)
                and self._stall == 0 and self.alloc.name == "token"
                and b * k <= self.alloc.available())

    def _wait_or_cut(self, ends: np.ndarray, k: int, t0: float, busy0: float,
                     ratio0: float) -> Iterator[simpy.Event]:
        """Wait out a run of `k` steps ending at `ends` (started at `t0`, with the busy
        time and `new_token_ratio` it started from), or cut it at a submit."""

        def cut(now: float) -> float:
            keep = min(int(np.searchsorted(ends[:k], now, side="left")) + 1, k)
            if keep < k:
                self._give_back(ends, k, keep, t0, busy0, ratio0)
            return float(ends[keep - 1]) - now

        yield from wait_or_cut(self, float(ends[k - 1]) - t0, cut)

    def _give_back(self, ends: np.ndarray, k: int, keep: int, t0: float, busy0: float,
                   ratio0: float) -> None:
        """Undo the last `k - keep` steps of the run just charged (`_run_decode`)."""
        d = k - keep
        self._advance(self.running, -d)
        for r in self.running:
            self.alloc.free_tokens(r.index, d)
        self._end_chunks[-1] = ends[:keep]
        self.n_dec_steps -= d
        self.counters.decode_steps -= d
        self.counters.busy_s = busy0 + (float(ends[keep - 1]) - t0)
        self.new_token_ratio = max(ratio0 - keep * self.ratio_decay, self.min_ratio)
        if self.step_log is not None:
            self.step_log[-1] = (*self.step_log[-1][:3], keep)


def wait_or_cut(rep, dur: float, cut) -> Iterator[simpy.Event]:
    """Replica `rep` waits out a decode run of `dur` seconds, or a submit cuts it: then
    `cut(now)` keeps the steps that end by the first step end at or after now, gives the
    rest back (the Python replica's `_give_back`, or the typed core's, twin/core.py) and
    answers how long the kept steps still run."""
    env = rep.env
    timer = rep._sleep(dur)
    if timer is None:  # nothing else happens before the run's end: no submit either
        return
    wake = rep._run_cut = env.event()  # the run's end or a submit, whichever first
    timer.callbacks.append(lambda _: wake.triggered or wake.succeed())
    try:
        yield wake
    finally:
        rep._run_cut = None
    if timer.processed:
        return
    yield env.timeout(cut(env.now))
