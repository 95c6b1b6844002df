"""Where requests come from: open-loop arrival times, or closed-loop clients.

The replica pulls from a `Source` at every step boundary, so an arrival is seen at the
first scheduling pass at or after its time, as SGLang's scheduler sees requests that came
in while a forward step ran.
"""

from __future__ import annotations

import heapq
from collections import deque

from twin.request_path import OFF, RequestPath, Tokenizer
from twin.workload import BENCH_WARMUP_GAP_S, BENCH_WARMUP_OUTPUT, WARMUP_RID, Request, Workload


class Source:
    """Releases the workload's requests in order. Closed loop (`concurrency` set): at most
    that many in flight; a request is sent at the later of its arrival time and the moment
    a slot frees (`bench_serving --max-concurrency`).

    With a `RequestPath` (twin/request_path.py) a request reaches the server through the
    tokenizer manager's queue, and a closed-loop client sends its next request when the
    last one's final chunk arrives (`egress_s` after it left the server); the times here
    are then arrivals at the scheduler, and `pop_ready` hands out the client's send time
    (the record's `arrival_s`, from which TTFT counts)."""

    def __init__(self, workload: Workload, path: RequestPath = OFF) -> None:
        self._pending = deque(workload.requests)
        self._limit = workload.concurrency
        # bench_serving's warm-up (workload.clients == "bench"): sent first; the measured
        # requests wait for it to end, then BENCH_WARMUP_GAP_S, and are sent from then on
        self._warm: deque[Request] = deque()
        self._warm_left = 0
        self._offset = 0.0  # added to every measured request's arrival time
        if workload.clients == "bench" and workload.requests:
            first = workload.requests[0]
            self._warm.append(Request(f"{WARMUP_RID}0", 0.0, first.segments,
                                      min(first.output_tokens, BENCH_WARMUP_OUTPUT),
                                      first.priority, first.prompt_tokens))
            self._warm_left = len(self._warm)
        self._in_flight = 0
        self._ready: list[tuple[float, int, Request]] = []  # (arrival, seq, request)
        self._sent: dict[int, float] = {}  # seq -> client send time (with a path only)
        self._path = path
        self._tokenizer = None if path.off else Tokenizer(path)
        self._seq = 0
        self._fill(0.0)

    def _fill(self, now: float) -> None:
        if self._limit is None and not self._warm and not self._warm_left:
            self._fill_open(now)
            return
        while self._limit is None or self._in_flight < self._limit:
            if self._warm:
                req = self._warm.popleft()
                sent = max(req.arrival_s, now)
            elif self._warm_left or not self._pending:
                break
            else:
                req = self._pending.popleft()
                sent = max(req.arrival_s + self._offset, now)
            self._in_flight += 1
            at = sent
            if self._tokenizer is not None:
                at = self._tokenizer.arrival(sent, req.prompt_tokens)
                self._sent[self._seq] = sent
            heapq.heappush(self._ready, (at, self._seq, req))
            self._seq += 1

    def _fill_open(self, now: float) -> None:
        """`_fill` of an open loop without warm-ups (every pending request released at
        once): the same sends, arrivals and heap, one loop without the checks a closed
        loop needs (a day's requests pass through here)."""
        pending, ready, offset, seq = self._pending, self._ready, self._offset, self._seq
        if not pending:
            return
        sent = []
        for req in pending:
            t = req.arrival_s + offset  # (max(arrival + offset, now), as `_fill`)
            sent.append(now if t < now else t)
        seqs = range(seq, seq + len(pending))
        if self._tokenizer is None:
            times = sent
        else:
            times = self._tokenizer.arrivals(sent, [r.prompt_tokens for r in pending])
            self._sent.update(zip(seqs, sent, strict=True))
        # one heapify instead of a push each: (time, seq) keys are distinct, so the heap
        # hands them out in the same order
        ready += zip(times, seqs, pending, strict=True)
        heapq.heapify(ready)
        self._in_flight += len(pending)
        self._seq = seqs.stop
        pending.clear()

    def next_time(self) -> float | None:
        """Send time of the next request, or None when nothing more will be sent until a
        request finishes (closed loop) or ever (open loop, exhausted)."""
        return self._ready[0][0] if self._ready else None

    def scheduled(self) -> list[tuple[float, int, Request]]:
        """The requests released and not yet sent, (send time, seq, request), unordered
        (read-only: a fleet looks for the next one bound for a pool)."""
        return self._ready

    @property
    def open_loop(self) -> bool:
        return self._limit is None

    def pop_ready(self, now: float) -> list[tuple[float, Request]]:
        out = []
        while self._ready and self._ready[0][0] <= now:
            t, seq, req = heapq.heappop(self._ready)
            out.append((self._sent.pop(seq, t), req))
        return out

    def finished(self, now: float) -> None:
        """A request left the system: a closed-loop client sends its next one (when the
        final chunk reached it)."""
        self._in_flight -= 1
        back = now + self._path.egress_s
        if self._warm_left:  # only warm-ups are in flight until the last one is back
            self._warm_left -= 1
            if not self._warm_left:
                self._offset = back + BENCH_WARMUP_GAP_S
        self._fill(back)

    def release_rest(self, now: float) -> None:
        """The end of a run: every request not yet released is, whatever the clients'
        slots (a request still in flight when the run ended holds its slot for good: a
        drain waiting for it to leave would never end). Each is sent at the later of its
        arrival and `now` plus the final chunk's way back, as `finished` would send it."""
        self._warm_left = 0  # a warm-up that never came back holds back nobody now
        limit, self._limit = self._limit, None
        try:
            self._fill(now + self._path.egress_s)
        finally:
            self._limit = limit

    @property
    def exhausted(self) -> bool:
        return not self._pending and not self._ready
