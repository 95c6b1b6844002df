"""Records streamed to disk as requests finish (issues 12 and 14).

A replica hands every request that leaves to `finished.append(req)` and reads
`len(finished)`; `RecordSink` is such a `finished`. It holds at most `chunk` finished
requests (SimRequest objects, ~2.5 KB each with their token events); then it formats
their records (twin/record_table.py over the window of the step timeline they use),
sorted within the chunk, appends the lines to an unnamed temporary file beside the output
(a spill; gone when the process ends, however it ends) and keeps of each request only
what the summary and the final order need, as numpy columns (~150 bytes a request).

At the end the chunks are merged in the records' order (arrival, then the replica's
index, then the order they left: exactly `RecordTable`'s stable sort) into the output,
written atomically (a temporary file renamed over `requests.jsonl` only when whole), and
the summary is computed from the columns in that order: byte for byte what the in-memory
path writes (tests/test_record_stream.py). A run that never filled a chunk takes the
in-memory path itself.

Requests mostly leave in the records' order, so a chunk spills only the requests whose
place is already fixed: those sorted first whose replica indexes continue the ones spilled
before (`RecordSink.flush(hold=True)`); the others wait for the next chunk (at most half a
chunk of them: more, and the whole chunk spills as it is). When the spill ends up in the
records' order, it becomes `requests.jsonl` itself (linked into the directory and renamed
over it, `_publish`): no copy. Otherwise the merge copies it. A step's end is fixed once a request that used it has left (a
decode run's planned steps are appended before it runs, and a cut or a crash only drops
steps that end after now), so a chunk's lines never change afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from twin.metrics import SLO, summarize, summary_from_columns, write_records
from twin.outputs import BlockWriter
from twin.record_table import (
    STATUS_CODES,
    Cols,
    RecordTable,
    add_weighed,
    itl_stats,
    record_order,
    request_columns,
    row_pieces,
    step_range,
    weighed_gaps,
)

CHUNK = 32768  # finished requests held before a spill (~80 MB of SimRequests)
_FLOATS = ("arrival_s", "ttft_s", "tpot_s", "e2e_s", "queue_s", "lost_s")  # rounded; NaN: null
_INTS = ("prompt_tokens", "cached_tokens", "output_tokens", "retractions", "preemptions",
         "kv_moved_bytes")
_COPY_BLOCK = 8 << 20  # bytes copied from the spill at a time


class RecordSink:
    """`finished` for a replica: records formatted and spilled `chunk` requests at a time.

    `timeline`: the replica whose step-end timeline (`Replica.step_end`) the requests'
    token events index (or a callable that returns the timeline); `path`: the
    `requests.jsonl` to write (None: only the summary is wanted, no lines are formatted);
    requests whose rid starts with `skip_prefix` count in `len` but get no record
    (bench_serving's warm-up)."""

    def __init__(self, timeline: Callable[[], np.ndarray] | object, path: Path | None = None,
                 chunk: int = CHUNK, skip_prefix: str | None = None) -> None:
        if chunk < 1:
            raise ValueError(f"chunk {chunk}: must be >= 1")
        self.timelines = [timeline]  # one per replica (a fleet's: twin/record_sink_fleet.py)
        self.path, self.chunk = path, chunk
        self.skip_prefix = skip_prefix
        self.skipped = 0  # appended with `skip_prefix`: no record
        self._n = 0
        self._buf: list = []
        self._buf_seq: list[int] = []  # each held request's place in the order they left
        self._left = 0  # requests appended with a record
        self._expect = 0  # the replica index the next spilled record should have
        self._gone: set[int] = set()  # indexes past `_expect` that get no record (skipped)
        self._ordered = True  # still holding back: the spill may end up in order
        self._cols: dict[str, list[np.ndarray]] = {}
        self._rids: list[str] = []
        self._runs: list[tuple[int, np.ndarray]] = []  # (first row, line end offsets)
        self._rows = 0
        self._own: list[np.ndarray] = []  # boundary gaps (RecordTable's own gaps), all chunks
        # the `ok` rows' distinct token gaps and their counts, a part per chunk (None: a
        # gap that cannot be added up by value, NaN or -0.0: the summary weighs them all)
        # by replica (a fleet's summaries of a pool or a replica take theirs)
        self._weighed: dict[int, list[tuple[np.ndarray, np.ndarray]]] | None = {}
        self._n_own = 0
        self._spill = None

    # ---- what a replica calls ------------------------------------------------------------
    def append(self, req) -> None:
        self._n += 1
        if self.skip_prefix and req.rid.startswith(self.skip_prefix):
            self.skipped += 1
            if req.index == self._expect:
                self._expect += 1
            elif req.index > self._expect:
                self._gone.add(req.index)
            return
        self._buf.append(req)
        self._buf_seq.append(self._left)
        self._left += 1
        if len(self._buf) >= self.chunk:
            self.flush(hold=self._ordered)

    def __len__(self) -> int:
        return self._n

    @property
    def spilled(self) -> bool:
        return bool(self._runs)

    # ---- chunks ------------------------------------------------------------------------
    def flush(self, group: int = 0, hold: bool = False) -> None:
        """Format the held requests' records, spill their lines, keep their columns;
        `hold`: only those whose place in the records is fixed (module docstring)."""
        buf, seqs = self._buf, self._buf_seq
        self._buf, self._buf_seq = [], []
        if not buf:
            return
        cols = request_columns(buf)  # (None: their attributes are read one by one)
        order = record_order(buf, cols)
        if hold:
            k = self._in_place(buf, order, cols)
            if len(order) - k > self.chunk // 2:  # not leaving in order: spill them all
                self._ordered = False
            else:
                rest = sorted(order[k:])
                self._buf = [buf[i] for i in rest]
                self._buf_seq = [seqs[i] for i in rest]
                order = order[:k]
                if not order:
                    return
        reqs = [buf[i] for i in order]
        seq = np.array(seqs, dtype=np.int64)[np.asarray(order, dtype=np.int64)]
        table = self._table(reqs, 0, None if cols is None else cols.take(order))
        self._keep_columns(table, reqs, seq, group)
        if self.path is not None:
            self._spill_lines(table)
        self._rows += len(reqs)

    def _in_place(self, buf: list, order: list[int], cols: Cols | None = None) -> int:
        """How many of `buf`, sorted by `order`, continue the replica indexes spilled so
        far (advancing `_expect` past them); `cols`: `buf`'s columns, read already."""
        e, gone, k = self._expect, self._gone, 0
        if cols is not None and not gone and order:
            index = cols.index[np.asarray(order, dtype=np.int64)]
            match = index == np.arange(e, e + len(index))
            k = len(index) if match.all() else int(np.argmin(match))
            self._expect = e + k
            return k
        for i in order:
            while e in gone:
                gone.discard(e)
                e += 1
            if buf[i].index != e:
                break
            e += 1
            k += 1
        self._expect = e
        return k

    def _table(self, reqs: list, worker: int, cols: Cols | None = None) -> RecordTable:
        """The records of `reqs` (sorted; `cols`: their columns, read already) over the
        window of replica `worker`'s timeline they use (-1: none)."""
        lo, hi = step_range(reqs)
        if hi <= lo or worker < 0:
            return RecordTable(reqs, np.empty(0), in_order=True, cols=cols)
        return RecordTable(reqs, step_window(self.timelines[worker], lo, hi), offset=lo,
                           in_order=True, cols=cols)

    def _keep_columns(self, table: RecordTable, reqs: list, seq: np.ndarray,
                      group: int, worker: int = 0) -> None:
        plan = table._plan()
        times = table._times()
        n = len(reqs)
        col = self._cols.setdefault
        col("seq", []).append(seq)
        col("group", []).append(np.full(n, group, dtype=np.int8))
        col("worker", []).append(np.full(n, worker, dtype=np.int32))
        c = table.columns()
        if c is not None:  # (read in one pass)
            raw, index, status, rids = c.arrival, c.index, c.status, c.rids
            ints = {"prompt_tokens": c.prompt, "cached_tokens": c.cached,
                    "retractions": c.retractions, "preemptions": c.preemptions,
                    "kv_moved_bytes": c.moved}
        else:
            raw = np.array([r.arrival_s for r in reqs], dtype=float)
            index = np.array([r.index for r in reqs], dtype=np.int64)
            status = np.array([STATUS_CODES[r.status] for r in reqs], dtype=np.int8)
            rids = [r.rid for r in reqs]
            ints = {"prompt_tokens": [r.prompt_tokens for r in reqs],
                    "cached_tokens": [r.cached_tokens for r in reqs],
                    "retractions": [r.retractions for r in reqs],
                    "preemptions": [r.preemptions for r in reqs],
                    "kv_moved_bytes": [round(r.moved_bytes) for r in reqs]}
        ints["output_tokens"] = plan.n_out
        col("raw_arrival", []).append(raw)
        col("index", []).append(index)
        col("status", []).append(status)
        for name, values in zip(_FLOATS, times, strict=True):
            col(name, []).append(np.array([np.nan if v is None else v for v in values],
                                          dtype=float))
        for name in _INTS:
            col(name, []).append(np.asarray(ints[name], dtype=np.int64))
        self._rids += rids
        # the ITL pieces of `ok` records: a step range of the timeline (absolute step
        # index, count) or a boundary gap (-(1 + its index among all chunks' gaps), 1)
        ok = status == STATUS_CODES["ok"]
        at = row_pieces(plan.first, np.flatnonzero(ok))
        start = plan.start[at]
        own = start < 0
        col("n_pieces", []).append(np.where(ok, np.diff(plan.first), 0))
        col("piece_start", []).append(np.where(own, start - self._n_own, start + table.offset))
        col("piece_len", []).append(plan.length[at])
        col("piece_worker", []).append(np.where(own, -1, worker).astype(np.int32))
        own_gaps = plan.own_gaps
        self._own.append(own_gaps)
        self._n_own += len(own_gaps)
        if self._weighed is not None:  # the summary's ITL counts, this chunk's share
            steps = ~own
            part = weighed_gaps(plan.step_gaps, table._step_unique, start[steps],
                                plan.length[at][steps], own_gaps[-1 - start[own]])
            if part is None:
                self._weighed = None
            else:
                self._weighed.setdefault(worker, []).append(part)

    def _spill_lines(self, table: RecordTable, tails: list[bytes] | None = None) -> None:
        """Append `table`'s lines to the spill, a block at a time (`RecordTable.blocks`;
        `tails`: theirs), and note where each begins."""
        if self._spill is None:  # unnamed (O_TMPFILE where there is one): never left behind
            self._spill = _unnamed_file(self.path.parent)
        start = self._spill.tell()
        sizes: list[np.ndarray] = []
        for data, lens in table.blocks(tails=tails, into=self._spill):
            if data is not None:  # (the Python writer's bytes)
                self._spill.write(data)
            sizes.append(lens)
        ends = np.cumsum(np.concatenate(sizes)) if sizes else np.empty(0, dtype=np.int64)
        self._runs.append((self._rows, start + np.concatenate(([0], ends))))

    # ---- the end -------------------------------------------------------------------------
    def finish(self, slo: SLO | None = None) -> tuple[Sequence[dict], dict]:
        """(records, summary) of a whole run; `requests.jsonl` written when `path` is set.
        Without a spill: the in-memory `RecordTable`, as `simulate` always gave."""
        if not self._runs and not self._cols:
            table = RecordTable(self._buf, step_window(self.timelines[0], 0, 1 << 62))
            self._buf = []
            if self.path is not None:
                write_records(self.path, table)
            return table, summarize(table, slo)
        self.flush()
        c = self._columns()
        perm = np.lexsort((c["seq"], c["index"], c["raw_arrival"]))
        return self._finish_in(perm, c, slo)

    def finish_with(self, left: Iterator, slo: SLO | None = None) -> tuple[Sequence[dict], dict]:
        """As `twin.sim.with_unfinished` (a run stopped early): the records so far and one
        for each SimRequest of `left` (each request that has none, `aborted`), ordered by
        rounded arrival, then rid."""
        self.flush()
        for r in left:
            self._buf.append(r)
            self._buf_seq.append(self._left)
            self._left += 1
            if len(self._buf) >= self.chunk:
                self.flush(group=1)
        self.flush(group=1)
        c = self._columns()
        base = np.lexsort((c["seq"], c["index"], c["raw_arrival"], c["group"]))
        ra, rids = c["arrival_s"], self._rids
        perm = np.array(sorted(base.tolist(), key=lambda i: (ra[i], rids[i])), dtype=np.int64)
        return self._finish_in(perm, c, slo)

    def rids(self) -> set[str]:
        """The rids that have a record (spilled or held)."""
        return {*self._rids, *(r.rid for r in self._buf)}

    def _columns(self) -> dict[str, np.ndarray]:
        c = {k: np.concatenate(v) for k, v in self._cols.items()}
        self._cols = {}
        return c

    def _finish_in(self, perm: np.ndarray, c: dict, slo: SLO | None):
        try:
            if self.path is not None:
                self._merge(perm)
        finally:
            if self._spill is not None:
                self._spill.close()
                self._spill = None
        summary = self._summary(perm, c, slo)
        records = StreamedRecords(self.path, len(perm))
        return records, summary

    def _merge(self, perm: np.ndarray, fix: tuple | None = None) -> None:
        """Copy the spilled lines into `path` in the order `perm` (rows), atomically;
        `fix`: (a mask over rows, a function of a line's bytes) rewrites those rows."""
        from twin.outputs import atomic_writer

        self._spill.flush()
        fd = self._spill.fileno()
        if fix is None and _in_order(perm) and _publish(fd, self.path):
            return
        firsts = np.array([r for r, _ in self._runs], dtype=np.int64)
        run = np.searchsorted(firsts, perm, side="right") - 1
        local = perm - firsts[run]
        # runs of consecutive lines of one chunk: one copy each (a row to fix: its own)
        cut = (np.diff(run) != 0) | (np.diff(local) != 1)
        if fix is not None:
            fixed = fix[0][perm]
            cut |= fixed[1:] | fixed[:-1]
        brk = np.flatnonzero(cut) + 1
        seg_a = np.concatenate(([0], brk))
        seg_b = np.concatenate((brk, [len(perm)]))
        # each row's line in the spill (runs hold consecutive rows, in row order)
        line_at = np.concatenate([offs[:-1] for _, offs in self._runs])
        line_end = np.concatenate([offs[1:] for _, offs in self._runs])
        pos_of = line_at[perm[seg_a]].tolist()
        stop_of = line_end[perm[seg_b - 1]].tolist()
        fixed_seg = fixed[seg_a].tolist() if fix is not None else None
        with atomic_writer(self.path, binary=True) as fh:
            fh.flush()
            out = fh.fileno()  # written through the descriptor only, so nothing buffers
            in_kernel = hasattr(os, "copy_file_range")
            with _Gatherer(fd, out) as short:  # (a fleet's records alternate replicas)
                for k, (pos, stop) in enumerate(zip(pos_of, stop_of, strict=True)):
                    if fixed_seg is not None and fixed_seg[k]:
                        short.add(fix[1](os.pread(fd, stop - pos, pos)))
                    elif stop - pos < _SHORT_SPAN:
                        short.add_span(pos, stop)
                    else:
                        short.drain()
                        in_kernel = _copy_span(fd, out, pos, stop, in_kernel)

    def _summary(self, perm: np.ndarray, c: dict, slo: SLO | None) -> dict:
        """`RecordTable.summary` over the columns, rows in the order `perm`."""
        itl = self._itl(perm, c)
        cols = {name: c[name][perm] for name in ("status", *_FLOATS, *_INTS)}
        return summary_from_columns(cols, itl, slo)  # (numpy columns: NaN is null)

    def _itl(self, perm: np.ndarray, c: dict) -> dict:
        """`itl_stats` of the `ok` rows' token gaps, rows in the order `perm`: the step
        gaps of the replicas they ran on, then every boundary gap, as one array."""
        at = row_pieces(np.concatenate(([0], np.cumsum(c["n_pieces"]))), perm)
        starts, lens, owner = c["piece_start"][at], c["piece_len"][at], c["piece_worker"][at]
        del at
        workers = np.unique(owner[owner >= 0]).tolist()
        own = np.concatenate(self._own) if self._own else np.empty(0)
        sizes = [max(_steps(self.timelines[w]) - 1, 0) for w in workers]
        joined = np.empty(sum(sizes) + len(own))
        base = 0
        for w, n in zip(workers, sizes, strict=True):  # replica w's gaps sit at `base`
            _gaps_into(self.timelines[w], joined[base:base + n])
            starts[owner == w] += base
            base += n
        joined[base:] = own
        own_piece = owner < 0
        starts[own_piece] = base - 1 - starts[own_piece]
        # (the chunks weighed their distinct gaps as they were kept; failing that,
        # itl_stats weighs them chunk by chunk: no sort of the whole array)
        return itl_stats(joined, starts, lens, weighed=self._weighed_of(perm, c))

    def _weighed_of(self, perm: np.ndarray, c: dict) -> tuple[np.ndarray, np.ndarray] | None:
        """The weighed gaps of the rows `perm` where those are every row of the replicas
        they ran on (else None: `itl_stats` weighs them itself)."""
        if self._weighed is None:
            return None
        workers = c["worker"]
        mine = np.unique(workers[perm])
        if len(perm) != len(workers) and \
                len(perm) != int(np.isin(workers, mine).sum()):
            return None
        return add_weighed([part for w in mine.tolist() for part in self._weighed.get(w, ())])


def _unnamed_file(where: Path) -> BlockWriter:
    """A read-write file in directory `where` with no name (O_TMPFILE, which `_publish`
    can give a name; tempfile's own sets O_EXCL, which forbids that), or one unlinked as
    soon as made where the system has none; written by twin/outputs.py `BlockWriter`."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            fd = os.open(where, flag | os.O_RDWR, 0o600)
        except OSError:
            pass
        else:
            return BlockWriter(fd)
    fd, name = tempfile.mkstemp(dir=where, prefix=".spill-")
    os.unlink(name)
    return BlockWriter(fd)


def _in_order(perm: np.ndarray) -> bool:
    return bool(len(perm)) and bool((perm == np.arange(len(perm))).all())


def _publish(fd: int, path: Path) -> bool:
    """Give the unnamed file `fd` the name `path` (synced, linked beside it under a
    temporary name, renamed over it, as `atomic_writer` does); False where the system
    cannot (no /proc, a file that had a name), and nothing is changed then."""
    link = f"/proc/self/fd/{fd}"
    try:
        os.fsync(fd)
        where = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return False
    try:
        for _ in range(8):
            tmp = f".{path.name}.{os.urandom(6).hex()}.tmp"
            try:  # (a dir fd makes os.link call linkat, which can follow the link to the
                # file itself; link(2) would link /proc's symbolic link and fail)
                os.link(link, tmp, dst_dir_fd=where, follow_symlinks=True)
            except FileExistsError:
                continue
            except (OSError, NotImplementedError):
                return False
            try:
                os.replace(tmp, path.name, src_dir_fd=where, dst_dir_fd=where)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=where)
                raise
            return True
        return False
    finally:
        os.close(where)


_SHORT_SPAN = 256 << 10  # spans shorter than this are gathered here, not copied one by one


class _Gatherer:
    """Short spans of the spill `src` appended to `dst` through one buffer, written
    `_COPY_BLOCK` at a time (a fleet's merge has a span per record: a system call each
    would cost more than the copy). The spill is read through a read-only mapping whose
    pages are dropped after each write, so a day's spill never sits in memory."""

    def __init__(self, src: int, dst: int) -> None:
        import mmap

        self.dst, self.buf = dst, bytearray()
        size = os.fstat(src).st_size
        self.map = mmap.mmap(src, size, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")
        self._drop = getattr(mmap, "MADV_DONTNEED", None)

    def __enter__(self) -> _Gatherer:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.drain()
        finally:
            self.view.release()
            if self.map is not None:
                self.map.close()

    def add_span(self, pos: int, stop: int) -> None:
        self.add(self.view[pos:stop])

    def add(self, data) -> None:
        self.buf += data
        if len(self.buf) >= _COPY_BLOCK:
            self.drain()

    def drain(self) -> None:
        if self.buf:
            data, self.buf = self.buf, bytearray()
            _write_all(self.dst, data)
            if self.map is not None and self._drop is not None:
                self.map.madvise(self._drop)


def _copy_span(src: int, dst: int, pos: int, stop: int, in_kernel: bool) -> bool:
    """Append bytes [pos, stop) of `src` to `dst`: by the kernel (`copy_file_range`, no
    bytes through Python) while `in_kernel` holds, else read and written here; returns
    whether the kernel may still be asked (a file system without it raises or copies
    nothing: then never again in this merge)."""
    while pos < stop:
        if in_kernel:
            try:
                n = os.copy_file_range(src, dst, stop - pos, pos)
            except OSError:
                n = 0
            if n > 0:
                pos += n
                continue
            in_kernel = False
        data = os.pread(src, min(_COPY_BLOCK, stop - pos), pos)
        _write_all(dst, data)
        pos += len(data)
    return in_kernel


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _parts(timeline) -> list[np.ndarray]:
    """The arrays whose concatenation is a replica's step timeline (`Replica.step_end`)
    without concatenating them (a day's timeline is ~300 MB); a callable: its result."""
    if callable(timeline):
        return [timeline()]
    return [*getattr(timeline, "_end_blocks", []), *timeline._end_chunks]


def _steps(timeline) -> int:
    return sum(len(a) for a in _parts(timeline))


def step_window(timeline, lo: int, hi: int) -> np.ndarray:
    """`timeline`'s steps [lo, hi) (a replica, or a callable returning the timeline)."""
    out, pos = [], 0
    for a in _parts(timeline):
        n = len(a)
        if pos + n > lo and pos < hi:
            out.append(a[max(lo - pos, 0):min(hi - pos, n)])
        pos += n
        if pos >= hi:
            break
    return np.concatenate(out) if out else np.empty(0)


def _gaps_into(timeline, out: np.ndarray) -> None:
    """`np.round(np.diff(timeline), 6)` written into `out`, part by part."""
    prev, pos = None, 0
    for a in _parts(timeline):
        if not len(a):
            continue
        if prev is not None:
            out[pos] = a[0] - prev
            pos += 1
        np.subtract(a[1:], a[:-1], out=out[pos:pos + len(a) - 1])
        pos += len(a) - 1
        prev = a[-1]
    np.round(out, 6, out=out)


class Count:
    """A `finished` that only counts (a fleet's replicas: the deployment's tickets carry
    the records)."""

    def __init__(self) -> None:
        self.n = 0

    def append(self, _) -> None:
        self.n += 1

    def __len__(self) -> int:
        return self.n


class StreamedRecords(Sequence):
    """The records of a streamed run, read back from its `requests.jsonl` on demand
    (iterating parses one line at a time; indexing reads them all once)."""

    def __init__(self, path: Path | None, n: int) -> None:
        self.path, self._n = path, n
        self._all: list[dict] | None = None

    def __len__(self) -> int:
        return self._n

    def lines(self) -> Iterator[str]:
        if self.path is None:
            from twin.errors import ConfigError

            raise ConfigError("the run's records were not kept (simulate without an output "
                              "file): only its summary")
        with open(self.path, encoding="utf-8") as fh:
            yield from fh

    def __iter__(self) -> Iterator[dict]:
        import json

        if self._all is not None:
            yield from self._all
            return
        for line in self.lines():
            yield json.loads(line)

    def __getitem__(self, i):
        if self._all is None:
            self._all = list(self)
        return self._all[i]
