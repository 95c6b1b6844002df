"""Install SGLang 0.5.23 into an isolated venv on a CPU-only Linux machine.

The recipe (docs/cpu-harness.md explains each step): CPU torch 2.13.0; sglang
without its declared dependencies (part of them are GPU-only); a curated list of
the dependencies it really needs, under a constraints file that pins torch, triton
and torchvision so pip can never swap the CPU torch for a multi-GB CUDA build;
torchvision without dependencies; the import shims of `shim.py` behind a `.pth`
file; and the tiny dummy-weight model of `model.py`.

Idempotent: a marker file records the recipe; when it matches, `install()` returns
at once. `ensure_plugin()` then installs servetwin itself (editable, no dependencies) so
SGLang finds its plugin; it is kept out of the marker. Usage: `python -m runtime.cpu.install [--prefix DIR]` or
`servetwin live install-cpu [--prefix DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.cpu import model
from runtime.cpu.pins import LOCKED
from runtime.venv import VenvPrefix
from twin.errors import ServetwinError

ENV_VAR = "SERVETWIN_SGLANG_ENV"
DEFAULT_PREFIX = Path("~/.cache/servetwin/sglang-cpu")
MARKER = "servetwin-harness.json"
SHIM_MODULE = "servetwin_cpu_shim"
SHIM_PTH = "servetwin_cpu_shim.pth"

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"
TRITON_VERSION = "3.8.0"
CONSTRAINTS = (
    f"torch=={TORCH_VERSION}",
    f"triton=={TRITON_VERSION}",
    f"torchvision=={TORCHVISION_VERSION}",
)
# What sglang 0.5.23 really needs to serve on CPU, found by trial on these machines.
DEPENDENCIES = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "pillow",
    "fastapi", "msgspec", "typing_extensions", f"triton=={TRITON_VERSION}",
    "pyzmq>=25.1.2", "tqdm", "IPython", "aiohttp", "transformers==5.19.0",
    "tokenizers==0.23.2", "dill", "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0", "gguf", "openai==2.8.0", "partial_json_parser",
    "setproctitle", "einops", "uvicorn>=0.51",
    # the HTTP server, /metrics and bench_serving
    "uvloop", "jsonschema", "xgrammar==0.2.7", "soundfile==0.13.1", "python-multipart",
    "datasets", "python-dateutil<3", "prometheus-client>=0.20.0",
)  # fmt: skip
RECIPE_VERSION = 2  # bump when the steps change, so existing installs are redone

Log = Callable[[str], None]


class HarnessError(ServetwinError):
    """The harness is missing, incomplete, or an install step failed."""


@dataclass(frozen=True)
class Harness(VenvPrefix):
    """Where an installed (or to-be-installed) harness lives."""

    marker_name = MARKER

    @property
    def model_dir(self) -> Path:
        return self.prefix / "models" / model.DEFAULT_SPEC.name

    def recipe(self) -> dict:
        return {
            "recipe_version": RECIPE_VERSION,
            "sglang": SGLANG_VERSION,
            "torch": TORCH_VERSION,
            "torchvision": TORCHVISION_VERSION,
            "triton": TRITON_VERSION,
            "model": model.DEFAULT_SPEC.name,
            "shim_sha256": _sha256(Path(__file__).with_name("shim.py")),
            "model_sha256": _sha256(Path(model.__file__)),
        }

    def is_installed(self) -> bool:
        recorded = _read_marker(self)
        return all(recorded.get(k) == v for k, v in self.recipe().items())


def _read_marker(harness: Harness) -> dict:
    try:
        return json.loads(harness.marker.read_text())
    except (OSError, ValueError):
        return {}


def resolve_prefix(prefix: str | os.PathLike | None = None) -> Path:
    """The harness location: the argument, else $SERVETWIN_SGLANG_ENV, else the default."""
    chosen = prefix or os.environ.get(ENV_VAR) or DEFAULT_PREFIX
    return Path(chosen).expanduser().resolve()


def require_harness(prefix: str | os.PathLike | None = None) -> Harness:
    """The installed harness, or a HarnessError saying how to install it."""
    harness = Harness(resolve_prefix(prefix))
    if not harness.is_installed():
        hint = "" if prefix is None and ENV_VAR not in os.environ else f" --prefix {harness.prefix}"
        state = "out of date" if harness.marker.exists() else "not installed"
        raise HarnessError(
            f"the CPU SGLang harness is {state} at {harness.prefix}: "
            f"run `servetwin live install-cpu{hint}` first"
        )
    return harness


def install(prefix: str | os.PathLike | None = None, log: Log = print) -> Harness:
    """Install the harness (a no-op when the marker says it is complete) and return it."""
    harness = Harness(resolve_prefix(prefix))
    if harness.is_installed():
        log(f"CPU SGLang harness already installed at {harness.prefix}")
        return harness
    log(f"installing the CPU SGLang harness into {harness.prefix} (about 2.5 GB, a few minutes)")
    log(f"pip's output goes to {harness.install_log}")
    started = time.monotonic()
    fresh = not harness.python.exists()
    previous = _read_marker(harness)
    harness.marker.unlink(missing_ok=True)
    steps = _steps(harness)
    for number, (title, action) in enumerate(steps, 1):
        log(f"[{number}/{len(steps)}] {title}")
        step_started = time.monotonic()
        action()
        log(f"      done in {time.monotonic() - step_started:.0f} s")
    seconds = round(time.monotonic() - started, 1)
    fresh_s = seconds if fresh else previous.get("fresh_install_s")
    record = harness.recipe() | {"installed_s": seconds, "fresh_install_s": fresh_s}
    harness.marker.write_text(json.dumps(record, indent=2) + "\n")
    log(f"CPU SGLang harness ready at {harness.prefix} ({record['installed_s']:.0f} s)")
    return harness


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def plugin_installed_from(harness: Harness) -> Path | None:
    """The project directory servetwin is installed from (editable) in the harness venv,
    None when it is not installed there. Read from the distribution's `direct_url.json`."""
    code = ("import json, importlib.metadata as m\n"
            "try:\n  d = m.distribution('servetwin')\n"
            "except m.PackageNotFoundError:\n  print('')\n"
            "else:\n  print(json.loads(d.read_text('direct_url.json') or '{}').get('url', ''))")
    # cwd: a checkout's own servetwin.egg-info would answer instead of the venv's
    out = subprocess.run([str(harness.python), "-c", code], capture_output=True, text=True,
                         env=harness_env(), cwd=harness.prefix)
    url = out.stdout.strip()
    return Path(url.removeprefix("file://")) if url.startswith("file://") else None


