"""`servetwin emulate` as a subprocess (tests, benchmarks, a fleet of emulated servers):

    with EmulatorProcess(["--gpu", "a100-sxm-80gb", "--speed", "10"]) as em:
        em.url  # an SGLang server of the emulated GPU

Each runs in its own process group on 127.0.0.1 and a free port; ready means it printed
its `ready:` line (it listens then); stopping signals the whole group (SIGINT, then
SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.cpu.serve import free_port, stop_process_group
from twin.errors import ServetwinError


class EmulatorStartError(ServetwinError):
    """`servetwin emulate` did not come up."""


class EmulatorProcess:
    def __init__(self, args: Sequence[str] = (), port: int | None = None,
                 log_path: Path | None = None, timeout_s: float = 120.0) -> None:
        self.args, self.port = list(args), port or free_port()
        self.log_path, self.timeout_s = log_path, timeout_s
        self.proc: subprocess.Popen | None = None
        self.banner = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "servetwin", "emulate", *self.args,
                "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> EmulatorProcess:
        err = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=err,
                                     text=True, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            lines.append(line)
            if line.startswith("ready:"):
                self.banner = "".join(lines)
                return self
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise EmulatorStartError(f"`{' '.join(self.command())}` did not start within "
                                 f"{self.timeout_s:g} s; it printed: {''.join(lines)[-500:]}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> EmulatorProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
