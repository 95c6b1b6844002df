"""The single-server run without SimPy (issue 14): the same scheduler, a plain loop.

`simulate` (twin/sim.py) runs one server fed by one open-loop source. SimPy then holds two
processes: the replica's scheduler loop (`Replica.run`) and the deployment's feeder
(`Deployment.run`), which wakes at every arrival to hand the request over. This module
runs the same two in a plain loop on a clock that schedules nothing (`PlainClock`):

- the replica's pass is `Replica.run`'s, calling the replica's own methods (prefill,
  decode runs, finishes, retractions, sampling: the same objects, the same state);
  their generators yield only the timeouts below (a policy decider answers at once);
- the feeder is replayed exactly: it fires at f, f' = f + max(next - f, 0.0), ... (the
  float sums SimPy's timeouts make), pumps at each firing with the clock at f (a submit
  reads it) and, when the source is exhausted, tells the replica nothing more will come.
  `PlainClock.peek` is its next firing, so a replica's sleep that would pass it returns a
  timeout (as `Replica._sleep` does on SimPy), and the firings due by the sleep's end are
  run first, as SimPy runs them (at a tie the feeder's timeout was scheduled first).

The domain (`reason_not`): `simulate` of one server, open loop (no `concurrency`, so no
closed-loop clients), no `--horizon`, no `--debug-checks`; any policy, allocator, cache,
overlap and request path (they are the replica's own code). Everything else, and any run
with SERVETWIN_GENERAL_LOOP=1 in the environment, runs on SimPy. The records are
byte-identical to SimPy's: tests/test_fastpath.py runs both on random configurations and
a grid of the CLI's shapes. Speed: the loop is the replica's, so this alone gains little
(SimPy's own share was small, benchmarks/sim_speed.py); it is the seam where a specialised
pass (scalar state, whole decode runs) can replace the replica's methods in its domain.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Generator

import simpy

from twin.errors import ServetwinError

GENERAL_LOOP_ENV = "SERVETWIN_GENERAL_LOOP"  # =1: always SimPy (the reference loop)


class FastPathError(ServetwinError):
    """The plain loop met something only SimPy can run (a bug: the domain is wrong)."""


class PlainClock(simpy.Environment):
    """SimPy's environment as a clock only: events may be created and triggered, nothing
    is ever scheduled (the plain loop decides what happens next). `peek` is the feeder's
    next firing, as in SimPy's queue: a replica's sleep that would pass it returns a
    timeout (`Replica._sleep`), which `_drive` turns into the firings and the jump."""

    due = math.inf  # the feeder's next firing (`_Feeder`)

    def schedule(self, event, priority=1, delay=0) -> None:
        pass

    def peek(self) -> float:
        return self.due

    def step(self) -> None:
        raise FastPathError("the plain loop's clock cannot step SimPy events")


def reason_not(workload, cfg) -> str | None:
    """Why `simulate(workload, cfg)` must run on SimPy (None: the plain loop runs it)."""
    if os.environ.get(GENERAL_LOOP_ENV, "") not in ("", "0"):
        return f"{GENERAL_LOOP_ENV} is set"
    if cfg.debug_checks:
        return "--debug-checks"
    if cfg.horizon_s is not None:
        return "--horizon"
    if workload.concurrency is not None:
        return "closed loop"
    return None


def environment(workload, cfg) -> simpy.Environment:
    """The clock for `simulate`: a `PlainClock` in the plain loop's domain, else SimPy's."""
    return PlainClock() if reason_not(workload, cfg) is None else simpy.Environment()


# The replica's methods the plain loop runs its own copy of, by a digest of their code
# (bytecode, names and constants: not line numbers). A change to any of them turns the copy
# off (the replica's method runs instead: slower, never different) and fails
# tests/test_fastpath.py, which says to bring the copy in line and update the digest.
COPIED = {
    "_run_decode": "44181b1f300dbd2e",
    "_schedule_prefill": "9fd715bd43c1f7af",
    "_sleep": "5973866b3eebfbc2",
    "_pull_arrivals": "8bc78826a4efe294",
    "_seen_by": "9c053eae8fa05456",
}


def code_digest(fn) -> str:
    """A digest of a function's code that ignores where it sits in its file."""
    h = hashlib.sha256()

    def add(code) -> None:
        h.update(code.co_code)
        h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
        for c in code.co_consts:
            if hasattr(c, "co_code"):
                add(c)
            elif isinstance(c, frozenset):  # `x in {...}`: its order varies by process
                h.update(repr(sorted(map(repr, c))).encode())
            else:
                h.update(repr(c).encode())

    add(fn.__code__)
    return h.hexdigest()[:16]


