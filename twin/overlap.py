"""SGLang's overlap scheduler (`Scheduler.event_loop_overlap`, the default on GPUs).

Each iteration of SGLang 0.5.23's overlap loop receives requests, schedules batch k+1 and
launches it, and only then processes batch k's results (waiting for batch k's forward to
end). So the CPU work of a step (scheduling, launching its kernels, processing results)
runs while the GPU computes the step before: a step takes about max(GPU, CPU) instead of
their sum. `--disable-overlap-schedule` (the CPU harness runs that way) is the plain loop,
where the two add up.

`OverlapStepTime` wraps a step-time backend whose `breakdown` names the CPU part
`overhead` (SGLang's scheduler CPU, a part per step and a part per request in the batch,
measured: twin/perf/step_cpu.py; plus kernel launches, smaller under a CUDA graph:
`opdb`, `roofline`): a step is `max(total - overhead, overhead)`, so a large batch of a
small model on fast GPUs can be CPU-bound. A backend fitted to a live
server already measured whichever loop that server ran, and is not wrapped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twin.perf import PrefillChunk, StepTimeModel


def overlaps(args, step_time: StepTimeModel) -> bool:
    """Whether the twin runs SGLang's overlap loop for these server arguments."""
    return not args.disable_overlap_schedule and getattr(step_time, "name", "") in (
        "opdb", "roofline")


class OverlapStepTime:
    """A step under the overlap loop: the GPU part and the CPU part overlap."""

    def __init__(self, inner: StepTimeModel) -> None:
        self.inner = inner
        self.name = inner.name
        # the CPU part of a prefill step alone, where the backend gives it (opdb)
        self._overhead = getattr(inner, "overhead", None)
        self._decode_oh: dict[int, float] = {}

    def _overhead_decode(self, b: int) -> float:
        oh = self._decode_oh.get(b)
        if oh is None:
            oh = self._decode_oh[b] = self.inner.breakdown([], [1] * b)["overhead"]
        return oh

    def decode_kernel(self, b: int) -> tuple | None:
        """The inner model's `decode_kernel` (c, xp, fp) and this wrapper's overhead oh:
        `decode_times(b, kv) == np.maximum(c + np.interp(kv / b, xp, fp) - oh, oh)`;
        None where the inner model has none (asked in `decode_times`' order)."""
        get = getattr(self.inner, "decode_kernel", None)
        got = get(b) if get is not None else None
        if got is None or len(got) != 3:
            return None
        return (*got, self._overhead_decode(b))

    def prefill_kernel(self) -> tuple | None:
        """The inner model's `prefill_kernel` and True (this wrapper's step is
        max(total - oh, oh), oh the inner model's `overhead` of the chunks: its eager and
        per-request parts), or None where the inner model has none."""
        get = getattr(self.inner, "prefill_kernel", None)
        if get is None or self._overhead is None:
            return None
        return (*get(), True)

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float:
        total = self.inner.step_time(prefill_chunks, decode_kv_lens)
        if prefill_chunks:
            part = self._overhead
            oh = (part(prefill_chunks, decode_kv_lens) if part is not None
                  else self.inner.breakdown(prefill_chunks, decode_kv_lens)["overhead"])
        else:
            oh = self._overhead_decode(len(decode_kv_lens))
        return max(total - oh, oh)

    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray:
        total = self.inner.decode_times(batch_size, kv_sums)
        oh = self._overhead_decode(batch_size)
        return np.maximum(total - oh, oh)

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        parts = dict(self.inner.breakdown(prefill_chunks, decode_kv_lens))
        oh = parts.pop("overhead")
        gpu = sum(parts.values())
        parts["overhead"] = max(oh - gpu, 0.0)  # only what the GPU does not hide
        return parts

    def describe(self) -> str:
        return (self.inner.describe() + "; overlap scheduler: step = max(GPU, CPU "
                "scheduling and launch overhead)")


class FreedLater:
    """Under the overlap loop a request that finished in the step just ended still holds
    its request slot and its KV while the next step is scheduled: SGLang schedules step
    k+1 before it processes step k's results (`_reqs_finishing_inflight` keeps such
    requests out of the next decode, and their slots and KV are released only when the
    result is processed, after step k+1 is launched). So what they free becomes usable one
    pass later. `add` at a finish; `turn` at the top of every pass."""

    __slots__ = ("slots", "tokens", "_next_slots", "_next_tokens")

    def __init__(self) -> None:
        self.slots = self.tokens = self._next_slots = self._next_tokens = 0

    def add(self, slots: int, tokens: int) -> None:
        self._next_slots += slots
        self._next_tokens += max(tokens, 0)

    def release(self) -> bool:
        """Nothing is in flight (the server would idle): SGLang processes the last result
        at once, so what was held is free now. True if anything was held."""
        held = bool(self.slots or self.tokens)
        self.slots = self.tokens = 0
        return held

    def turn(self) -> bool:
        """A new pass: what finished in the step just ended is held now, what was held is
        free. True when something was freed (a smaller batch clears batch_is_full)."""
        freed = bool(self.slots or self.tokens)
        self.slots, self.tokens = self._next_slots, self._next_tokens
        self._next_slots = self._next_tokens = 0
        return freed
