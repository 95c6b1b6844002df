"""The compiled records writer (twin/_recordsc.pyx) gives the Python code's values and bytes.

The Python code in twin/record_table.py is the specification. Each test runs both on the
same requests (`record_table._C` set to None for the Python side) and compares the token
gaps' columns, the rounded times, the lines' bytes and the steps a chunk uses: on real
simulated runs, and on requests drawn by hypothesis with what a run rarely makes
(rids and errors that need escaping, numpy integers, NaN and infinite times, events
out of order, huge byte counts). Without the extension built these skip, except under
SERVETWIN_CI=1, where the install must have built it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import GPU, MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_record_table import CASES

from twin import record_table
from twin.config import ServerArgs
from twin.record_table import RecordTable
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

pytestmark = pytest.mark.offline

COMPILED = record_table._C
if COMPILED is None:
    if os.environ.get("SERVETWIN_CI") == "1":
        raise RuntimeError(f"CI must build the compiled writer: {record_table.WHY_PYTHON}")
    pytest.skip(f"not built: {record_table.WHY_PYTHON}", allow_module_level=True)


def both(reqs: list, ends: np.ndarray, off: int = 0) -> tuple[dict, dict]:
    """What each core makes of the same requests: columns, times, blocks, lines, the
    records as dicts, window."""
    out = []
    for core in (None, COMPILED):
        saved = record_table._C
        record_table._C = core
        try:
            t = RecordTable(reqs, ends, offset=off, in_order=True)
            p = t._plan()
            out.append({"plan": [a.tolist() for a in p],
                        "times": [list(c) for c in t._times()],
                        "blocks": [(d, s.tolist()) for d, s in t.blocks(size=7)],
                        "tailed": [(d, s.tolist()) for d, s in t.blocks(size=5, tails=[
                            f',"replica":"r{i}","attempts":{i}'.encode()
                            for i in range(len(reqs))])],
                        "lines": list(t.lines()),
                        "dicts": [repr(d) for d in t],  # (repr: NaN equals itself)
                        "window": record_table.step_range(reqs)})
        finally:
            record_table._C = saved
    return out[0], out[1]


RUNS = CASES  # tests/test_record_table.py: plain, retractions, swap and slices, mixed


@pytest.mark.parametrize("name", list(RUNS))
def test_both_cores_write_the_same_records_of_a_run(name: str) -> None:
    server, twin, spec = RUNS[name]
    res = simulate(from_spec(spec, seed=3), SimConfig(
        args=ServerArgs(model_path=MODEL, **server), gpu=GPU, step_time_backend="roofline",
        **twin))
    table = res.records
    py, c = both(table._reqs, table._ends)
    assert py == c
    assert c["lines"] == [json.dumps(r, separators=(",", ":")) + "\n" for r in table]
    # a window of the timeline, as a spilled chunk's table has it
    lo, hi = c["window"]
    assert hi > lo
    py, c = both(table._reqs, table._ends[lo:hi], lo)
    assert py == c


class Req:
    """The fields of a SimRequest (twin/request_state.py) that the records read."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
TIME = st.one_of(st.floats(0, 1e6, allow_nan=False), st.sampled_from(
    [float("nan"), float("inf"), 0.1 + 0.2, 1e-7, 123456.7890125]))
INT = st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 10**6).map(np.int64),
                st.booleans())


