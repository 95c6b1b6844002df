"""A fleet's records streamed to disk (`simulate --deployment ... --out`).

`TicketSink` is a deployment's `done_tickets` (twin/cluster.py appends each request's
final ticket once): as `RecordSink` (twin/record_sink.py), every `chunk` tickets have
their records formatted (per replica, over the window of that replica's step timeline,
tagged with replica, pool and attempts as `Deployment.records` tags them), spilled and
reduced to columns. `finish()` merges them in the fleet's order (rounded arrival, then
the ticket's sequence number) and gives `FleetRecords`, which `Deployment.summary` asks
for the fleet's, each pool's and each replica's summary from the columns. Without a path
(a run kept in memory) the records are built as dicts from the same tables instead of
lines, and `finish()` gives them as `FleetList`, summarised from the same columns.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path

import numpy as np

from twin.metrics import SLO
from twin.record_sink import CHUNK, RecordSink, StreamedRecords

# errors of requests a Ctrl-C'd fleet run gives up (twin/fleet.py rewrites them)
UNFINISHED = ("not sent before the horizon", "simulation ended")


class TicketSink(RecordSink):
    def __init__(self, dep, path: Path | None, chunk: int = CHUNK) -> None:
        super().__init__(lambda: np.empty(0), path, chunk)
        self.workers = dep.workers
        self.timelines = [w.replica for w in dep.workers]  # read by `step_window`
        self.interrupted: str | None = None  # set before `finish`: the rewritten errors
        self.kept: list[dict] = []  # without a path: the records, in row order

    def append(self, ticket) -> None:
        self._n += 1
        self._buf.append(ticket)
        if len(self._buf) >= self.chunk:
            self.flush()

    def flush(self, group: int = 0) -> None:
        buf, self._buf = self._buf, []
        by_worker: dict[int, list] = {}
        for t in buf:
            by_worker.setdefault(-1 if t.worker is None else t.worker, []).append(t)
        for w in sorted(by_worker):
            tickets = sorted(by_worker[w], key=lambda t: (t.final.arrival_s, t.final.index,
                                                          t.seq))
            reqs = [t.final for t in tickets]
            table = self._table(reqs, w)
            self._keep_columns(table, reqs, np.array([t.seq for t in tickets],
                                                     dtype=np.int64), group, w)
            self._cols.setdefault("attempts", []).append(
                np.array([t.attempts for t in tickets], dtype=np.int64))
            self._cols.setdefault("unfinished", []).append(np.array(
                [r.status == "aborted" and (r.error or "").startswith(UNFINISHED)
                 for r in reqs], dtype=bool))
            if self.path is not None:
                self._spill_lines(table, self._tails(w, tickets))
            else:
                self._keep_records(w, tickets, table)
            self._rows += len(reqs)

    def _keep_records(self, w: int, tickets: list, table) -> None:
        """The records as dicts, tagged as `Deployment.records` tags them."""
        worker = self.workers[w] if w >= 0 else None
        name, pool = (worker.name, worker.pool) if worker is not None else (None, None)
        for t, rec in zip(tickets, table, strict=True):
            rec["replica"] = name
            rec["pool"] = pool
            rec["attempts"] = t.attempts
            self.kept.append(rec)

    def _tails(self, w: int, tickets: list) -> list[bytes]:
        """Each record's fleet fields: the replica and pool it ran on, its attempts."""
        name, pool = ("null", "null") if w < 0 else (
            _json_str(self.workers[w].name), _json_str(self.workers[w].pool))
        head = f',"replica":{name},"pool":{pool},"attempts":'
        return [f"{head}{t.attempts}".encode() for t in tickets]

    def finish(self, slo: SLO | None = None) -> FleetRecords | FleetList:
        """The records (merged into `path`; without one, in memory), for
        `Deployment.summary` to summarise."""
        self.flush()
        c = self._columns() if self._cols else {}
        if not c:  # no request at all
            if self.path is None:
                return FleetList([], FleetRecords(None, 0, self, None, {}))
            from twin.outputs import atomic_write_text

            atomic_write_text(self.path, "")
            return FleetRecords(self.path, 0, self, None, {})
        perm = np.lexsort((c["seq"], c["arrival_s"]))
        if self.path is None:
            kept, self.kept = self.kept, []
            return FleetList([kept[i] for i in perm.tolist()],
                             FleetRecords(None, len(perm), self, perm, c))
        fix = None
        if self.interrupted:
            fix = c["unfinished"]
            why = f"{self.interrupted}, before it finished"

            def rewrite(line: bytes) -> bytes:
                rec = json.loads(line)
                rec["error"] = why
                return (json.dumps(rec, separators=(",", ":")) + "\n").encode()

            fix = (fix, rewrite)
        try:
            self._merge(perm, fix)
        finally:
            if self._spill is not None:
                self._spill.close()
                self._spill = None
        return FleetRecords(self.path, len(perm), self, perm, c)


class FleetRecords(StreamedRecords):
    """A streamed fleet run's records (read back from `requests.jsonl`) and, for
    `Deployment.summary`, the summaries of all of them or of one pool's or replica's."""

    def __init__(self, path: Path, n: int, sink: TicketSink, perm, cols: dict) -> None:
        super().__init__(path, n)
        self._sink, self._perm, self._c = sink, perm, cols

    def _rows(self, key: str | None, value) -> np.ndarray:
        if self._perm is None:
            return np.empty(0, dtype=np.int64)
        if key is None:
            return self._perm
        names = [w.name if key == "replica" else w.pool for w in self._sink.workers]
        match = np.array([n == value for n in names] + [value is None], dtype=bool)
        return self._perm[match[self._c["worker"][self._perm]]]

    def summary(self, slo: SLO | None = None, duration_s: float | None = None) -> dict:
        return self.part(None, None, slo)

    def part(self, key: str | None, value, slo: SLO | None = None) -> dict:
        """`summarize([r for r in records if r[key] == value], slo)` from the columns."""
        rows = self._rows(key, value)
        if not len(rows):
            from twin.metrics import summarize

            return summarize([], slo)
        return self._sink._summary(rows, self._c, slo)

    def all_in(self, key: str, value) -> bool:
        return len(self._rows(key, value)) == len(self)


class FleetList(list):
    """A fleet's records kept in memory: the dicts, in the fleet's order, and the summaries
    `Deployment.summary` asks for, from the columns (`FleetRecords`)."""

    def __init__(self, records: list[dict], columns: FleetRecords) -> None:
        super().__init__(records)
        self._columns = columns

    def summary(self, slo: SLO | None = None, duration_s: float | None = None) -> dict:
        return self._columns.summary(slo, duration_s)

    def part(self, key: str | None, value, slo: SLO | None = None) -> dict:
        return self._columns.part(key, value, slo)

    def all_in(self, key: str, value) -> bool:
        return self._columns.all_in(key, value)
