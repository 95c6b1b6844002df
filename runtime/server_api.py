"""Small synchronous calls to a live SGLang server around a replay (standard library only).

`probe(url)` reads `/server_info` and what the replayer needs from it: the model's vocab
size (from the model directory's `config.json` when the server runs on this machine, as the
CPU harness does; `/server_info` does not report it), whether priority scheduling is on,
and the context limits. `snapshot(url)` saves `/server_info` and `/metrics` as they are.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from twin.config import SCHEDULE_POLICIES
from twin.errors import ServetwinError

# Used when the vocab size is neither given nor readable: every common LLM tokenizer has at
# least this many ids (see runtime.token_ids for the range actually drawn from).
FALLBACK_VOCAB = 32_000


class ReplayError(ServetwinError):
    """The replay could not run or did not finish: unreachable or dead server, slow client."""


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def describe_url_error(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ServerFacts:
    info: dict
    vocab_size: int
    vocab_source: str
    priority_scheduling: bool
    context_length: int | None
    max_req_input_len: int | None
    workers: tuple[str, ...] = ()  # behind an sglang-router: its workers' URLs

    @property
    def version(self) -> str:
        return str(self.info.get("version", "?"))


def router_workers(url: str, timeout: float = 10.0) -> list[str]:
    """The worker URLs an sglang-router at `url` lists (`GET /workers`), [] for a server."""
    try:
        body = json.loads(_get(url + "/workers", timeout))
    except (OSError, ValueError):
        return []
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        return []
    return [str(w["url"]) for w in body["workers"] if isinstance(w, dict) and "url" in w]


def probe(url: str, vocab_size: int | None = None, timeout: float = 10.0) -> ServerFacts:
    """What the replayer needs to know about the server; `ReplayError` when unreachable.
    Behind an sglang-router (no `/server_info` of its own), the facts of its first worker,
    and `workers` lists them all."""
    workers = tuple(router_workers(url, timeout))
    try:
        info = json.loads(_get((workers[0] if workers else url) + "/server_info", timeout))
    except (OSError, ValueError) as exc:
        raise ReplayError(f"cannot reach an SGLang server at {url} (GET /server_info: "
                          f"{describe_url_error(exc)}); is it running, and is the URL "
                          "right?") from None
    if not isinstance(info, dict):
        raise ReplayError(f"{url}/server_info did not answer a JSON object: is it SGLang?")
    vocab, source = _vocab(info, vocab_size)
    return ServerFacts(
        info=info, vocab_size=vocab, vocab_source=source,
        priority_scheduling=info.get("enable_priority_scheduling") is True,
        context_length=positive_int(info.get("context_length")),
        max_req_input_len=positive_int(info.get("max_req_input_len")), workers=workers,
    )


def positive_int(value: object) -> int | None:
    """A token limit from `/server_info`, or None when it is not a positive integer (a
    server that is not SGLang's, or garbage): then no limit is assumed."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _vocab(info: dict, given: int | None) -> tuple[int, str]:
    if given:
        return int(given), "--vocab-size"
    config = Path(str(info.get("model_path", ""))) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return FALLBACK_VOCAB, (f"fallback {FALLBACK_VOCAB}: {config} not readable here; "
                                "pass --vocab-size")
    text_cfg = cfg.get("text_config") if isinstance(cfg, dict) else None
    vocab = (cfg.get("vocab_size") if isinstance(cfg, dict) else None) or (
        text_cfg.get("vocab_size") if isinstance(text_cfg, dict) else None)
    if not vocab:
        return FALLBACK_VOCAB, f"fallback {FALLBACK_VOCAB}: no vocab_size in {config}"
    if positive_int(vocab) is None or vocab < 5:  # token_ids draws from [3, vocab)
        return FALLBACK_VOCAB, (f"fallback {FALLBACK_VOCAB}: vocab_size {vocab!r} in {config} "
                                "is not a token count; pass --vocab-size")
    return int(vocab), str(config)


def snapshot(url: str, timeout: float = 10.0) -> dict[str, str]:
    """`/server_info` (JSON text) and `/metrics` (Prometheus text); when the server does not
    answer, `{"unavailable": why}` and a `# unavailable: why` comment instead."""
    out = {}
    for name, path in (("server_info", "/server_info"), ("metrics", "/metrics")):
        try:
            out[name] = _get(url + path, timeout).decode(errors="replace")
        except (OSError, ValueError) as exc:
            why = f"GET {path}: {describe_url_error(exc)}"
            out[name] = (json.dumps({"unavailable": why}) + "\n" if name == "server_info"
                         else f"# unavailable: {why}\n")
    return out


def flush_cache(url: str, timeout: float = 30.0) -> str | None:
    """Empty the server's radix cache (the twin starts cold); None on success, else why not.
    SGLang refuses while requests are running."""
    request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        return None
    except (OSError, ValueError) as exc:
        return describe_url_error(exc)


def twin_server_args(info: dict):
    """The twin's `ServerArgs` for a live server, from its `/server_info` (SGLang's own
    names), so a simulation of "this server" uses the server's actual configuration."""
    from twin.config import ServerArgs

    return ServerArgs(**twin_server_values(info))


def twin_server_values(info: dict) -> dict:
    """The `ServerArgs` fields a `/server_info` (or a profile's `server_args`) gives. A CPU
    server has no CUDA graphs; a pool left to the server's own sizing is the pool it
    reported (`max_total_num_tokens`), so the twin's pool is the server's."""
    from dataclasses import fields

    from twin.config import ServerArgs

    given = {f.name: info[f.name] for f in fields(ServerArgs)
             if f.name in info and info[f.name] is not None}
    if info.get("device") == "cpu":
        given["disable_cuda_graph"] = True
    if given.get("schedule_policy") not in (None, *SCHEDULE_POLICIES):
        given.pop("schedule_policy")  # a policy the twin does not model: its default
    if "max_total_tokens" not in given and isinstance(info.get("max_total_num_tokens"), int):
        given["max_total_tokens"] = info["max_total_num_tokens"]
    return given


def fresh_rid_suffix() -> str:
    """A token for the request ids one replay (or one calibration group) sends. SGLang
    0.5.23's tokenizer manager refuses a `rid` it still holds ("Duplicate request ID
    detected", HTTP 400), and a request of an earlier replay on the same server can still
    be there after its client has gone (interrupted, or its stream closed early): sent as
    `RID.SUFFIX`, a new replay's ids never meet an old one's. Records keep the workload's
    ids; the suffix is in the replay's metadata."""
    return secrets.token_hex(3)


def server_rid(rid: str, suffix: str) -> str:
    """The id sent to the server for the workload's `rid` (`suffix` "" : as it is)."""
    return f"{rid}.{suffix}" if suffix else rid

