"""Start and stop a real SGLang server on the CPU harness.

`CpuServer` is a context manager for tests and benchmarks:

    with CpuServer() as server:
        requests.post(server.url + "/generate", ...)

It builds the `python -m sglang.launch_server` command (`build_command`), starts it
in its own process group with the harness environment, waits for `/health` and one
trivial `/generate`, and on exit stops the whole group: SIGINT, then SIGTERM, then
SIGKILL. Only the standard library is used here: the project does not need SGLang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from runtime.cpu.install import Harness, HarnessError, harness_env, require_harness

# Flags the CPU harness needs; `True` marks a switch that takes no value.
REQUIRED_ARGS: dict[str, str | bool] = {
    "--load-format": "dummy",
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--disable-overlap-schedule": True,
    "--dtype": "float32",
    "--enable-metrics": True,
    "--skip-server-warmup": True,
    "--host": "127.0.0.1",
    # an idle SGLang server otherwise polls its sockets at a whole core (benchmarks/
    # idle_cpu.py): on a 2-core
    # machine a few idle servers (a test module's) starve the one under test; with it the
    # scheduler blocks in zmq poll when idle and wakes at once when a request arrives
    "--sleep-on-idle": True,
}
# Defaults sized for a 2-core, 24 GiB machine; any of them can be overridden.
DEFAULT_ARGS: dict[str, str | bool] = {
    "--max-total-tokens": "16384",
    "--max-running-requests": "16",
    "--chunked-prefill-size": "1024",
    "--context-length": "8192",
    "--log-level": "info",
}
STOP_SIGNALS = ((signal.SIGINT, 15.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flag_names(args: Sequence[str]) -> set[str]:
    """The `--flag` names present in an argument list (`--a=1` and `--a 1` both give `--a`)."""
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def build_command(
    python: Path | str,
    model_dir: Path | str,
    port: int,
    user_args: Sequence[str] = (),
) -> list[str]:
    """The launch command: harness flags and defaults, each overridden by the user's args."""
    given = flag_names(user_args)
    cmd = [str(python), "-m", "sglang.launch_server"]
    if "--model-path" not in given:
        cmd += ["--model-path", str(model_dir)]
    if "--port" not in given:
        cmd += ["--port", str(port)]
    for flag, value in (REQUIRED_ARGS | DEFAULT_ARGS).items():
        if flag in given:
            continue
        cmd += [flag] if value is True else [flag, value]
    return cmd + list(user_args)


#: SGLang's CPU engine binds each TP rank's threads to cores; without it it asks for a NUMA
#: node per rank, which these one-node machines do not have
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def tp_size_of(args: Sequence[str]) -> int:
    for i, arg in enumerate(args):
        if arg in ("--tp-size", "--tp", "--tensor-parallel-size") and i + 1 < len(args):
            return int(args[i + 1])
        for flag in ("--tp-size=", "--tp=", "--tensor-parallel-size="):
            if arg.startswith(flag):
                return int(arg[len(flag):])
    return 1


