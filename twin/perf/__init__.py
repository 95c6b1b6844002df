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
from twin.errors import ConfigError

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
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Register a backend factory under `name`; a duplicate name is an error."""

    def deco(factory: BackendFactory) -> BackendFactory:
        if name in _BACKENDS:
            raise ValueError(f"step-time backend {name!r} registered twice")
        _BACKENDS[name] = factory
        return factory

    return deco


def backend_names() -> list[str]:
    _load_builtin()
    return sorted(_BACKENDS)


def make_step_time(name: str, capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    _load_builtin()
    if name not in _BACKENDS:
        raise ConfigError(f"--step-time-backend {name!r}: allowed values: "
                          f"{', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](capacity, args)


def default_backend(capacity: Capacity) -> str:
    """`opdb` where aiconfigurator-core's measured data covers the model, GPU and dtypes,
    else `roofline`. Costs a model compile (under a second); call once per run."""
    try:
        from twin.perf.opdb import covers
    except ModuleNotFoundError:
        return "roofline"
    return "opdb" if covers(capacity) is None else "roofline"


def _load_builtin() -> None:
    import importlib

    for module in ("twin.perf.roofline", "twin.perf.opdb", "twin.perf.fitted"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
