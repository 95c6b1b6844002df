"""`servetwin emulate`: the twin of one SGLang server as a live HTTP server on the wall clock."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys

from servetwin.args import add_server_args, gpu_from, server_args_from
from twin.errors import ConfigError
from twin.inputs import POSITIVE, check


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate", help="serve the twin of an SGLang server over SGLang's HTTP API",
        description="Run the twin of one SGLang 0.5.x server on the wall clock behind "
        "SGLang's HTTP interface: /generate (streaming or not), /v1/completions, "
        "/v1/models, /health, /health_generate, /server_info, /get_model_info, "
        "/flush_cache and /metrics under SGLang's metric names. Clients, the real "
        "sglang-router, bench_serving and dashboards see an SGLang server of the emulated "
        "GPU and model; the text it returns is filler. Output length is max_new_tokens "
        "(the emulator does not know where a model would stop, with or without "
        "ignore_eos); a text prompt counts one token per 4 bytes of UTF-8. Several "
        "processes on several ports make a fleet (put the sglang-router in front). "
        "Times in responses and /metrics are the emulated server's (at --speed F a "
        "client's wall clock sees 1/F of them). docs/emulator.md.",
        epilog="example: servetwin emulate --model-path meta-llama/Llama-3.1-8B "
        "--tp-size 1 --gpu h100-sxm-80gb --port 30000 --speed 10")
    add_server_args(p)
    e = p.add_argument_group("the emulated server")
    e.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    e.add_argument("--port", type=int, default=30000,
                   help="port (default 30000, SGLang's; 0 picks a free one and prints it)")
    e.add_argument("--speed", type=float, default=1.0,
                   help="simulated seconds per wall-clock second (default 1: real time; "
                   "10 runs ten times faster)")
    e.add_argument("--weight-version", default="default",
                   help="echoed in meta_info.weight_version, as SGLang does (default "
                   "'default'; a fleet names its replicas with it)")
    e.add_argument("--step-time-backend", default=None,
                   help="roofline | opdb | fitted (default: opdb where measured data "
                   "covers the model and GPU, else roofline)")
    e.add_argument("--calibration", default=None, metavar="PROFILE",
                   help="a calibration profile from `servetwin calibrate`: its fitted step "
                   "time")
    e.add_argument("--policy", default=None, metavar="SPEC",
                   help="a scheduling policy name or spec file, as for simulate")
    p.set_defaults(func=run, _parser=p)


def config_from(ns: argparse.Namespace):
    from twin.sim import SimConfig

    check("--speed", ns.speed, POSITIVE)
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port {ns.port}: must be in 0..65535")
    return SimConfig(args=server_args_from(ns), gpu=gpu_from(ns),
                     step_time_backend=ns.step_time_backend, calibration=ns.calibration,
                     policy=ns.policy)


def run(ns: argparse.Namespace) -> int:
    from runtime.emulator.server import Emulator

    cfg = config_from(ns)
    em = Emulator(cfg, ns.speed, weight_version=ns.weight_version, host=ns.host,
                  port=ns.port, launch_command=shlex.join(sys.argv[1:]))
    try:
        asyncio.run(_serve(em))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc}") \
            from None
    return 0


async def _serve(em) -> None:
    import gc

    url = await em.start()
    gc.collect()
    gc.freeze()  # start-up's objects (step-time tables, modules) out of the collector's way
    cap = em.cap
    print(f"emulating {cap.model.name} on {cap.tp_size}x {em.cfg.gpu} (step-time backend "
          f"{em.engine.backend}; KV pool {cap.max_total_num_tokens} tokens, context "
          f"{cap.context_len}) at speed {em.speed:g}", flush=True)
    print(f"ready: {url}  port {em.port}; Ctrl-C stops it", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await em.stop()
