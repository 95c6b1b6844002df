"""Fit the twin's step time to samples: robust non-negative least squares (scipy).

A sample is the measured duration of a sequence of steps (`calibration.derive`). Both
candidate forms of `twin.perf.fitted` are linear in their parameters once each step is
reduced to numbers, so a sample's row is the sum of its steps' rows:

- `linear`: the step's term counts (`twin.perf.fitted.term_counts`);
- `roofline-correction`: `[1, base.step_time(step)]` for the uncalibrated base backend.

Residuals are relative, `(predicted - measured) / measured`, so a 20 ms decode step and a
600 ms prefill count alike, and each sample kind (decode, prefill, mixed, chunked
prefill) gets the same total weight however many samples it has. `scipy.optimize.
least_squares` with the `soft_l1` loss (a few noisy steps on a shared machine do not drag
the fit) and bounds `>= 0`. Terms whose count is zero in every sample (TP communication
at TP 1, say) are not identifiable: fixed at 0 and reported so.

Each form is fitted for two targets (`robust_nnls`): the `median` step (robust) and the
`mean` step (what sums of steps add up to). The pair is chosen by held-out error: the
runs (sample tags) are split, every fourth run held out; each pair is fitted on the rest
and scored by the median over held-out runs of the |relative error| of the run's total
step time (what a latency that sums many steps sees), ties broken by the median
|relative error| per step. The target is `mean` unless the `median` target beats it on
that score by over 5 points: on the CPU harness the two score within noise of each
other on the short, calm profiling runs, while sustained validation replays run a few
percent slower than both, so the higher of the two is the safer default. The winner is
refitted on everything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from calibration.session import CalibrationError
from twin.perf.fitted import TERMS, term_counts

HOLDOUT_EVERY = 4
SOFT_L1_SCALE = 0.1  # relative residual where the loss turns from quadratic to linear
MEAN_SCALE = 1.0  # the same for the `mean` target's second pass
TARGETS = ("mean", "median")
MEDIAN_MARGIN = 0.05  # how much better (run-total error) the median target must do


@dataclass(frozen=True)
class Fit:
    names: tuple[str, ...]
    coef: np.ndarray  # in the units of the names (seconds per count)
    stderr: np.ndarray  # nan where not identifiable
    identifiable: np.ndarray  # bool
    rel_residuals: np.ndarray  # per sample, on the samples it was fitted on

    def as_dict(self) -> dict[str, float]:
        return {n: float(c) for n, c in zip(self.names, self.coef, strict=True)}

    def uncertainty(self) -> dict[str, float | None]:
        return {n: (None if not ok or not np.isfinite(s) else float(s))
                for n, s, ok in zip(self.names, self.stderr, self.identifiable, strict=True)}


def linear_rows(samples: Sequence[dict], tp_size: int = 1) -> np.ndarray:
    """One row of `TERMS` counts per sample (summed over its steps)."""
    rows = np.zeros((len(samples), len(TERMS)))
    for i, s in enumerate(samples):
        for prefill, (batch, kv) in s["steps"]:
            rows[i] += term_counts([tuple(c) for c in prefill], batch, kv, tp_size)
    return rows


def correction_rows(samples: Sequence[dict], base) -> np.ndarray:
    """`[steps, sum of base step times]` per sample."""
    rows = np.zeros((len(samples), 2))
    for i, s in enumerate(samples):
        for prefill, (batch, kv) in s["steps"]:
            rows[i, 0] += 1
            rows[i, 1] += base.step_time([tuple(c) for c in prefill], _lens(batch, kv))
    return rows


def _lens(batch: int, kv: int) -> list[int]:
    """Decode KV lengths with the right count and sum (backends depend on no more)."""
    if batch == 0:
        return []
    q, r = divmod(int(kv), int(batch))
    return [q + 1] * r + [q] * (batch - r)


def kind_weights(samples: Sequence[dict]) -> np.ndarray:
    """Weights that give each sample kind the same total weight."""
    kinds = [s["kind"] for s in samples]
    counts = {k: kinds.count(k) for k in set(kinds)}
    w = np.array([1.0 / counts[k] for k in kinds])
    return w * len(w) / w.sum()


def robust_nnls(rows: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None,
                names: Sequence[str] | None = None, target: str = "median") -> Fit:
    """Non-negative coefficients minimising a soft-L1 loss of relative residuals.

    `median`: residuals relative to the measured duration, loss linear beyond 10 %: the
    fit follows the typical step and ignores slow outliers. `mean`: a second pass with
    residuals relative to the first pass's prediction and the loss linear only beyond
    100 %: close to least squares, so it follows the mean step time, which is what sums
    of steps (TPOT, E2E, throughput) add up to when noise is skewed towards slow steps
    (other jobs on a shared machine); only gross stalls are damped."""
    if len(y) == 0:
        raise CalibrationError("no samples to fit")
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: one of {TARGETS}")
    w = np.ones(len(y)) if weights is None else np.asarray(weights, float)
    names = tuple(names or (f"x{j}" for j in range(rows.shape[1])))
    coef, stderr, ident = _solve(rows, y, y, w, SOFT_L1_SCALE)
    if target == "mean":
        denom = np.maximum(rows @ coef, 0.3 * y)
        coef, stderr, ident = _solve(rows, y, denom, w, MEAN_SCALE)
    return Fit(names, coef, stderr, ident, (rows @ coef - y) / y)


def _solve(rows: np.ndarray, y: np.ndarray, denom: np.ndarray, w: np.ndarray,
           f_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ident = np.abs(rows).sum(axis=0) > 0
    a = rows[:, ident] / denom[:, None] * np.sqrt(w)[:, None]  # relative, weighted
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    a_s = a / scale
    target = y / denom * np.sqrt(w)

    def resid(theta: np.ndarray) -> np.ndarray:
        return a_s @ theta - target

    x0 = np.full(a_s.shape[1], 1.0 / a_s.shape[1])
    res = least_squares(resid, x0, jac=lambda _t: a_s, bounds=(0, np.inf), loss="soft_l1",
                        f_scale=f_scale, x_scale="jac")
    coef = np.zeros(rows.shape[1])
    coef[ident] = res.x / scale
    stderr = np.full(rows.shape[1], np.nan)
    dof = max(len(y) - a_s.shape[1], 1)
    r = resid(res.x)
    cov = np.linalg.pinv(a_s.T @ a_s) * float(r @ r) / dof
    stderr[ident] = np.sqrt(np.clip(np.diag(cov), 0, None)) / scale
    return coef, stderr, ident


def holdout_split(samples: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Indices (train, held out): every `HOLDOUT_EVERY`-th run by tag, in sorted tag order;
    with fewer than `HOLDOUT_EVERY` runs, every fifth sample."""
    tags = sorted({s.get("tag", "") for s in samples})
    if len(tags) >= HOLDOUT_EVERY:
        held = {t for i, t in enumerate(tags) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1}
        test = [i for i, s in enumerate(samples) if s.get("tag", "") in held]
    else:
        test = list(range(4, len(samples), 5))
    held_set = set(test)
    return [i for i in range(len(samples)) if i not in held_set], test


