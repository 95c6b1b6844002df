"""A deployment: replicas fed from one source of requests through a router.

The deployment owns the arrivals (`Source`: open-loop times or closed-loop clients) and
the end of the run; replicas take what they are handed (`Replica.submit`). A feeder
process wakes at every arrival and hands the request to the replica the router picks;
each replica also pumps at the start of its scheduling pass, so a request due by then
enters that pass whichever process runs first at that instant. One server is a
deployment of one (`simulate` in twin/sim.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import simpy

from twin.replica import Replica
from twin.request_state import SimRequest
from twin.source import Source
from twin.workload import Request

Router = Callable[[Request, Sequence[Replica]], Replica]


def only_replica(req: Request, replicas: Sequence[Replica]) -> Replica:
    return replicas[0]


class Deployment:
    def __init__(self, env: simpy.Environment, source: Source,
                 router: Router = only_replica, horizon_s: float | None = None) -> None:
        self.env, self.source, self.router = env, source, router
        self.horizon = horizon_s
        self.replicas: list[Replica] = []
        self._more = env.event()  # a leave released closed-loop requests
        self._drained = False

    def add(self, rep: Replica) -> Replica:
        rep.feed = self
        self.replicas.append(rep)
        return rep

    # ---- the Feed protocol (twin/replica.py) -----------------------------------------
    def pump(self, now: float) -> None:
        for sent, req in self.source.pop_ready(now):
            self.router(req, self.replicas).submit(sent, req)

    def next_arrival(self) -> float | None:
        return self.source.next_time()

    def done(self) -> bool:
        return self.source.exhausted

    def left(self, replica: Replica, req: SimRequest) -> None:
        self.source.finished(self.env.now)
        if self.source.next_time() is not None and not self._more.triggered:
            self._more.succeed()

    def unsent(self) -> list[tuple[float, Request]]:
        """At the horizon: every request not yet handed to a replica (once)."""
        if self._drained:
            return []
        self._drained = True
        out = []
        while not self.source.exhausted:  # closed loop: each leave releases the next one
            for item in self.source.pop_ready(math.inf):
                out.append(item)
                self.source.finished(self.env.now)
        return out

    # ---- the feeder -----------------------------------------------------------------
    def run(self) -> Iterator[simpy.Event]:
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

    def start(self) -> None:
        self.env.process(self.run())
