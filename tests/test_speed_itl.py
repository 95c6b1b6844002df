"""The summary's ITL statistics without the array of every gap (twin/record_table.py,
`itl_stats`) are numpy's own over the gathered array: the same mean (numpy's pairwise sum
replayed leaf by leaf) and the same percentiles (method 'linear'), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import twin.record_table as rt
from twin.metrics import PERCENTILES, _pcts

pytestmark = pytest.mark.offline


def _layout(rng, size: int, pieces: int, longest: int):
    values = np.round(rng.exponential(0.01, size), int(rng.integers(2, 7)))
    starts = [int(x) for x in rng.integers(0, size, pieces)]
    lens = [int(min(rng.integers(1, longest), size - s)) for s in starts]
    return values, starts, lens


def test_matches_numpy_on_random_layouts():
    rng = np.random.default_rng(11)
    for _ in range(300):
        values, starts, lens = _layout(rng, int(rng.integers(1, 3000)),
                                       int(rng.integers(0, 300)), 80)
        if not sum(lens):
            assert rt.itl_stats(values, starts, lens) == {
                **{f"p{p}": None for p in PERCENTILES}, "mean": None}
            continue
        want = _pcts(rt._gather(values, starts, lens), scratch=True)
        assert rt.itl_stats(values, starts, lens) == want
        m = int(rng.integers(1, len(values) + 1))  # the step gaps' unique, known already
        head = np.unique(values[:m], return_inverse=True)
        assert rt.itl_stats(values, starts, lens, head) == want


def test_mean_and_percentiles_unrounded_across_many_leaves(monkeypatch):
    monkeypatch.setattr(rt, "_PW_LEAF", 1000)  # many leaves and splits of numpy's tree
    rng = np.random.default_rng(12)
    for size, pieces in ((50_000, 20_000), (7, 3), (1, 1), (200_003, 61_111)):
        values, starts, lens = _layout(rng, size, pieces, 90)
        gathered = rt._gather(values, starts, lens)
        n = len(gathered)
        total = rt._pairwise_sum(rt._Pieces(values, starts, lens, chunk=97), n)
        assert total == np.add.reduce(gathered)  # numpy's pairwise sum, exactly
        assert float(total / n) == float(gathered.mean())
        pct = rt.itl_stats(values, starts, lens)
        for p, v in zip(PERCENTILES, np.percentile(gathered, PERCENTILES), strict=True):
            assert pct[f"p{p}"] == round(float(v), 6)


def test_a_single_gap_and_ties():
    values = np.array([0.5, 0.25, 0.25, 0.75])
    assert rt.itl_stats(values, [1], [1]) == {"p50": 0.25, "p90": 0.25, "p99": 0.25,
                                              "mean": 0.25}
    starts, lens = [0, 1, 1, 2], [4, 3, 1, 2]
    assert rt.itl_stats(values, starts, lens) == _pcts(rt._gather(values, starts, lens))


def test_gaps_weighed_in_groups_give_the_same_statistics():
    """The streamed summary weighs each chunk's gaps as it is kept (`weighed_gaps`) and
    adds the groups up by value (`add_weighed`): the statistics of all of them, bit for
    bit; a NaN or -0.0 gap refuses (the sink then weighs the whole array)."""
    rng = np.random.default_rng(13)
    for _ in range(200):
        parts, joined, starts, lens = [], [], [], []
        base = 0
        for _g in range(int(rng.integers(1, 5))):
            values, s, n = _layout(rng, int(rng.integers(1, 500)), int(rng.integers(0, 60)), 40)
            own = np.round(rng.exponential(0.05, int(rng.integers(0, 20))), 4)
            part = rt.weighed_gaps(values, None, np.asarray(s, dtype=np.int64),
                                   np.asarray(n, dtype=np.int64), own)
            parts.append(part)
            joined += [values, own]
            starts += [base + x for x in s]
            lens += n
            starts += list(range(base + len(values), base + len(values) + len(own)))
            lens += [1] * len(own)
            base += len(values) + len(own)
        if not sum(lens):
            continue
        values = np.concatenate(joined)
        want = _pcts(rt._gather(values, starts, lens), scratch=True)
        assert rt.itl_stats(values, starts, lens, weighed=rt.add_weighed(parts)) == want
    v = np.array([0.5, -0.0, 0.25])
    assert rt.weighed_gaps(v, None, np.array([0]), np.array([3]), np.empty(0)) is None
    assert rt.weighed_gaps(v[:1], None, np.array([0]), np.array([1]),
                           np.array([np.nan])) is None
    with pytest.raises(RuntimeError, match="weighed gaps"):  # counts that do not add up
        rt.itl_stats(np.array([0.5, 0.25]), [0], [2], weighed=(np.array([0.5]), np.ones(1)))


def test_compiled_weighing_counts_what_the_sort_counts(monkeypatch):
    """The compiled weighing counts whole microseconds in an array (`weigh_micros`): the
    same values with the same counts as the Python code's sort of the distinct gaps, for
    rounded gaps, gaps of a second and more (counted apart), unrounded ones and zeros."""
    if rt._C is None:
        pytest.skip(f"not built: {rt.WHY_PYTHON}")
    rng = np.random.default_rng(14)
    for k in range(300):
        size = int(rng.integers(1, 2000))
        values = np.round(rng.exponential([0.01, 0.5, 3.0][k % 3], size), 6)
        if k % 5 == 0:  # unrounded, zero and far-off values among them
            pick = rng.integers(0, size, size // 4 + 1)
            values[pick] = rng.choice([0.0, 1e-7, 123.456789123, 2e6, 0.3], len(pick))
        values = np.repeat(values, rng.integers(1, 4, size))  # runs of equal neighbours
        starts = rng.integers(0, len(values), int(rng.integers(0, 200)))
        lens = np.array([int(rng.integers(0, len(values) - s + 1)) for s in starts],
                        dtype=np.int64)
        own = np.round(rng.exponential(0.05, int(rng.integers(0, 9))), 6)
        got = rt.weighed_gaps(values, None, starts, lens, own)
        monkeypatch.setattr(rt, "_C", None)
        want = rt.weighed_gaps(values, None, starts, lens, own)
        monkeypatch.undo()
        (gu, gw), (wu, ww) = rt.add_weighed([got]), rt.add_weighed([want])
        keep = ww > 0  # (the sort keeps values no piece takes, with weight 0)
        assert gu.tobytes() == wu[keep].tobytes() and gw.tobytes() == ww[keep].tobytes()
    v = np.array([0.5, -0.0, 0.25])
    assert rt.weighed_gaps(v, None, np.array([2]), np.array([1]), np.empty(0)) is None
