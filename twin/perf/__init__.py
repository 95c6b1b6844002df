"""Step-time models behind one interface, chosen by name from a registry.

The replica times every step through `StepTimeModel.step_time`; nothing else in the twin
knows how long a step takes. A prefill chunk is `(new_tokens, cached_prefix_tokens)`;
each decode request contributes its KV length (prompt plus tokens generated so far).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from twin.config import Capacity, ServerArgs
from twin.registry import Registry

PrefillChunk = tuple[int, int]  # (new_tokens, cached_prefix_tokens)


@runtime_checkable
class StepTimeModel(Protocol):
    """Contract of a step-time backend.

    - `step_time` is the duration of one forward step of the given batch, in seconds.
    - `decode_times(b, kv_sums)` is the vectorised fast path for decode-only steps: element
      i is `step_time([], lens)` for any `lens` of length `b` summing to `kv_sums[i]`.
      A backend therefore depends on a decode batch only through its size and total KV
      (it folds variable KV lengths in by their mean), which lets the replica advance
      many decode steps at once.
    - `breakdown` splits `step_time` into named parts that sum to it.
    """

    name: str

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float: ...

    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray: ...

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]: ...

    def describe(self) -> str: ...


BackendFactory = Callable[[Capacity, ServerArgs], StepTimeModel]
BACKENDS: Registry[BackendFactory] = Registry(
    "step-time backend", "--step-time-backend",
    ("twin.perf.roofline", "twin.perf.opdb", "twin.perf.fitted"))
register_backend = BACKENDS.register  # @register_backend("name") on a factory


def backend_names() -> list[str]:
    return BACKENDS.names()


def make_step_time(name: str, capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    return BACKENDS.get(name)(capacity, args)


def default_step_time(capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    """`opdb` where aiconfigurator-core's measured data covers the model, GPU and dtypes,
    else `roofline`. The opdb tables are built at most once (and then read from the disk
    cache, twin/perf/table_cache.py), the coverage check included."""
    from twin.errors import ConfigError

    try:
        return make_step_time("opdb", capacity, args)
    except ConfigError:
        return make_step_time("roofline", capacity, args)


def default_backend(capacity: Capacity) -> str:
    """`opdb` where aiconfigurator-core's measured data covers the model, GPU and dtypes,
    else `roofline`. Costs a model compile (under a second); call once per run."""
    try:
        from twin.perf.opdb import covers
    except ModuleNotFoundError:
        return "roofline"
    return "opdb" if covers(capacity) is None else "roofline"

