"""The users' length router: pools by prompt length, in front of SGLang and vLLM pools.

sglang-router cannot route by prompt length, so this is a small aiohttp proxy on
127.0.0.1. It speaks SGLang's native `POST /generate` (what `servetwin live replay`
sends): the prompt's length is `len(input_ids)` (a `text` prompt is estimated at 4
characters per token); the request goes to the first pool whose `max_prompt_tokens` is at
least that (the last pool takes the rest).

- An SGLang pool (a server or an sglang-router URL) gets the body as it is; the answer is
  streamed back byte for byte.
- A vLLM pool gets it translated to `/v1/completions` (token-id prompt, `max_tokens`,
  `temperature`, `ignore_eos`, streaming with per-chunk usage); each chunk comes back in
  SGLang's format: `meta_info` with cumulative `completion_tokens`, `prompt_tokens`,
  `cached_tokens` (vLLM's `prompt_tokens_details`), `finish_reason` and
  `weight_version = "replica-<pool>"`, so replay records name the pool.

Also: `GET /health` (200 while the proxy runs), `GET /workers` (every pool's workers, in the
router's format, so replay's probe and per-worker split work through it), `POST
/flush_cache` (SGLang pools' `/flush_cache`, vLLM pools' `/reset_prefix_cache`).
`GET /pools` lists the pools and how many requests each got.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

CHARS_PER_TOKEN = 4  # for `text` prompts only: the proxy has no tokenizer
ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class Pool:
    name: str
    url: str
    engine: str  # "sglang" or "vllm"
    max_prompt_tokens: int | None  # None: everything longer than the previous pools take

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"pool {self.name}: engine {self.engine!r}, not one of {ENGINES}")

    def spec(self) -> str:
        bound = "" if self.max_prompt_tokens is None else f":{self.max_prompt_tokens}"
        return f"{self.name}={self.engine}:{self.url}{bound}"


def parse_pool(text: str) -> Pool:
    """`NAME=ENGINE:URL[:MAX_PROMPT_TOKENS]`, e.g. `sglang=sglang:http://127.0.0.1:30000:32000`."""
    try:
        name, rest = text.split("=", 1)
        engine, rest = rest.split(":", 1)
        head, _, tail = rest.rpartition(":")
        url, bound = (head, int(tail)) if tail.isdigit() and head.count(":") >= 2 else (rest, None)
    except ValueError:
        raise ValueError(f"pool {text!r}: expected NAME=ENGINE:URL[:MAX_PROMPT_TOKENS]") from None
    return Pool(name, url.rstrip("/"), engine, bound)


def check_pools(pools: list[Pool]) -> None:
    if not pools:
        raise ValueError("at least one pool")
    bounds = [p.max_prompt_tokens for p in pools]
    if None in bounds[:-1]:
        raise ValueError("only the last pool may have no upper bound")
    given = [b for b in bounds if b is not None]
    if given != sorted(given) or len(set(given)) != len(given):
        raise ValueError(f"pool bounds must increase: {given}")


def choose_pool(pools: list[Pool], prompt_tokens: int) -> Pool:
    """The first pool whose bound admits the prompt; the last one takes the rest."""
    for pool in pools:
        if pool.max_prompt_tokens is None or prompt_tokens <= pool.max_prompt_tokens:
            return pool
    return pools[-1]


def prompt_length(body: dict) -> int:
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return len(ids)
    text = body.get("text")
    return len(text) // CHARS_PER_TOKEN if isinstance(text, str) else 0


def vllm_completion_body(body: dict, model: str) -> dict:
    """SGLang's /generate body as vLLM's /v1/completions body (token-id prompts only)."""
    params = body.get("sampling_params") or {}
    prompt = body.get("input_ids") if "input_ids" in body else body.get("text", "")
    out = {"model": model, "prompt": prompt, "max_tokens": int(params.get("max_new_tokens", 16)),
           "temperature": float(params.get("temperature", 1.0)),
           "ignore_eos": bool(params.get("ignore_eos", False)), "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if body.get("rid"):
        out["request_id"] = str(body["rid"])
    return out


def sglang_chunk(vllm_chunk: dict, rid: str | None, pool: Pool,
                 previous: dict | None = None) -> dict | None:
    """One vLLM streamed completion chunk as an SGLang /generate chunk (None: nothing to say).
    vLLM reports `prompt_tokens_details.cached_tokens` only in the closing usage-only chunk
    (no choices): that one repeats the `previous` chunk's meta_info (its finish reason
    included) with the cached tokens filled in."""
    usage = vllm_chunk.get("usage") or {}
    choices = vllm_chunk.get("choices") or []
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    if not choices:
        if previous is None:
            return None
        meta = dict(previous["meta_info"])
        meta["cached_tokens"] = details.get("cached_tokens") or meta.get("cached_tokens", 0)
        return {"text": "", "meta_info": meta}
    finish = choices[0].get("finish_reason")
    return {"text": choices[0].get("text", ""),
            "meta_info": {"id": rid, "prompt_tokens": usage.get("prompt_tokens"),
                          "completion_tokens": usage.get("completion_tokens", 0),
                          "cached_tokens": details.get("cached_tokens") or 0,
                          "finish_reason": {"type": finish} if finish else None,
                          "weight_version": f"replica-{pool.name}"}}


class LengthRouter:
    """The aiohttp application: routes, the pools and their request counts."""

    def __init__(self, pools: list[Pool]) -> None:
        check_pools(pools)
        self.pools = pools
        self.counts = {p.name: 0 for p in pools}
        self.models: dict[str, str] = {}
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/workers", self.workers)
        app.router.add_get("/pools", self.pools_info)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout,
                                             connector=aiohttp.TCPConnector(limit=0))

    async def _close(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def pools_info(self, request: web.Request) -> web.Response:
        return web.json_response([{"name": p.name, "url": p.url, "engine": p.engine,
                                   "max_prompt_tokens": p.max_prompt_tokens,
                                   "requests": self.counts[p.name]} for p in self.pools])

    async def workers(self, request: web.Request) -> web.Response:
        out = []
        for pool in self.pools:
            urls = await self._pool_workers(pool)
            out += [{"url": u, "pool": pool.name, "engine": pool.engine} for u in urls]
        return web.json_response({"workers": out, "total": len(out)})

    async def _pool_workers(self, pool: Pool) -> list[str]:
        assert self.session is not None
        if pool.engine == "sglang":
            try:
                async with self.session.get(pool.url + "/workers") as resp:
                    if resp.status == 200:
                        body = await resp.json()
                        return [w["url"] for w in body.get("workers", [])]
            except (aiohttp.ClientError, ValueError, KeyError):
                pass
        return [pool.url]

    async def flush_cache(self, request: web.Request) -> web.Response:
        assert self.session is not None
        results = {}
        for pool in self.pools:
            path = "/flush_cache" if pool.engine == "sglang" else "/reset_prefix_cache"
            try:
                async with self.session.post(pool.url + path) as resp:
                    results[pool.name] = resp.status
            except aiohttp.ClientError as exc:
                results[pool.name] = str(exc)
        ok = all(v == 200 for p, v in results.items()
                 if next(x for x in self.pools if x.name == p).engine == "sglang")
        return web.json_response(results, status=200 if ok else 502)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.Response(status=400, text="the body is not JSON")
        pool = choose_pool(self.pools, prompt_length(body))
        self.counts[pool.name] += 1
        if pool.engine == "sglang":
            return await self._proxy_sglang(request, pool, raw)
        return await self._proxy_vllm(request, pool, body)

    async def _proxy_sglang(self, request: web.Request, pool: Pool, raw: bytes):
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        try:
            async with self.session.post(pool.url + "/generate", data=raw,
                                         headers=headers) as upstream:
                resp = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"pool {pool.name}: {exc}")

    async def _model(self, pool: Pool) -> str:
        if pool.name not in self.models:
            assert self.session is not None
            async with self.session.get(pool.url + "/v1/models") as resp:
                body = await resp.json()
            self.models[pool.name] = body["data"][0]["id"]
        return self.models[pool.name]

    async def _proxy_vllm(self, request: web.Request, pool: Pool, body: dict):
        assert self.session is not None
        try:
            payload = vllm_completion_body(body, await self._model(pool))
            async with self.session.post(pool.url + "/v1/completions", json=payload) as upstream:
                if upstream.status != 200:
                    return web.Response(status=upstream.status, text=await upstream.text())
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                last: dict | None = None
                async for line in upstream.content:
                    out, last = _translate_line(line, body.get("rid"), pool, last)
                    if out:
                        await resp.write(out)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, KeyError, ValueError) as exc:
            return web.Response(status=502, text=f"pool {pool.name}: {exc}")


def _translate_line(line: bytes, rid: str | None, pool: Pool,
                    last: dict | None) -> tuple[bytes | None, dict | None]:
    """One SSE line of vLLM's stream as SGLang's, and the last chunk sent so far."""
    if not line.startswith(b"data:"):
        return None, last
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return b"data: [DONE]\n\n", last
    chunk = sglang_chunk(json.loads(payload), rid, pool, last)
    if chunk is None:
        return None, last
    return b"data: " + json.dumps(chunk).encode() + b"\n\n", chunk


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.length_router --port N --pool NAME=ENGINE:URL[:MAX] ...`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pool", action="append", required=True, metavar="NAME=ENGINE:URL[:MAX]")
    args = parser.parse_args(argv)
    try:
        router = LengthRouter([parse_pool(p) for p in args.pool])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for pool in router.pools:
        print(f"pool {pool.spec()}", flush=True)
    web.run_app(router.app(), host="127.0.0.1", port=args.port, print=None)
    return 0


# -- a process, for the fleet command and tests ---------------------------------------
class LengthRouterProcess:
    """`python -m runtime.length_router` in its own process group (project venv)."""

    def __init__(self, pools: list[Pool], *, port: int | None = None,
                 log_path: Path | None = None, start_timeout: float = 30.0) -> None:
        from runtime.cpu.serve import free_port

        check_pools(pools)
        self.pools = pools
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(f"/tmp/servetwin/length-router-{self.port}.log")
        self.command = [sys.executable, "-m", "runtime.length_router", "--port", str(self.port)]
        for p in pools:
            self.command += ["--pool", p.spec()]
        self.start_timeout = start_timeout
        self._process = None

    def __enter__(self) -> LengthRouterProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        import subprocess
        import time
        import urllib.request

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[1]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.command, cwd=root, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the length router did not start; log {self.log_path}")
            time.sleep(0.2)

    def wait(self) -> int:
        assert self._process is not None
        return self._process.wait()

    def stop(self) -> None:
        from runtime.cpu.serve import stop_process_group

        if self._process is not None:
            stop_process_group(self._process)
            self._process = None


if __name__ == "__main__":
    sys.exit(main())
