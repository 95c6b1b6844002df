"""Replay a workload against a live SGLang server and record it in the twin's schema.

    result = replay(workload, ReplayConfig(url="http://127.0.0.1:30000"))
    result.write(Path("out/live"))          # requests.jsonl, summary.json, replay.json, ...
    result.check()                          # ReplayError: server died, client too late

The same `Request` objects the twin simulates go to SGLang's native `/generate` with
`stream: true`: `input_ids` from the request's segments (`runtime.token_ids`),
`max_new_tokens` = the output length with `ignore_eos` (a request with `ignore_eos`
False: `ignore_eos` false and `min_new_tokens` = its length), temperature 0, the request's
`rid`, and its `priority` when the server has priority scheduling on. Open loop, each
request is sent at its arrival time; closed loop (`workload.concurrency`), N clients each
send their next request when their last one ends (not before its arrival time).

The load generator measures itself: lateness is the actual send time minus the scheduled
one (arrival time, or in closed loop the later of arrival and the moment the client
freed). `check()` fails when its P99 exceeds `max_lateness_s`, so a slow client is never
mistaken for a slow server.

Failures are records, not crashes: HTTP errors, in-stream errors, answers that are not
SGLang's (bad JSON, wrong fields), timeouts and lost connections give status `failed`
(`rejected` for a request the server refuses as too long), with the error. The whole
server is watched too, so a dead one does not cost a timeout per request: a connection
error makes the replayer ask `/health`, and `stall_s` without data on any stream makes it
ask `/health_generate` (SGLang's own end-to-end check); a server that fails the check
ends the replay: the requests in flight fail with that reason, nothing more is sent.
Ctrl-C stops it too; in-flight requests become `aborted`. Every request of the workload
is in the records exactly once: those never sent (the replay stopped) are `aborted`,
and `replay.json` counts them (`not_sent`).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from runtime.recording import StreamLog
from runtime.server_api import (
    ReplayError,
    ServerFacts,
    flush_cache,
    fresh_rid_suffix,
    probe,
    server_rid,
    snapshot,
)
from runtime.token_ids import SegmentTokens
from twin.metrics import summarize, write_records
from twin.outputs import atomic_write_text
from twin.workload import Request, Workload


class HttpStatusError(Exception):
    """`/generate` answered with a status other than 200."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status, self.text = status, text


async def stream_generate(session: aiohttp.ClientSession, url: str, **post: object):
    """POST a streaming `/generate` request and yield `(arrival time, chunk)` for every
    `data:` line until `[DONE]` (time from `time.perf_counter()`, taken as the line
    arrives). Raises `HttpStatusError` for a non-200 answer; a chunk may carry `error`.
    Use under `contextlib.aclosing` so a caller that stops early closes the response."""
    async with session.post(url + "/generate", **post) as resp:
        if resp.status != 200:
            raise HttpStatusError(resp.status, (await resp.text())[:500])
        async for line in resp.content:
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield now, json.loads(payload)


INTERRUPTED = "interrupted (Ctrl-C)"
START_LEAD_S = 0.2  # between building the schedule and the first scheduled send
READ_BUFFER = 1 << 22  # streamed lines carry the cumulative output ids: allow long ones


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    seed: int = 0
    max_lateness_s: float = 0.050  # bound on the P99 of the client's own lateness
    request_timeout_s: float = 600.0  # longest silence (or time without a new token) per stream
    connect_timeout_s: float = 10.0
    # whole-server liveness: after this long with requests in flight and no data on any
    # stream, ask /health_generate (None: the request timeout, at most 60 s)
    stall_s: float | None = None
    health_timeout_s: float = 30.0  # SGLang's /health_generate gives up after 20 s

    @property
    def stall_after_s(self) -> float:
        return self.stall_s if self.stall_s is not None else min(self.request_timeout_s, 60.0)
    vocab_size: int | None = None  # None: from the server's model config.json
    flush_cache: bool = True  # start with an empty radix cache, as the twin does


