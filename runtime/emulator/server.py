"""SGLang 0.5.23's HTTP interface in front of the wall-clock twin (runtime/emulator/engine.py).

Routes: `/generate` (POST/PUT; streaming and not), `/v1/completions` and
`/v1/chat/completions` (streaming and not), `/v1/models`, `/health`, `/health_generate`, `/server_info` and `/get_server_info`,
`/model_info` and `/get_model_info`, `/flush_cache` (GET/POST), `/metrics`. Responses carry
SGLang's fields; the text is filler (runtime/emulator/protocol.py). Anything a handler
did not expect becomes a 500 with SGLang's error shape; nothing a client sends stops the
server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import sys
import threading
import time

from aiohttp import web

from runtime.emulator.engine import Engine, Ticket
from runtime.emulator.metrics import EmulatorMetrics
from runtime.emulator.protocol import (
    Generate,
    HttpError,
    filler_ids,
    filler_text,
    parse_chat,
    parse_completions,
    parse_generate,
    parse_json,
    stream_error_event,
)
from twin.config import derive_capacity
from twin.sim import SimConfig

SGLANG_VERSION = "0.5.23"
MAX_BODY = 256 * 2**20  # a 1M-token prompt as JSON ids fits
HEALTH_RID = "HEALTH_CHECK"


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: object) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


class Emulator:
    """One emulated SGLang server (one twin replica)."""

    def __init__(self, cfg: SimConfig, speed: float = 1.0, *, weight_version: str = "default",
                 launch_command: str = "", host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg, self.speed = cfg, speed
        self.cap = derive_capacity(cfg.args, cfg.gpu)
        self.engine = Engine(cfg, speed, on_finish=self._finished)
        self.metrics = EmulatorMetrics(self.engine, cfg.args.model_path)
        self.weight_version, self.launch_command = weight_version, launch_command
        self.host, self.port = host, port
        self.vocab = self.cap.model.vocab
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.started = time.time()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.metrics_text)
        return app

    async def start(self) -> str:
        """Listen and start the clock; returns the URL (port 0: a free port)."""
        from prometheus_client import disable_created_metrics

        disable_created_metrics()  # SGLang's exposition has no `_created` series
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._task = asyncio.create_task(self.engine.run())
        return self.url

    async def stop(self) -> None:
        """Stop: open streams end with an error event, then the listener closes."""
        self.engine.close()
        self.engine._fail("the emulator is shutting down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- /generate and /v1/completions ---------------------------------------------------------
    def _rid(self, given: str | None) -> str:
        if given:
            return given
        return hashlib.blake2b(str(next(self._ids)).encode(), digest_size=16).hexdigest()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json(raw, request.headers.get("Content-Type", ""), "/generate")
            g = parse_generate(body, self.vocab, self.cap.context_len)
        except HttpError as exc:
            return await self._refuse(request, exc)
        if self.engine.failed:
            return _json({"error": {"message": self._failed_text()}}, 500)
        t = self.engine.submit(self._rid(g.rid), g.ids, g.max_new_tokens, g.stream,
                               g.priority)
        if g.stream:
            return await self._stream(request, t, lambda n, end: self._gen_chunk(t, n, end))
        await self._wait_done(t)
        if t.final.status != "ok":
            return _json({"error": {"message": t.final.error}}, 500)
        return _json(self._gen_chunk(t, self._n(t), True))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json(raw, request.headers.get("Content-Type", ""), "/v1/completions")
            g = parse_completions(body, self.vocab, self.cap.context_len)
        except HttpError as exc:
            return await self._refuse(request, exc)
        if self.engine.failed:
            return _json({"error": {"message": self._failed_text()}}, 500)
        t = self.engine.submit(self._rid(None), g.ids, g.max_new_tokens, g.stream)
        model = g.model or "default"
        if g.stream:
            done = {"n": 0}

            def chunk(n: int, end: bool) -> dict:
                text = filler_text(n)[len(filler_text(done["n"])):]
                done["n"] = n
                return self._cmpl(t, model, text, "length" if end else None, None)

            tail = (lambda: [self._cmpl_usage(t, g, model)]) if g.include_usage else None
            return await self._stream(request, t, chunk, tail)
        await self._wait_done(t)
        if t.final.status != "ok":
            return _json({"error": {"message": t.final.error}}, 500)
        n = self._n(t)
        out = self._cmpl(t, model, filler_text(n), "length", self._usage(t, n))
        out["metadata"] = {"weight_version": self.weight_version}
        return _json(out)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = parse_json(raw, request.headers.get("Content-Type", ""),
                              "/v1/chat/completions")
            g = parse_chat(body, self.vocab, self.cap.context_len)
        except HttpError as exc:
            return await self._refuse(request, exc)
        if self.engine.failed:
            return _json({"error": {"message": self._failed_text()}}, 500)
        t = self.engine.submit(self._rid(None), g.ids, g.max_new_tokens, g.stream)
        model = g.model or "default"
        if g.stream:
            def chunk(n: int, end: bool) -> dict:
                delta = {"content": filler_text(n)[len(filler_text(n - 1)):] if n else ""}
                if n <= 1:
                    delta = {"role": "assistant", **delta}
                return self._chat_obj(t, model, "chat.completion.chunk",
                                      {"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": "length" if end else None})

            def usage() -> list:
                out = self._chat_obj(t, model, "chat.completion.chunk", None)
                out["usage"] = self._usage(t, self._n(t))
                return [out]

            return await self._stream(request, t, chunk, usage if g.include_usage else None)
        await self._wait_done(t)
        if t.final.status != "ok":
            return _json({"error": {"message": t.final.error}}, 500)
        n = self._n(t)
        out = self._chat_obj(t, model, "chat.completion", {
            "index": 0, "message": {"role": "assistant", "content": filler_text(n)},
            "logprobs": None, "finish_reason": "length"})
        out["usage"] = self._usage(t, n)
        return _json(out)

    def _chat_obj(self, t: Ticket, model: str, kind: str, choice: dict | None) -> dict:
        return {"id": t.rid, "object": kind, "created": int(self.started), "model": model,
                "choices": [choice] if choice is not None else []}

    async def _refuse(self, request: web.Request, exc: HttpError) -> web.StreamResponse:
        if not exc.in_stream:
            return _json(exc.body, exc.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            await resp.write(_sse(stream_error_event(exc)) + b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

    def _n(self, t: Ticket) -> int:
        n = t.available
        return n if t.reported is None else min(n, t.reported)

    async def _wait_done(self, t: Ticket) -> None:
        try:
            while not t.done:
                t.changed.clear()
                await t.changed.wait()
        except asyncio.CancelledError:
            self.engine.abort(t)
            raise

    async def _stream(self, request: web.Request, t: Ticket, chunk,
                      tail=None) -> web.StreamResponse:
        """An event stream: one `data:` event per token, the last with the finish reason,
        then the events `tail()` gives, then `data: [DONE]`. A client that goes away aborts
        the request."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        sent, ended = 0, False
        try:
            await resp.prepare(request)
            while True:
                t.changed.clear()
                n = self._n(t)
                while sent < n:
                    sent += 1
                    ended = t.done and sent == n
                    await resp.write(_sse(chunk(sent, ended)))
                if t.done:
                    break
                await t.changed.wait()
            if t.final.status != "ok":
                await resp.write(_sse({"error": {"message": t.final.error,
                                                 "type": "internal_error", "code": 500,
                                                 "retryable": False}}))
            elif not ended:  # the last token went out before the request ended
                await resp.write(_sse(chunk(sent, True)))
            for extra in tail() if tail is not None else ():
                await resp.write(_sse(extra))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream
            self.engine.abort(t)
        except asyncio.CancelledError:
            self.engine.abort(t)
            raise
        return resp

    def _gen_chunk(self, t: Ticket, n: int, end: bool) -> dict:
        r = t.sim
        meta = {"id": t.rid, "finish_reason": {"type": "length", "length": n} if end else None,
                "prompt_tokens": t.req.prompt_tokens, "weight_version": self.weight_version,
                "num_retractions": r.retractions if r else 0,
                "queue_time": round(r.queued_s, 9) if r else 0.0, "reasoning_tokens": 0,
                "completion_tokens": n, "cached_tokens": r.cached_tokens if r else 0}
        if end and t.final is not None and t.final.finish_s is not None:
            first = t.token_s[0] if t.token_s else t.final.finish_s
            meta["e2e_latency"] = round(t.final.finish_s - t.sent_s, 9)
            meta["first_token_latency"] = round(first - t.sent_s, 9)
        return {"text": filler_text(n), "output_ids": filler_ids(n, self.vocab),
                "meta_info": meta}

    def _cmpl(self, t: Ticket, model: str, text: str, finish: str | None,
              usage: dict | None) -> dict:
        return {"id": t.rid, "object": "text_completion", "created": int(self.started),
                "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish, "matched_stop": None}],
                "usage": usage}

    def _usage(self, t: Ticket, n: int) -> dict:
        p = t.req.prompt_tokens
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                "prompt_tokens_details": None, "reasoning_tokens": 0,
                "completion_tokens_details": None}

    def _cmpl_usage(self, t: Ticket, g: Generate, model: str) -> dict:
        out = self._cmpl(t, model, "", None, None)
        out["choices"] = []
        n = self._n(t)
        p = t.req.prompt_tokens
        out["usage"] = {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                        "reasoning_tokens": 0}
        return out

    def _finished(self, t: Ticket) -> None:
        if not t.rid.startswith(HEALTH_RID):
            self.metrics.finished(t)

    def _failed_text(self) -> str:
        return f"the emulated server stopped: {self.engine.failed}"

    # ---- the rest of SGLang's routes -------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.failed else 200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's check: a one-token generate must come back (within 20 s)."""
        if self.engine.failed:
            return web.Response(status=503)
        t = self.engine.submit(f"{HEALTH_RID}_{next(self._ids)}", [0], 1, False)
        try:
            await asyncio.wait_for(self._wait_done(t), 20.0)
        except TimeoutError:
            self.engine.abort(t)
            return web.Response(status=503)
        return web.Response(status=200 if t.final.status == "ok" else 503)

    def info(self) -> dict:
        a, cap = self.cfg.args, self.cap
        rep = self.engine.rep
        state = {"last_gen_throughput": self.metrics.gauges()["gen_throughput"],
                 "num_running_reqs": len(rep.running), "num_waiting_reqs": len(rep.waiting),
                 "memory_usage": {"kv_cache_tokens": cap.max_total_num_tokens}}
        return {**dataclasses.asdict(a), "served_model_name": a.model_path,
                "tokenizer_path": a.model_path, "host": self.host, "port": self.port,
                "device": "cuda", "load_format": "dummy", "enable_metrics": True,
                "max_total_num_tokens": cap.max_total_num_tokens,
                "max_req_input_len": cap.max_req_input_len, "context_length": cap.context_len,
                "chunked_prefill_size": cap.chunked_prefill_size or -1,
                "max_running_requests": cap.max_running_requests,
                "max_prefill_tokens": cap.max_prefill_tokens, "page_size": cap.page_size,
                "weight_version": self.weight_version, "launch_command": self.launch_command,
                "internal_states": [state], "version": SGLANG_VERSION, "frontend": "python",
                "emulated": {"by": "servetwin emulate", "gpu": self.cfg.gpu,
                             "speed": self.speed, "step_time_backend": self.engine.backend,
                             "vocab_size": self.vocab, "failed": self.engine.failed,
                             "lateness_ms": self.engine.lateness_ms(),
                             "counts": dict(self.engine.counts)}}

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(self.info())

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.cfg.args.model_path
        return _json({"model_path": path, "served_model_name": path, "tokenizer_path": path,
                      "is_generation": True, "preferred_sampling_params": None,
                      "weight_version": self.weight_version, "load_format": "dummy",
                      "has_image_understanding": False, "has_audio_understanding": False,
                      "model_type": None, "architectures": None})

    async def models(self, request: web.Request) -> web.Response:
        path = self.cfg.args.model_path
        return _json({"object": "list", "data": [
            {"id": path, "object": "model", "created": int(self.started),
             "owned_by": "sglang", "root": path, "parent": None,
             "max_model_len": self.cap.context_len}]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Empty the radix cache; refused (400), as by SGLang, while requests are inside."""
        rep = self.engine.rep
        if rep.running or rep.waiting or rep.chunked is not None or self.engine.tickets:
            return web.Response(status=400, text="Flush cache failed.\n")
        if rep.tree is not None:
            rep.tree.evict(rep.tree.total_tokens)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will "
                            "not be performed.)\n")

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; "
                                     "charset=utf-8"})


@web.middleware
async def _errors(request: web.Request, handler):
    """FastAPI's 404/405 bodies; any unexpected failure a 500 that names it."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)
    except web.HTTPRequestEntityTooLarge as exc:
        return _json({"object": "error", "message": exc.text, "type": "Payload Too Large",
                      "param": None, "code": 413}, 413)
    except (web.HTTPException, asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:  # never let one request take the server down
        print(f"servetwin emulate: {request.method} {request.path}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return _json({"object": "error", "message": f"{type(exc).__name__}: {exc}",
                      "type": "Internal Server Error", "param": None, "code": 500}, 500)


class EmulatorThread:
    """An emulator on its own event loop in a background thread (tests, benchmarks):
    `with EmulatorThread(Emulator(cfg)) as em: em.url`."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Emulator:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.emulator.start(), self.loop).result(30)
        return self.emulator

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.emulator.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
