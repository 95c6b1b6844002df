"""Weights in and out of torch without pickle: a trained policy network to the numpy
`learned` selector's weight file, and whole state dicts to and from safetensors.

SB3's own `.zip` save pickles its objects; here every tensor goes through
`twin.policy.learned.write_safetensors` (float32) and everything else through JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments.rl.config import EnvConfig
from twin.policy.learned import read_safetensors_meta, write_safetensors


def actor_layers(policy) -> list[tuple[np.ndarray, np.ndarray]]:
    """The action network of an SB3 `ActorCriticPolicy` with ReLU activations (the
    observation flattened as is): policy_net's Linear layers, then action_net."""
    import torch.nn as nn

    linears = [m for m in policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)]
    acts = [m for m in policy.mlp_extractor.policy_net if not isinstance(m, nn.Linear)]
    if not all(isinstance(a, nn.ReLU) for a in acts):
        raise ValueError(f"policy activations {acts}: the numpy policy runs ReLU only")
    linears.append(policy.action_net)
    return [(m.weight.detach().cpu().numpy().astype(np.float64),
             m.bias.detach().cpu().numpy().astype(np.float64)) for m in linears]


def selector_meta(cfg: EnvConfig) -> dict:
    return {"kind": "selector", "features": cfg.features, "k_slots": cfg.k_slots,
            "menu": list(cfg.menu), "targets": cfg.targets.to_json(),
            "chunk_cap": cfg.chunk_cap, **({"prefill": list(cfg.prefill)} if cfg.prefill
                                           else {}),
            **({"chunks": list(cfg.chunk_answer)} if cfg.chunk_answer else {})}


def export_selector(layers, cfg: EnvConfig, path: Path, about: dict | None = None) -> Path:
    """Write the weight file the `learned` policy reads; `about` (how it was trained, its
    evaluation) goes into a JSON sidecar `PATH.json` beside it."""
    tensors = {}
    for i, (w, b) in enumerate(layers):
        tensors[f"w{i}"], tensors[f"b{i}"] = w, b
    meta = {"servetwin": json.dumps(selector_meta(cfg), sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, tensors, meta)
    if about is not None:
        path.with_suffix(".json").write_text(json.dumps(about, indent=2, sort_keys=True) + "\n")
    return path


def save_state(path: Path, state: dict, meta: dict | None = None) -> None:
    """A flat `{name: tensor}` dict (torch or numpy) as safetensors."""
    arrays = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v,
                            dtype=np.float32) for k, v in state.items()}
    write_safetensors(path, arrays, {k: json.dumps(v) for k, v in (meta or {}).items()})


def load_state(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    tensors, raw = read_safetensors_meta(path)
    return tensors, {k: json.loads(v) for k, v in raw.items()}


def optimizer_to_flat(opt_state: dict) -> tuple[dict, dict]:
    """torch optimizer `state_dict()` as tensors `optim.{param}.{key}` plus JSON for the
    parameter groups."""
    flat = {}
    for idx, st in opt_state["state"].items():
        for key, val in st.items():
            flat[f"optim.{idx}.{key}"] = val
    return flat, {"param_groups": opt_state["param_groups"]}


def optimizer_from_flat(tensors: dict[str, np.ndarray], groups: list) -> dict:
    import torch

    state: dict[int, dict] = {}
    for name, arr in tensors.items():
        if not name.startswith("optim."):
            continue
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = torch.tensor(arr, dtype=torch.float32)
    return {"state": state, "param_groups": groups}
