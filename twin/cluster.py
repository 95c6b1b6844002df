"""A deployment: replicas fed from one source of requests through a router.

The deployment owns the arrivals (`Source`: open-loop times or closed-loop clients), the
router's state (its in-flight counts, health checks, circuit breakers, retries), the
faults, and the end of the run; replicas take what they are handed (`Replica.submit`).
A feeder process wakes at every arrival and hands the request to the replica the router
picks; each replica also pumps at the start of its scheduling pass, so a request due by
then enters that pass whichever process runs first at that instant. One server is a
deployment of one (`simulate` in twin/sim.py, with the `only_replica` router and no
failover); a fleet (twin/fleet.py) adds workers with pools, a registered router
(twin/routers.py), failover and faults (twin/faults.py).

Every request ends once, as a `Ticket`: the engine's record of its last attempt, or a
request the router could not place (`failed`); records carry `replica`, `pool` and
`attempts`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from twin.core import adopt, why_not_fleet
from twin.core import life as core_life
from twin.faults import Breaker, Failover, Fault, Health
from twin.metrics import SLO, summarize, twin_records
from twin.replica import Replica
from twin.request_state import SimRequest
from twin.routers import Router, WorkerView
from twin.source import Source
from twin.workload import Request

RouterFn = Callable[[Request, Sequence[Replica]], Replica]


def only_replica(req: Request, replicas: Sequence[Replica]) -> Replica:
    return replicas[0]


class ScaledStepTime:
    """A replica's step times x `factor` (a `slow` fault); the backend is shared."""

    def __init__(self, inner) -> None:
        self.inner, self.factor, self.name = inner, 1.0, inner.name

    def step_time(self, prefill_chunks, decode_kv_lens) -> float:
        return self.inner.step_time(prefill_chunks, decode_kv_lens) * self.factor

    def decode_times(self, batch_size, kv_sums):
        return self.inner.decode_times(batch_size, kv_sums) * self.factor

    def breakdown(self, prefill_chunks, decode_kv_lens) -> dict[str, float]:
        return {k: v * self.factor for k, v in self.inner.breakdown(prefill_chunks,
                                                                    decode_kv_lens).items()}

    def describe(self) -> str:
        return self.inner.describe() + (f" x{self.factor:g}" if self.factor != 1 else "")


class PoolFeed:
    """A replica's feed in a fleet whose router assigns pools by a static rule: the
    deployment's, with the next arrival that may reach the replica's pool."""

    def __init__(self, dep: Deployment, pool: str, size: int) -> None:
        self.dep, self.pool = dep, pool
        # with one replica in the pool, the pool's arrivals are all the replica's own
        self.cuts_runs = size > 1 and dep.sends_known()

    def pump(self, now: float) -> None:
        self.dep.pump(now)

    def next_arrival(self) -> float | None:
        return self.dep.next_arrival_for(self.pool)

    def done(self) -> bool:
        return self.dep.done()

    def left(self, replica, req: SimRequest) -> None:
        self.dep.left(replica, req)

    def unsent(self) -> list[tuple[float, Request]]:
        return self.dep.unsent()


@dataclass
class Worker:
    """The deployment's handle on one replica, with the router's view of it."""

    index: int
    name: str
    pool: str
    replica: object  # Replica or VllmReplica
    gpus: int = 1
    kind: str = "sglang"
    scaled: ScaledStepTime | None = None
    health: Health = field(default_factory=Health)
    breaker: Breaker | None = None
    up: bool = True  # the engine process is alive
    answers_health: bool = True
    inflight: int = 0  # the router's count
    polled: int | None = None
    routed: int = 0
    proc: simpy.Process | None = None
    crashes: list[tuple[float, float]] = field(default_factory=list)  # (down at, up at)
    loop: str | None = "not started"  # None: the typed core runs it (twin/core.py); why not


@dataclass
class Ticket:
    seq: int
    req: Request
    sent: float
    attempts: int = 0
    worker: int | None = None  # where the final outcome happened
    final: SimRequest | None = None
    last_error: str = ""


