"""Python's cyclic garbage collector paused over work that makes no cycles (issue 14).

A collection walks every container object alive; a run that allocates millions of them
(a day's requests, their records) triggers thousands of collections that find nothing,
because what it makes forms no cycles (docs/perf.md: the thirteenth and fourteenth
rounds counted the cyclic garbage of a run: a builder's closures, dozens of objects). A
leaf module: anything may import it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block (as it was after it: a caller that turned it off
    keeps it off); reference counting still frees everything that is not in a cycle."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def off_to_the_end() -> Iterator[None]:
    """The collector off for the rest of a process that ends with the block (a console
    command that simulates): its imports and its run make no cycles worth a collection,
    and at the block's end what is still alive (the command's modules and caches; a
    SimPy environment's few cycles holding a run's state) is moved out of the
    collector's sight (`gc.freeze`), so that neither a collection on the way out nor the
    interpreter's own collections at exit walk what the process is about to drop. Not
    for a caller that goes on (a test session calling `main`): frozen objects are never
    collected."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
