"""Shared pytest fixtures.

`sglang_server` starts one real SGLang server on the CPU harness for the whole
session (about 30-60 s) and stops it at the end. A missing harness is an error, not
a skip: run `servetwin live install-cpu` first. Set `SERVETWIN_NO_LIVE=1` to skip
the live tests instead (for example while editing offline code).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# CI runs the property tests on hypothesis's fixed examples, so a landing does not depend on
# the draw; local runs keep exploring new examples (SERVETWIN_CI unset).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("SERVETWIN_CI") == "1":
    settings.load_profile("ci")

NO_LIVE_ENV = "SERVETWIN_NO_LIVE"


@pytest.fixture(scope="session")
def cpu_harness() -> object:
    """The installed CPU harness (`runtime.cpu.install.Harness`), without a server."""
    if os.environ.get(NO_LIVE_ENV) == "1":
        pytest.skip(f"live SGLang tests switched off by {NO_LIVE_ENV}=1")
    from runtime.cpu.install import require_harness

    return require_harness()


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A running CPU SGLang server: `.url`, `.port`, `.log_path`."""
    if os.environ.get(NO_LIVE_ENV) == "1":
        pytest.skip(f"live SGLang tests switched off by {NO_LIVE_ENV}=1")
    from runtime.cpu.serve import CpuServer

    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    with CpuServer(log_path=log_path) as server:
        yield server