class Deployment:
    def __init__(self, env: simpy.Environment, source: Source,
                 router: RouterFn | Router = only_replica, horizon_s: float | None = None, *,
                 failover: Failover | None = None, faults: Sequence[Fault] = (),
                 seed: int = 0, poll_interval_s: float | None = None) -> None:
        self.env, self.source, self.router = env, source, router
        self.horizon = horizon_s
        self.replicas: list = []
        self.workers: list[Worker] = []
        self._by_rep: dict[int, Worker] = {}
        self._more = env.event()  # a leave released closed-loop requests
        self._drained = False
        self.fleet = not callable(router) or hasattr(router, "pick")
        self.failover = failover or Failover()
        self.faults = list(faults)
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E7]))
        self.poll_interval_s = poll_interval_s
        self.tickets: dict[int, Ticket] = {}  # id(request) -> ticket (lookups only)
        self.done_tickets: list[Ticket] = []
        self._open = 0
        self._seq = 0
        self._retry_at: list[tuple[float, str | None]] = []  # (time, pool)
        # a length router's static pools (not with fallbacks: then a pool may get others')
        self._pool_of = None if getattr(router, "fallback", None) else getattr(
            router, "pool_of", None)
        self._pool_times: dict[str, list[float]] | None = None
        self._pool_next: dict[str, int] = {}
        self.stats = {"retries": 0, "refused": 0, "no_worker": 0, "lost_in_flight": 0}
        self.send_log: list[tuple[float, str, str, int]] | None = None  # (t, rid, worker, try)
        self._view_cache: list[WorkerView | None] = []
        # a fleet of several: a replica's decode run ends at its own submits (which cut
        # it, twin/decode_cut.py), not at every arrival in the fleet (set by `start`)
        self.cuts_runs = False

    def wait_in_events(self) -> None:
        """Every replica's busy periods wait on events from now on (twin/interrupt.py)."""
        for rep in self.replicas:
            rep.wait_in_events()

    def add(self, rep, pool: str = "default", name: str | None = None, gpus: int = 1,
            kind: str = "sglang", scaled: ScaledStepTime | None = None) -> Replica:
        rep.feed = self
        w = Worker(len(self.workers), name or f"r{len(self.workers)}", pool, rep, gpus, kind,
                   scaled, breaker=Breaker(self.failover))
        rep.name = w.name
        self.replicas.append(rep)
        self.workers.append(w)
        self._by_rep[id(rep)] = w
        return rep

    # ---- the Feed protocol (twin/replica.py) -----------------------------------------
    def sends_known(self) -> bool:
        """Every hand-off time is known before it comes: open loop, no faults (so no
        retries). Only then is a cut exactly a run bounded by the next arrival. (A
        closed-loop request released by a finish elsewhere is sent at once: a replica
        planning by `next_arrival` never saw it coming and takes it at the end of its
        run; cutting would take it at the next step, which is SGLang's behaviour but
        not the twin's records so far.)"""
        return self.source.open_loop and not self.faults

    def pump(self, now: float) -> None:
        nxt = self.source.next_time()
        if nxt is None or nxt > now:  # most passes: nothing is due
            return
        for sent, req in self.source.pop_ready(now):
            if self._pool_times is not None:
                pool = self._pool_of(req)
                self._pool_next[pool] = self._pool_next.get(pool, 0) + 1
            t = Ticket(self._seq, req, sent)
            self._seq += 1
            self._open += 1
            self.tickets[id(req)] = t
            self._send(t)

    def next_arrival(self) -> float | None:
        nxt = self.source.next_time()
        if self._retry_at:
            soon = min(t for t, _ in self._retry_at)
            return soon if nxt is None else min(nxt, soon)
        return nxt

    def next_arrival_for(self, pool: str) -> float | None:
        """The next hand-off that may reach `pool` (pools by a static rule, the length
        router): a replica need not end its decode run at another pool's arrivals."""
        if self._pool_times is not None:
            times, i = self._pool_times.get(pool, []), self._pool_next.get(pool, 0)
            nxt = times[i] if i < len(times) else None
        else:
            nxt = min((t for t, _, r in self.source.scheduled() if self._pool_of(r) == pool),
                      default=None)
        soon = min((t for t, p in self._retry_at if p == pool), default=None)
        if soon is None or nxt is None:
            return nxt if soon is None else soon
        return min(nxt, soon)

    def done(self) -> bool:
        return self.source.exhausted and self._open == 0

    def left(self, replica, req: SimRequest) -> None:
        t = self.tickets.get(id(req.req))
        if t is None:  # drained at the horizon, never sent
            t = Ticket(self._seq, req.req, req.arrival_s, final=req)
            self._seq += 1
            self.tickets[id(req.req)] = t
            self.done_tickets.append(t)
            self.source.finished(self.env.now)
            self._release_more()
            return
        w = self._by_rep[id(replica)]
        w.inflight -= 1
        if self.fleet:
            self.router.done(w.index, t.req, self.env.now, req.status == "ok")
        if not w.up and req.status == "aborted":  # lost in a crash
            self._lost(t, w, req)
            return
        if req.status == "ok":
            w.breaker.record(True, self.env.now)
        self._finish(t, w.index, req)

    def unsent(self) -> list[tuple[float, Request]]:
        """At the horizon: every request not yet handed to a replica (once). A fleet
        drains in `finalize`, when no replica holds a closed-loop slot any more."""
        if self._drained or self.fleet:
            return []
        return self._drain()

    def _drain(self) -> list[tuple[float, Request]]:
        self._drained = True
        out = []
        while not self.source.exhausted:  # closed loop: each leave releases the next one
            items = self.source.pop_ready(math.inf)
            if not items:  # the clients' slots are held by requests still in flight
                self.source.release_rest(self.env.now)  # (they end in `finalize`)
                continue
            for item in items:
                out.append(item)
                self.source.finished(self.env.now)
        return out

    # ---- routing and failover -----------------------------------------------------------
    def _views(self, now: float) -> list[WorkerView]:
        """What the router sees of every worker; a view is rebuilt only when it changed
        (a fleet of 16 picks among 16 views per request)."""
        views = self._view_cache
        if len(views) != len(self.workers):
            views[:] = [None] * len(self.workers)
        for w, v in zip(self.workers, views, strict=True):
            br = w.breaker  # (a closed breaker lets requests through: no call to ask)
            ok = w.health.healthy and (br.state == "closed" or br.allows(now))
            if v is None or v.healthy != ok or v.load != w.inflight or v.polled_load != w.polled:
                views[w.index] = WorkerView(w.index, w.name, w.pool, ok, w.inflight, w.polled)
        return list(views)

    def _send(self, t: Ticket) -> None:
        now = self.env.now
        t.attempts += 1
        if not self.fleet:
            w = self._by_rep[id(self.router(t.req, self.replicas))]
            w.inflight += 1
            w.routed += 1
            w.replica.submit(t.sent, t.req)
            return
        idx = self.router.pick(t.req, self._views(now), now)
        if idx is None:
            self.stats["no_worker"] += 1
            self._attempt_failed(t, None, "no healthy worker (the router answers 503)")
            return
        w = self.workers[idx]
        w.routed += 1
        if self.send_log is not None:
            self.send_log.append((now, t.req.rid, w.name, t.attempts))
        if not w.up:
            self.stats["refused"] += 1
            w.breaker.record(False, now)
            self._attempt_failed(t, idx, f"connection refused by {w.name} (down since "
                                 f"{w.crashes[-1][0]:g} s)")
            return
        w.inflight += 1
        w.replica.submit(t.sent, t.req)

    def _attempt_failed(self, t: Ticket, idx: int | None, why: str) -> None:
        t.last_error = why
        if t.attempts < self.failover.max_attempts and not self._past_horizon():
            self.stats["retries"] += 1
            delay = self.failover.backoff_s(t.attempts, self.rng)
            at = self.env.now + delay
            self._retry_at.append((at, self._pool_of(t.req) if self._pool_of else None))
            self.env.process(self._retry(t, at))
            return
        r = SimRequest(t.req, t.sent, -1)
        r.status, r.error, r.finish_s = "failed", f"{why}; {t.attempts} attempt(s)", self.env.now
        self._finish(t, idx, r)

    def _retry(self, t: Ticket, at: float) -> Iterator[simpy.Event]:
        yield self.env.timeout(max(at - self.env.now, 0.0))
        self._retry_at.remove(next(x for x in self._retry_at if x[0] == at))
        if self._past_horizon():
            r = SimRequest(t.req, t.sent, -1)
            r.status, r.finish_s = "aborted", self.env.now
            r.error = f"simulation horizon {self.horizon}s reached while waiting to retry"
            self._finish(t, None, r)
            return
        self._send(t)

    def _lost(self, t: Ticket, w: Worker, r: SimRequest) -> None:
        """A request in flight on a server that crashed. A stream that broke after its
        HTTP 200 is not a circuit-breaker failure (sglang-router 0.3.2 records the outcome
        when the response starts: its log opens the circuit at the 10th refused
        connection, the broken streams not counted); a reset before the answer is."""
        self.stats["lost_in_flight"] += 1
        if self.failover.streaming:
            r.status = "failed"
            r.error = (f"{w.name} crashed at {self.env.now:g} s mid-response; the stream had "
                       "started (HTTP 200), so the router cannot retry it")
            self._finish(t, w.index, r)
            return
        w.breaker.record(False, self.env.now)
        self._attempt_failed(t, w.index, f"{w.name} crashed at {self.env.now:g} s "
                             "(connection reset)")

    def _past_horizon(self) -> bool:
        return self.horizon is not None and self.env.now >= self.horizon

    def _finish(self, t: Ticket, idx: int | None, r: SimRequest) -> None:
        t.final, t.worker = r, idx
        self.tickets.pop(id(t.req), None)  # ended: no lookup needs it (a day of them)
        self.done_tickets.append(t)
        self._open -= 1
        self.source.finished(self.env.now)
        self._release_more()
        if self.done():
            for w in self.workers:
                w.replica.submit_nothing()

    def _release_more(self) -> None:
        if self.source.next_time() is not None and not self._more.triggered:
            self._more.succeed()

    # ---- processes ------------------------------------------------------------------
    def run(self) -> Iterator[simpy.Event]:
        """The feeder."""
        while True:
            nxt = self.source.next_time()
            if nxt is None:
                if self.source.exhausted:
                    for rep in self.replicas:  # idle replicas see that nothing will come
                        rep.submit_nothing()
                    return
                yield self._more
                self._more = self.env.event()
                continue
            if self.horizon is not None and nxt >= self.horizon:
                return
            yield self.env.timeout(max(nxt - self.env.now, 0.0))
            self.pump(self.env.now)

    def start(self, run_replicas: bool = False) -> None:
        """Start the feeder; with `run_replicas` (a fleet) also every replica's life,
        the health checker, the load poller and the faults."""
        self.env.process(self.run())
        if not run_replicas:
            return
        self.cuts_runs = self.fleet and len(self.workers) > 1 and self.sends_known()
        if self._pool_of is not None:
            self._feed_by_pool()
        for f in sorted(self.faults, key=lambda f: (f.at_s, f.replica, f.kind)):
            self.env.process(self._fault(f, self._worker(f.replica)))  # first: a fault at t
        for w in self.workers:  # applies to steps that start at t
            w.loop = why_not_fleet(w.replica)
            if w.loop is None:
                adopt(w.replica, self)
            self.env.process(self._life(w))
            if not self.failover.disable_health_check:
                self.env.process(self._health(w))
        if self.poll_interval_s:
            self.env.process(self._poll())

    def _feed_by_pool(self) -> None:
        if self.source.open_loop:  # every arrival is known: per-pool times, in send order
            self._pool_times = {}
            for t, _, req in sorted(self.source.scheduled(), key=lambda x: (x[0], x[1])):
                self._pool_times.setdefault(self._pool_of(req), []).append(t)
        for w in self.workers:
            size = sum(1 for v in self.workers if v.pool == w.pool)
            w.replica.feed = PoolFeed(self, w.pool, size)

    def _worker(self, name: str) -> Worker:
        for w in self.workers:
            if w.name == name:
                return w
        from twin.errors import ConfigError

        raise ConfigError(f"fault on replica {name!r}: no such replica; replicas: "
                          f"{', '.join(w.name for w in self.workers)}")

    def _life(self, w: Worker) -> Iterator[simpy.Event]:
        while True:
            w.proc = self.env.process(w.replica.run() if w.loop else core_life(w.replica))
            try:
                yield w.proc
                return
            except simpy.Interrupt as stop:
                repair_s = stop.cause
            why = f"{w.name} crashed at {self.env.now:g} s"
            if w.loop is None:  # the typed core holds the replica's state
                w.replica._core.crash(why, self.env.now)
            else:
                w.replica.crash(why)
            end = self.env.now + repair_s
            if self.horizon is not None:
                end = min(end, self.horizon)
            yield self.env.timeout(end - self.env.now)
            w.crashes[-1] = (w.crashes[-1][0], self.env.now)
            w.up = True
            w.replica.restart()
            if w.loop is None:
                w.replica._core.restart()

    def _fault(self, f: Fault, w: Worker) -> Iterator[simpy.Event]:
        if self.horizon is not None and f.at_s >= self.horizon:
            return
        if f.at_s > self.env.now:
            yield self.env.timeout(f.at_s - self.env.now)
        if f.kind == "crash":
            if not w.up:
                return
            w.up = False
            w.crashes.append((self.env.now, math.inf))
            if w.proc is not None and w.proc.is_alive:
                w.proc.interrupt(f.repair_s)
            else:  # its run had ended: it is simply down for the repair time
                yield self.env.timeout(f.repair_s)
                w.crashes[-1] = (w.crashes[-1][0], self.env.now)
                w.up = True
        elif f.kind == "slow":
            w.scaled.factor = f.factor
            yield self.env.timeout(f.duration_s)
            w.scaled.factor = 1.0
        else:
            w.answers_health = False
            yield self.env.timeout(f.duration_s)
            w.answers_health = True

    def _ended(self) -> bool:
        return self.done() or self._past_horizon()

    def _health(self, w: Worker) -> Iterator[simpy.Event]:
        cfg = self.failover
        k = 0
        while not self._ended():  # fixed-rate ticks, as a tokio interval
            k += 1
            yield self.env.timeout(max(k * cfg.health_check_interval_secs - self.env.now, 0.0))
            if not w.up:  # connection refused at once
                w.health.result(False, self.env.now, cfg)
            elif not w.answers_health:
                yield self.env.timeout(cfg.health_check_timeout_secs)
                w.health.result(False, self.env.now, cfg)
            else:
                w.health.result(True, self.env.now, cfg)

    def _poll(self) -> Iterator[simpy.Event]:
        while not self._ended():
            for w in self.workers:
                rep = w.replica
                if not w.up:
                    w.polled = None
                elif w.loop is None:  # the typed core's queues (twin/core.py)
                    w.polled = rep._core.queue_load()
                else:
                    w.polled = len(rep.running) + len(rep.waiting)
            yield self.env.timeout(self.poll_interval_s)

    # ---- results --------------------------------------------------------------------
    def finalize(self) -> None:
        """After `env.run()`: what never ended (a retry pending at the horizon, requests
        no replica drained) ends `aborted`."""
        for w in self.workers:  # a run stopped early: the typed core's state, as it stands
            if w.loop is None:
                w.replica._core.settle()
        for sent, req in self._drain():
            t = Ticket(self._seq, req, sent)
            self._seq += 1
            self._open += 1
            r = SimRequest(req, sent, -1)
            r.status, r.finish_s = "aborted", self.env.now
            r.error = f"not sent before the horizon {self.horizon}s"
            self._finish(t, None, r)
        for t in sorted(self.tickets.values(), key=lambda t: t.seq):
            if t.final is None:
                r = SimRequest(t.req, t.sent, -1)
                r.status, r.finish_s = "aborted", self.env.now
                r.error = f"simulation ended before it did ({t.last_error or 'in flight'})"
                self._finish(t, None, r)

    def records(self) -> list[dict]:
        """One record per request (arrival order), tagged with replica, pool, attempts."""
        by_worker: dict[int | None, list[Ticket]] = {}
        for t in self.done_tickets:
            by_worker.setdefault(t.worker, []).append(t)
        out: list[tuple[float, int, dict]] = []
        for idx in sorted(by_worker, key=lambda i: -1 if i is None else i):
            tickets = sorted(by_worker[idx], key=lambda t: (t.final.arrival_s, t.final.index,
                                                            t.seq))
            ends = self.workers[idx].replica.step_end if idx is not None else []
            recs = twin_records([t.final for t in tickets], ends)
            w = self.workers[idx] if idx is not None else None
            for t, rec in zip(tickets, recs, strict=True):
                rec["replica"] = w.name if w else None
                rec["pool"] = w.pool if w else None
                rec["attempts"] = t.attempts
                out.append((rec["arrival_s"], t.seq, rec))
        out.sort(key=lambda x: (x[0], x[1]))
        return [rec for _, _, rec in out]

    def summary(self, records: list[dict], slo: SLO | None = None) -> dict:
        """The fleet's summary, per pool and per replica, with the router's counts."""
        s = summarize(records, slo)
        whole = copy.deepcopy(s)  # a pool that served every request has the same
        s["gpus"] = sum(w.gpus for w in self.workers)
        s["failover"] = dict(self.stats)
        pools = sorted({w.pool for w in self.workers}, key=[w.pool for w in self.workers].index)
        s["pools"] = {}
        for p in pools:
            gpus = sum(w.gpus for w in self.workers if w.pool == p)
            if _all_in(records, "pool", p):
                s["pools"][p] = {**copy.deepcopy(whole), "gpus": gpus}
            else:
                s["pools"][p] = _part(records, "pool", p, slo, gpus)
        s["replicas"] = {}
        for w in self.workers:
            part = _part(records, "replica", w.name, slo, w.gpus)
            part.update(kind=w.kind, pool=w.pool, routed=w.routed,
                        health_events=w.health.events, crashes=w.crashes,
                        breaker_opens=w.breaker.opens,
                        engine=dict(w.replica.counters.__dict__))
            s["replicas"][w.name] = part
        decisions = getattr(self.router, "decisions", None)
        if decisions is not None:
            s["router_decisions"] = dict(decisions)
        if getattr(self.router, "fallback", None):
            s["router_fallbacks"] = self.router.fallbacks
        for pool, inner in getattr(self.router, "inner", {}).items():  # the length router
            if getattr(inner, "decisions", None) is not None:
                s["pools"][pool]["router_decisions"] = dict(inner.decisions)
        return s

    def series(self) -> list[tuple]:
        return [(w.name, *row) for w in self.workers for row in w.replica.series]


def _all_in(records, key: str, value: str) -> bool:
    if hasattr(records, "all_in"):  # streamed (twin/record_sink_fleet.py): its columns
        return records.all_in(key, value)
    return all(r[key] == value for r in records)


def _part(records: list[dict], key: str, value: str, slo: SLO | None, gpus: int) -> dict:
    if hasattr(records, "part"):  # streamed (twin/record_sink_fleet.py): its columns
        s = records.part(key, value, slo)
    else:
        s = summarize([r for r in records if r[key] == value], slo)
    s["gpus"] = gpus
    return s
