"""What every simulated server kind shares about being fed from outside: an inbox that
`submit` fills and a wake-up event an idle server sleeps on (twin/replica.py,
twin/vllm_replica.py; the deployment in twin/cluster.py calls `submit`)."""

from __future__ import annotations

from collections.abc import Iterator

import simpy

from twin.workload import Request


class Inbox:
    env: simpy.Environment
    horizon: float | None
    _inbox: list[tuple[float, Request]]
    _wake: simpy.Event
    _run_cut: simpy.Event | None = None  # a decode run a submit may cut (twin/decode_cut.py)

    def submit(self, sent_s: float, req: Request) -> None:
        """A request handed to this server (it enters the queue at the next pass)."""
        self._inbox.append((sent_s, req))
        cut = self._run_cut
        if cut is not None and not cut.triggered:
            cut.succeed()
        self.submit_nothing()

    def submit_nothing(self) -> None:
        """Wake an idle server to look again (e.g. to see that the feed is done)."""
        if not self._wake.triggered:
            self._wake.succeed()

    def _idle(self, now: float) -> Iterator[simpy.Event]:
        """Sleep until a request is submitted (or the horizon)."""
        wake = self._wake
        if self.horizon is not None:
            wake = wake | self.env.timeout(max(self.horizon - now, 0.0))
        yield wake
        if self._wake.triggered:
            self._wake = self.env.event()