@st.composite
def requests(draw):
    n_steps = draw(st.integers(2, 40))
    ends = np.cumsum(draw(st.lists(st.sampled_from([0.0125, 0.013, 1 / 3, 0.5, 2.0, 1e-9]),
                                   min_size=n_steps, max_size=n_steps)))
    reqs = []
    for i in range(draw(st.integers(0, 6))):
        # decode ranges (a, b) of the timeline (an empty or reversed one is skipped) and
        # prefill ends, in any order
        events = draw(st.lists(st.one_of(
            st.tuples(st.integers(0, n_steps - 1), st.integers(0, n_steps)), TIME),
            max_size=5))
        status = draw(st.sampled_from(["ok", "ok", "aborted", "rejected", "failed"]))
        ok_times = status == "ok"
        arrival = draw(TIME)
        first = draw(st.one_of(st.none(), TIME)) if not ok_times else draw(TIME)
        reqs.append(Req(
            rid=draw(TEXT), arrival_s=arrival, first_token_s=first,
            finish_s=draw(TIME), status=status, queued_s=draw(TIME),
            first_admit_s=draw(st.one_of(st.none(), TIME)), lost_s=draw(TIME),
            prompt_tokens=draw(INT), cached_tokens=draw(INT), priority=draw(INT),
            retractions=draw(INT), preemptions=draw(INT),
            error=draw(st.one_of(st.none(), TEXT)),
            moved_bytes=draw(st.one_of(st.floats(0, 1e22), st.just(2.5), st.just(3.5))),
            ignore_eos=draw(st.sampled_from([True, False, 0, 1])), tok_events=events, index=i))
    return reqs, ends


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_both_cores_agree_on_drawn_requests(drawn) -> None:
    reqs, ends = drawn
    py, c = both(reqs, ends)
    assert repr(py) == repr(c)  # NaN times: equal text, not equal floats


@pytest.mark.parametrize("events", [[(3, 9)], [(0, 3)], [1.0, (1, 4)]])
def test_a_token_event_outside_the_window_is_refused_not_read(events) -> None:
    """By both cores: the Python one would read a step before the window as the last
    (numpy's negative index)."""
    for plan in (COMPILED.plan_gaps, record_table._pieces):
        with pytest.raises(IndexError, match="outside the steps 2..6"):
            plan([Req(tok_events=events)], np.arange(5, dtype=float), 2)


TIES = [k / 128 for k in range(-300, 300)] + [k / 2**20 for k in range(0, 4000, 7)]


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2e9, 2e9),
                 st.floats(-1e-5, 1e-5), st.sampled_from(TIES),
                 st.integers(-10**15, 10**15).map(lambda n: n / 1e6),
                 st.integers(-10**15, 10**15).map(lambda n: (n + 0.5) / 1e6)))
def test_round_6_is_pythons_round(x: float) -> None:
    got, want = COMPILED.round_6(x), round(x, 6)
    assert repr(got) == repr(want), x  # the sign of a zero and NaN included


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2e9, 2e9),
                 st.sampled_from(TIES), st.integers(-10**12, 10**12).map(lambda n: n / 1e4),
                 st.integers(-10**12, 10**12).map(lambda n: (n + 0.5) / 1e4)),
       st.integers(0, 7))
def test_rounding_to_other_digits_is_pythons_round(x: float, digits: int) -> None:
    """`round_to` at every number of digits (the typed core's samples round to 4 and 6)."""
    got, want = COMPILED.round_digits(x, digits), round(x, digits)
    assert repr(got) == repr(want), (x, digits)


def test_round_6_on_every_tie_and_its_neighbours() -> None:
    """Exact halves of 1e-6 (x * 1e6 = N + 1/2 exactly: x = odd / 128) and the doubles
    beside them, where a rounding shortcut goes wrong."""
    for x in TIES:
        for y in (x, np.nextafter(x, 1), np.nextafter(x, -1)):
            assert repr(COMPILED.round_6(float(y))) == repr(round(float(y), 6)), y


def test_strings_that_need_escaping_are_escaped_as_json_does() -> None:
    odd = ["", "plain-1", 'q"uote', "back\\slash", "new\nline", "tab\t", "del\x7f", "\x1f",
           "~ok~", "é", "日本", "\U0001f600", " "]
    reqs = [Req(rid=s, arrival_s=1.0, first_token_s=None, finish_s=None, status="aborted",
                queued_s=0.0, first_admit_s=None, lost_s=float("inf"), prompt_tokens=1,
                cached_tokens=0, priority=0, retractions=0, preemptions=0, error=s or None,
                moved_bytes=0.0, ignore_eos=True, tok_events=[], index=i)
            for i, s in enumerate(odd)]
    py, c = both(reqs, np.empty(0))
    assert repr(py) == repr(c)
    for line, s in zip(c["lines"], odd, strict=True):
        assert json.loads(line.replace("Infinity", "1e999"))["rid"] == s


