"""SGLang's CPU work per scheduler step: a fixed part and a part per request in the batch.

Every iteration of SGLang 0.5.23's scheduler loop (`event_loop_overlap` on a GPU,
`event_loop_normal` with `--disable-overlap-schedule`) spends CPU time outside the
model's forward: `ingest_requests`; `get_next_batch_to_run` (filtering the finished out
of the running batch, the decode memory check, `prepare_for_decode`); `run_batch` less
the forward (`ForwardBatch.init_new`, the sampling launch); and
`process_batch_result_decode`, which walks the batch request by request (append the
token, `check_finished`, logprob and grammar bookkeeping, release a finished request's
KV) and then `stream_output` builds the batch's output message for the detokenizer,
again per request. So the CPU part of a step is `per_step_s + per_request_s x requests`.
Under the overlap loop a step lasts max(GPU, that CPU part) (twin/overlap.py); in the
plain loop the two add.

The step-time backends without measurements of their own (`roofline`, `opdb`) charge it
(`RooflineParams.scheduler_overhead_s`, `scheduler_per_request_s`) on top of their kernel
launch overhead; a fitted backend measured the whole step and does not. The default is
the CPU harness's measurement (`benchmarks/step_cpu_cost.py`, below): CPU work, so the
same on every GPU, assuming a GPU host's core runs SGLang's Python about as fast as the
harness's (a 2.8 GHz Xeon VM; a GPU host's 2-4 GHz Xeon or EPYC is within a factor of
about 1.5 either way, and on a GPU host the scheduler's small tensor ops are kernel
launches of a few microseconds instead of CPU work of about the same). `load` reads
another measurement (the benchmark's `--json`, or a calibration profile's `step_cpu`
section) for a host whose CPU differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from twin.inputs import NON_NEGATIVE, check


@dataclass(frozen=True)
class StepCpu:
    """Seconds of scheduler CPU per step: `per_step_s + per_request_s x requests`."""

    per_step_s: float
    per_request_s: float

    def __post_init__(self) -> None:
        for name in ("per_step_s", "per_request_s"):
            check(f"step CPU {name}", getattr(self, name), NON_NEGATIVE)

    def seconds(self, requests: int) -> float:
        return self.per_step_s + self.per_request_s * requests


# Measured on the CPU harness (SGLang 0.5.23; `python benchmarks/step_cpu_cost.py --rounds 2`,
# 2026-12-01 22:41 UTC, load average 3-4; docs/calibration.md): the scheduler thread's CPU
# time per decode step less the model's forward and sampling, decode batches of 1-512
# streamed requests, 94 steps each, fitted a + b x batch (max |residual| 0.2 ms; two
# single-sweep runs before it gave 1.25-1.28 ms + 15.9-26.7 us: the machine is shared).
SGLANG_0_5_23 = StepCpu(per_step_s=1.086e-3, per_request_s=18.8e-6)


def from_dict(data: dict, where: str) -> StepCpu:
    """A `{"per_step_s": ..., "per_request_s": ...}` mapping; `where` names it in errors."""
    from twin.errors import ConfigError

    vals = {}
    for key in ("per_step_s", "per_request_s"):
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
            raise ConfigError(f"{where}: {key}={v!r}: must be seconds in [0, 1)")
        vals[key] = float(v)
    return StepCpu(**vals)


def load(path: str | Path) -> StepCpu:
    """The step CPU cost in a JSON file: `benchmarks/step_cpu_cost.py --json` output (its
    top-level `per_step_s`, `per_request_s`) or a calibration profile's `step_cpu`."""
    from twin.errors import ConfigError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"step CPU file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"step CPU file {path}: expected a JSON object")
    if isinstance(data.get("step_cpu"), dict):
        return from_dict(data["step_cpu"], f"{path}: step_cpu")
    return from_dict(data, str(path))


def charged(model, cpu: StepCpu):
    """`model` with its scheduler CPU part set to `cpu` (`with_step_cpu`: the kernel
    launches and the GPU's work unchanged, the tables shared), for the backends that charge
    it (`roofline`, `opdb`); any other model (fitted: it measured its server's whole step)
    as it is."""
    with_cpu = getattr(model, "with_step_cpu", None)
    return model if with_cpu is None else with_cpu(cpu)