def ensure_plugin(harness: Harness, log: Log = print, root: Path = PROJECT_ROOT) -> None:
    """`pip install --no-deps -e ROOT` into the harness venv, so SGLang finds servetwin's
    plugin entry point there; a no-op when it is already installed from ROOT. Kept out of
    the marker: another checkout re-points it without making the harness "out of date"."""
    if plugin_installed_from(harness) == root:
        log(f"servetwin plugin installed in the harness from {root}")
        return
    log(f"installing servetwin (its SGLang plugin) into the harness from {root}")
    _run_logged([str(harness.python), "-m", "pip", "install", "--progress-bar", "off",
                 "--no-deps", "--no-build-isolation", "-e", str(root)], harness.install_log)


def _steps(harness: Harness) -> list[tuple[str, Callable[[], None]]]:
    constraints = harness.prefix / "constraints.txt"
    pip = [str(harness.python), "-m", "pip", "install", "--progress-bar", "off"]

    def _run(cmd: list[str]) -> None:
        _run_logged(cmd, harness.install_log)

    return [
        ("create the virtualenv", lambda: _create_venv(harness, constraints)),
        (
            f"CPU torch {TORCH_VERSION}",
            lambda: _run([*pip, "-c", str(constraints), f"torch=={TORCH_VERSION}"]),
        ),
        (
            f"sglang {SGLANG_VERSION} without its dependencies",
            lambda: _run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"]),
        ),
        (
            f"{len(DEPENDENCIES)} curated dependencies (all versions pinned)",
            lambda: _run([*pip, "-c", str(constraints), *DEPENDENCIES]),
        ),
        (
            f"torchvision {TORCHVISION_VERSION} without its dependencies",
            lambda: _run([*pip, "--no-deps", f"torchvision=={TORCHVISION_VERSION}"]),
        ),
        ("torchvision and sgl_kernel import shims", lambda: _install_shim(harness)),
        ("check that sglang imports", lambda: _check_import(harness)),
        (f"tiny dummy-weight model {model.DEFAULT_SPEC.name}", lambda: _make_model(harness)),
    ]


def _create_venv(harness: Harness, constraints: Path) -> None:
    if not harness.python.exists():
        venv.EnvBuilder(with_pip=True, clear=False).create(harness.prefix)
    constraints.write_text("\n".join(CONSTRAINTS + LOCKED) + "\n")


def _site_packages(harness: Harness) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(harness.python), "-c", code], check=True, capture_output=True)
    return Path(out.stdout.decode().strip())


def _install_shim(harness: Harness) -> None:
    site = _site_packages(harness)
    source = Path(__file__).with_name("shim.py").read_text()
    (site / f"{SHIM_MODULE}.py").write_text(source)
    # A .pth line that starts with `import` is executed at interpreter start-up.
    (site / SHIM_PTH).write_text(f"import {SHIM_MODULE}; {SHIM_MODULE}.activate()\n")


def _check_import(harness: Harness) -> None:
    code = "import torch, torchvision, sglang.srt.server_args; print(torch.__version__)"
    env = harness_env()
    out = subprocess.run([str(harness.python), "-c", code], env=env, capture_output=True)
    if out.returncode != 0:
        raise HarnessError(f"sglang does not import in the harness:\n{out.stderr.decode()[-3000:]}")
    if "+cpu" not in out.stdout.decode():
        raise HarnessError(f"the harness torch is not the CPU build: {out.stdout.decode()}")


def _make_model(harness: Harness) -> None:
    model.create_model_dir(harness.model_dir, python=harness.python)


def harness_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a harness process runs in: the shims on, CPU engine, offline hub."""
    env = dict(os.environ if base is None else base)
    env.update(
        SERVETWIN_CPU_HARNESS="1",
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONNOUSERSITE="1",
    )
    # One torch thread: with the default (all cores) the server collapses whenever another
    # process competes for the cores (measured: median ITL 1,305 ms vs 29 ms; docs/live.md).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONPATH", None)  # the project's own paths must not leak into the harness
    return env


def _run_logged(cmd: list[str], log_file: Path) -> None:
    with open(log_file, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise HarnessError(f"command failed ({code}): {' '.join(cmd)}\n{tail}")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", help=f"harness venv (default ${ENV_VAR} or {DEFAULT_PREFIX})")
    args = parser.parse_args(argv)
    try:
        harness = install(args.prefix, log=lambda line: print(line, flush=True))
        ensure_plugin(harness, log=lambda line: print(line, flush=True))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
