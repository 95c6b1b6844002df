"""`servetwin live fleet` as a user runs it: one CPU SGLang server behind the real
sglang-router; the router's URL printed, answering, and after Ctrl-C nothing left."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.live


def test_fleet_command_prints_the_router_url_and_stops_everything(tmp_path):
    if os.environ.get("SERVETWIN_NO_LIVE") == "1":
        pytest.skip("live tests switched off by SERVETWIN_NO_LIVE=1")
    cmd = [sys.executable, "-m", "servetwin", "live", "fleet", "--replicas", "1",
           "--router-policy", "round_robin", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("ready in"):
                break
        ready = [ln for ln in lines if ln.startswith("ready in")]
        assert ready, "".join(lines)
        url = re.search(r"(http://127\.0\.0\.1:\d+)", ready[0]).group(1)
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", "".join(lines))]
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopping the fleet" in out
    for port in set(ports):
        assert not _listening(port), f"port {port} still served after Ctrl-C"
        assert not _processes_with(f"--port {port}"), f"a process with --port {port} is left"


def _listening(port: int) -> bool:

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_with(text: str) -> list[int]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in args and state not in ("Z", "X"):
            out.append(int(cmdline.parent.name))
    return out