@dataclass
class ReplayResult:
    records: list[dict]
    meta: dict
    snapshots: dict[str, dict[str, str]]
    stop_reason: str | None = None
    # behind an sglang-router: each worker's /metrics, {"before"|"after": {url: text}}
    worker_metrics: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def workers(self) -> list[dict]:
        """Per-worker split of the run (runtime.worker_split), [] for a single server."""
        from runtime.worker_split import worker_split

        if not self.worker_metrics:
            return []
        return worker_split(self.worker_metrics["before"], self.worker_metrics["after"])

    @property
    def lateness(self) -> dict:
        return self.meta["lateness_ms"]

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_records(out / "requests.jsonl", self.records)
        summary = summarize(self.records)
        summary["engine"] = {"live": self.meta["url"], "version": self.meta.get("version")}
        if self.stop_reason:  # a replay that stopped early: say so where the numbers are
            summary["partial"] = {"stop_reason": self.stop_reason, "sent": self.meta["sent"],
                                  "not_sent": self.meta["not_sent"]}
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        atomic_write_text(out / "replay.json", json.dumps(self.meta, indent=2) + "\n")
        for when, snap in self.snapshots.items():
            atomic_write_text(out / f"server_info_{when}.json", snap["server_info"])
            atomic_write_text(out / f"metrics_{when}.prom", snap["metrics"])
        for when, texts in self.worker_metrics.items():
            for i, text in enumerate(texts.values()):
                atomic_write_text(out / f"metrics_{when}_worker{i}.prom", text)
        if self.worker_metrics:
            atomic_write_text(out / "workers.json", json.dumps(self.workers, indent=2) + "\n")

    def check(self) -> None:
        """Raise `ReplayError` when the replay stopped early or the client was too late."""
        if self.stop_reason:
            m = self.meta
            raise ReplayError(f"{self.stop_reason}; {m['sent']} of {m['requests']} requests "
                              f"were sent; all {len(self.records)} records are written (the "
                              f"{m['not_sent']} never sent as aborted)")
        late, bound = self.lateness, self.meta["max_lateness_ms"]
        if late["p99"] is not None and late["p99"] > bound:
            raise ReplayError(
                f"the load generator itself was late: P99 lateness {late['p99']:.1f} ms > "
                f"bound {bound:g} ms (P50 {late['p50']:.1f}, max {late['max']:.1f} ms); the "
                "latencies measured are not the server's alone. Use a less loaded machine, "
                "or raise --max-lateness-ms knowingly")


def replay(workload: Workload, cfg: ReplayConfig, progress=None,
           facts: ServerFacts | None = None) -> ReplayResult:
    """Run the replay (blocking). `progress(run)` is called about once a second."""
    facts = facts or probe(cfg.url, cfg.vocab_size)
    flush_error = flush_cache(cfg.url) if cfg.flush_cache else "not asked (--no-flush-cache)"
    before = snapshot(cfg.url)
    workers = {"before": worker_metrics(facts.workers)} if facts.workers else {}
    run = _Run(workload, cfg, facts, progress)
    try:
        asyncio.run(run.main())
    except KeyboardInterrupt:
        run.stop(INTERRUPTED)
    try:
        after = snapshot(cfg.url, 5.0 if run.dead else 10.0)
        if facts.workers:
            workers["after"] = worker_metrics(facts.workers)
    except KeyboardInterrupt:  # a Ctrl-C after the requests: keep the records
        run.stop(INTERRUPTED)
        after = {"server_info": json.dumps({"unavailable": INTERRUPTED}) + "\n",
                 "metrics": f"# unavailable: {INTERRUPTED}\n"}
        workers.pop("before", None)
    meta = run.meta() | {"cache_flushed": flush_error is None, "flush_error": flush_error,
                         "router_workers": list(facts.workers)}
    return ReplayResult(run.records(), meta, {"before": before, "after": after},
                        run.stop_reason, workers)


def worker_metrics(urls) -> dict[str, str]:
    """Each worker's `/metrics` text (a `# unavailable` note for one that does not answer)."""
    return {url: snapshot(url)["metrics"] for url in urls}