def test_the_line_writer_refuses_columns_that_do_not_fit() -> None:
    """`block` reads its columns unchecked: a piece past the gaps is refused up front."""
    r = Req(rid="a", arrival_s=0.0, first_token_s=0.5, finish_s=1.0, status="ok", queued_s=0.0,
            first_admit_s=0.0, lost_s=0.0, prompt_tokens=1, cached_tokens=0, priority=0,
            retractions=0, preemptions=0, error=None, moved_bytes=0.0, ignore_eos=True,
            tok_events=[], index=0)
    i64 = np.int64
    times = [[0.0]] * 6
    args = dict(first=np.array([0, 1], i64), n_out=np.array([2], i64), times=times,
                uniq=np.array([0.5]), inv=np.zeros(3, i64), own=np.empty(0))
    ok = COMPILED.LineWriter([r], start=np.array([1], i64), length=np.array([2], i64), **args)
    assert ok.block(0, 1)[0].count(b"0.5") == 2
    with pytest.raises(ValueError, match="outside the 3 step gaps"):
        COMPILED.LineWriter([r], start=np.array([2], i64), length=np.array([2], i64), **args)
    with pytest.raises(ValueError, match="outside the 0 boundary gaps"):
        COMPILED.LineWriter([r], start=np.array([-1], i64), length=np.array([1], i64), **args)
    with pytest.raises(IndexError, match="block 0..2 of 1"):
        ok.block(0, 2)


def _req(**kw) -> Req:
    base = dict(rid="a", arrival_s=0.0, first_token_s=0.5, finish_s=1.0, status="ok",
                queued_s=0.0, first_admit_s=0.0, lost_s=0.0, prompt_tokens=1, cached_tokens=0,
                priority=0, retractions=0, preemptions=0, error=None, moved_bytes=0.0,
                ignore_eos=True, tok_events=[0.5], index=0)
    return Req(**{**base, **kw})


def test_inputs_that_would_read_outside_the_arrays_raise_instead() -> None:
    """The compiled code reads its arrays unchecked; each of these once reached past them
    (integer overflow in a bounds check, a list that changed under a writer, a second
    __init__): now each raises, and nothing is read."""
    ends = np.arange(5.0)
    with pytest.raises(IndexError, match="outside the steps"):  # a - off wrapped around
        COMPILED.plan_gaps([_req(tok_events=[(-2**63, -2**62), 1.0])], ends, 1)
    with pytest.raises(ValueError, match="negative step offset"):
        COMPILED.plan_gaps([_req(tok_events=[(0, 2**62 + 2**40)])], ends, -10)
    i64 = np.int64
    args = dict(n_out=np.array([2], i64), times=[[0.0]] * 6, uniq=np.array([0.5]),
                inv=np.zeros(3, i64), own=np.empty(0))
    with pytest.raises(ValueError, match="outside the 3 step gaps"):  # start + length wrapped
        COMPILED.LineWriter([_req()], np.array([0, 1], i64), np.array([1], i64),
                            np.array([2**63 - 1], i64), **args)
    reqs = [_req()]
    w = COMPILED.LineWriter(reqs, np.array([0, 1], i64), np.array([1], i64),
                            np.array([2], i64), **args)
    line = w.block(0, 1)[0]
    reqs.extend(_req() for _ in range(1000))  # the writer keeps its own copy
    with pytest.raises(IndexError, match="block 0..1001 of 1"):
        w.block(0, len(reqs))
    with pytest.raises(TypeError, match="initialized once"):  # its text is read uncopied
        w.__init__([_req()], np.array([0, 1], i64), np.array([10**6], i64),
                   np.array([10**6], i64), **args)
    with pytest.raises(TypeError, match="initialized once"):  # however right the inputs
        w.__init__(reqs, np.array([0, 1], i64), np.array([1], i64), np.array([2], i64),
                   **args)
    assert w.block(0, 1)[0] == line


def test_a_list_emptied_while_it_is_read_is_read_from_a_copy() -> None:
    reqs: list = []

    class Emptying(Req):
        @property
        def tok_events(self):
            reqs.clear()
            return [0.5]

    reqs[:] = [Emptying(**{k: v for k, v in vars(_req()).items() if k != "tok_events"})
               for _ in range(50)]
    first, *_ = COMPILED.plan_gaps(reqs, np.arange(5.0), 0)
    assert len(first) == 51


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300).flatmap(lambda m: st.tuples(
    st.just(m), st.lists(st.tuples(st.integers(0, m - 1), st.integers(0, 40)), max_size=30),
    st.lists(st.integers(0, 50), max_size=10))))