def error_stats(rel: np.ndarray) -> dict:
    a = np.abs(rel)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "median_abs_rel": round(float(np.median(a)), 4),
            "p90_abs_rel": round(float(np.percentile(a, 90)), 4),
            "mean_rel": round(float(np.mean(rel)), 4)}


@dataclass(frozen=True)
class Candidate:
    form: str
    names: tuple[str, ...]
    rows: np.ndarray


def candidates(samples: Sequence[dict], tp_size: int,
               base_factory: Callable[[], object] | None) -> list[Candidate]:
    out = [Candidate("linear", TERMS, linear_rows(samples, tp_size))]
    if base_factory is not None:
        out.append(Candidate("roofline-correction", ("offset", "scale"),
                             correction_rows(samples, base_factory())))
    return out


def run_total_error(pred: np.ndarray, y: np.ndarray, tags: Sequence[str]) -> float:
    """Median over runs of |sum of predicted - sum of measured| / sum of measured."""
    errs = []
    for tag in sorted(set(tags)):
        idx = [i for i, t in enumerate(tags) if t == tag]
        errs.append(abs(pred[idx].sum() - y[idx].sum()) / y[idx].sum())
    return round(float(np.median(errs)), 4) if errs else float("inf")


def fit_step_time(samples: Sequence[dict], tp_size: int = 1,
                  base_factory: Callable[[], object] | None = None,
                  base_name: str | None = None) -> dict:
    """The profile's `step_time` and `fit` sections from the samples."""
    samples = [s for s in samples if s.get("dur_s", 0) > 0 and s.get("steps")]
    if not samples:
        raise CalibrationError("the sample set is empty: nothing to fit (did the profiling "
                               "runs fail, or do the offline inputs hold no usable steps?)")
    y = np.array([s["dur_s"] for s in samples])
    w = kind_weights(samples)
    train, test = holdout_split(samples)
    tags = [samples[i].get("tag", "") for i in test]
    scores, cands = {}, {}
    for cand in candidates(samples, tp_size, base_factory):
        for target in TARGETS:
            fit = robust_nnls(cand.rows[train], y[train], w[train], cand.names, target)
            pred = cand.rows[test] @ fit.coef
            key = f"{cand.form}/{target}"
            scores[key] = error_stats((pred - y[test]) / y[test]) | {
                "run_total_abs_rel": run_total_error(pred, y[test], tags)}
            cands[key] = (cand, target)
    # the form by held-out error; the target is the mean unless the median fits the
    # held-out runs' totals clearly better (sums of steps are what latencies add up)
    forms = {k.split("/")[0] for k in scores}
    form = min(forms, key=lambda f: (scores[f"{f}/mean"]["run_total_abs_rel"],
                                     scores[f"{f}/mean"].get("median_abs_rel", np.inf)))
    best = f"{form}/mean"
    if scores[f"{form}/median"]["run_total_abs_rel"] < \
            scores[best]["run_total_abs_rel"] - MEDIAN_MARGIN:
        best = f"{form}/median"
    cand, target = cands[best]
    fit = robust_nnls(cand.rows, y, w, cand.names, target)
    section = {"backend": "fitted", "form": cand.form, "target": target,
               "coefficients": fit.as_dict(), "uncertainty": fit.uncertainty(),
               "not_identifiable": [n for n, ok in zip(fit.names, fit.identifiable,
                                                       strict=True) if not ok]}
    if cand.form == "roofline-correction":
        section["base"] = base_name
    by_kind = {k: error_stats(fit.rel_residuals[[s["kind"] == k for s in samples]])
               for k in sorted({s["kind"] for s in samples})}
    fit_info = {"samples": len(samples), "train_samples": len(train),
                "held_out_samples": len(test), "held_out": scores,
                "chosen_by": "form: held-out runs' median |error| of a run's total step "
                             "time (mean target); target: mean unless the median target's "
                             f"is lower by over {MEDIAN_MARGIN:.0%}",
                "residuals": error_stats(fit.rel_residuals), "residuals_by_kind": by_kind,
                "samples_by_source": _count(samples, "source")}
    return {"step_time": section, "fit": fit_info}


def _count(samples: Sequence[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        out[s.get(key, "?")] = out.get(s.get(key, "?"), 0) + 1
    return dict(sorted(out.items()))
