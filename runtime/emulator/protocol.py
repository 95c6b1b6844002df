"""SGLang 0.5.23's HTTP request contract, as the emulator checks it: the same checks, in
the same order, with the same status codes, JSON shapes and messages as the real server
(each captured from the CPU harness's SGLang; tests/test_emulator.py holds them).

- A body that is not JSON, not an object, or not sent as `application/json`: 400
  `{"object": "error", "message": "1 validation error: ...", "type": "Bad Request",
  "param": null, "code": 400}` (FastAPI's validation error, rewritten by SGLang).
- A schema violation in `sampling_params` (an unknown key, a wrong type): 400
  `{"error": "unknown field `x`, expected one of ..."}` (the API contract gate). Unknown
  top-level keys are ignored, as SGLang's schema ignores them.
- A request the tokenizer manager refuses (no prompt, an empty one, negative
  `max_new_tokens`, a prompt over the context length, prompt + max_new_tokens over it):
  400 `{"error": {"message": ...}}`; when streaming, a 200 event stream of one
  `data: {"error": {..., "type": "invalid_request_error", "code": 400, "retryable":
  false}}` and `data: [DONE]`.

Prompt length: `input_ids` as given (ids outside [0, vocab) are refused: the real CPU
SGLang's scheduler dies on one), or `text` under a deterministic rule, one token per 4
bytes of UTF-8 (rounded up; ids are the bytes' values), roughly a BPE tokenizer's rate
on English. Output: `max_new_tokens` tokens (default 128, SGLang's), whether or not
`ignore_eos` is set: the emulator cannot know where a model would stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice")
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang's CompletionRequest default (OpenAI's)
BYTES_PER_TOKEN = 4


class HttpError(Exception):
    """A refused request: `status` and the JSON body SGLang answers with; `in_stream`:
    a streaming request gets it as an event of a 200 stream instead (SGLang's
    tokenizer-manager errors)."""

    def __init__(self, status: int, body: dict, in_stream: bool = False) -> None:
        super().__init__(json.dumps(body))
        self.status, self.body, self.in_stream = status, body, in_stream


def validation_error(detail: str, where: str) -> HttpError:
    """FastAPI's request validation error as SGLang reshapes it."""
    return HttpError(400, {"object": "error", "message": f"1 validation error:\n  {detail}"
                           f"\n\n  {where}", "type": "Bad Request", "param": None,
                           "code": 400})


def contract_error(text: str) -> HttpError:
    return HttpError(400, {"error": text})


def request_error(message: str) -> HttpError:
    """A tokenizer-manager ValueError: a 400, or in a stream an error event."""
    return HttpError(400, {"error": {"message": message}}, in_stream=True)


def stream_error_event(exc: HttpError) -> dict:
    return {"error": {"message": exc.body["error"]["message"],
                      "type": "invalid_request_error", "code": exc.status,
                      "retryable": False}}


def parse_json(raw: bytes, content_type: str, route: str) -> dict:
    """The body as a JSON object, or SGLang's validation error for it."""
    where = f"POST {route}"
    media = content_type.split(";", 1)[0].strip().lower()
    try:
        body = json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        why = getattr(exc, "msg", str(exc))
        raise validation_error(f"{{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': "
                               f"'JSON decode error', 'input': {{}}, 'ctx': {{'error': "
                               f"{why!r}}}}}", where) from None
    if media != "application/json" or not isinstance(body, dict):
        shown = raw[:200] if media != "application/json" else body
        raise validation_error(f"{{'type': 'dataclass_type', 'loc': ('body',), 'msg': "
                               f"'Input should be a dictionary or an instance of "
                               f"GenerateReqInput', 'input': {shown!r}}}", where)
    return body