def test_the_summarys_gather_reads_the_pieces_as_python_does(drawn) -> None:
    m, pieces, takes = drawn
    values = np.random.default_rng(m).random(m)
    starts = [s for s, _ in pieces]
    lens = [min(n, m - s) for s, n in pieces]
    total = sum(lens)
    py, c = record_table._Pieces(values, starts, lens), COMPILED.Gather(values, starts, lens)
    for k in takes:
        if k > total:
            with pytest.raises(ValueError, match="elements asked"):
                c.take(k)
            break
        assert c.take(k).tobytes() == py.take(k).tobytes()
        total -= k
    with pytest.raises(ValueError, match="outside the 3 values"):
        COMPILED.Gather(np.zeros(3), [2], [2])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0125, 0.013, 1 / 3, 0.02, 1e-6]), min_size=1, max_size=400),
       st.lists(st.tuples(st.integers(0, 399), st.integers(1, 200)), min_size=1, max_size=40))
def test_itl_statistics_are_the_same_from_both_cores(values, pieces) -> None:
    values = np.array(values)
    m = len(values)
    starts = [s % m for s, _ in pieces]
    lens = [min(n, m - s) for s, (_, n) in zip(starts, pieces, strict=True)]
    out = []
    for core in (None, COMPILED):
        for leaf in (1 << 16, 128):  # numpy's whole sum; and many leaves, many takes
            saved = record_table._C, record_table._PW_LEAF
            record_table._C, record_table._PW_LEAF = core, leaf
            try:
                out.append(record_table.itl_stats(values, starts, lens))
            finally:
                record_table._C, record_table._PW_LEAF = saved
    assert out[0] == out[2] and out[1] == out[3]


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(-2**49, 2**49).map(lambda k: k / 1e6),
                 st.floats(-1e9, 1e9).map(lambda x: round(x, 6)),
                 st.integers(0, 2000).map(lambda k: k / 1e6)))
def test_microsecond_numbers_are_written_as_repr_writes_them(x: float) -> None:
    """The writer's own digits for whole microseconds (`put_micros`) are repr's; any
    other number is left to CPython's formatting."""
    got = COMPILED.micros_repr(x)
    assert got is None or got.decode() == repr(x)
    if got is None and x == x and 1e-4 <= abs(x) < 2**27 and round(x, 6) == x:
        raise AssertionError(f"{x!r}: a microsecond number not written by put_micros")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True),
                          st.integers(-2**70, 2**70), st.booleans(), st.none(),
                          st.floats(-1e6, 1e6).map(np.float64),
                          st.text(st.characters(blacklist_categories=("Cs",),
                                                blacklist_characters="\n"), max_size=4)),
                max_size=20))
def test_timeseries_rows_are_written_as_str_writes_them(rows: list) -> None:
    """timeseries.csv's compiled writer (`csv_block`) gives `",".join(map(str, row))`
    for any field type (floats, ints beyond 64 bits, bools, None, numpy floats, text)."""
    want = "".join(",".join(map(str, row)) + "\n" for row in rows).encode()
    assert COMPILED.csv_block(rows, 0, len(rows)) == want
    if rows:
        assert COMPILED.csv_block(rows, 1, len(rows)) == want[want.index(b"\n") + 1:]
    for width in (0, 1, 3, 11):  # a fleet's rows (twin/fleet.py write_fleet_series)
        fleet = "".join(",".join("" if x is None else str(x)
                                 for x in list(row[:width]) + [""] * (width - len(row)))
                        + "\n" for row in rows).encode()
        assert COMPILED.csv_block(rows, 0, len(rows), width, True) == fleet


