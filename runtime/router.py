"""The real sglang-router (PyPI `sglang-router` 0.3.2) in front of live servers.

`install_router()` puts it in its own venv (`~/.cache/servetwin/sglang-router`, or
`$SERVETWIN_ROUTER_ENV`): in the SGLang harness venv its launcher imports `sglang`, hence
torch, at every start. Its dependencies are pinned to the harness's versions
(`runtime/cpu/pins.py`); idempotent. `RouterProcess` starts
`python -m sglang_router.launch_router` on 127.0.0.1 (its Prometheus port too) with the
given worker URLs, policy and flags (the router's own names), in its own process group,
waits until the router reports every worker healthy, and stops the group on exit.
Only the standard library is used here.

    with RouterProcess(["http://127.0.0.1:31001", "http://127.0.0.1:31002"],
                       RouterOptions(policy="round_robin")) as router:
        router.url  # send /generate here
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import venv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.cpu.install import HarnessError, _run_logged
from runtime.cpu.pins import LOCKED
from runtime.cpu.serve import free_port, log_tail, stop_process_group
from runtime.venv import VenvPrefix

ROUTER_VERSION = "0.3.2"
ENV_VAR = "SERVETWIN_ROUTER_ENV"
DEFAULT_PREFIX = Path("~/.cache/servetwin/sglang-router")
MARKER = "servetwin-router.json"
POLICIES = ("round_robin", "random", "cache_aware", "power_of_two")
Log = Callable[[str], None]


@dataclass(frozen=True)
class RouterEnv(VenvPrefix):
    """Where the router's venv lives."""

    marker_name = MARKER

    def is_installed(self) -> bool:
        try:
            recorded = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return False
        return recorded.get("sglang_router") == ROUTER_VERSION and self.python.exists()


def router_env(prefix: str | os.PathLike | None = None) -> RouterEnv:
    chosen = prefix or os.environ.get(ENV_VAR) or DEFAULT_PREFIX
    return RouterEnv(Path(chosen).expanduser().resolve())


def install_router(prefix: str | os.PathLike | None = None, log: Log = print) -> RouterEnv:
    """A venv with `sglang-router==0.3.2` (dependencies at the harness's pinned versions);
    a no-op when its marker says so."""
    env = router_env(prefix)
    if env.is_installed():
        log(f"sglang-router {ROUTER_VERSION} already installed at {env.prefix}")
        return env
    log(f"installing sglang-router {ROUTER_VERSION} into {env.prefix} (about 150 MB)")
    started = time.monotonic()
    if not env.python.exists():
        venv.EnvBuilder(with_pip=True, clear=False).create(env.prefix)
    constraints = env.prefix / "constraints.txt"
    constraints.write_text("\n".join(LOCKED) + "\n")
    _run_logged([str(env.python), "-m", "pip", "install", "--progress-bar", "off",
                 "-c", str(constraints), f"sglang-router=={ROUTER_VERSION}"],
                env.prefix / "install.log")
    seconds = round(time.monotonic() - started, 1)
    env.marker.write_text(json.dumps({"sglang_router": ROUTER_VERSION,
                                      "installed_s": seconds}) + "\n")
    log(f"sglang-router ready at {env.prefix} ({seconds:.0f} s)")
    return env


def require_router(prefix: str | os.PathLike | None = None) -> RouterEnv:
    env = router_env(prefix)
    if not env.is_installed():
        raise HarnessError(f"sglang-router {ROUTER_VERSION} is not installed at {env.prefix}: "
                           "run `servetwin live install-cpu` first")
    return env


def router_process_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONNOUSERSITE"] = "1"
    env["NO_COLOR"] = "1"
    return env


