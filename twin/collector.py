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