def copies_current() -> dict[str, bool]:
    """Whether each copied method is still the replica's code the copy was made from."""
    from twin.replica import Replica

    return {name: code_digest(getattr(Replica, name)) == d for name, d in COPIED.items()}


class _OneServer:
    """The `Feed` a `Deployment` of one replica is for it (open loop, the `only_replica`
    router, no faults, so no retries), without its tickets and router bookkeeping, which
    `simulate` never reads: the same calls on the source, in the same order."""

    cuts_runs = False  # every arrival is the replica's own: runs end at next_arrival

    def __init__(self, source, rep) -> None:
        self.source, self.rep, self.replicas = source, rep, [rep]
        self.open = 0  # handed over, not yet left
        self._drained = False

    def pump(self, now: float) -> None:
        nxt = self.source.next_time()
        if nxt is None or nxt > now:
            return
        for sent, req in self.source.pop_ready(now):
            self.open += 1
            self.rep.submit(sent, req)

    def next_arrival(self) -> float | None:
        return self.source.next_time()

    def done(self) -> bool:
        return self.source.exhausted and self.open == 0

    def left(self, replica, req) -> None:
        self.open -= 1
        self.source.finished(replica.env.now)
        if self.done():
            replica.submit_nothing()

    def unsent(self) -> list:
        """`Deployment.unsent` (at the end: what was never handed over, once)."""
        if self._drained:
            return []
        self._drained = True
        out = []
        while not self.source.exhausted:
            for item in self.source.pop_ready(math.inf):
                out.append(item)
                self.source.finished(self.rep.env.now)
        return out


class _Feeder:
    """`Deployment.run` for an open-loop source, replayed: `due` is its next firing."""

    def __init__(self, dep, env: PlainClock) -> None:
        self.dep, self.env = dep, env
        nxt = dep.source.next_time()  # the feeder's first step, at time 0
        self._set(None if nxt is None else 0.0 + max(nxt - 0.0, 0.0))

    def _set(self, due: float | None) -> None:
        self.due = due
        self.env.due = math.inf if due is None else due
        if due is None:  # the source is exhausted: idle replicas see nothing will come
            for rep in self.dep.replicas:
                rep.submit_nothing()

    def fire(self) -> None:
        f = self.due
        self.dep.pump(f)
        nxt = self.dep.source.next_time()
        self._set(None if nxt is None else f + max(nxt - f, 0.0))

    def advance(self, t: float) -> None:
        """The replica sleeps until `t`: every firing due by then happens first."""
        while self.due is not None and self.due <= t:
            self.env._now = self.due  # SimPy's clock at the firing (submits read it)
            self.fire()
        self.env._now = t


def _drive(gen: Generator, feeder: _Feeder):
    """Run one of the replica's generator methods to its end; its return value. A
    timeout it yields (a sleep past the feeder's next firing) is served as SimPy would:
    the firings due by its end first (scheduled earlier, they come first at a tie)."""
    try:
        ev = next(gen)
        while True:
            if type(ev) is not simpy.Timeout:
                gen.close()
                raise FastPathError(f"the replica waited on {type(ev).__name__} in the "
                                    "plain loop")
            feeder.advance(feeder.env._now + ev._delay)
            ev = gen.send(None)
    except StopIteration as stop:
        return stop.value


