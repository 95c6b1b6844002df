"""The twin replica on the wall clock, fed from HTTP requests as they arrive.

Why asyncio drives SimPy directly (and not `simpy.rt.RealtimeEnvironment` in a thread):
the HTTP server is asyncio (aiohttp), and a request must reach the replica at the
simulated time it arrived, which a real-time environment sleeping in another thread
cannot be told about without locks around every piece of replica state. Here one
coroutine (`Engine.run`) owns the environment: it sleeps until the wall-clock time of the
next SimPy event, or until an HTTP handler hands in a request (an `asyncio.Event`), then
steps every event that is due. All replica state is touched from the event loop's one
thread, so handlers read token counts without locks. SimPy events are short (a scheduling
pass), so stepping them inline does not hold up the HTTP side measurably
(`benchmarks/emulator.py` measures the lateness this gives).

The model code is the twin's own (`twin.sim.make_replica`): the environment is SimPy's,
subclassed only so that the replica does not move the clock without an event (its fast
path for plain environments). A request arriving at simulated time s is handed in by
setting the clock to s (no event is due before s: the driver steps events in time
order) and calling `Replica.submit`, exactly what a deployment's feed does. SGLang's
request path in front of the scheduler (`twin.request_path`: the tokenizer manager's
serial queue) delays the hand-off as in `servetwin simulate`.

Tokens: the replica advances a decode run's requests when it plans the run, so a
request's count may include tokens whose step has not ended; the driver publishes only
the tokens due by now (a run's step ends are in the replica's step-end timeline) and
wakes at each step end to publish the next one.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from twin.request_path import Tokenizer
from twin.request_state import SimRequest
from twin.sim import SimConfig, make_replica
from twin.workload import Request

# Prompt tokens per radix segment: two prompts share cached KV up to their longest common
# run of whole blocks (SGLang matches single tokens; a block of 16 loses < 16 per match).
BLOCK = 16
LATENESS_SAMPLES = 100_000
EARLY_S = 0.0015  # the driver's asyncio wait ends this early; it sleeps the rest exactly
SERIES_KEEP = 3600  # the replica's per-second samples kept (an hour of simulated time)


class WallClockEnv(simpy.Environment):
    """SimPy's environment; a subclass so `Replica._sleep` always waits on an event."""

    def hand_in_at(self, t: float) -> None:
        """Move the clock to `t` for an outside hand-off (no event is due before it)."""
        if t > self._now:
            self._now = t


def prompt_segments(ids: list[int]) -> tuple[tuple[int, int], ...]:
    """The prompt as radix segments: blocks of `BLOCK` tokens, each named by a hash of
    the whole prompt up to its end, so equal prefixes give equal leading segments."""
    segs, h = [], hashlib.blake2b(digest_size=8)
    arr = np.asarray(ids, dtype=np.int64)
    for start in range(0, len(arr), BLOCK):
        block = arr[start:start + BLOCK]
        h.update(block.tobytes())
        segs.append((int.from_bytes(h.copy().digest(), "big") >> 1, len(block)))
    return tuple(segs)


@dataclass
class Ticket:
    """One HTTP request's life: what its handler streams from."""

    rid: str
    req: Request
    stream: bool
    sent_s: float  # simulated time it arrived
    wall_t0: float  # perf_counter() when it arrived
    available: int = 0  # tokens whose step has ended (published)
    token_s: list[float] = field(default_factory=list)  # simulated time of each token
    sim: SimRequest | None = None  # the replica's request, once it ran
    final: SimRequest | None = None  # set when it left the replica
    cancelled: bool = False
    reported: int | None = None  # tokens to report (max_new_tokens 0 runs one, shows none)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.final is not None


class LiveFeed:
    """The replica's `Feed` (twin/replica.py) for requests handed in from outside: the
    next hand-off may come at any moment, so a decode run ends at every step (one
    scheduling pass per step, as SGLang's loop), unless the batch is full."""

    cuts_runs = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.closed = False

    def pump(self, now: float) -> None:
        pass  # the engine submits as requests arrive

    def next_arrival(self) -> float | None:
        return None if self.closed else self.engine.env.now

    def done(self) -> bool:
        return self.closed

    def left(self, replica, req: SimRequest) -> None:
        self.engine.left(req)

    def unsent(self) -> list:
        return []


