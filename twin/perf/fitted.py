"""Step time fitted to a live server: coefficients from a calibration profile.

Two forms, chosen by calibration on held-out samples (the profile records which):

- `linear`: a sum of terms, each a non-negative coefficient times a count of the step:
  `step` (1 per step: the scheduler loop, launches, sampling set-up), `prefill_token`
  (new prompt tokens), `prefill_token_ctx` (new tokens x their attention context:
  `n * (cached + (n + 1) / 2)` per chunk: causal attention of the new tokens),
  `prefill_ctx_sq` (`(cached + n) ** 2` per chunk: attention kernels that compute the
  whole sequence's causal square whatever is cached, as SGLang's `torch_native` backend
  does with its redundant queries), `prefill_request` (sequences in the prefill batch),
  `decode_batched` (1 when two or more sequences decode together: on the CPU harness a
  decode step jumps by about 6 ms from one sequence to two, then grows by about 1 ms per
  sequence), `decode_request` (sequences decoding), `decode_kv_token` (their total KV
  length), `tp_comm_token` (tokens through the layers when TP > 1, for the all-reduces).
- `roofline-correction`: `a + b x base(step)` on top of an uncalibrated backend (the
  roofline; on a CPU server the CPU roofline guess of `twin.perf.cpu_guess`).

Both depend on a decode batch only through its size and total KV, which is what
`decode_times` needs. The twin reads only the profile's `step_time` section; the rest of
the profile (engine, model, fit quality) is calibration's business.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from twin.config import Capacity, ServerArgs
from twin.errors import ConfigError
from twin.inputs import NON_NEGATIVE, read_text
from twin.perf import PrefillChunk, StepTimeModel, register_backend

TERMS = ("step", "prefill_token", "prefill_token_ctx", "prefill_ctx_sq", "prefill_request",
         "decode_batched", "decode_request", "decode_kv_token", "tp_comm_token")
_STEP, _BATCHED, _DEC_REQ, _DEC_KV, _TP = (
    TERMS.index(t) for t in ("step", "decode_batched", "decode_request", "decode_kv_token",
                             "tp_comm_token"))
FORMS = ("linear", "roofline-correction")


def term_counts(prefill_chunks: Sequence[PrefillChunk], batch: int, kv_sum: float,
                tp_size: int = 1) -> np.ndarray:
    """The counts each linear coefficient multiplies, in `TERMS` order."""
    new = sum(n for n, _ in prefill_chunks)
    ctx = sum(n * (c + (n + 1) / 2) for n, c in prefill_chunks)
    square = sum((c + n) ** 2 for n, c in prefill_chunks)
    comm = (new + batch) if tp_size > 1 else 0
    batched = 1.0 if batch >= 2 else 0.0
    return np.array([1.0, new, ctx, square, len(prefill_chunks), batched, batch, kv_sum, comm],
                    dtype=float)


class LinearStepTime:
    """`step_time = coefficients . term_counts(step)`."""

    name = "fitted"
    quiet_kv_mean = float("inf")  # decode_times has no side effect (twin/perf/step_cache.py)

    def __init__(self, coefficients: dict[str, float], tp_size: int = 1, label: str = "") -> None:
        unknown = sorted(set(coefficients) - set(TERMS))
        if unknown:
            raise ConfigError(f"calibration profile: unknown step-time terms {unknown}; "
                              f"known: {', '.join(TERMS)}")
        self.coef = np.array([_coefficient(coefficients, t) for t in TERMS])
        self.tp_size, self.label = tp_size, label

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        counts = term_counts(prefill_chunks, len(decode_kv_lens), sum(decode_kv_lens),
                             self.tp_size)
        return {t: float(c * x) for t, c, x in zip(TERMS, self.coef, counts, strict=True)}

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float:
        counts = term_counts(prefill_chunks, len(decode_kv_lens), sum(decode_kv_lens),
                             self.tp_size)
        return float(self.coef @ counts)

    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray:
        c = self.coef
        per_req = c[_DEC_REQ] + (c[_TP] if self.tp_size > 1 else 0.0)
        const = c[_STEP] + per_req * batch_size + (c[_BATCHED] if batch_size >= 2 else 0.0)
        return const + c[_DEC_KV] * np.asarray(kv_sums, dtype=float)

    def describe(self) -> str:
        parts = ", ".join(f"{t} {c:.3g}" for t, c in zip(TERMS, self.coef, strict=True) if c)
        return f"fitted linear ({self.label}): {parts} (s)"


class CorrectedStepTime:
    """`offset + scale x base.step_time(step)`."""

    name = "fitted"

    def __init__(self, base: StepTimeModel, offset_s: float, scale: float,
                 label: str = "") -> None:
        offset_s = _coefficient({"offset": offset_s}, "offset")
        scale = _coefficient({"scale": scale}, "scale")
        self.base, self.offset, self.scale, self.label = base, offset_s, scale, label

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        parts = {k: self.scale * v for k, v in
                 self.base.breakdown(prefill_chunks, decode_kv_lens).items()}
        parts["calibrated_offset"] = self.offset
        return parts

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float:
        return self.offset + self.scale * self.base.step_time(prefill_chunks, decode_kv_lens)

    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray:
        return self.offset + self.scale * self.base.decode_times(batch_size, kv_sums)

    def describe(self) -> str:
        return (f"fitted correction ({self.label}): {self.offset * 1e3:.2f} ms + "
                f"{self.scale:.3g} x [{self.base.describe()}]")


def _coefficient(coefficients: dict, term: str) -> float:
    """A coefficient of the profile's `step_time` section: a finite number >= 0 (s)."""
    value = coefficients.get(term, 0.0)
    try:
        return float(NON_NEGATIVE.parse(value))
    except ValueError as exc:
        raise ConfigError(f"calibration profile: step_time coefficient {term} = {value!r}: "
                          f"must be {exc}") from None