def _serde_type(v: object) -> str:
    """How serde names a JSON value in "invalid type" (SGLang's contract gate)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f"string {json.dumps(v)}"
    return "sequence" if isinstance(v, list) else "map"


def _int(v: object, what: str = "i64") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise contract_error(f"invalid type: {_serde_type(v)}, expected {what}")
    return v


@dataclass(frozen=True)
class Generate:
    """One parsed `/generate` (or `/v1/completions`) request."""

    ids: list[int]
    max_new_tokens: int
    stream: bool
    rid: str | None
    priority: int
    include_usage: bool = False  # /v1/completions stream_options.include_usage
    model: str | None = None


def check_sampling(sp: object) -> int:
    """`sampling_params` against SGLang's schema; its `max_new_tokens`."""
    if sp is None:
        return DEFAULT_MAX_NEW_TOKENS
    if not isinstance(sp, dict):
        raise contract_error(f"invalid type: {_serde_type(sp)}, expected struct "
                             "SamplingParams")
    for key in sp:
        if key not in SAMPLING_KEYS:
            raise contract_error(f"unknown field `{key}`, expected one of "
                                 + ", ".join(f"`{k}`" for k in SAMPLING_KEYS))
    if "ignore_eos" in sp and not isinstance(sp["ignore_eos"], bool):
        raise contract_error(f"invalid type: {_serde_type(sp['ignore_eos'])}, expected a "
                             "boolean")
    mnt = sp.get("max_new_tokens")
    return DEFAULT_MAX_NEW_TOKENS if mnt is None else _int(mnt)


def text_ids(text: str) -> list[int]:
    """The deterministic tokenization of `text`: one token per 4 bytes of UTF-8."""
    raw = text.encode()
    return [int.from_bytes(raw[i:i + BYTES_PER_TOKEN], "little")
            for i in range(0, len(raw), BYTES_PER_TOKEN)]


def prompt_ids(text: object, ids: object, vocab: int, *, key: str = "input_ids") -> list[int]:
    """The prompt's token ids (`input_ids` win over `text`, as in SGLang)."""
    if ids is not None:
        if not isinstance(ids, list):
            raise contract_error(f"invalid type: {_serde_type(ids)}, expected a sequence")
        if ids and isinstance(ids[0], list):
            raise request_error(f"the emulator serves one prompt per request: a batch of "
                                f"{len(ids)} {key} lists is not supported")
        for v in ids:
            _int(v)
        if not ids:
            raise request_error(f"{key} cannot be empty.")
        bad = next((v for v in ids if not 0 <= v < vocab), None)
        if bad is not None:
            raise request_error(f"token id {bad} in {key} is outside the vocabulary "
                                f"[0, {vocab})")
        return list(ids)
    if text is None:
        raise request_error("Either text, input_ids or input_embeds should be provided.")
    if isinstance(text, list):
        raise request_error(f"the emulator serves one prompt per request: a batch of "
                            f"{len(text)} texts is not supported")
    if not isinstance(text, str):
        raise contract_error(f"invalid type: {_serde_type(text)}, expected a string")
    return text_ids(text) or [0]


def check_lengths(n_prompt: int, max_new: int, context_len: int) -> None:
    """The tokenizer manager's checks, its messages."""
    if max_new < 0:
        raise request_error(f"max_new_tokens must be at least 0, got {max_new}.")
    if n_prompt >= context_len:
        raise request_error(f"The input ({n_prompt} tokens) is longer than the model's "
                            f"context length ({context_len} tokens).")
    if n_prompt + max_new > context_len:
        raise request_error(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {n_prompt + max_new} tokens: "
            f"{n_prompt} tokens from the input messages and {max_new} tokens for the "
            f"completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit.")


def parse_generate(body: dict, vocab: int, context_len: int) -> Generate:
    """A `/generate` body: SGLang's checks in SGLang's order."""
    for key in ("rid",):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise contract_error(f"invalid type: {_serde_type(body[key])}, expected a string")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise contract_error(f"invalid type: {_serde_type(body['stream'])}, expected a "
                             "boolean")
    priority = body.get("priority")
    priority = 0 if priority is None else _int(priority)
    max_new = check_sampling(body.get("sampling_params"))
    stream = bool(body.get("stream"))
    try:
        ids = prompt_ids(body.get("text"), body.get("input_ids"), vocab)
        check_lengths(len(ids), max_new, context_len)
    except HttpError as exc:
        exc.in_stream = exc.in_stream and stream
        raise
    return Generate(ids, max_new, stream, body.get("rid"), priority)


