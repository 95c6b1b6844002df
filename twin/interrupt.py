"""Ctrl-C during a simulation, taken between events.

A KeyboardInterrupt raised wherever Python happens to be can land in the middle of
bookkeeping: between taking a request from the source and giving it a ticket, say, and
that request then has no record (the fleet's Ctrl-C test lost one of 40,000 that way).
So while a simulation runs in the main thread, SIGINT only sets a flag; the run stops
at the next event boundary, where every process waits at a `yield` and the state is
whole, and the caller records what is unfinished as before.

A replica moves the clock on without yielding while its wake-up is the next event
anyway (`Replica._sleep`): once the arrivals are over, an overloaded replica drains its
queue in one event, to the end. `on_signal` (the caller passes what turns that off:
`Replica.wait_in_events`) makes it yield at its next busy period, so the loop sees the
flag at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import simpy
from simpy.core import EmptySchedule


@contextmanager
def sigint_taken(on_signal: Callable[[], None] | None = None) -> Iterator[list[int]]:
    """While inside, SIGINT only appends to the list yielded (and calls `on_signal`): the
    caller stops at its next boundary when the list is not empty. Outside the main
    thread, or where SIGINT is ignored (a background job) or handled outside Python, no
    handler is installed: a KeyboardInterrupt is raised wherever it lands, as before."""
    previous = signal.getsignal(signal.SIGINT)
    handles = threading.current_thread() is threading.main_thread() and \
        previous not in (signal.SIG_IGN, None)  # None: a handler set outside Python
    stopped: list[int] = []

    def handler(signum, frame) -> None:
        stopped.append(signum)
        if on_signal is not None:
            on_signal()

    if handles:
        signal.signal(signal.SIGINT, handler)
    try:
        yield stopped
    finally:
        if handles:
            signal.signal(signal.SIGINT, previous)


def run_interruptible(env: simpy.Environment,
                      on_signal: Callable[[], None] | None = None) -> bool:
    """Run `env` until no events are left; True when Ctrl-C stopped it first (taken
    between events: `sigint_taken`)."""
    try:
        with sigint_taken(on_signal) as stopped:
            step = env.step
            while not stopped:
                step()
    except EmptySchedule:
        return bool(stopped)
    except KeyboardInterrupt:  # raised, not signalled (a progress callback, a test)
        return True
    return True