def base_model(name: str, capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    """The uncalibrated backend a correction applies to."""
    if name == "roofline-cpu":
        from twin.perf.cpu_guess import cpu_step_time

        return cpu_step_time(capacity, args)
    if name in ("roofline", "opdb"):
        from twin.perf import make_step_time

        return make_step_time(name, capacity, args)
    raise ConfigError(f"calibration profile: unknown base backend {name!r}")


def from_step_time_section(section: dict, capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    """The model a profile's `step_time` section describes."""
    form = section.get("form")
    label = str(section.get("label", ""))
    coefficients = section.get("coefficients")
    if form in FORMS and not isinstance(coefficients, dict):
        raise ConfigError("calibration profile: step_time.coefficients must be an object of "
                          "term: seconds")
    if form == "linear":
        return LinearStepTime(coefficients, capacity.tp_size, label)
    if form == "roofline-correction":
        missing = [k for k in ("offset", "scale") if k not in coefficients]
        if missing or not isinstance(section.get("base"), str):
            raise ConfigError("calibration profile: a roofline-correction step_time needs "
                              "coefficients offset and scale and a base backend name")
        return CorrectedStepTime(base_model(section["base"], capacity, args),
                                 coefficients["offset"], coefficients["scale"], label)
    raise ConfigError(f"calibration profile: step_time form {form!r}; known: {', '.join(FORMS)}")


def load_profile(path: str | Path) -> dict:
    """A calibration profile (JSON), checked for a `step_time` section."""
    text = read_text(path, "--calibration")
    try:
        profile = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"--calibration {path}: not JSON ({exc})") from None
    if not isinstance(profile, dict) or not isinstance(profile.get("step_time"), dict):
        raise ConfigError(f"--calibration {path}: not a servetwin calibration profile "
                          "(no 'step_time' section)")
    return profile


def profile_engine(profile: dict) -> str | None:
    """The engine a profile measured (`engine.name`; None in a profile that does not say)."""
    engine = profile.get("engine")
    name = engine.get("name") if isinstance(engine, dict) else None
    return str(name) if name else None


def check_engine(profile: dict, engine: str, where: str) -> None:
    """Refuse a profile of another engine: its steps are another scheduler's (a vLLM step
    is one token budget of mixed prefill and decode, an SGLang step is not)."""
    have = profile_engine(profile)
    if have is not None and have != engine:
        raise ConfigError(f"{where}: a calibration profile of a {have} server, for a "
                          f"replica of engine {engine}: its step times are the other "
                          f"scheduler's (calibrate a {engine} server)")


def profile_step_time(path: str | Path, capacity: Capacity, args: ServerArgs,
                      engine: str = "sglang") -> StepTimeModel:
    profile = load_profile(path)
    check_engine(profile, engine, f"--calibration {path}")
    return from_step_time_section(profile["step_time"], capacity, args)


def vllm_step_time(profile: dict, tp_size: int, where: str) -> StepTimeModel:
    """The step time of a vLLM profile (`calibration/vllm.py`: the linear form)."""
    check_engine(profile, "vllm", where)
    section = profile["step_time"]
    if section.get("form") != "linear" or not isinstance(section.get("coefficients"), dict):
        raise ConfigError(f"{where}: a vLLM profile's step_time must be the linear form "
                          "with coefficients (as `servetwin calibrate` writes it)")
    return LinearStepTime(section["coefficients"], tp_size, str(section.get("label", "")))


@register_backend("fitted")
def _make(capacity: Capacity, args: ServerArgs) -> StepTimeModel:
    raise ConfigError("the fitted step-time backend needs its coefficients: pass "
                      "--calibration PROFILE.json (made by `servetwin calibrate`)")
