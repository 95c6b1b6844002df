"""Step-time models with round numbers, so scheduling tests can assert exact timelines.

They implement the `twin.perf.StepTimeModel` contract; they stand in for no real system
(the real backends are tested in their own files)."""

from __future__ import annotations

import numpy as np


class FixedStepTime:
    """Every step with a prefill chunk takes `prefill_s`; a decode-only step `decode_s`."""

    name = "fixed"

    def __init__(self, prefill_s: float = 2.0, decode_s: float = 1.0) -> None:
        self.prefill_s, self.decode_s = prefill_s, decode_s

    def step_time(self, prefill_chunks, decode_kv_lens) -> float:
        return self.prefill_s if prefill_chunks else self.decode_s

    def decode_times(self, batch_size, kv_sums):
        return np.full(len(kv_sums), self.decode_s)

    def breakdown(self, prefill_chunks, decode_kv_lens):
        return {"step": self.step_time(prefill_chunks, decode_kv_lens)}

    def describe(self) -> str:
        return "fixed step times"
