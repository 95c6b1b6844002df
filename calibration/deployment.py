"""The deployment a calibration profile measured, and the one check that a profile fits
the server it is used for.

A profile's step times describe one server: an engine version, a model, a device. Every
command that takes a profile (`simulate`, `validate`) therefore (1) refuses a profile of
another engine version, model or device than the one asked for, naming both sides, unless
`--force` (`check`), and (2) `simulate` takes the profile's deployment (model, TP, every
server argument it recorded, the device) as its defaults, flags given on the command line
winning, and says which is which (`header`).

The device: a GPU profile may name the twin's GPU type (`device.gpu`; `servetwin
calibrate --gpu`). A CPU-harness profile (`device.kind` "cpu") has no GPU: the twin still
needs a GPU entry for its start-up arithmetic and copy bandwidths, and uses
`HARNESS_GPU` there, as `validate` does (the pool is the server's `--max-total-tokens`;
step times are the profile's, never a GPU's). `--gpu` with a CPU profile asks for another
device and is refused unless `--force`; then that GPU sizes memory and copies while the
step times stay the CPU's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from calibration.session import CalibrationError
from twin.config import ServerArgs

HARNESS_GPU = "a100-pcie-80gb"  # for capacity only: a CPU server's pool is --max-total-tokens
TWIN_ENGINE = ("sglang", "0.5")  # the engine the twin models: SGLang 0.5.x
KEYS = ("engine", "version", "model", "device")
VLLM_HINT = ("; a vLLM profile is for the vLLM replicas of a deployment (`calibration: "
             "FILE` in `servetwin simulate --deployment FILE`, docs/calibration.md)")


def model_name(path: object) -> str:
    return Path(str(path)).name if path else "?"


def _section(profile: dict, key: str) -> dict:
    value = profile.get(key)
    return value if isinstance(value, dict) else {}


def profile_identity(profile: dict) -> dict:
    """engine, version, model and device of the server a profile measured (None: not
    recorded)."""
    engine, device = _section(profile, "engine"), _section(profile, "device")
    kind = device.get("kind")
    return {"engine": engine.get("name"),
            "version": str(engine["version"]) if engine.get("version") else None,
            "model": _section(profile, "model").get("name"),
            "device": kind, "gpu": device.get("gpu")}


def server_identity(info: dict) -> dict:
    """The same for a live server, from its `/server_info`."""
    return {"engine": "sglang", "version": str(info.get("version")),
            "model": model_name(info.get("model_path")), "device": info.get("device") or "cuda"}


def _same(key: str, have: str, want: str) -> bool:
    if key == "version":  # "0.5" asks for any 0.5.x
        return have == want or have.startswith(want + ".")
    return have == want


def mismatches(have: dict, want: dict, side: str) -> list[str]:
    """`key: profile X, <side> Y` for every key both sides know and disagree on. The
    device is a kind ("cpu", "cuda") or, asked by `--gpu`, a GPU name: a profile naming
    its GPU is compared by name."""
    have = dict(have)
    if have.get("gpu") and want.get("device") not in (None, "cpu", "cuda"):
        have["device"] = have["gpu"]
    return [f"{k}: profile {have[k]!r}, {side} {want[k]!r}" for k in KEYS
            if have.get(k) is not None and want.get(k) is not None
            and not _same(k, str(have[k]), str(want[k]))]


def check(profile: dict, want: dict, force: bool, side: str, hint: str) -> list[str]:
    """Refuse (`CalibrationError`) a profile that measured another server than `want`
    (engine, version, model, device; None: not asked); with `force`, the differences as
    warnings instead."""
    diffs = mismatches(profile_identity(profile), want, side)
    engine = [d for d in diffs if d.startswith("engine:")]
    if engine:  # another engine's steps are another scheduler's: no --force for that
        raise CalibrationError(f"the calibration profile was made on another engine "
                               f"({engine[0]}): its step times are for that engine's "
                               f"scheduler, not this one's. {hint}" + VLLM_HINT * (
                                   profile_identity(profile)["engine"] == "vllm"))
    if diffs and not force:
        raise CalibrationError(f"the calibration profile was made on another {side_noun(side)} ("
                               + "; ".join(diffs) + f"); its step times do not apply. {hint}, "
                               "or pass --force to use it anyway")
    return [f"profile mismatch ignored (--force): {d}" for d in diffs]


def side_noun(side: str) -> str:
    return "server" if side == "server" else "deployment than the one asked for"


@dataclass(frozen=True)
class Deployment:
    """What a profile measured, as the twin's defaults."""

    server_args: dict  # ServerArgs field: value, as the server ran
    gpu: str  # the twin's GPU entry (HARNESS_GPU for a CPU server)
    device: str  # "cpu", "cuda" or a GPU name
    gpu_note: str  # why that GPU


