"""Command-line flags shared by several commands: SGLang's server arguments by their own
names, generated from `twin.config.ServerArgs` so the two cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path

from twin.config import KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULE_POLICIES, ServerArgs
from twin.hardware import GPUS
from twin.hicache import HOST_MEMORY_MODES, IO_BACKENDS, MEM_LAYOUTS, WRITE_POLICIES

CHOICES = {
    "schedule_policy": SCHEDULE_POLICIES,
    "kv_cache_dtype": tuple(KV_CACHE_DTYPES),
    "quantization": tuple(q for q in QUANTIZATIONS if q),
    "hicache_write_policy": WRITE_POLICIES,
    "hicache_io_backend": IO_BACKENDS,
    "hicache_mem_layout": MEM_LAYOUTS,
    "hicache_host_memory_mode": HOST_MEMORY_MODES,
}
HELP = {
    "model_path": "Hugging Face id from the catalog or a local dir/config.json",
    "tp_size": "tensor-parallel size (GPUs per replica)",
    "mem_fraction_static": "share of GPU memory for weights + KV (default: SGLang's rule)",
    "max_total_tokens": "KV pool size in tokens (default: what fits)",
    "chunked_prefill_size": "max tokens per prefill chunk; -1 disables (default by GPU)",
    "max_running_requests": "cap on running requests (default: SGLang's rule)",
    "enable_hierarchical_cache": "SGLang's HiCache: a host-memory tier behind the radix cache; "
    "evicted prefixes are loaded back over the host link (twin/hicache.py, docs/memory.md)",
    "hicache_ratio": "host KV pool / device KV pool (default 2.0, SGLang's in cache mode)",
    "hicache_size": "host KV pool in GB per GPU; overrides --hicache-ratio",
    "hicache_write_policy": "when a radix node is copied to host: on first insert "
    "(write_through), second (write_through_selective), on eviction (write_back)",
    "hicache_io_backend": "accepted and resolved as SGLang does; same host-link bandwidth",
    "hicache_mem_layout": "accepted and resolved as SGLang does; same host-link bandwidth",
    "hicache_host_memory_mode": "cache only (buffer_only needs a storage backend)",
    "hicache_storage_backend": "not modelled (the twin has the host tier only): leave unset",
}
# The users' deployment differs from SGLang's defaults here (shown in --help).
DEPLOYMENT_DEFAULTS = {"tp_size": 2}
DEFAULT_GPU = "a100-pcie-80gb"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's server arguments and `--gpu`. Every default is None, so that
    `given_server_args` knows what the user typed; `server_args_from` fills the rest from a
    base (a calibration profile's deployment) or the defaults shown in --help."""
    group = parser.add_argument_group("SGLang server arguments (SGLang's names and defaults)")
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        default = DEPLOYMENT_DEFAULTS.get(f.name, f.default)
        help_text = HELP.get(f.name, "")
        if f.name in DEPLOYMENT_DEFAULTS:
            help_text += f" (default {default}: the users' deployment; SGLang's is {f.default})"
        elif default is not None and not isinstance(default, bool):
            help_text += f" (default {default})"
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text or None)
            continue
        group.add_argument(flag, type=_base_type(hint), default=None,
                           choices=CHOICES.get(f.name),
                           metavar=f.name.upper() if f.name not in CHOICES else None,
                           help=help_text or None)
    parser.add_argument("--gpu", default=None, choices=sorted(GPUS),
                        help=f"GPU type (default {DEFAULT_GPU}: the users' cards; with "
                        "--calibration, the profile's device: a CPU-harness profile has no "
                        "GPU, and the GPU only sizes capacity and copy bandwidths there)")


def _base_type(hint: object) -> type:
    if isinstance(hint, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint  # type: ignore[return-value]


def given_server_args(ns: argparse.Namespace) -> dict:
    """The server arguments (and `gpu`) the user gave on the command line."""
    names = [f.name for f in dataclasses.fields(ServerArgs)] + ["gpu"]
    return {n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None}


def server_args_from(ns: argparse.Namespace, base: dict | None = None) -> ServerArgs:
    """The command line's server arguments over `base` (field: value) over the defaults."""
    values = {**DEPLOYMENT_DEFAULTS, **(base or {}), **given_server_args(ns)}
    values.pop("gpu", None)
    return ServerArgs(**values)


def gpu_from(ns: argparse.Namespace, base: str | None = None) -> str:
    return ns.gpu or base or DEFAULT_GPU


def add_workload_args(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """`--workload` or `--trace` with its options: the same flags for every command that
    runs a workload (simulate, live replay, validate)."""
    from twin.traces import formats
    from twin.workload import PRESETS

    w = parser.add_argument_group("workload")
    tail = f" (default {default} when no --trace)" if default else ""
    w.add_argument("--workload", default=None,
                   help=f"a preset ({', '.join(PRESETS)}), a preset with arrival keys "
                   "(finance-qa,n=20000; finance-qa,arrival=poisson,rate=0.4,n=100000) or a "
                   f"key=value spec{tail}")
    w.add_argument("--trace", type=Path, help="a trace file instead of --workload")
    w.add_argument("--trace-format", choices=formats(), help="format of --trace")
    w.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="multiply inter-arrival gaps by F (default 1)")
    w.add_argument("--trace-offset", type=float, default=0.0,
                   help="start S seconds into the trace (default 0)")
    w.add_argument("--trace-limit", type=int, default=None, help="use at most N requests")
    w.add_argument("--seed", type=int, default=0,
                   help="workload (and live token-id) seed (default 0)")


def workload_from(ns: argparse.Namespace, default: str | None = None):
    """The workload the `add_workload_args` flags name; `default` when neither is given."""
    from twin.errors import ConfigError
    from twin.inputs import SEED, check
    from twin.traces import formats, load_trace
    from twin.workload import get_workload

    if ns.trace is not None and ns.workload is not None or (
            ns.trace is None and ns.workload is None and default is None):
        raise ConfigError("give exactly one of --workload SPEC and --trace FILE")
    check("--seed", ns.seed, SEED)
    if ns.trace is not None:
        if not ns.trace_format:
            raise ConfigError(f"--trace needs --trace-format ({', '.join(formats())})")
        workload = load_trace(ns.trace, ns.trace_format, time_scale=ns.trace_time_scale,
                              offset_s=ns.trace_offset, limit=ns.trace_limit)
        for note in workload.notes:
            print(f"servetwin: warning: {note}", file=sys.stderr)
        return workload
    return get_workload(ns.workload or default, ns.seed)