def thread_binding(tp: int) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `tp` ranks: this process's cores split into `tp`
    contiguous groups ('0|1' for two ranks on two cores), a core shared round-robin when
    there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        return "|".join(str(cores[i % len(cores)]) for i in range(tp))
    per = len(cores) // tp
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def port_of(cmd: Sequence[str]) -> int:
    """The `--port` of a launch command."""
    for i, arg in enumerate(cmd):
        if arg == "--port":
            return int(cmd[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    raise ValueError("no --port in the command")


class ServerStartError(HarnessError):
    """The server exited or did not become healthy in time."""


_PLUGIN_CHECKED: set[Path] = set()
_PLUGIN_LOCK = threading.Lock()


def plugin_from_this_tree(harness: Harness) -> None:
    """Point the harness's servetwin (an editable install) at this source tree, once per
    process, before a server that loads servetwin's plugin starts: the harness keeps
    whichever checkout installed it last (a CI clone, another worktree), and its plugin
    would run instead of this tree's (a spec with a parameter that tree lacks then
    refuses to load, and SGLang's own scheduling runs)."""
    from runtime.cpu.install import ensure_plugin

    with _PLUGIN_LOCK:
        if harness.prefix not in _PLUGIN_CHECKED:
            ensure_plugin(harness, log=lambda line: None)
            _PLUGIN_CHECKED.add(harness.prefix)


class CpuServer:
    """A real SGLang server on the CPU harness, started and stopped as one process group.

    `start_timeout` is generous: a start is 20-35 s on an idle 2-core machine, but in the CI
    run on 6ad013c (a loaded machine) SGLang's own imports took 2 minutes before its first
    log line and the 180 s it had then ran out.
    """

    def __init__(
        self,
        user_args: Sequence[str] = (),
        *,
        prefix: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        start_timeout: float = 420.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.harness: Harness = require_harness(prefix)
        self.env = dict(env or {})  # on top of the harness environment (e.g. the plugin's)
        if "SGLANG_PLUGINS" in self.env:
            plugin_from_this_tree(self.harness)
        tp = tp_size_of(user_args)
        if tp > 1 and BIND_ENV not in self.env:
            self.env[BIND_ENV] = thread_binding(tp)
        self.command = build_command(
            self.harness.python, self.harness.model_dir, free_port(), user_args
        )
        self.port = port_of(self.command)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else _default_log_path(self.port)
        self.start_timeout = start_timeout
        self.start_seconds: float | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> CpuServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Launch the server and wait until it answers `/health` and a trivial `/generate`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command,
                env=harness_env() | self.env,
                # not the caller's directory: `python -m` puts it on sys.path, and a
                # checkout's servetwin.egg-info there would hide the installed plugin
                cwd=self.harness.prefix,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, stopped as a whole
            )
        try:
            self._wait_until_ready(started + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def _wait_until_ready(self, deadline: float) -> None:
        while not self._get_ok("/health"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ServerStartError(self._failure("did not answer /health in time"))
            time.sleep(0.5)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
        try:
            post_json(self.url + "/generate", body, timeout=max(deadline - time.monotonic(), 1))
        except (OSError, ValueError) as exc:
            raise ServerStartError(self._failure(f"failed its first /generate: {exc}")) from exc

    def _get_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status == 200
        except (OSError, ValueError):
            return False

    def _check_alive(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise ServerStartError(self._failure(f"exited with code {self._process.returncode}"))

    def _failure(self, what: str) -> str:
        return f"the SGLang server {what}; log {self.log_path}:\n{log_tail(self.log_path)}"

    def wait(self) -> int:
        """Block until the server process exits; its exit code."""
        if self._process is None:
            raise RuntimeError("the server was not started")
        return self._process.wait()

    def stop(self) -> None:
        """Stop the server's whole process group; escalates SIGINT -> SIGTERM -> SIGKILL."""
        if self._process is None:
            return
        stop_process_group(self._process)
        self._process = None


def stop_process_group(
    leader: subprocess.Popen, signals: Sequence[tuple[int, float]] = STOP_SIGNALS
) -> None:
    """Signal the group `leader` heads (started with `start_new_session=True`) until it is gone.

    Each `(signal, grace seconds)` is sent only if a live process of the group is left.
    """
    pgid = leader.pid  # the leader of its own session, so its pgid is its pid
    for sig, grace in signals:
        if not _group_alive(pgid):
            break
        _signal_group(pgid, sig)
        _wait_group(pgid, leader, grace)
    leader.poll()


def post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    """POST a JSON body, return the decoded JSON answer (raises on HTTP errors)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _default_log_path(port: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / "servetwin" / f"sglang-cpu-{stamp}-{port}.log"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group.

    Read from /proc, because `killpg(pgid, 0)` also counts zombies, and a
    container's init may never reap the orphans it inherits.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        state, pgrp = fields[0], int(fields[3])
        if pgrp == pgid and state not in ("Z", "X"):
            return True
    return False


def _wait_group(pgid: int, leader: subprocess.Popen, grace: float) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        leader.poll()  # reap the leader so it does not linger as a zombie
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