class Engine:
    """One emulated server: `submit` requests, `await run()` drives the clock."""

    def __init__(self, cfg: SimConfig, speed: float = 1.0, step_time=None,
                 on_finish: Callable[[Ticket], None] | None = None) -> None:
        self.cfg, self.speed = cfg, speed
        self.env = WallClockEnv()
        self.rep, self.backend = make_replica(self.env, cfg, step_time)
        self.feed = LiveFeed(self)
        self.rep.feed = self.feed
        self.path = cfg.path_for(self.rep.st)
        self.tokenizer = None if self.path.off else Tokenizer(self.path)
        self.on_finish = on_finish
        self.tickets: dict[int, Ticket] = {}  # id(Request) -> ticket, while inside
        self._pending: list[tuple[float, int, Ticket]] = []  # (hand-off time, seq, ticket)
        self._seq = itertools.count()
        self._aborting: list[Ticket] = []
        self._kick = asyncio.Event()
        self.t0 = time.perf_counter()
        self.failed: str | None = None  # the model raised: the server is unhealthy
        # wall-clock lateness of the last published tokens (s): /server_info reports it
        self.lateness_s: deque[float] = deque(maxlen=LATENESS_SAMPLES)
        self.counts = {"requests": 0, "finished": 0, "aborted": 0}
        self.tokens_out = 0  # tokens published, every request
        self.batch_seconds, self._batch_t = 0.0, 0.0  # integral of the running batch size
        self._started = False

    # ---- the clock ----------------------------------------------------------------------
    def sim_now(self) -> float:
        return (time.perf_counter() - self.t0) * self.speed

    def wall_of(self, sim_t: float) -> float:
        return self.t0 + sim_t / self.speed

    # ---- requests -------------------------------------------------------------------------
    def submit(self, rid: str, ids: list[int], max_new_tokens: int, stream: bool,
               priority: int = 0) -> Ticket:
        """Hand a request in now; its ticket tells the handler what to stream."""
        now = max(self.sim_now(), self.env.now)
        out = max(max_new_tokens, 1)
        req = Request.make(rid, now, prompt_segments(ids), out, priority)
        t = Ticket(rid, req, stream, now, time.perf_counter(),
                   reported=max_new_tokens if max_new_tokens < out else None)
        at = self.tokenizer.arrival(now, req.prompt_tokens) if self.tokenizer else now
        heapq.heappush(self._pending, (at, next(self._seq), t))
        self.counts["requests"] += 1
        self._kick.set()
        return t

    def abort(self, t: Ticket) -> None:
        """The client went away: the request leaves at its next step boundary (a waiting
        request at once), as SGLang aborts a disconnected request."""
        if t.done or t.cancelled:
            return
        t.cancelled = True
        self.counts["aborted"] += 1
        if id(t.req) not in self.tickets:
            return  # not handed in yet: dropped when its hand-off comes
        self._aborting.append(t)
        self._kick.set()

    def _try_abort(self, t: Ticket) -> bool:
        rep = self.rep
        for i, (_, req) in enumerate(rep._inbox):
            if req is t.req:
                del rep._inbox[i]
                self.tickets.pop(id(t.req), None)
                return True
        for r in rep.waiting:
            if r.req is t.req and not r.swapped_tokens:
                rep.waiting.remove(r)
                rep._leave(r, "aborted", "client disconnected")
                return True
        for r in rep.running:
            if r.req is t.req:  # one more step (the run in flight decided its own)
                r.max_new_tokens = min(r.max_new_tokens, r.generated_tokens + 1)
                return True
        return t.done  # in a prefill step: try again after it

    def left(self, r: SimRequest) -> None:
        t = self.tickets.pop(id(r.req), None)
        if t is None:
            return
        self._publish_one(t, r.generated_tokens, self.env.now)
        t.sim = t.final = r
        t.changed.set()
        self.counts["finished"] += 1
        if self.on_finish is not None and not t.cancelled:
            self.on_finish(t)

    # ---- the driver -------------------------------------------------------------------------
    async def run(self) -> None:
        """Drive the simulation on the wall clock until cancelled."""
        if not self._started:
            self._started = True
            self.t0 = time.perf_counter()
            self.env.process(self.rep.run())
        while True:
            try:
                self._advance(self.sim_now())
                wait = self.wall_of(self._next_due()) - time.perf_counter()
            except Exception as exc:  # the model itself failed: stop, say why, stay up
                self._fail(f"{type(exc).__name__}: {exc}")
                return
            self._kick.clear()
            if self._pending and self._pending[0][0] <= self.sim_now():
                wait = 0.0
            if wait > EARLY_S:
                try:
                    await asyncio.wait_for(self._kick.wait(), min(wait - EARLY_S, 1.0))
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let the handlers run
            if not self._kick.is_set():
                # the loop's timers wake up to 1 ms late (epoll's millisecond timeout):
                # the last stretch is slept exactly
                rest = self.wall_of(self._next_due()) - time.perf_counter()
                if 0 < rest <= EARLY_S:
                    time.sleep(rest)

    def _next_due(self) -> float:
        nxt = self.env.peek()
        if self._pending:
            nxt = min(nxt, self._pending[0][0])
        future = self._future_ends(self._pub_now())
        if len(future):
            nxt = min(nxt, float(future[0]))
        return nxt if math.isfinite(nxt) else self.sim_now() + self.speed

    def _advance(self, now: float, budget: int = 2000) -> None:
        """Step every event and hand off every request due by `now` (simulated), at most
        `budget` events before the handlers get a turn; publish tokens at each time."""
        env = self.env
        for _ in range(budget):
            t_ev = env.peek()
            t_in = self._pending[0][0] if self._pending else math.inf
            if min(t_ev, t_in) > now:
                break
            self._integrate(min(t_ev, t_in))
            if t_in <= t_ev:
                _, _, ticket = heapq.heappop(self._pending)
                env.hand_in_at(t_in)
                if not ticket.cancelled:
                    self.tickets[id(ticket.req)] = ticket
                    self.rep.submit(ticket.sent_s, ticket.req)
            else:
                env.step()
            nxt = min(env.peek(), self._pending[0][0] if self._pending else math.inf)
            if nxt > env.now:  # every event of this instant is done: its tokens are out
                self._publish(env.now)
        self._publish(self._pub_now())
        if self._aborting:
            self._aborting = [t for t in self._aborting if not self._try_abort(t)]
        self._trim()

    def _trim(self) -> None:
        """Keep memory bounded on a server that runs for days: the replica's records of
        finished requests, its folded step-end blocks (only records read them) and all
        but the last hour of its per-second samples go."""
        rep = self.rep
        rep.finished.clear()
        if rep._end_blocks:
            rep._end_blocks.clear()
        if len(rep.series) > 2 * SERIES_KEEP:
            del rep.series[:-SERIES_KEEP]

    def _integrate(self, t: float) -> None:
        """Running requests x time, for `batch_efficiency` (a time average)."""
        if t > self._batch_t:
            self.batch_seconds += len(self.rep.running) * (t - self._batch_t)
            self._batch_t = t

    def _pub_now(self) -> float:
        """Now on the simulated clock, but not past the next event (not yet stepped)."""
        return max(self.env.now, min(self.sim_now(), self.env.peek()))

    def _run_ends(self) -> np.ndarray | None:
        """Step ends of the decode run in flight (None between runs)."""
        chunks = self.rep._end_chunks
        if not chunks or chunks[-1][-1] <= self.env.now:
            return None
        return chunks[-1]

    def _future_ends(self, now: float) -> np.ndarray:
        """Ends of the in-flight decode run's steps after `now`."""
        ends = self._run_ends()
        if ends is None:
            return np.empty(0)
        return ends[int(np.searchsorted(ends, now, side="right")):]

    def _future_steps(self, now: float) -> int:
        return len(self._future_ends(now))

    def _publish(self, now: float) -> None:
        """Every running request's tokens whose step ended by `now` go to its handler,
        stamped with that step's end."""
        ends = self._run_ends()
        stamp, future = self.env.now, 0
        if ends is not None:
            done = int(np.searchsorted(ends, now, side="right"))
            if done and ends[done - 1] >= self.env.peek():
                done -= 1  # the run's last step ends with an event not yet stepped
            future = len(ends) - done
            if done:
                stamp = float(ends[done - 1])
        for r in self.rep.running:
            t = self.tickets.get(id(r.req))
            if t is not None:
                t.sim = r
                have = r.generated_tokens - (future if r.dec_start >= 0 else 0)
                self._publish_one(t, have, stamp)

    def _publish_one(self, t: Ticket, have: int, stamp: float) -> None:
        if have <= t.available:
            return
        late = time.perf_counter() - self.wall_of(stamp)
        for _ in range(have - t.available):
            t.token_s.append(stamp)
            self.lateness_s.append(late)
        self.tokens_out += have - t.available
        t.available = have
        t.changed.set()

    def _fail(self, why: str) -> None:
        self.failed = why
        for t in [*self.tickets.values(), *(p[2] for p in self._pending)]:
            t.final = t.final or _failed(t.req, why)
            t.changed.set()
        self.tickets.clear()
        self._pending.clear()

    def lateness_ms(self) -> dict:
        """P50/P99/max of the last tokens' lateness: how long after its simulated step
        end (on the wall clock) each token went to its handler."""
        if not self.lateness_s:
            return {"tokens": 0, "p50": None, "p99": None, "max": None}
        arr = np.asarray(self.lateness_s) * 1e3
        p50, p99 = np.percentile(arr, [50, 99])
        return {"tokens": len(arr), "p50": round(float(p50), 3), "p99": round(float(p99), 3),
                "max": round(float(arr.max()), 3)}

    def close(self) -> None:
        self.feed.closed = True


def _failed(req: Request, why: str) -> SimRequest:
    r = SimRequest(req, req.arrival_s, -1)
    r.status, r.error = "failed", f"the emulated server failed: {why}"
    return r