def profile_deployment(profile: dict) -> Deployment:
    """The server a profile measured: its `server_args` as `ServerArgs` values (the CPU
    harness runs without CUDA graphs; an unset pool is the pool the server reported), and
    the GPU entry the twin uses for it."""
    from runtime.server_api import twin_server_values

    recorded = _section(profile, "server_args")
    device = _section(profile, "device")
    kind = str(device.get("kind") or recorded.get("device") or "cuda")
    values = twin_server_values({"device": kind, **recorded})
    if "tp_size" not in values and isinstance(device.get("tp_size"), int):
        values["tp_size"] = device["tp_size"]
    if "model_path" not in values and _section(profile, "model").get("path"):
        values["model_path"] = profile["model"]["path"]
    if kind == "cpu":
        return Deployment(values, HARNESS_GPU, "cpu",
                          "the profile measured a CPU server: this GPU entry only sizes "
                          "memory and copy bandwidths; step times are the CPU's")
    if device.get("gpu"):
        return Deployment(values, str(device["gpu"]), str(device["gpu"]), "the profile's GPU")
    return Deployment(values, "", kind, "the profile does not name its GPU")


def asked_identity(given: dict, dep: Deployment) -> dict:
    """What a command line asks for, to check a profile against: the twin's engine, and
    the model and device only where the user named them."""
    want = {"engine": TWIN_ENGINE[0], "version": TWIN_ENGINE[1], "model": None,
            "device": None}
    if "model_path" in given:
        want["model"] = model_name(given["model_path"])
    if "gpu" in given and (dep.device == "cpu" or dep.gpu):
        want["device"] = given["gpu"]
    return want


def header(path: object, profile: dict, dep: Deployment, given: dict,
           args: ServerArgs, gpu: str) -> list[str]:
    """Lines saying which values came from the profile and which the command line
    overrode (with the profile's value)."""
    ident = profile_identity(profile)
    lines = [f"calibration: {path} (SGLang {ident['version']}, model {ident['model']}, "
             f"device {dep.device}; {_section(profile, 'device').get('machine', '?')}; "
             f"{profile.get('date', '?')})"]
    names = [f.name for f in fields(ServerArgs)]
    taken = [f"{n} {getattr(args, n)}" for n in names if n in dep.server_args and n not in given]
    over = [f"{n} {given[n]} (profile {dep.server_args[n]})" for n in names
            if n in given and n in dep.server_args and given[n] != dep.server_args[n]]
    lines += _wrapped("from the profile: ", taken or ["nothing (it records no server "
                                                      "arguments)"])
    if over:
        lines += _wrapped("overridden on the command line: ", over)
    if "gpu" in given:
        lines.append(f"gpu: {gpu} (command line; {dep.gpu_note})")
    else:
        lines.append(f"gpu: {gpu} ({dep.gpu_note})")
    return lines


def _wrapped(lead: str, items: list[str], width: int = 92) -> list[str]:
    lines, line = [], lead
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else "")
        if len(line) + len(piece) > width and line.strip():
            lines.append(line.rstrip())
            line = "  "
        line += piece
    return lines + [line.rstrip()]


def server_differences(profile: dict, info: dict) -> list[str]:
    """Server arguments a live server runs with that differ from the profile's (validate:
    the twin follows the live server)."""
    from runtime.server_api import twin_server_values

    have = profile_deployment(profile).server_args
    now = twin_server_values(info)
    return [f"{k}: profile {have[k]}, server {now[k]}" for k in [f.name for f in
            fields(ServerArgs)] if k in have and k in now and have[k] != now[k]]
