"""A live fleet: N CPU SGLang servers behind the real sglang-router, on loopback.

    with Fleet(FleetSpec(replicas=2, router=RouterOptions(policy="round_robin"))) as fleet:
        fleet.url          # the router: `servetwin live replay --url` it
        fleet.kill(0)      # SIGKILL replica 0's process group (a crash, for failover tests)

The servers are `runtime.cpu.serve.CpuServer`s (the harness's launch code), started in
parallel, each labelled `--weight-version replica-N` so every streamed `meta_info` says
which replica served it (runtime/recording.py reads it; the dummy weights are the same
everywhere). Then the router starts with their URLs and is ready once it reports every
worker healthy. Stopping (on exit, an exception or Ctrl-C) stops the router first, then
every server, each as a whole process group (SIGINT, SIGTERM, SIGKILL): nothing is left.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cpu.serve import CpuServer, stop_process_group
from runtime.recording import REPLICA_LABEL
from runtime.router import RouterOptions, RouterProcess, require_router


@dataclass(frozen=True)
class FleetSpec:
    """What to start. `server_args` go to every SGLang server (its own flag names);
    `server_env` on top of the harness environment (e.g. the plugin's policy)."""

    replicas: int = 2
    router: RouterOptions = field(default_factory=RouterOptions)
    server_args: tuple[str, ...] = ()
    server_env: tuple[tuple[str, str], ...] = ()
    port: int | None = None  # the router's; None: a free one
    log_dir: Path | None = None
    start_timeout_s: float = 420.0

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 16:
            raise ValueError(f"replicas must be 1..16, not {self.replicas}")
        if any(a.split("=", 1)[0] in ("--port", "--weight-version") for a in self.server_args):
            raise ValueError("--port and --weight-version are set per replica by the fleet")


class Fleet:
    """N live SGLang servers and one sglang-router, started and stopped together."""

    def __init__(self, spec: FleetSpec = FleetSpec(), *, prefix: str | None = None,
                 router_prefix: str | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="servetwin-fleet-"))
        self.router_env = require_router(router_prefix)
        self.servers = [
            CpuServer([*spec.server_args, "--weight-version", replica_name(i)], prefix=prefix,
                      log_path=self.log_dir / f"{replica_name(i)}.log",
                      start_timeout=spec.start_timeout_s, env=dict(spec.server_env))
            for i in range(spec.replicas)
        ]
        self.router: RouterProcess | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("the fleet is not running")
        return self.router.url

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def replica_of(self, worker_url: str) -> str:
        return replica_name(self.worker_urls.index(worker_url))

    def start(self) -> None:
        started = time.monotonic()
        try:
            self._start_servers()
            self.router = RouterProcess(self.worker_urls, self.spec.router, env=self.router_env,
                                        port=self.spec.port,
                                        log_path=self.log_dir / "router.log")
            self.router.start()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def _start_servers(self) -> None:
        """All servers at once (each start is mostly waiting); the first failure is raised."""
        errors: list[BaseException] = []

        def start(server: CpuServer) -> None:
            try:
                server.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in this thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def kill(self, index: int, wait: bool = True) -> None:
        """SIGKILL replica `index`'s whole process group at once: a crash, no clean exit.
        `wait=False` only sends the signal (safe inside an event loop); `stop()` reaps."""
        server = self.servers[index]
        if server._process is None:
            return
        try:
            os.killpg(server._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if wait:
            stop_process_group(server._process, ((signal.SIGKILL, 10.0),))

    def stop(self) -> None:
        """The router first (no new requests reach a stopping server), then every server."""
        if self.router is not None:
            self.router.stop()
        for server in self.servers:
            server.stop()

    def describe(self) -> list[str]:
        lines = [f"router {self.url} (sglang-router, policy {self.spec.router.policy}; log "
                 f"{self.router.log_path if self.router else '-'})"]
        for i, s in enumerate(self.servers):
            lines.append(f"  {replica_name(i)}: {s.url} (log {s.log_path})")
        return lines


def replica_name(index: int) -> str:
    return f"{REPLICA_LABEL}{index}"


def live_group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in a process group, read from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out
