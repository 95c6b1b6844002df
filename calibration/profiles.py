"""The calibration profile file: build it from samples, write it, check it against a server.

A profile (JSON) says what was calibrated and how well (docs/calibration.md):
`engine` (name, version), `model`, `device`, `server_args` (the server's own, from
`/server_info`), `step_time` (the twin's backend, form and coefficients with standard
errors: the only part `twin.perf.fitted` reads), `request_path` (latency outside the
scheduler's steps: HTTP, tokenizer, detokenizer), `fit` (sample counts, held-out and
in-sample residuals), `sources` and `date`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import numpy as np

from calibration.deployment import HARNESS_GPU, check, model_name, server_identity
from calibration.fit import fit_step_time
from calibration.session import CalibrationError
from twin.config import ServerArgs

FORMAT = 1
__all__ = ["HARNESS_GPU", "build_profile", "check_profile", "identity", "model_name"]


def identity(info: dict) -> dict:
    """What a profile must share with a server to describe it (a resumed or combined
    calibration's runs must share it too)."""
    return {"engine": "sglang", "version": str(info.get("version")),
            "model": model_name(info.get("model_path"))}


def server_args_subset(info: dict) -> dict:
    keys = [f.name for f in fields(ServerArgs)] + [
        "max_total_num_tokens", "max_req_input_len", "device", "dtype", "attention_backend",
        "disable_overlap_schedule", "stream_interval", "enable_metrics"]
    return {k: info[k] for k in keys if k in info}


def base_for(info: dict):
    """(name, factory) of the uncalibrated backend a correction can sit on, or (None, None)
    when the model cannot be read here or the device is unknown to the twin."""
    if info.get("device") != "cpu":
        return None, None
    try:
        from runtime.server_api import twin_server_args
        from twin.config import derive_capacity
        from twin.perf.fitted import base_model

        args = twin_server_args(info)
        cap = derive_capacity(args, HARNESS_GPU)
        base_model("roofline-cpu", cap, args)
    except Exception:  # noqa: BLE001 - any model the twin cannot build: no correction form
        return None, None
    return "roofline-cpu", lambda: base_model("roofline-cpu", cap, args)


def request_path(samples: Sequence[dict]) -> dict:
    """Median latency of the request path outside the steps (from forward-stamp samples),
    and the tokenizer manager's costs where the samples carry its stamps
    (`tokenizer_costs`)."""
    out = {}
    for key in ("ingress_s", "egress_s", "overhead_s"):
        vals = [s[key] for s in samples if key in s]
        out[key] = round(float(np.median(vals)), 6) if vals else 0.0
        out[f"{key[:-2]}_samples"] = len(vals)
    return out | tokenizer_costs(samples)


def tokenizer_costs(samples: Sequence[dict]) -> dict:
    """twin/request_path.py's costs fitted from the samples' tokenizer stamps
    (calibration/derive.py): `per_request_s + per_token_s x prompt` by least squares over
    the dispatch gaps of requests that queued at the tokenizer manager (one prompt length
    only: its median gap per request, 0 per token; both clipped at 0), and `latency_s`,
    the rest of the way in: the median of a first-dispatched request's ingress less its
    service. {} without stamps (older servers, older profiles)."""
    pts = [g for s in samples for g in s.get("dispatch", ())]
    if not pts:
        return {}
    x = np.array([p for p, _ in pts], dtype=float)
    y = np.array([g for _, g in pts], dtype=float)
    if len(set(x.tolist())) < 2:
        per_req, per_tok = float(np.median(y)), 0.0
    else:
        (per_req, per_tok), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y,
                                                  rcond=None)
        if per_tok < 0:  # no measurable token cost: all of it per request
            per_req, per_tok = float(np.median(y)), 0.0
        elif per_req < 0:
            per_req, per_tok = 0.0, float(y.sum() / x.sum())
    firsts = [s["first"] for s in samples if "first" in s]
    lat = [ing - (per_req + per_tok * n) for n, ing in firsts]
    return {"per_request_s": round(max(float(per_req), 0.0), 9),
            "per_token_s": round(max(float(per_tok), 0.0), 12),
            "latency_s": round(max(float(np.median(lat)), 0.0), 7) if lat else 0.0,
            "tokenizer_samples": len(pts)}


def build_profile(samples: Sequence[dict], info: dict, sources: list[str],
                  device_note: str = "", gpu: str | None = None) -> dict:
    """The profile of a server (`info`: its `/server_info`); `gpu` names the twin's GPU
    type of a GPU server (`/server_info` does not say), so `simulate --calibration` takes
    it as the device."""
    if gpu and info.get("device") == "cpu":
        raise CalibrationError(f"--gpu {gpu}: the server runs on the CPU")
    base_name, factory = base_for(info)
    tp = int(info.get("tp_size") or 1)
    fitted = fit_step_time(samples, tp, factory, base_name)
    fitted["step_time"]["label"] = f"{model_name(info.get('model_path'))} on " \
                                   f"{info.get('device', '?')}"
    ident = identity(info)
    return {
        "servetwin_calibration": FORMAT,
        "engine": {"name": ident["engine"], "version": ident["version"]},
        "model": {"name": ident["model"], "path": info.get("model_path")},
        "device": {"kind": info.get("device") or "cuda", "tp_size": tp,
                   "machine": device_note or machine(), **({"gpu": gpu} if gpu else {})},
        "server_args": server_args_subset(info),
        **fitted,
        "request_path": request_path(samples),
        "sources": sources,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_profile(path: Path, profile: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    from twin.outputs import atomic_write_text

    atomic_write_text(path, json.dumps(profile, indent=2) + "\n")


def read_profile(path: Path) -> dict:
    from twin.perf.fitted import load_profile

    return load_profile(path)


def check_profile(profile: dict, info: dict, force: bool = False) -> list[str]:
    """Refuse (`CalibrationError`) a profile of another model, SGLang version or device
    than the server's; with `force`, return the differences as warnings instead."""
    return check(profile, server_identity(info), force, "server",
                 "Calibrate this server (`servetwin calibrate`)")


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.node()}: {platform.machine()}, {model}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}")


def describe_fit(profile: dict, engine: str) -> list[str]:
    """The lines `servetwin calibrate` prints for a fitted profile of either engine: the
    samples, the step-time form and its held-out error, each coefficient with its
    uncertainty, the fit's residuals (the request path is each engine's own)."""
    st, fit = profile["step_time"], profile["fit"]
    lines = [f"{engine} {profile['engine']['version']}, model {profile['model']['name']}, "
             f"{profile['device']['kind']}: {fit['samples']} samples "
             f"({', '.join(f'{k} {v}' for k, v in fit['samples_by_source'].items())})",
             f"step time: {st['form']}, {st.get('target', 'median')} target; held-out "
             "error (run total / per step, median |error|): " + ", ".join(
                 f"{f} {e.get('run_total_abs_rel', float('nan')):.1%} / "
                 f"{e.get('median_abs_rel', float('nan')):.1%}"
                 for f, e in fit["held_out"].items())]
    for name, value in st["coefficients"].items():
        err = st["uncertainty"].get(name)
        unc = f" +- {err:.3g}" if err is not None else " (not identifiable)"
        lines.append(f"  {name:<18} {value:.4g}{unc}")
    r = fit["residuals"]
    lines.append(f"fit residuals: median |error| {r['median_abs_rel']:.1%}, P90 "
                 f"{r['p90_abs_rel']:.1%}, mean {r['mean_rel']:+.1%}")
    return lines
