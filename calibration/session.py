"""Talking to a live SGLang server while profiling it: facts from `/server_info`, and
groups of streamed `/generate` calls whose every chunk time and `meta_info` are kept.

`runtime.client` replays whole workloads into records; profiling needs less and more: a
few requests sent together at exact offsets, and the full `meta_info` of the last chunk
(SGLang's own `queue_time`, `forward_entry_time`, `prefill_finished_time`), which records
do not keep. A `Trace` is one request's raw timeline (client clock, seconds).
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
from contextlib import aclosing
from dataclasses import dataclass, field

import aiohttp

from runtime.client import HttpStatusError, stream_generate
from runtime.recording import meta_problem
from runtime.server_api import ReplayError, flush_cache, fresh_rid_suffix, probe, server_rid
from twin.errors import ServetwinError

READ_BUFFER = 1 << 22


class CalibrationError(ServetwinError):
    """Calibration cannot go on: not an SGLang server, no samples, a mismatched profile."""


@dataclass
class Trace:
    """One request: when it was sent, when each output token arrived, its last meta_info.
    `prompt` and `cached` are the server's counts; `tag` says which profiling run."""

    rid: str
    sent: float
    prompt: int
    token_times: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    error: str | None = None
    tag: str = ""
    sent_wall: float = 0.0  # time.time() at sending: SGLang's stamps are wall-clock

    @property
    def cached(self) -> int:
        return int(self.meta.get("cached_tokens") or 0)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    def to_json(self) -> dict:
        return {"rid": self.rid, "sent": self.sent, "prompt": self.prompt,
                "token_times": self.token_times, "meta": _meta_subset(self.meta),
                "error": self.error, "tag": self.tag, "sent_wall": self.sent_wall}

    @classmethod
    def from_json(cls, d: dict) -> Trace:
        return cls(d["rid"], d["sent"], d["prompt"], list(d["token_times"]), d.get("meta") or {},
                   d.get("error"), d.get("tag", ""), d.get("sent_wall", 0.0))


META_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens", "queue_time",
             "forward_entry_time", "prefill_finished_time", "first_token_latency",
             "e2e_latency", "num_retractions", "finish_reason",
             "request_received_ts", "api_server_dispatch_finish_ts")  # the tokenizer's stamps


def _meta_subset(meta: dict) -> dict:
    return {k: meta[k] for k in META_KEYS if k in meta}


def server_facts(url: str):
    """`runtime.server_api.ServerFacts` for an SGLang server, or `CalibrationError` when the
    URL does not answer like one (no JSON `/server_info` with `version` and `model_path`)."""
    try:
        facts = probe(url)
    except ReplayError as exc:
        raise CalibrationError(str(exc)) from None
    info = facts.info
    if not info.get("version") or not info.get("model_path"):
        raise CalibrationError(f"{url} is not an SGLang server: its /server_info has no "
                               "'version' and 'model_path'")
    if not info.get("enable_metrics"):
        raise CalibrationError(f"the server at {url} runs without --enable-metrics: its "
                               "meta_info lacks queue_time and the forward timestamps that "
                               "prefill samples need; restart it with --enable-metrics")
    return facts


def flush(url: str) -> None:
    """Empty the radix cache; SGLang refuses while requests run, so retry briefly."""
    for _ in range(20):
        if flush_cache(url) is None:
            return
        time.sleep(0.25)
    raise CalibrationError(f"{url}/flush_cache kept failing; is another client using the "
                           "server? Profiling needs it to itself")


def health(url: str, timeout_s: float = 30.0) -> str | None:
    """None when the server passes SGLang's end-to-end check (`/health_generate`; a
    server without it: `/health`), else why not."""
    from runtime.server_api import _get, describe_url_error

    for path in ("/health_generate", "/health"):
        try:
            _get(url + path, timeout_s)
            return None
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                return f"GET {path}: HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return f"GET {path}: {describe_url_error(exc)}"
    return None


def run_group(url: str, requests: list[tuple[str, list[int], int, float]],
              timeout_s: float = 300.0, tag: str = "") -> list[Trace]:
    """Send `(rid, input_ids, max_new_tokens, offset_s)` requests, each at its offset from
    now, streaming; block until all end. Errors are kept in the traces, not raised."""
    return asyncio.run(_group(url, requests, timeout_s, tag))


async def _group(url: str, requests, timeout_s: float, tag: str) -> list[Trace]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=READ_BUFFER,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter() + 0.05
        traces = [Trace(rid, 0.0, len(ids), tag=tag) for rid, ids, _, _ in requests]
        suffix = fresh_rid_suffix()  # a resumed run's ids never meet an interrupted one's
        jobs = [_bounded(_one(session, url, tr, ids, n, t0 + off, suffix), tr,
                         timeout_s + off)
                for tr, (_, ids, n, off) in zip(traces, requests, strict=True)]
        await asyncio.gather(*jobs)
    return traces


async def _bounded(job, tr: Trace, timeout_s: float) -> None:
    """One request, ended after `timeout_s` in all (the socket's read timeout alone lets a
    server that dribbles bytes hold it forever)."""
    try:
        await asyncio.wait_for(job, timeout_s)
    except TimeoutError:
        tr.error = tr.error or f"not finished in {timeout_s:g} s"


async def _one(session: aiohttp.ClientSession, url: str, tr: Trace, ids: list[int],
               max_new: int, at: float, rid_suffix: str = "") -> None:
    body = {"rid": server_rid(tr.rid, rid_suffix), "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                "temperature": 0.0}}
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    tr.sent, tr.sent_wall = time.perf_counter(), time.time()
    try:
        async with aclosing(stream_generate(session, url, json=body)) as chunks:
            async for now, chunk in chunks:
                if not isinstance(chunk, dict):
                    raise ValueError(f"a chunk that is not a JSON object: {chunk!r:.60}")
                if "error" in chunk:
                    tr.error = f"server error: {chunk['error']}"
                    return
                meta = chunk.get("meta_info") or {}
                problem = meta_problem(meta, len(tr.token_times), max_new)
                if problem:
                    raise ValueError(problem)
                tr.meta = meta
                new = (meta.get("completion_tokens") or 0) - len(tr.token_times)
                tr.token_times.extend([now] * max(new, 0))
    except HttpStatusError as exc:
        tr.error = str(exc)[:320]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        tr.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a trace with its error, never a crash
        tr.error = f"unexpected: {type(exc).__name__}: {exc}"