def parse_completions(body: dict, vocab: int, context_len: int) -> Generate:
    """A `/v1/completions` body (OpenAI's fields SGLang reads; others ignored)."""
    where = "POST /v1/completions"
    mt = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if mt is None:
        mt = COMPLETIONS_DEFAULT_MAX_TOKENS
    if isinstance(mt, bool) or not isinstance(mt, int):
        raise validation_error(f"{{'type': 'int_type', 'loc': ('body', 'max_tokens'), "
                               f"'msg': 'Input should be a valid integer', 'input': {mt!r}}}",
                               where)
    if mt < 0:
        raise validation_error(f"{{'type': 'value_error', 'loc': ('body', 'max_tokens'), "
                               f"'msg': 'Value error, max_tokens must be positive', "
                               f"'input': {mt}}}", where)
    if "prompt" not in body:
        raise validation_error("{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': "
                               "'Field required', 'input': {}}", where)
    prompt = body["prompt"]
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    try:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = prompt_ids(None, prompt, vocab, key="prompt")
        else:
            ids = prompt_ids(prompt, None, vocab, key="prompt")
        check_lengths(len(ids), mt, context_len)
    except HttpError as exc:
        exc.in_stream = exc.in_stream and stream
        raise
    model = body.get("model")
    return Generate(ids, mt, stream, None, 0,
                    include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
                    model=model if isinstance(model, str) else None)


CHAT_DEFAULT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS  # none given: SGLang's generate default


def chat_text(messages: object, where: str) -> str:
    """The prompt of a chat request: each message as `role: content` on its own line
    (the emulator's stand-in for the model's chat template)."""
    if not isinstance(messages, list) or not messages:
        raise validation_error("{'type': 'missing', 'loc': ('body', 'messages'), 'msg': "
                               "'Field required (a non-empty list)', 'input': {}}", where)
    lines = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # OpenAI content parts: the text ones count
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                content, str | None):
            raise validation_error(f"{{'type': 'model_type', 'loc': ('body', 'messages', {i}), "
                                   f"'msg': 'Input should be a message with a role and "
                                   f"content'}}", where)
        lines.append(f"{m['role']}: {content or ''}")
    return "\n".join(lines) + "\nassistant: "


def parse_chat(body: dict, vocab: int, context_len: int) -> Generate:
    """A `/v1/chat/completions` body: `messages`, `max_completion_tokens` or `max_tokens`,
    `stream`, `stream_options.include_usage`, `model`."""
    where = "POST /v1/chat/completions"
    mt = body.get("max_completion_tokens") or body.get("max_tokens")
    if mt is None:
        mt = CHAT_DEFAULT_MAX_TOKENS
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
        raise validation_error(f"{{'type': 'value_error', 'loc': ('body', 'max_tokens'), "
                               f"'msg': 'Value error, max_tokens must be a non-negative "
                               f"integer', 'input': {mt!r}}}", where)
    ids = text_ids(chat_text(body.get("messages"), where))
    stream = bool(body.get("stream"))
    try:
        check_lengths(len(ids), mt, context_len)
    except HttpError as exc:
        exc.in_stream = exc.in_stream and stream
        raise
    opts = body.get("stream_options") or {}
    model = body.get("model")
    return Generate(ids, mt, stream, None, 0,
                    include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
                    model=model if isinstance(model, str) else None)


FILLER = ("the", " twin", " emulates", " an", " SGLang", " server", ";", " its", " tokens",
          " are", " filler", ",", " the", " timing", " is", " real", ".")


def filler_text(n: int) -> str:
    """The text of `n` output tokens (deterministic)."""
    return "".join(FILLER[i % len(FILLER)] for i in range(n))


def filler_ids(n: int, vocab: int) -> list[int]:
    return [(1000 + i % len(FILLER)) % vocab for i in range(n)]
