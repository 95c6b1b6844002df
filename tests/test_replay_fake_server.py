"""The replay client against a small fake SGLang (aiohttp.web in a thread): the protocol
details and failure paths that a real server produces only rarely."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from runtime.client import ReplayConfig, replay
from runtime.cpu.serve import free_port
from runtime.token_ids import SegmentTokens
from twin.workload import Request, Workload

pytestmark = pytest.mark.offline
# Tests of behaviour, not of speed: the machine may be busy (a live server, other jobs).
LOOSE = 60.0  # these tests check records, not how loaded the machine is


class FakeSglang:
    """`/server_info`, `/metrics`, `/flush_cache`, `/health` and a streaming `/generate`
    whose behaviour is chosen per request by its rid prefix."""

    def __init__(self, priority: bool = False, token_delay: float = 0.002) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.priority, self.token_delay = priority, token_delay
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()

    def __enter__(self) -> FakeSglang:
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/server_info", self._info)
        app.router.add_get("/metrics", _text("sglang:fake 1\n"))
        app.router.add_get("/health", _text("ok"))
        app.router.add_post("/flush_cache", _text("flushed"))
        app.router.add_post("/generate", self._generate)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _info(self, request):
        return web.json_response({"version": "fake", "model_path": "/nonexistent",
                                  "enable_priority_scheduling": self.priority,
                                  "context_length": 1000, "max_req_input_len": 999})

    async def _generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        rid, n = body["rid"], body["sampling_params"]["max_new_tokens"]
        if rid.startswith("http500"):
            return web.Response(status=500, text="boom")
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

        if rid.startswith("toolong"):
            await send({"error": {"message": "The input is longer than the model's context "
                                  "length (1000 tokens).", "code": 400}})
        else:
            step = 2 if rid.startswith("pairs") else 1
            for done in range(step, n + step, step):
                await asyncio.sleep(3.0 if rid.startswith("stall") else self.token_delay)
                meta = {"completion_tokens": min(done, n), "prompt_tokens": prompt,
                        "cached_tokens": 0, "queue_time": 0.001, "num_retractions": 0,
                        "finish_reason": {"type": "length"} if done >= n else None}
                await send({"meta_info": meta})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _text(text: str):
    async def handler(request):
        return web.Response(text=text)

    return handler


def _workload(rids: list[str], out: int = 4, gap: float = 0.01, conc: int | None = None):
    reqs = [Request.make(rid, i * gap, [(7, 16), (100 + i, 8)], out, priority=i % 3)
            for i, rid in enumerate(rids)]
    return Workload("fake", tuple(reqs), conc)


def test_bodies_priority_and_records():
    with FakeSglang(priority=True) as fake:
        res = replay(_workload(["a0", "pairs1", "a2"]),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    res.check()
    assert res.meta["vocab_source"].startswith("fallback 32000")
    tokens = SegmentTokens(32_000)
    by_rid = {b["rid"]: b for b in fake.bodies}
    assert by_rid["a0"]["input_ids"][:16] == by_rid["a2"]["input_ids"][:16] == list(
        tokens.segment(7, 16))
    assert [by_rid[r]["priority"] for r in ("a0", "pairs1", "a2")] == [0, 1, 2]
    recs = {r["rid"]: r for r in res.records}
    assert all(r["status"] == "ok" and r["output_tokens"] == 4 for r in recs.values())
    assert recs["pairs1"]["itl_s"][0] == 0.0 and recs["pairs1"]["itl_s"][2] == 0.0


def test_priority_left_out_when_the_server_has_it_off():
    with FakeSglang(priority=False) as fake:
        replay(_workload(["a0"]), ReplayConfig(url=fake.url, max_lateness_s=LOOSE)).check()
    assert "priority" not in fake.bodies[0]


def test_errors_become_records():
    with FakeSglang() as fake:
        res = replay(_workload(["http500x", "toolong1", "stall2", "ok3"]),
                     ReplayConfig(url=fake.url, request_timeout_s=1.0, max_lateness_s=LOOSE))
    res.check()  # failures are records, the run itself is fine
    recs = {r["rid"]: r for r in res.records}
    assert recs["http500x"]["status"] == "failed" and "HTTP 500" in recs["http500x"]["error"]
    assert recs["toolong1"]["status"] == "rejected"
    assert "context length" in recs["toolong1"]["error"]
    assert recs["stall2"]["status"] == "failed" and "--request-timeout" in recs["stall2"]["error"]
    assert recs["ok3"]["status"] == "ok"
    assert len(res.records) == 4


def test_closed_loop_keeps_at_most_n_in_flight():
    rids = [f"c{i}" for i in range(12)]
    with FakeSglang(token_delay=0.05) as fake:
        res = replay(_workload(rids, out=5, gap=0.0, conc=3),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    res.check()
    assert 2 <= fake.max_in_flight <= 3
    assert sorted(r["rid"] for r in res.records) == sorted(rids)


def test_a_fast_open_loop_is_sent_and_recorded_whole():
    """400 requests at 200/s: all sent once, all recorded, lateness measured for each.
    (No time bound here: the client's speed is measured, not tested; docs/live.md.)"""
    rids = [f"f{i}" for i in range(400)]
    with FakeSglang(token_delay=0.001) as fake:
        res = replay(_workload(rids, out=8, gap=0.005),
                     ReplayConfig(url=fake.url, max_lateness_s=LOOSE))
    assert sorted(r["rid"] for r in res.records) == sorted(rids)
    assert all(r["status"] == "ok" for r in res.records)
    assert res.lateness["n"] == 400 and len(fake.bodies) == 400