def _fits(r) -> bool:
    """Whether `request_columns` can hold a request's fields (else it declines)."""
    def num(v, none_ok):
        return (v is None and none_ok) or (type(v) in (int, float) and v == v
                                           and abs(v) < 2**63)
    ints = (r.index, r.prompt_tokens, r.cached_tokens, r.priority, r.retractions,
            r.preemptions)
    return (r.status in ("ok", "rejected", "aborted", "failed")
            and all(type(v) is int and -2**63 <= v < 2**63 for v in ints)
            and num(r.arrival_s, False) and num(r.queued_s, False) and num(r.lost_s, False)
            and num(r.first_token_s, True) and num(r.finish_s, True)
            and type(r.ignore_eos) is bool and type(r.moved_bytes) is float
            and abs(r.moved_bytes) < 4e18)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.booleans())
def test_a_chunks_columns_are_its_requests_fields(drawn, plain: bool) -> None:
    """`request_columns` (one compiled pass) holds exactly what the attributes say, or
    declines (None) where a field does not fit its column: then the sink reads the
    attributes one by one, as before. `plain`: fields as a run makes them (they fit)."""
    reqs, _ = drawn
    if plain:
        for r in reqs:
            for name in ("prompt_tokens", "cached_tokens", "priority", "retractions",
                         "preemptions"):
                setattr(r, name, int(getattr(r, name)) % 10**6)
            r.moved_bytes = float(r.moved_bytes % 1e15)
            r.ignore_eos = bool(r.ignore_eos)
            for name in ("arrival_s", "queued_s", "lost_s", "first_token_s", "finish_s"):
                v = getattr(r, name)
                if v is not None and not 0 <= v < 1e9:  # NaN, infinities
                    setattr(r, name, 1.5)
        assert all(_fits(r) for r in reqs)
    cols = record_table.request_columns(reqs)
    if not all(_fits(r) for r in reqs):
        assert cols is None
        return
    assert cols is not None
    for i, r in enumerate(reqs):
        assert cols.arrival[i] == r.arrival_s and cols.index[i] == r.index
        assert ("ok", "rejected", "aborted", "failed")[cols.status[i]] == r.status
        assert [cols.prompt[i], cols.cached[i], cols.priority[i], cols.retractions[i],
                cols.preemptions[i], cols.moved[i]] == [
            r.prompt_tokens, r.cached_tokens, r.priority, r.retractions, r.preemptions,
            round(r.moved_bytes)]
        assert bool(cols.ignore_eos[i]) is r.ignore_eos
        assert bool(cols.admitted[i]) is (r.first_admit_s is not None)
        for col, v in ((cols.first_token, r.first_token_s), (cols.finish, r.finish_s),
                       (cols.queued, r.queued_s), (cols.lost, r.lost_s)):
            assert (np.isnan(col[i]) and v is None) or col[i] == v
        assert cols.rids[i] is r.rid and cols.errors[i] is r.error
    order = list(range(len(reqs)))[::-1]
    taken = cols.take(order)
    assert taken.rids == cols.rids[::-1] and (taken.index == cols.index[::-1]).all()
    n_out = np.array([len(r.rid) % 4 for r in reqs], dtype=np.int64)  # 0..3 tokens
    try:
        want = COMPILED.times(reqs, n_out)
    except TypeError:  # ok without a finish or a first token: the columns decline
        want = None
    got = COMPILED.times_of(cols.arrival, cols.first_token, cols.finish, cols.status, 0,
                            n_out, cols.queued, cols.admitted.view(np.int8), cols.lost)
    assert repr(got) == repr(want)
    if plain:  # the lines and dicts written from the columns: the Python code's
        py, c = both(reqs, drawn[1])
        assert repr(py) == repr(c)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True),
                          st.integers(-2**70, 2**70), st.booleans()), max_size=30))
def test_samples_as_an_array_are_numpys(rows: list) -> None:
    """The memory summary's samples as a float array (`rows_array`): numpy's own
    conversion, huge ints, bools, NaN and infinities included; other rows declined."""
    got = COMPILED.rows_array(rows, 3)
    want = np.asarray(rows, dtype=float).reshape(-1, 3)
    assert got.tobytes() == want.tobytes() and got.shape == want.shape
    assert COMPILED.rows_array([(1.0, 2)], 3) is None
    assert COMPILED.rows_array([(1.0, None, 2)], 3) is None
    assert COMPILED.rows_array([[1.0, 2.0, 3.0]], 3) is None