@dataclass(frozen=True)
class RouterOptions:
    """The router flags servetwin sets, by the router's own names; `None` keeps its default.

    Defaults of sglang-router 0.3.2 (`launch_router --help`): cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 60,
    max_tree_size 2**26, retry_max_retries 5, retry_initial_backoff_ms 50,
    retry_max_backoff_ms 30000, retry_backoff_multiplier 1.5, retry_jitter_factor 0.2,
    cb_failure_threshold 10, cb_success_threshold 3, cb_timeout_duration_secs 60,
    health_failure_threshold 3, health_success_threshold 2, health_check_timeout_secs 5,
    health_check_interval_secs 60.
    """

    policy: str = "cache_aware"
    cache_threshold: float | None = None
    balance_abs_threshold: int | None = None
    balance_rel_threshold: float | None = None
    eviction_interval_secs: int | None = None
    max_tree_size: int | None = None
    retry_max_retries: int | None = None
    retry_initial_backoff_ms: int | None = None
    retry_max_backoff_ms: int | None = None
    retry_backoff_multiplier: float | None = None
    retry_jitter_factor: float | None = None
    disable_retries: bool = False
    cb_failure_threshold: int | None = None
    cb_success_threshold: int | None = None
    cb_timeout_duration_secs: int | None = None
    disable_circuit_breaker: bool = False
    health_failure_threshold: int | None = None
    health_success_threshold: int | None = None
    health_check_timeout_secs: int | None = None
    health_check_interval_secs: int | None = None
    request_timeout_secs: int | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy {self.policy!r}: one of {', '.join(POLICIES)}")

    def flags(self) -> list[str]:
        out = ["--policy", self.policy, "--log-level", self.log_level]
        for name, value in self.__dict__.items():
            if name in ("policy", "log_level") or value is None or value is False:
                continue
            flag = "--" + name.replace("_", "-")
            out += [flag] if value is True else [flag, str(value)]
        return out


def router_command(python: Path | str, worker_urls: Sequence[str], port: int,
                   prometheus_port: int, options: RouterOptions) -> list[str]:
    """`python -m sglang_router.launch_router` on loopback (its metrics port too)."""
    return [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            *options.flags()]


class RouterStartError(HarnessError):
    """The router exited or did not register its workers in time."""


class RouterProcess:
    """The real sglang-router, started and stopped as one process group."""

    def __init__(self, worker_urls: Sequence[str], options: RouterOptions = RouterOptions(),
                 *, env: RouterEnv | None = None, port: int | None = None, log_path: Path | None = None,
                 start_timeout: float = 60.0) -> None:
        self.worker_urls = list(worker_urls)
        self.options = options
        self.port = port or free_port()
        self.prometheus_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or require_router()
        self.command = router_command(self.env.python, self.worker_urls, self.port,
                                      self.prometheus_port, options)
        self.log_path = log_path or Path(f"/tmp/servetwin/sglang-router-{self.port}.log")
        self.start_timeout = start_timeout
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> RouterProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command, env=router_process_env(), cwd=self.env.prefix,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            self._wait_until_ready(time.monotonic() + self.start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_until_ready(self, deadline: float) -> None:
        while len(self.healthy_workers()) < len(self.worker_urls):
            if self._process is not None and self._process.poll() is not None:
                raise RouterStartError(self._failure(f"exited with code {self._process.returncode}"))
            if time.monotonic() > deadline:
                raise RouterStartError(self._failure("did not register all its workers in time"))
            time.sleep(0.3)

    def workers(self) -> list[dict]:
        """The router's `/workers` list (its registry), empty when it does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=5) as response:
                body = json.loads(response.read())
        except (OSError, ValueError):
            return []
        return list(body.get("workers", [])) if isinstance(body, dict) else []

    def healthy_workers(self) -> list[str]:
        return [w["url"] for w in self.workers() if w.get("is_healthy")]

    def _failure(self, what: str) -> str:
        return f"the sglang-router {what}; log {self.log_path}:\n{log_tail(self.log_path)}"

    def wait(self) -> int:
        if self._process is None:
            raise RuntimeError("the router was not started")
        return self._process.wait()

    def stop(self) -> None:
        if self._process is None:
            return
        stop_process_group(self._process)
        self._process = None