def build_body(req: Request, tokens: SegmentTokens, priority: bool,
               rid_suffix: str = "") -> bytes:
    body = {
        "rid": server_rid(req.rid, rid_suffix),
        "input_ids": tokens.prompt(req.segments),
        "sampling_params": {"max_new_tokens": req.output_tokens, "ignore_eos": True,
                            "temperature": 0.0},
        "stream": True,
    }
    if req.ignore_eos is False:  # may stop at EOS: SGLang admits it by new_token_ratio;
        # min_new_tokens holds it to the workload's length (admission never reads it)
        body["sampling_params"] = {"max_new_tokens": req.output_tokens, "ignore_eos": False,
                                   "min_new_tokens": req.output_tokens, "temperature": 0.0}
    if priority:
        body["priority"] = req.priority
    return json.dumps(body, separators=(",", ":")).encode()


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    arr = np.asarray(values) * 1e3
    return {"p50": round(float(np.percentile(arr, 50)), 3),
            "p99": round(float(np.percentile(arr, 99)), 3),
            "max": round(float(arr.max()), 3), "n": int(arr.size)}


@dataclass
class _Run:
    """One replay in progress: the event-loop side."""

    workload: Workload
    cfg: ReplayConfig
    facts: ServerFacts
    progress: object = None
    logs: list[StreamLog] = field(default_factory=list)
    lateness_s: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    t0: float = 0.0
    started_wall: str = ""
    duration_s: float = 0.0
    dead: str | None = None  # why the server counts as gone (in-flight requests fail so)
    _probing: asyncio.Lock | None = None
    _stopped: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self.tokens = SegmentTokens(self.facts.vocab_size, self.cfg.seed)
        self.rid_suffix = fresh_rid_suffix()  # the server sees RID.SUFFIX (server_api)
        self.in_flight = 0
        self.flying: dict[asyncio.Task, StreamLog] = {}  # requests in flight, by task
        self.expired: set[asyncio.Task] = set()  # cancelled by _expire (already failed)
        self.last_data = 0.0  # client clock: the last chunk from any stream

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        if self._stopped is not None:
            self._stopped.set()

    def server_gone(self, reason: str) -> None:
        """The server failed its health check: stop sending, fail what is in flight."""
        if self.dead is not None:
            return
        self.dead = reason
        self.stop(reason)
        me = asyncio.current_task()
        for task in list(self.flying):
            if task is not me:
                task.cancel()

    async def main(self) -> None:
        self._probing = asyncio.Lock()
        self._stopped = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                        sock_read=self.cfg.request_timeout_s)
        # limit=0: no connection-pool queueing hidden between "sent" and the server.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         read_bufsize=READ_BUFFER) as session:
            self.session = session
            self.started_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.t0 = time.perf_counter() + START_LEAD_S
            helpers = [asyncio.create_task(self._tick()), asyncio.create_task(self._watch())]
            try:
                if self.workload.concurrency:
                    await self._closed_loop(self.workload.concurrency)
                else:
                    await self._open_loop()
            finally:
                for task in helpers:
                    task.cancel()
                self.duration_s = time.perf_counter() - self.t0

    async def _open_loop(self) -> None:
        tasks = []
        try:
            for req in self.workload.requests:
                body = build_body(req, self.tokens, self.facts.priority_scheduling,
                                  self.rid_suffix)
                scheduled = self.t0 + req.arrival_s
                await self._sleep_until(scheduled)
                if self.stop_reason:
                    break
                tasks.append(asyncio.create_task(self._send(req, body, scheduled)))
                await asyncio.sleep(0)  # let it start sending before the next body is built
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _closed_loop(self, clients: int) -> None:
        queue = iter(self.workload.requests)

        async def client() -> None:
            free_at = self.t0
            for req in queue:  # a shared iterator: each request goes to one client
                if self.stop_reason:
                    return
                scheduled = max(self.t0 + req.arrival_s, free_at)
                body = build_body(req, self.tokens, self.facts.priority_scheduling,
                                  self.rid_suffix)
                await self._sleep_until(scheduled)
                if self.stop_reason:
                    return
                await self._send(req, body, scheduled)
                free_at = time.perf_counter()

        workers = [asyncio.create_task(client()) for _ in range(clients)]
        try:
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _sleep_until(self, deadline: float) -> None:
        """Sleep until `deadline` (client clock), or until the replay is stopped."""
        delay = deadline - time.perf_counter()
        if delay <= 0:
            return
        assert self._stopped is not None
        try:
            await asyncio.wait_for(self._stopped.wait(), delay)
        except TimeoutError:
            pass

    async def _send(self, req: Request, body: bytes, scheduled: float) -> None:
        sent = time.perf_counter()
        self.lateness_s.append(max(sent - scheduled, 0.0))
        log = StreamLog(req, sent - self.t0, sent)
        self.logs.append(log)
        if not self.in_flight:
            self.last_data = sent  # the stall clock starts with the first request in flight
        self.in_flight += 1
        task = asyncio.current_task()
        assert task is not None
        self.flying[task] = log
        try:
            await self._attempt(log, body)
        except asyncio.CancelledError:
            if task in self.expired:  # _expire failed it: no new token for too long
                task.uncancel()
                return
            if self.dead is None:  # Ctrl-C: the client gave up, not the server
                log.fail("aborted", "the replay was interrupted while the request was in "
                         "flight")
                raise
            log.fail("failed", self.dead)  # server_gone cancelled it; carry on (and stop)
            task.uncancel()
        finally:
            self.flying.pop(task, None)
            self.expired.discard(task)
            self.in_flight -= 1

    async def _attempt(self, log: StreamLog, body: bytes) -> None:
        """One request's stream; every way it can go wrong becomes the log's failure."""
        try:
            await self._stream(log, body)
        except TimeoutError:
            log.fail("failed", f"no data for {self.cfg.request_timeout_s:g} s "
                     "(--request-timeout) or no connection in "
                     f"{self.cfg.connect_timeout_s:g} s")
        except aiohttp.ClientError as exc:
            log.fail("failed", f"connection error: {type(exc).__name__}: {exc}")
            await self._check_server()
        except ValueError as exc:  # a chunk that is not JSON, or not SGLang's
            log.fail("failed", f"unreadable stream from the server: {exc}")
        except Exception as exc:  # noqa: BLE001 - whatever else: a record, never a crash
            log.fail("failed", f"unexpected error on this request: {type(exc).__name__}: "
                     f"{exc}")

    async def _stream(self, log: StreamLog, body: bytes) -> None:
        # X-Request-Id: an sglang-router in front logs each attempt under this id, so its
        # retries can be matched to requests (experiments/fleet_live.router_attempts)
        headers = {"Content-Type": "application/json", "X-Request-Id": log.request.rid}
        try:
            async with aclosing(stream_generate(self.session, self.cfg.url, data=body,
                                                headers=headers)) as chunks:
                async for now, chunk in chunks:
                    if not isinstance(chunk, dict):
                        raise ValueError(f"a chunk that is not a JSON object: {chunk!r:.60}")
                    if "error" in chunk:
                        log.fail(*_stream_error(chunk["error"]))
                        break
                    log.on_chunk(now, chunk.get("meta_info") or {})
                    self.last_data = now
        except HttpStatusError as exc:
            log.fail("rejected" if exc.status == 400 and "context length" in exc.text
                     else "failed", str(exc))

    async def _check_server(self) -> None:
        """After a connection error: is the server still there? If not, stop sending."""
        assert self._probing is not None
        async with self._probing:
            if self.stop_reason:
                return
            why = await self._health("/health", 5.0)
            if why:
                self.server_gone(f"the SGLang server at {self.cfg.url} stopped answering "
                                 f"mid-run (GET /health: {why})")

    async def _health(self, path: str, timeout_s: float) -> str | None:
        """None when `path` answers 200 (or 404: a server without it), else why not."""
        try:
            async with self.session.get(self.cfg.url + path,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                if resp.status in (200, 404):
                    return None
                return f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer in {timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def _watch(self) -> None:
        """Whole-server liveness: requests in flight and nothing from any stream for
        `stall_s` -> SGLang's `/health_generate` (a one-token generation, or any recent
        output); a server that fails it is gone. A server that passes gets another
        `stall_s` before the next question; per-request timeouts still apply."""
        stall = self.cfg.stall_after_s
        while True:
            await asyncio.sleep(min(1.0, stall / 4))
            self._expire()
            quiet = time.perf_counter() - self.last_data
            if not self.in_flight or quiet < stall or self.stop_reason:
                continue
            why = await self._health("/health_generate", self.cfg.health_timeout_s)
            if why is None:
                self.last_data = time.perf_counter()
                continue
            self.server_gone(f"the SGLang server at {self.cfg.url} stopped answering mid-run "
                             f"(no data on any of the {self.in_flight} streams in flight for "
                             f"{quiet:.0f} s, and GET /health_generate: {why})")
            return

    def _expire(self) -> None:
        """Fail the requests without a new token for the request timeout even though bytes
        keep coming (chunks without progress, a line dribbled out byte by byte), which the
        socket's read timeout does not catch."""
        now, limit = time.perf_counter(), self.cfg.request_timeout_s
        for task, log in list(self.flying.items()):
            since = log.token_times[-1] if log.token_times else log.sent_at
            if now - since > limit and task not in self.expired:
                log.fail("failed", f"no new token for {now - since:.0f} s (--request-timeout)")
                self.expired.add(task)
                task.cancel()

    async def _tick(self) -> None:
        while self.progress is not None:
            await asyncio.sleep(1.0)
            self.progress(self)

    # -- results -------------------------------------------------------------------
    def records(self) -> list[dict]:
        """One per request of the workload: those sent, then those never sent (aborted,
        at their scheduled arrival)."""
        recs = [log.record() for log in self.logs]
        sent = {id(log.request) for log in self.logs}
        for req in self.workload.requests:
            if id(req) not in sent:
                log = StreamLog(req, req.arrival_s, 0.0)
                log.fail("aborted", f"not sent: {self.stop_reason or 'the replay stopped'}")
                recs.append(log.record())
        return sorted(recs, key=lambda r: (r["arrival_s"], r["rid"]))

    def done_counts(self) -> dict[str, int]:
        """Finished requests so far, by status (for progress lines)."""
        out: dict[str, int] = {}
        for log in self.logs:
            if log.done:
                status = log.outcome()[0]
                out[status] = out.get(status, 0) + 1
        return out

    def meta(self) -> dict:
        f = self.facts
        return {
            "url": self.cfg.url,
            "version": f.version,
            "model_path": f.info.get("model_path"),
            "workload": self.workload.name,
            "workload_description": self.workload.description,
            "closed_loop_clients": self.workload.concurrency,
            "requests": len(self.workload.requests),
            "sent": len(self.logs),
            "not_sent": len(self.workload.requests) - len(self.logs),
            "stop_reason": self.stop_reason,
            "started_utc": self.started_wall,
            "duration_s": round(self.duration_s, 3),
            "seed": self.cfg.seed,
            "server_rid_suffix": self.rid_suffix,  # the server saw RID.SUFFIX
            "vocab_size": f.vocab_size,
            "vocab_source": f.vocab_source,
            "token_id_range": [self.tokens.low, self.tokens.high],
            "priority_sent": f.priority_scheduling,
            "max_lateness_ms": self.cfg.max_lateness_s * 1e3,
            "lateness_ms": percentiles_ms(self.lateness_s),
        }


def _stream_error(err: object) -> tuple[str, str]:
    if isinstance(err, dict):
        message = str(err.get("message", err))
        code = err.get("code")
        status = "rejected" if code == 400 and "context length" in message else "failed"
        return status, f"server error {code}: {message}"
    return "failed", f"server error: {err}"


