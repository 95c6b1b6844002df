"""`calibration: FILE` on a deployment's replica or pool (twin/fleet.py): the profile's
checks and what a calibrated replica takes from it.

The profile must be of the replica's engine (a vLLM step is one token budget of mixed
prefill and decode, an SGLang step is not), model and GPU; a CPU-server profile sizes
memory on `CPU_PROFILE_GPU` (its step times are the CPU's), as `servetwin simulate
--calibration` does. A vLLM replica takes the profile's server arguments (vLLM's names)
and model as defaults, the file's own winning. Errors name the file, line and key.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from twin.errors import ServetwinError

# the GPU entry of a replica calibrated on a CPU server: it only sizes memory
CPU_PROFILE_GPU = "a100-pcie-80gb"


def calibrated(where, at: str, value, engine: str, args: dict, rep: dict,
               gpu: str) -> tuple[str, dict, str]:
    """(the profile's resolved path, the server arguments, the GPU entry) of a replica
    with `calibration: FILE`: the profile must be of the replica's engine and model and
    of its GPU; a vLLM replica takes the profile's server arguments (vLLM's names) as
    defaults, the file's own winning."""
    from twin.perf.fitted import check_engine, load_profile

    if not isinstance(value, str) or not value:
        raise where.err(at, f"{value!r}: must be the path of a calibration profile (JSON)")
    path = Path(value)
    if not path.is_absolute() and Path(where.path).is_file():
        path = Path(where.path).resolve().parent / path  # relative to the deployment file
    try:
        profile = load_profile(path)
        check_engine(profile, engine, str(path))
    except ServetwinError as exc:
        raise where.err(at, str(exc).removeprefix("--calibration ")) from None
    model = profile.get("model") if isinstance(profile.get("model"), dict) else {}
    if engine == "vllm":
        from twin.vllm_replica import VllmArgs

        known = {f.name for f in fields(VllmArgs)}
        recorded = profile.get("server_args") if isinstance(profile.get("server_args"),
                                                           dict) else {}
        base = {k: v for k, v in recorded.items() if k in known}
        if model.get("path"):
            base["model"] = model["path"]
        args = {**base, **args}
    asked = args.get("model" if engine == "vllm" else "model_path")
    if asked and model.get("name") and Path(str(asked)).name != model["name"]:
        raise where.err(at, f"{path}: model: profile {model['name']!r}, replica "
                        f"{Path(str(asked)).name!r}: its step times are another model's")
    device = profile.get("device") if isinstance(profile.get("device"), dict) else {}
    own = rep.get("gpu")
    if device.get("kind") == "cpu":
        if own is not None and own != CPU_PROFILE_GPU:
            raise where.err(f"{at.rsplit('.', 1)[0]}.gpu", f"{own!r}: the replica's profile "
                            f"({path}) measured a CPU server, whose step times are not a "
                            "GPU's: drop gpu (the twin sizes memory on "
                            f"{CPU_PROFILE_GPU} for it)")
        gpu = CPU_PROFILE_GPU
    elif device.get("gpu") and (own or gpu) != device["gpu"]:
        raise where.err(at, f"{path}: device: profile {device['gpu']!r}, replica "
                        f"{own or gpu!r}")
    return str(path), args, gpu
