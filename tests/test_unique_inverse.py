"""twin/record_table.py `unique_inverse`: np.unique(values, return_inverse=True), the same
arrays bit for bit, on the records' rounded gaps and on anything else it may be given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.record_table import unique_inverse


def same(values: np.ndarray) -> None:
    u, inv = unique_inverse(values)
    u0, inv0 = np.unique(values, return_inverse=True)
    assert u.dtype == u0.dtype and u.tobytes() == u0.tobytes()
    assert inv.shape == inv0.shape and np.array_equal(inv, inv0)


def step_gaps(seed: int, n: int) -> np.ndarray:
    """Runs of equal rounded gaps (a batch's decode steps), drifting, with idles between."""
    rng = np.random.default_rng(seed)
    run_lens = rng.integers(1, 30, n)
    base = np.repeat(rng.uniform(0.006, 0.012, n), run_lens)[:n]
    base[rng.random(n) < 0.05] += rng.uniform(0, 20, int(n * 0.05) + 1)[:1]
    return np.round(base, 6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 5_000),
       spoil=st.sampled_from(["none", "nan", "negative", "minus_zero", "inf", "zero",
                              "alternating"]))
def test_any_array_gives_np_unique(seed, n, spoil):
    v = step_gaps(seed, n)
    if n:
        i = np.random.default_rng(seed).integers(0, n, 3)
        if spoil == "nan":
            v[i] = np.nan
        elif spoil == "negative":
            v[i] = -v[i]
        elif spoil == "minus_zero":
            v[i] = -0.0
            v[0] = 0.0
        elif spoil == "inf":
            v[i] = np.inf
        elif spoil == "zero":
            v[i] = 0.0
        elif spoil == "alternating":  # no runs at all
            v = np.where(np.arange(n) % 2 == 0, 0.007, 0.008)
    same(v)


@pytest.mark.parametrize("values", [np.empty(0), np.array([0.5]), np.array([3, 1, 3, 1]),
                                    np.array([0.1, 0.1, 0.1])])
def test_small_and_integer_arrays(values):
    same(values)


def test_minus_zero_goes_to_np_unique():
    # runs of equal neighbours merge -0.0 with 0.0 (they compare equal), and which one a
    # run keeps is not the one np.unique's sort keeps: this array's runs would give -0.0
    v = np.array([0.5, 0.5, -0.0, 0.0, 0.0, 0.0, -0.0, 0.5, 0.0, 0.0, 0.5, -0.0, 0.5, 0.0,
                  0.5, -0.0, -0.0, 0.5, 0.0, 0.5, -0.0, -0.0, 0.5, 0.0, 0.5, 0.5, -0.0, 0.0,
                  -0.0, 0.0, 0.5, 0.0, 0.5, -0.0, -0.0, -0.0, 0.5])
    same(v)
