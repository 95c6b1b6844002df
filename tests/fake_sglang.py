"""A small fake SGLang server (aiohttp.web in a thread, real HTTP on loopback) for the
replay client's protocol details and failure paths, which a real server produces rarely
or cannot be made to produce.

`/server_info`, `/metrics`, `/flush_cache`, `/health`, `/health_generate` and a streaming
`/generate` whose behaviour is chosen per request by its rid prefix (see `_stream`), and
two whole-server faults: `die_after=K` (at the K-th `/generate` the server stops
listening and drops every connection, as a killed process does) and `stall_after=K`
(from the K-th on, nothing is answered any more, open streams included, while
connections are still accepted: a hung process).
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from runtime.cpu.serve import free_port

FOREVER = 3600.0


class FakeSglang:
    def __init__(self, priority: bool = False, token_delay: float = 0.002,
                 die_after: int | None = None, stall_after: int | None = None,
                 info: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.priority, self.token_delay = priority, token_delay
        self.die_after, self.stall_after = die_after, stall_after
        self.info_override = info or {}  # /server_info fields replaced (garbage, say)
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.dead = self.stalled = False
        self._transports: list = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()

    def __enter__(self) -> FakeSglang:
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _close(self) -> None:
        """End the handlers still waiting (a stalled server's), so none is left pending."""
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/server_info", self._info)
        app.router.add_get("/metrics", self._plain("sglang:fake 1\n"))
        app.router.add_get("/health", self._plain("ok"))
        app.router.add_get("/health_generate", self._plain("ok"))
        app.router.add_post("/flush_cache", self._plain("flushed"))
        app.router.add_post("/generate", self._generate)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._site = web.TCPSite(runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(self._site.start())
        self._ready.set()
        self._loop.run_forever()

    def _plain(self, text: str):
        async def handler(request):
            await self._hang_if_stalled()
            return web.Response(text=text)

        return handler

    async def _hang_if_stalled(self) -> None:
        if self.stalled:
            await asyncio.sleep(FOREVER)

    async def _info(self, request):
        return web.json_response({"version": "fake", "model_path": "/nonexistent",
                                  "enable_priority_scheduling": self.priority,
                                  "context_length": 1000, "max_req_input_len": 999,
                                  "enable_metrics": True, "max_total_num_tokens": 4096,
                                  "max_running_requests": 8, "chunked_prefill_size": 512}
                                 | self.info_override)

    async def _die(self) -> None:
        """Stop listening and drop every connection (a killed process's sockets)."""
        self.dead = True
        await self._site.stop()
        for transport in self._transports:
            transport.abort()

    async def _generate(self, request):
        await self._hang_if_stalled()
        if self.dead:
            request.transport.abort()
            return web.Response(status=500)
        body = await request.json()
        self.bodies.append(body)
        self._transports.append(request.transport)
        k = len(self.bodies)
        if self.die_after is not None and k >= self.die_after:
            await self._die()
            return web.Response(status=500)
        if self.stall_after is not None and k >= self.stall_after:
            self.stalled = True
            await self._hang_if_stalled()
        rid, n = body["rid"], body["sampling_params"]["max_new_tokens"]
        if rid.startswith("http500"):
            return web.Response(status=500, text="boom")
        if rid.startswith("html"):
            return web.Response(text="<html>not an SGLang server</html>",
                                content_type="text/html")
        if rid.startswith("hang"):
            await asyncio.sleep(FOREVER)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, rid, n, len(body["input_ids"]))
        finally:
            self.in_flight -= 1

    async def _stream(self, request, rid: str, n: int, prompt: int):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def meta(done: int, **over) -> dict:
            m = {"completion_tokens": done, "prompt_tokens": prompt, "cached_tokens": 0,
                 "queue_time": 0.001, "num_retractions": 0,
                 "finish_reason": {"type": "length"} if done >= n else None}
            return m | over

        garbage = {  # rid prefix -> the first chunk it sends instead of SGLang's
            "badjson": b"data: {not json\n\n",
            "list": b"data: [1, 2, 3]\n\n",
            "strcount": f"data: {json.dumps({'meta_info': meta(1, completion_tokens='x')})}\n\n"
            .encode(),
            "negative": f"data: {json.dumps({'meta_info': meta(-1)})}\n\n".encode(),
            "toomany": f"data: {json.dumps({'meta_info': meta(n + 5)})}\n\n".encode(),
            "nanqueue": f"data: {json.dumps({'meta_info': meta(1, queue_time=float('nan'))})}"
            "\n\n".encode(),
            "metalist": b'data: {"meta_info": [1]}\n\n',
            "binary": b"data: \xff\xfe\x00garbage\n\n",
        }
        kind = next((k for k in garbage if rid.startswith(k)), None)
        if kind is not None:
            await resp.write(garbage[kind])
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if rid.startswith("toolong"):
            await send({"error": {"message": "The input is longer than the model's context "
                                  "length (1000 tokens).", "code": 400}})
        elif rid.startswith("drip"):  # one line, a byte at a time, never finished
            while True:
                await asyncio.sleep(0.05)
                await resp.write(b"d")
        elif rid.startswith("junk"):  # chunks forever, never a new token
            while True:
                await asyncio.sleep(0.02)
                await send({"meta_info": meta(0)})
        else:
            step = 2 if rid.startswith("pairs") else 1
            for done in range(step, n + step, step):
                await asyncio.sleep(3.0 if rid.startswith("stall") else self.token_delay)
                await self._hang_if_stalled()
                if rid.startswith("down") and done == 3:
                    await send({"meta_info": meta(1)})
                    continue
                if rid.startswith("cut") and done > n // 2:
                    request.transport.abort()  # the connection drops mid-stream
                    return resp
                await send({"meta_info": meta(min(done, n))})
        await resp.write(b"data: [DONE]\n\n")
        return resp
