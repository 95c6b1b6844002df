"""Start and stop a real vLLM 0.32 V1 server on the CPU harness (runtime/vllm_cpu/install.py).

    with VllmServer() as server:
        server.url  # OpenAI API: /v1/completions with a token-id prompt, /metrics, /health

The command is `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
fails: the distribution is named `vllm-cpu`) with the tiny dummy-weight Llama, on
127.0.0.1, in its own process group; ready means `/health` answers 200 and a one-token
completion succeeds. Stopping is `CpuServer`'s: SIGINT, SIGTERM, SIGKILL to the group.
Every flag the user passes replaces the harness's own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.cpu.serve import CpuServer, ServerStartError, flag_names, free_port, post_json
from runtime.vllm_cpu.install import require_vllm, vllm_env

SERVED_NAME = "tiny-llama"
# Sized like the SGLang harness's defaults; `--enable-prompt-tokens-details` makes the
# usage block carry `cached_tokens` (prefix-cache hits), as SGLang's meta_info does.
DEFAULT_ARGS: dict[str, str | bool] = {
    "--load-format": "dummy",
    "--dtype": "float32",
    "--max-model-len": "8192",
    "--max-num-seqs": "16",
    "--served-model-name": SERVED_NAME,
    "--enable-prompt-tokens-details": True,
    # no torch.compile: its start-up compile took 150 s on the shared 2-core machine, and
    # a tiny dummy model gains nothing from it
    "--enforce-eager": True,
}


def build_vllm_command(python: Path | str, model_dir: Path | str, port: int,
                       user_args: Sequence[str] = ()) -> list[str]:
    given = flag_names(user_args)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    if "--model" not in given:
        cmd += ["--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1"] if "--host" not in given else []
    cmd += ["--port", str(port)] if "--port" not in given else []
    for flag, value in DEFAULT_ARGS.items():
        if flag in given or value is False:
            continue
        cmd += [flag] if value is True else [flag, value]
    return cmd + list(user_args)


class VllmServer(CpuServer):
    """A real vLLM server on the CPU harness, started and stopped as one process group."""

    def __init__(self, user_args: Sequence[str] = (), *, prefix: str | os.PathLike | None = None,
                 log_path: str | os.PathLike | None = None, start_timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> None:
        self.harness = require_vllm(prefix)  # type: ignore[assignment]
        self.env = vllm_env() | dict(env or {})
        port = free_port()
        self.command = build_vllm_command(self.harness.python, self.harness.model_dir, port,
                                          user_args)
        self.port = int(self.command[self.command.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = Path(log_path or f"/tmp/servetwin/vllm-cpu-{stamp}-{self.port}.log")
        self.start_timeout = start_timeout
        self.start_seconds: float | None = None
        self._process = None
        self.served_name = _value_of(self.command, "--served-model-name") or SERVED_NAME

    def _wait_until_ready(self, deadline: float) -> None:
        while not self._get_ok("/health"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ServerStartError(self._failure("did not answer /health in time"))
            time.sleep(0.5)
        body = {"model": self.served_name, "prompt": [5, 6, 7], "max_tokens": 1}
        try:
            post_json(self.url + "/v1/completions", body,
                      timeout=max(deadline - time.monotonic(), 1))
        except (OSError, ValueError) as exc:
            raise ServerStartError(self._failure(f"failed its first completion: {exc}")) from exc

    def _failure(self, what: str) -> str:
        return super()._failure(what).replace("the SGLang server", "the vLLM server", 1)


def _value_of(cmd: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
