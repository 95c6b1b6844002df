"""Records of a finished simulation without building a dict per request (issue 14).

`RecordTable` is a read-only sequence of the same records `records_one_by_one` builds (indexing
or iterating it builds each dict on demand), plus the two things a run does with all of
them at once, written for speed: `lines()`, the JSON lines of `requests.jsonl`, and
`summary()`, the same summary as `summarize`. Both are byte for byte what the dict path
gives (tests/test_record_digests.py, tests/test_record_table.py).

The speed comes from the token gaps: the gap between two consecutive decode steps is the
same for every request in both, so the replica's step-end timeline is differenced,
rounded and formatted once (compiled: each run of equal gaps formatted once; in Python,
each distinct value), and a request's `itl_s` is a join of slices of those strings; only the gaps at a request's own boundaries (its
prefill token, a return after a retraction) are computed per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from json.encoder import encode_basestring_ascii as _json_str
from typing import NamedTuple

import numpy as np

from twin.compiled import load
from twin.metrics import SLO, STATUSES, summary_from_columns

_C, WHY_PYTHON = load("_recordsc", "records writer")  # tests set `_C` to None to run the Python code
BLOCK = 1024  # lines formatted into one bytes at a time (~3 MB of Vidur's)


def _num(x: float | None) -> str:
    """A JSON number as `json.dumps` writes it (float.__repr__; NaN and infinities as
    Python's json module spells them)."""
    if x is None:
        return "null"
    s = repr(x)
    if s in ("nan", "inf", "-inf"):
        return {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[s]
    return s


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


_NO_IGNORE_EOS = ',"ignore_eos":false'  # a request that may stop at EOS (twin/metrics.py)


def record_order(reqs: Sequence, cols: Cols | None = None) -> list[int]:
    """The positions of `reqs` in the records' order, by arrival and then the replica's
    index, ties in the order given: `sorted(range(n), key=(arrival_s, index))`, by a
    stable `np.lexsort` of the two columns (`cols`: theirs, read already)."""
    n = len(reqs)
    if n < 64:
        return sorted(range(n), key=lambda i: (reqs[i].arrival_s, reqs[i].index))
    if cols is not None:
        return np.lexsort((cols.index, cols.arrival)).tolist()
    arrival = np.fromiter((r.arrival_s for r in reqs), dtype=float, count=n)
    index = np.fromiter((r.index for r in reqs), dtype=np.int64, count=n)
    return np.lexsort((index, arrival)).tolist()


class Cols(NamedTuple):
    """The fields of requests that the records read, as columns (`request_columns`):
    floats with NaN for None (only where None is what it stands for), ints as int64."""

    arrival: np.ndarray  # arrival_s as given (the order's key; `_times` rounds it)
    index: np.ndarray
    status: np.ndarray  # int8: its place in twin.metrics.STATUSES
    prompt: np.ndarray
    cached: np.ndarray
    priority: np.ndarray
    retractions: np.ndarray
    preemptions: np.ndarray
    moved: np.ndarray  # round(moved_bytes)
    ignore_eos: np.ndarray  # bool
    first_token: np.ndarray
    finish: np.ndarray
    queued: np.ndarray
    lost: np.ndarray
    admitted: np.ndarray  # bool: first_admit_s is not None
    rids: list
    errors: list

    def take(self, order) -> Cols:
        """The rows `order` (positions), in that order."""
        at = np.asarray(order, dtype=np.int64)
        return Cols(*(c[at] for c in self[:15]), [self.rids[i] for i in at.tolist()],
                    [self.errors[i] for i in at.tolist()])


STATUS_CODES = {s: i for i, s in enumerate(STATUSES)}


def request_columns(reqs: Sequence) -> Cols | None:
    """`reqs`' fields as `Cols`, read in one compiled pass; None without the compiled
    writer, or where a value does not fit the columns (a numpy integer, an int beyond 64
    bits, a NaN time, an unknown status, a None where a number is due): the callers then
    read the attributes themselves, as before."""
    if _C is None:
        return None
    got = _C.columns(reqs if type(reqs) is list else list(reqs), STATUS_CODES)
    return None if got is None else Cols(*got)


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_inverse=True)`, the same two arrays, sorting only the
    first value of each run of equal neighbours: consecutive decode steps of a batch mostly
    take the same rounded gap. Arrays
    with NaN or a sign bit set (-0.0, which equals 0.0 but prints apart) go to np.unique
    whole."""
    n = len(values)
    if n < 2 or values.dtype.kind != "f" or np.isnan(values).any() \
            or np.signbit(values).any():
        return np.unique(values, return_inverse=True)
    starts = np.concatenate(([0], np.flatnonzero(values[1:] != values[:-1]) + 1))
    uniq, inv = np.unique(values[starts], return_inverse=True)
    return uniq, np.repeat(inv, np.diff(np.append(starts, n)))


class Plan(NamedTuple):
    """The token gaps of a table's requests, as columns. Request i's gaps are its pieces
    `first[i]` .. `first[i + 1] - 1`, in order: a piece with `start` s >= 0 is the step gaps
    s .. s + `length` - 1 (`step_gaps`, the timeline's rounded differences, shared by the
    batch); one with s < 0 is its own boundary gap `own_gaps[-1 - s]` (its prefill token,
    a return after a retraction). `n_out`: each request's output tokens."""

    first: np.ndarray  # int64, len n + 1
    start: np.ndarray  # int64, one per piece
    length: np.ndarray  # int64, one per piece
    n_out: np.ndarray  # int64, one per request
    step_gaps: np.ndarray  # float64
    own_gaps: np.ndarray  # float64


def plan_gaps(reqs: list, ends: np.ndarray, off: int) -> Plan:
    """The `Plan` of `reqs`' token events over `ends`, the step-end timeline from step
    `off` on."""
    ends = np.ascontiguousarray(ends, dtype=float)
    pieces = (_C.plan_gaps if _C is not None else _pieces)(reqs, ends, off)
    first, start, length, n_out, own_raw = pieces
    step_gaps = np.round(np.diff(ends), 6) if len(ends) > 1 else np.empty(0)
    return Plan(first, start, length, n_out, step_gaps, np.round(own_raw, 6))


def _pieces(reqs: list, ends: np.ndarray, off: int) -> tuple:
    """`plan_gaps`'s columns but the gaps' rounding: the first, start, length and n_out
    columns and the boundary gaps unrounded (twin/_recordsc.pyx `plan_gaps`, compiled)."""
    item = ends.item  # a request's own boundaries only: no list of every step end
    at = item if not off else lambda j: item(j - off)
    if off < 0:
        raise ValueError(f"negative step offset {off}")
    m = len(ends)
    braw: list[float] = []
    first = [0]
    start: list[int] = []
    length: list[int] = []
    n_outs: list[int] = []
    for r in reqs:
        prev = None
        n_out = 0
        for ev in r.tok_events:
            if isinstance(ev, tuple):
                a, b = ev
                if b <= a:
                    continue
                if a < off or b - off > m:  # numpy would wrap a negative index round
                    raise IndexError(f"token event {ev} outside the steps "
                                     f"{off}..{off + m - 1}")
                if prev is not None:
                    start.append(-1 - len(braw))
                    length.append(1)
                    braw.append(at(a) - prev)
                if b - a > 1:
                    start.append(a - off)
                    length.append(b - 1 - a)
                prev = at(b - 1)
                n_out += b - a
            else:
                if prev is not None:
                    start.append(-1 - len(braw))
                    length.append(1)
                    braw.append(ev - prev)
                prev = ev
                n_out += 1
        first.append(len(start))
        n_outs.append(n_out)
    i64 = np.int64
    return (np.array(first, dtype=i64), np.array(start, dtype=i64),
            np.array(length, dtype=i64), np.array(n_outs, dtype=i64),
            np.asarray(braw, dtype=float))


class RecordTable(Sequence):
    def __init__(self, finished: Sequence, step_end: Sequence[float], offset: int = 0,
                 in_order: bool = False, cols: Cols | None = None) -> None:
        """`step_end`: the timeline's steps from index `offset` on (a window of it that
        covers every step the requests took part in: twin/record_sink.py); `in_order`:
        `finished` is already in `record_order`; `cols`: their `request_columns`, read
        already (in that order)."""
        self._reqs = list(finished) if in_order else [finished[i] for i in record_order(finished)]
        self._cols = cols if in_order else None
        self._cols_read = cols is not None and in_order
        self._ends = np.asarray(step_end, dtype=float)
        self.offset = offset
        self._gaps: tuple | None = None
        self._rounded: tuple | None = None  # `_times`
        self._gap_floats: tuple | None = None  # the gaps as floats, for `_record`
        self._uniq: tuple | None = None  # `_step_unique`

    def columns(self) -> Cols | None:
        """The requests' `request_columns` (read once; None: read attribute by attribute)."""
        if not self._cols_read:
            self._cols, self._cols_read = request_columns(self._reqs), True
        return self._cols

    # ---- the sequence of dicts (built on demand) ---------------------------------------
    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._record(j) for j in range(*i.indices(len(self._reqs)))]
        n = len(self._reqs)
        if not -n <= i < n:
            raise IndexError("record index out of range")
        return self._record(i % n)

    def __iter__(self) -> Iterator[dict]:
        if _C is None:
            for i in range(len(self._reqs)):
                yield self._record(i)
            return
        plan, times = self._plan(), self._times()
        sg, og = self._gap_lists()
        for i in range(0, len(self._reqs), BLOCK):  # compiled, a block of dicts at a time
            yield from _C.records(self._reqs, plan.first, plan.start, plan.length,
                                  plan.n_out, times, sg, og, i,
                                  min(i + BLOCK, len(self._reqs)))

    def _record(self, i: int) -> dict:
        """`records_one_by_one([request i], step_end)[0]`, from the table's columns: the gaps
        are the timeline's differences (the same subtractions, rounded alike)."""
        plan = self._plan()
        sg, og = self._gap_lists()
        r = self._reqs[i]
        itl: list[float] = []
        a, b = int(plan.first[i]), int(plan.first[i + 1])
        for s, n in zip(plan.start[a:b].tolist(), plan.length[a:b].tolist(), strict=True):
            if s >= 0:
                itl += sg[s:s + n]
            else:
                itl.append(og[-1 - s])
        arrival, ttft, tpot, e2e, queue, lost = (col[i] for col in self._times())
        return {"rid": r.rid, "arrival_s": arrival, "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens, "output_tokens": int(plan.n_out[i]),
                "priority": r.priority, "ttft_s": ttft, "tpot_s": tpot, "itl_s": itl,
                "e2e_s": e2e, "queue_s": queue, "retractions": r.retractions,
                "preemptions": r.preemptions, "status": r.status, "error": r.error,
                "lost_s": lost, "kv_moved_bytes": round(r.moved_bytes),
                **({} if r.ignore_eos else {"ignore_eos": False})}

    def _gap_lists(self) -> tuple[list, list]:
        """The step gaps and the boundary gaps as Python floats (the dicts' values)."""
        if self._gap_floats is None:
            plan = self._plan()
            self._gap_floats = (plan.step_gaps.tolist(), plan.own_gaps.tolist())
        return self._gap_floats

    # ---- token gaps --------------------------------------------------------------------
    def _plan(self) -> Plan:
        """Every request's token gaps as pieces (`Plan`), and its output token count."""
        if self._gaps is None:
            self._gaps = plan_gaps(self._reqs, self._ends, self.offset)
        return self._gaps

    def _step_unique(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct step gaps (sorted) and each step gap's index among them: sorted
        once for both the summary's ITL statistics and the lines."""
        if self._uniq is None:
            step_gaps = self._plan().step_gaps
            uniq, inv = unique_inverse(step_gaps)
            self._uniq = (uniq, inv.astype(np.int32) if len(uniq) < 2**31 else inv)
        return self._uniq

    @staticmethod
    def _strings(values: np.ndarray, unique: tuple | None = None) -> list[str]:
        """repr of every value (as json writes a float), each distinct value formatted once."""
        if not len(values):
            return []
        uniq, inv = unique if unique is not None else unique_inverse(values)
        table = np.array([repr(v) for v in uniq.tolist()], dtype=object)
        return table[inv].tolist()

    # ---- rounded times ---------------------------------------------------------------------
    def _times(self) -> tuple[list, ...]:
        """Per request, rounded as the record writes them: arrival, TTFT, TPOT, E2E,
        queue and lost seconds (None where the record has null); computed once for the
        summary and the lines."""
        if self._rounded is not None:
            return self._rounded
        if _C is not None:
            c = self.columns()
            if c is not None:  # (from the columns read already)
                self._rounded = _C.times_of(
                    c.arrival, c.first_token, c.finish, c.status, STATUS_CODES["ok"],
                    self._plan().n_out, c.queued, c.admitted.view(np.int8), c.lost)
            if self._rounded is None:
                self._rounded = _C.times(self._reqs, self._plan().n_out)
            return self._rounded
        arrival, ttft_c, tpot_c, e2e_c, queue_c, lost_c = [], [], [], [], [], []
        for r, n_out in zip(self._reqs, self._plan().n_out.tolist(), strict=True):
            ok = r.status == "ok"
            ttft = r.first_token_s - r.arrival_s if r.first_token_s is not None else None
            e2e = r.finish_s - r.arrival_s if ok else None
            arrival.append(_r(r.arrival_s))
            ttft_c.append(_r(ttft))
            tpot_c.append(_r((e2e - ttft) / (n_out - 1)) if ok and n_out > 1 else None)
            e2e_c.append(_r(e2e))
            queue_c.append(_r(r.queued_s) if r.first_admit_s is not None else None)
            lost_c.append(_r(r.lost_s))
        self._rounded = (arrival, ttft_c, tpot_c, e2e_c, queue_c, lost_c)
        return self._rounded

    # ---- requests.jsonl ------------------------------------------------------------------
    def blocks(self, size: int = BLOCK, tails: list[bytes] | None = None, into=None
               ) -> Iterator[tuple[bytes | None, np.ndarray]]:
        """The JSON lines of every record, in order, `size` records at a time: (their
        bytes, each line's length in bytes). `tails`: per record, ASCII fields that end
        its object (a fleet's replica, pool and attempts); `into`: a file-like object the
        compiled writer writes the bytes to itself (None then in their place)."""
        if _C is None:
            lines = self._lines()
            if tails is not None:
                lines = (f"{line[:-2]}{tail.decode()}}}\n"
                         for line, tail in zip(lines, tails, strict=True))
            yield from line_blocks(lines, size)
            return
        if tails is not None and len(tails) != len(self._reqs):
            raise ValueError(f"{len(tails)} tails for {len(self._reqs)} records")
        plan = self._plan()
        if not len(plan.step_gaps):
            uniq, inv = np.empty(0), np.empty(0, np.int64)
        elif _C.plain(plan.step_gaps):  # each gap formatted where it stands
            uniq, inv = plan.step_gaps, None
        else:  # written as `_strings` writes them: -0.0 as np.unique's 0.0
            uniq, inv = self._step_unique()
        own = plan.own_gaps
        if len(own) and not _C.plain(own):
            ou, oi = unique_inverse(own)
            own = ou[oi]
        writer = _C.LineWriter(self._reqs, plan.first, plan.start, plan.length, plan.n_out,
                               self._times(), uniq, inv, own, self.columns(), STATUSES)
        for i in range(0, len(self._reqs), size):
            j = min(i + size, len(self._reqs))
            yield writer.block(i, j, None if tails is None else tails[i:j], into)

    def lines(self) -> Iterator[str]:
        """The JSON line of every record, in order (with its newline)."""
        if _C is None:
            yield from self._lines()
            return
        for data, sizes in self.blocks():
            text, pos = data.decode("ascii"), 0
            for n in sizes.tolist():
                yield text[pos:pos + n]
                pos += n

    def _lines(self) -> Iterator[str]:
        plan = self._plan()
        step_gaps = plan.step_gaps
        ss = self._strings(step_gaps, self._step_unique() if len(step_gaps) else None)
        xs = self._strings(plan.own_gaps)
        first, start, length = plan.first.tolist(), plan.start.tolist(), plan.length.tolist()
        for i, (r, n_out, arrival, ttft, tpot, e2e, queue, lost) in enumerate(zip(
                self._reqs, plan.n_out.tolist(), *self._times(), strict=True)):
            parts: list[str] = []
            for k in range(first[i], first[i + 1]):
                s = start[k]
                if s >= 0:
                    parts += ss[s:s + length[k]]
                else:
                    parts.append(xs[-1 - s])
            error = "null" if r.error is None else _json_str(r.error)
            yield (f'{{"rid":{_json_str(r.rid)},"arrival_s":{_num(arrival)},'
                   f'"prompt_tokens":{int(r.prompt_tokens)},'
                   f'"cached_tokens":{int(r.cached_tokens)},"output_tokens":{n_out},'
                   f'"priority":{int(r.priority)},"ttft_s":{_num(ttft)},'
                   f'"tpot_s":{_num(tpot)},"itl_s":[{",".join(parts)}],'
                   f'"e2e_s":{_num(e2e)},"queue_s":{_num(queue)},'
                   f'"retractions":{int(r.retractions)},"preemptions":{int(r.preemptions)},'
                   f'"status":{_json_str(r.status)},"error":{error},'
                   f'"lost_s":{_num(lost)},"kv_moved_bytes":{round(r.moved_bytes)}'
                   f'{"" if r.ignore_eos else _NO_IGNORE_EOS}}}\n')

    # ---- summary -----------------------------------------------------------------------
    def summary(self, slo: SLO | None = None, duration_s: float | None = None) -> dict:
        """`summarize(list(self), slo, duration_s)`, computed from columns."""
        plan = self._plan()
        n_step = len(plan.step_gaps)
        joined = np.concatenate([plan.step_gaps, plan.own_gaps])
        reqs = self._reqs
        arrival, ttft, tpot, e2e, queue, lost = self._times()
        status = [r.status for r in reqs]
        cols: dict[str, list] = {
            "status": status, "arrival_s": arrival, "e2e_s": e2e,
            "ttft_s": ttft, "tpot_s": tpot, "queue_s": queue,
            "prompt_tokens": [r.prompt_tokens for r in reqs],
            "output_tokens": plan.n_out.tolist(),
            "cached_tokens": [r.cached_tokens for r in reqs],
            "retractions": [r.retractions for r in reqs],
            "preemptions": [r.preemptions for r in reqs], "lost_s": lost,
            "kv_moved_bytes": [round(r.moved_bytes) for r in reqs]}
        at = row_pieces(plan.first, np.flatnonzero([s == "ok" for s in status]))
        start, length = plan.start[at], plan.length[at]
        steps = start >= 0
        weighed = weighed_gaps(plan.step_gaps, self._step_unique, start[steps], length[steps],
                               plan.own_gaps[-1 - start[~steps]])
        if weighed is not None:  # (its step and boundary values, as one sorted set)
            weighed = add_weighed([weighed])
        starts = np.where(steps, start, n_step - 1 - start).tolist()
        lens = length.tolist()
        itl = itl_stats(joined, starts, lens,
                        self._step_unique() if n_step and weighed is None else None,
                        weighed=weighed)
        return summary_from_columns(cols, itl, slo, duration_s)


def line_blocks(lines: Iterator[str], size: int = BLOCK) -> Iterator[tuple[bytes, np.ndarray]]:
    """`lines` encoded, `size` at a time: (their bytes, each line's length in bytes)."""
    batch: list[bytes] = []
    for line in lines:
        batch.append(line.encode())
        if len(batch) == size:
            yield b"".join(batch), np.array([len(b) for b in batch], dtype=np.int64)
            batch = []
    if batch:
        yield b"".join(batch), np.array([len(b) for b in batch], dtype=np.int64)


def row_pieces(first: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The indices of the pieces of requests `rows`, in that order; request i's pieces are
    `first[i]` .. `first[i + 1] - 1` (a `Plan`'s, or a sink's columns)."""
    take = first[rows + 1] - first[rows]
    return np.repeat(first[rows] - (np.cumsum(take) - take), take) + np.arange(
        int(take.sum()), dtype=np.int64)


def step_range(reqs: list) -> tuple[int, int]:
    """The step indices [lo, hi) of the timeline that `reqs`' token events use."""
    if _C is not None:
        return _C.window(reqs)
    lo, hi = None, 0
    for r in reqs:
        for ev in r.tok_events:
            if isinstance(ev, tuple) and ev[1] > ev[0]:
                lo = ev[0] if lo is None or ev[0] < lo else lo
                hi = max(hi, ev[1])
    return (0, 0) if lo is None else (lo, hi)


def _gather(values: np.ndarray, starts: list[int], lens: list[int],
            chunk: int = 1 << 16) -> np.ndarray:
    """The concatenation of values[s:s + n] for each (s, n), filled chunk by chunk into
    one array (index arrays only for one chunk of pieces at a time: a day has ~1e8 gaps)."""
    out = np.empty(sum(lens), dtype=values.dtype)
    pos = 0
    for i in range(0, len(starts), chunk):
        s = np.asarray(starts[i:i + chunk], dtype=np.int64)
        n = np.asarray(lens[i:i + chunk], dtype=np.int64)
        m = int(n.sum())
        offsets = np.cumsum(n) - n
        out[pos:pos + m] = values[np.repeat(s - offsets, n) + np.arange(m, dtype=np.int64)]
        pos += m
    return out


# ---- ITL statistics without the array of every gap ----------------------------------------
# A day of traffic has ~3e8 token gaps (2.4 GB as float64), but only as many distinct step
# gaps as decode steps, each shared by the batch. `itl_stats` gives what `_pcts(gathered,
# scratch=True)` gives for the gathered array, byte for byte, without building it: the
# percentiles from the distinct values and how many gaps take each (numpy's 'linear'
# method: the same virtual index, order statistics and interpolation), the mean from
# numpy's own pairwise summation replayed over the virtual array, one leaf at a time.

_PW_LEAF = 1 << 16  # elements summed by one np.add.reduce (a node of numpy's recursion)


class _Pieces:
    """values[s:s + n] for each (s, n), read in order, `take(n)` elements at a time
    (twin/_recordsc.pyx `Gather`, compiled)."""

    def __init__(self, values: np.ndarray, starts: list[int], lens: list[int],
                 chunk: int = 1 << 12) -> None:
        self.values, self.starts, self.lens, self.chunk = values, starts, lens, chunk
        self.next_piece = 0
        self.buf = np.empty(0, dtype=values.dtype)
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        while len(self.buf) - self.pos < n:
            i = self.next_piece
            more = _gather(self.values, self.starts[i:i + self.chunk],
                           self.lens[i:i + self.chunk])
            self.next_piece = i + self.chunk
            self.buf = np.concatenate((self.buf[self.pos:], more))
            self.pos = 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out


def _pairwise_sum(src: _Pieces, n: int) -> np.float64:
    """np.add.reduce of the next n elements: numpy's pairwise summation splits a block of
    more than 128 elements at n2 = n // 2 - (n // 2) % 8 and adds the two halves' sums;
    any node of that tree is summed by np.add.reduce on its own elements alone."""
    if n <= _PW_LEAF:
        return np.add.reduce(src.take(n))
    n2 = n // 2
    n2 -= n2 % 8
    left = _pairwise_sum(src, n2)
    return left + _pairwise_sum(src, n - n2)


class _Cover:
    """How many pieces values[s:s + n] cover each element, a range of elements at a time
    (no array the size of the timeline: a day has ~4e7 steps): the starts at or before
    an element minus the ends at or before it, from the sorted starts and ends."""

    def __init__(self, starts: list[int], lens: list[int]) -> None:
        st = np.asarray(starts, dtype=np.int64)
        self.ups = np.sort(st)
        self.downs = np.sort(st + np.asarray(lens, dtype=np.int64))

    def __call__(self, i: int, j: int) -> np.ndarray:
        """The counts of elements i..j-1, as floats (whole numbers: exact)."""
        out = np.zeros(j - i)
        for edges, sign in ((self.ups, 1.0), (self.downs, -1.0)):
            a, b = np.searchsorted(edges, (i, j), side="left").tolist()
            step = np.bincount(edges[a:b] - i, minlength=j - i).astype(float)
            step[0] += a  # the edges before i
            out += sign * np.cumsum(step)
        return out


def _weighted_counts(values: np.ndarray, cover: _Cover, offset: int = 0,
                     chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values (sorted) and the total count of each, chunk by chunk;
    `values` starts at element `offset` of the covered array."""
    us, ws = [], []
    for i in range(0, len(values), chunk):
        part = values[i:i + chunk]
        u, inv = unique_inverse(part)
        us.append(u)
        counts = cover(offset + i, offset + i + len(part))
        ws.append(np.bincount(inv, weights=counts, minlength=len(u)))
    if not us:
        return np.empty(0), np.empty(0)
    u, inv = np.unique(np.concatenate(us), return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate(ws), minlength=len(u))


def weighed_gaps(values: np.ndarray,
                 uniq_inv: Callable[[], tuple[np.ndarray, np.ndarray]] | None,
                 starts: np.ndarray, lens: np.ndarray, own: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct token gaps of some pieces and how many times each is taken: step
    pieces values[s:s + n] for each (s, n) of `starts`, `lens` (`uniq_inv`: a function
    giving `values`' `unique_inverse`, where the caller keeps it), and single gaps `own`.
    None where a gap is NaN or -0.0 (which equals 0.0 and prints apart): weights of such
    values cannot be added up by value afterwards. Compiled, the step gaps are counted by
    their whole microseconds (`weigh_micros`), without a sort."""
    if len(values) and len(starts) and _C is not None:
        got = _C.weigh_micros(values, np.ascontiguousarray(starts, dtype=np.int64),
                              np.ascontiguousarray(lens, dtype=np.int64))
        if got is None:
            return None
        u, w = got
    elif len(values) and len(starts):
        u, inv = uniq_inv() if uniq_inv is not None else unique_inverse(values)
        m = len(values)  # how many pieces take each step: pieces begun minus pieces ended
        ends = np.asarray(starts, dtype=np.int64) + lens
        cover = np.cumsum(np.bincount(starts, minlength=m + 1)[:m]
                          - np.bincount(ends, minlength=m + 1)[:m])
        w = np.bincount(inv, weights=cover, minlength=len(u))
    else:
        u, w = np.empty(0), np.empty(0)
    if len(own):
        ou, oc = np.unique(own, return_counts=True)
        u, w = np.concatenate((u, ou)), np.concatenate((w, oc.astype(float)))
    if np.isnan(u).any() or np.signbit(u).any():
        return None
    return u, w


def add_weighed(parts: Sequence[tuple[np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray]:
    """`weighed_gaps` of several groups of pieces, as one: the distinct values (sorted)
    and their summed weights."""
    if not parts:
        return np.empty(0), np.empty(0)
    uniq, inv = np.unique(np.concatenate([u for u, _ in parts]), return_inverse=True)
    return uniq, np.bincount(inv, weights=np.concatenate([w for _, w in parts]),
                             minlength=len(uniq))


def itl_stats(values: np.ndarray, starts: list[int], lens: list[int],
              head_unique: tuple[np.ndarray, np.ndarray] | None = None,
              weighed: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """`metrics._pcts(_gather(values, starts, lens), scratch=True)`, without the gathered
    array: P50/P90/P99 and mean of the concatenation of values[s:s + n] for each (s, n).
    `head_unique`: `np.unique(values[:m], return_inverse=True)` of its first m values,
    already computed (the step gaps); `weighed`: the gathered values' distinct ones and
    their counts, already computed (`add_weighed`)."""
    from twin.metrics import PERCENTILES

    n = int(sum(lens))
    if n == 0:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    src = _C.Gather(values, starts, lens) if _C is not None else _Pieces(values, starts, lens)
    mean = round(float(_pairwise_sum(src, n) / n), 6)
    if weighed is not None:
        uniq, weight = weighed
        if int(weight.sum()) != n:
            raise RuntimeError(f"{int(weight.sum())} weighed gaps for {n} gathered")
        return _linear_percentiles(uniq, weight, n, mean)
    # how many gaps take each element of `values`: pieces cover ranges of it
    cover = _Cover(starts, lens)
    if head_unique is not None:  # the first m values' distinct ones are known: weigh those
        u0, inv0 = head_unique
        m = len(inv0)
        u1, w1 = _weighted_counts(values[m:], cover, m)
        w0 = np.zeros(len(u0))
        for i in range(0, m, 1 << 20):
            j = min(i + (1 << 20), m)
            w0 += np.bincount(inv0[i:j], weights=cover(i, j), minlength=len(u0))
        uniq, inv = np.unique(np.concatenate((u0, u1)), return_inverse=True)
        weight = np.bincount(inv, weights=np.concatenate((w0, w1)), minlength=len(uniq))
    else:
        uniq, weight = _weighted_counts(values, cover)  # a value of weight 0 is never picked
    return _linear_percentiles(uniq, weight, n, mean)


def _linear_percentiles(uniq: np.ndarray, weight: np.ndarray, n: int, mean: float) -> dict:
    """`itl_stats`'s dict from the n gaps' distinct values (sorted) and counts."""
    from twin.metrics import PERCENTILES

    cum = np.cumsum(weight)  # whole numbers below 2**53: exact
    # numpy's percentile, method 'linear' (numpy.lib._function_base_impl._quantile)
    q = np.true_divide(np.asarray(PERCENTILES), 100)
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    nxt = prev + 1
    top = virtual >= n - 1
    prev[top] = nxt[top] = n - 1
    gamma = np.asarray(virtual - np.floor(virtual), dtype=virtual.dtype)
    lo = uniq[np.searchsorted(cum, prev, side="right")]
    hi = uniq[np.searchsorted(cum, nxt, side="right")]
    diff = hi - lo  # numpy's _lerp
    res = np.add(lo, diff * gamma)
    np.subtract(hi, diff * (1 - gamma), out=res, where=gamma >= 0.5)
    out: dict[str, float | None] = {f"p{p}": round(float(v), 6)
                                    for p, v in zip(PERCENTILES, res, strict=True)}
    out["mean"] = mean
    return out
