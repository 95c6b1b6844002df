"""One configuration, two engines: the real `python -m sglang.launch_server` command from the
same `ServerArgs` the twin simulates, and what does not carry over.

- `launch_command(args)`: SGLang's flags for every argument that differs from SGLang's
  default (plus the model and TP size), so a simulated and a live deployment cannot drift.
- `not_sglang(sim_config)`: the twin's own settings (GPU type, step-time backend, the
  users' scheduler and memory design) that no SGLang flag carries, so they are reported,
  not silently dropped, when a simulated configuration goes live.
- `sglang_server_args(python)`: SGLang 0.5.23's own `ServerArgs` fields and defaults, read
  from an installed SGLang (the CPU harness, or the `live` extra), so `check_flags` can say
  which of the twin's flags SGLang lacks and where a default differs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from twin.config import ServerArgs

# The twin's ServerArgs values whose SGLang default is derived at start-up (None in both).
_DERIVED = {"context_length", "mem_fraction_static", "max_total_tokens",
            "chunked_prefill_size", "max_running_requests", "cuda_graph_max_bs_decode",
            "quantization"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def launch_command(args: ServerArgs, *, python: str = "python", host: str = "127.0.0.1",
                   port: int = 30000, extra: Sequence[str] = ()) -> list[str]:
    """The `sglang.launch_server` command for `args` (only non-default values are passed,
    with `--model-path` and `--tp-size` always)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--tp-size", str(args.tp_size), "--host", host, "--port", str(port)]
    defaults = ServerArgs()
    for f in dataclasses.fields(ServerArgs):
        if f.name in ("model_path", "tp_size"):
            continue
        value = getattr(args, f.name)
        if value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            cmd.append(flag(f.name))
        else:
            cmd += [flag(f.name), str(value)]
    return cmd + list(extra)


TWIN_ONLY = {
    "gpu": "the GPU type is the machine's, not a flag",
    "step_time_backend": "the live engine runs real kernels",
    "kv_allocator": "SGLang 0.5.23 has only its token/paged pool",
    "buddy_min_block_bytes": "no buddy allocator in SGLang",
    "kv_reserve_fraction": "no contiguous pre-allocation in SGLang",
    "preemption_mode": "the users' scheduler runs in the twin; live it needs the policy plugin",
    "time_slice_ms": "SGLang schedules on events, not time slices",
    "priority_weights": "the users' score is the twin's policy",
    "preemption_threshold": "the users' score threshold (SGLang's own is "
                            "--priority-scheduling-preemption-threshold)",
    "swap_min_tokens": "SGLang retracts and recomputes; it does not swap to host",
    "host_kv_bytes": "no swap in SGLang",
    "defrag_every": "SGLang's token pool needs no compaction",
    "defrag_threshold": "SGLang's token pool needs no compaction",
}


def not_sglang(sim_config: object) -> list[str]:
    """The settings of a `twin.sim.SimConfig` that differ from its defaults and that no
    SGLang flag carries, each with the reason."""
    default = type(sim_config)()
    out = []
    for name, why in TWIN_ONLY.items():
        value = getattr(sim_config, name, None)
        if name != "gpu" and value == getattr(default, name, None):
            continue
        out.append(f"{flag(name)} {value}: not an SGLang flag ({why})")
    return out


_DUMP = """
import json, msgspec
from sglang.srt.server_args import ServerArgs  # a msgspec Struct in SGLang 0.5.23
out = {}
for f in msgspec.structs.fields(ServerArgs):
    d = None if f.default is msgspec.NODEFAULT else f.default
    out[f.name] = d if isinstance(d, (int, float, str, bool, type(None))) else repr(d)
print(json.dumps(out))
"""


def sglang_server_args(python: str | Path, env: dict[str, str] | None = None) -> dict:
    """SGLang's own `ServerArgs` field names and static defaults, from an installed SGLang."""
    out = subprocess.run([str(python), "-c", _DUMP], capture_output=True, text=True, env=env,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"could not read SGLang's ServerArgs with {python}: "
                           f"{out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_flags(sglang_fields: dict) -> tuple[list[str], list[str]]:
    """(twin flags SGLang lacks, defaults that differ), against SGLang's own fields."""
    missing, differ = [], []
    for f in dataclasses.fields(ServerArgs):
        if f.name not in sglang_fields:
            missing.append(flag(f.name))
            continue
        ours, theirs = f.default, sglang_fields[f.name]
        if f.name in _DERIVED or f.name == "model_path":
            continue
        if ours != theirs and not (f.name == "page_size" and theirs is None and ours == 1):
            differ.append(f"{flag(f.name)}: twin {ours!r}, SGLang {theirs!r}")
    return missing, differ