def _decode(rep, feeder: _Feeder) -> None:
    """`Replica._run_decode` (a copy, see COPIED) for a token pool without a step log, one
    server's run (never cut: its runs end at its own arrivals), with `_sleep` served by
    the feeder as `_drive` would: fewer calls per decode run, the same state after it."""
    running = rep.running
    b = len(running)
    env = rep.env
    now = env._now
    rep._scheduled_at = rep._pass_at if rep.freed_later is not None else None
    room = rep.room()
    k = min(min([r.max_new_tokens - r.generated_tokens for r in running]), max(room // b, 1))
    kv0 = sum([r.prompt_tokens + r.generated_tokens for r in running])
    limit = rep._next_boundary(arrivals=True)
    cache = rep._cache
    if (cache is not None and rep._cache_st is rep.st
            and (kv0 + b * (k - 1)) / b <= cache.quiet):
        times = cache.run(b, kv0, k, limit - now)
        k = len(times)
    else:
        times = rep._decode_times(b, kv0, k)
        if k > 1:
            bound = int((limit - now) / float(times[0])) + 1
            if bound < k:
                k, times = bound, times[:bound]
    ends = times.cumsum()
    ends += now
    if ends[-1] > limit:
        k = min(int(ends.searchsorted(limit, side="left")) + 1, len(ends))
    if not rep._grow_decoders(running, k):
        return
    dur_copy = rep._stall
    rep._stall = 0.0
    rep._add_ends(ends[:k])
    rep.n_dec_steps += k
    dur = float(ends[k - 1]) - now + dur_copy
    c = rep.counters
    c.stall_s += dur_copy
    c.decode_steps += k
    c.busy_s += dur
    rep.new_token_ratio = max(rep.new_token_ratio - k * rep.ratio_decay, rep.min_ratio)
    done = False
    for r in running:
        r.generated_tokens += k
        r.private += k
        if r.generated_tokens >= r.max_new_tokens:
            done = True
    feeder.advance(env._now + dur)  # `_sleep(dur)`: the clock, or the firings first
    if done:
        rep._finish_done(env._now)


def run(rep) -> None:
    """`Replica.run` of a replica built on a `PlainClock` by `build_replica`, with its
    feeder, to the end of the workload."""
    env = rep.env
    if not isinstance(env, PlainClock):
        raise FastPathError("the plain loop needs a replica built on a PlainClock")
    rep._fast_clock = True  # a sleep short of the feeder's next firing moves the clock
    if rep.feed.workers[0].replica is not rep or len(rep.feed.workers) != 1:
        raise FastPathError("the plain loop runs a deployment of one replica")
    rep.feed = _OneServer(rep.feed.source, rep)
    feeder = _Feeder(rep.feed, env)
    same = copies_current()
    own_decode = (same["_run_decode"] and same["_sleep"] and rep._counts_only
                  and rep.step_log is None)

    def decode() -> None:
        if own_decode:
            _decode(rep, feeder)
        else:
            _drive(rep._run_decode(), feeder)

    # `_schedule_prefill`'s first answer, without the call: nothing waits, no preemption
    quick = same["_schedule_prefill"] and not rep.preempt
    own_pull = same["_pull_arrivals"] and same["_seen_by"]
    fl = rep.freed_later
    source, overlap = rep.feed.source, fl is not None
    same_t, spins = -1.0, 0
    while True:
        now = env._now
        spins = spins + 1 if now == same_t else 0
        same_t = now
        if spins > 100_000:
            raise RuntimeError(f"scheduler livelock at t={now}: 100,000 passes without "
                               f"time advancing ({len(rep.waiting)} waiting, "
                               f"{len(rep.running)} running)")
        nxt = source.next_time()
        if own_pull and not rep._inbox and (nxt is None or nxt > now):
            # `_pull_arrivals` with nothing to take: what it leaves behind
            rep._scheduled_at, rep._pass_at = None, now
            if overlap:
                rep._known = 0
        else:
            rep._pull_arrivals(now)
        if fl is not None and fl.turn():
            rep.batch_full = False
        if now >= rep._next_sample:
            rep._sample(now)
        if rep._stall > 0:
            stall, rep._stall = rep._stall, 0.0
            rep.counters.stall_s += stall
            feeder.advance(now + stall)
            continue
        if rep.shrunk:
            rep.shrunk = False
            rep.batch_full = False
        if quick and not rep.waiting and rep.chunked is None:
            batch = None
        else:
            batch = _drive(rep._schedule_prefill(now), feeder)
        if batch:
            _drive(rep._run_prefill(batch), feeder)
            if not rep._placed_any and rep.running:
                decode()
        elif rep.running:
            decode()
        elif fl is not None and fl.release():
            rep.batch_full = False
            continue
        else:
            rep.batch_full = False
            rep.new_token_ratio = rep.init_ratio
            if rep._inbox:
                continue
            if rep.waiting or rep.chunked is not None:
                if rep.feed.next_arrival() is None:
                    rep._reject_stuck()
                    continue
            elif rep.feed.done():
                break
            if not _idle(rep, feeder):
                return  # SimPy would run out of events with the replica asleep
    rep._end(env._now)


def _idle(rep, feeder: _Feeder) -> bool:
    """`Inbox._idle` without a horizon: sleep until a submit (a wake-up already
    triggered resumes at once). False when nothing will ever wake the replica."""
    while not rep._wake.triggered:
        if feeder.due is None:
            return False
        feeder.advance(feeder.due)
    rep._wake = rep.env.event()
    return True
