"""A learned policy: a small scoring network over request features, from a weight file.

The network scores each waiting request from `request_features` (a fixed-size, normalised
vector documented there); the queue is ordered by descending score (ties: queue entry).
With `preempt_margin` set, a running request whose score is lower than the candidate's by
more than the margin may be preempted (lowest score first, each credited with its future
reservation, as SGLang credits victims). Weights come from a safetensors file (read here
with numpy: an 8-byte header length, a JSON header, raw little-endian tensors) or a JSON
file `{"layers": [{"w": [[...]], "b": [...]}, ...]}`; never from pickle. Layers are dense
with ReLU between them; the last layer has one output.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from twin.policy.base import Policy, RequestView, Snapshot
from twin.policy.registry import register

FEATURES = ("priority", "log_wait_s", "log_prompt", "log_uncached", "cached_share",
            "log_max_new", "log_generated", "is_running")
_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2"}


def request_features(r: RequestView, snap: Snapshot, running: bool) -> list[float]:
    """Features of one request, each roughly in [-1, 1] or [0, ~2]:
    priority / 10, log1p(seconds since queue entry) / 5, log1p(prompt) / 12,
    log1p(uncached prompt) / 12, cached share of the prompt, log1p(max new) / 10,
    log1p(generated) / 10, 1 for a running request."""
    wait = max(snap.now - r.queue_entry_s, 0.0)
    return [r.priority / 10, math.log1p(wait) / 5, math.log1p(r.prompt_tokens) / 12,
            math.log1p(r.uncached) / 12, r.prefix_len / max(r.prompt_tokens, 1),
            math.log1p(r.max_new_tokens) / 10, math.log1p(r.generated_tokens) / 10,
            1.0 if running else 0.0]


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: not a safetensors file (header length {n})")
    header = json.loads(data[8:8 + n])
    out = {}
    base = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name}: dtype {meta['dtype']} not supported "
                             f"(allowed: {', '.join(_DTYPES)})")
        a, b = meta["data_offsets"]
        arr = np.frombuffer(data[base + a:base + b], dtype=_DTYPES[meta["dtype"]])
        out[name] = arr.reshape(meta["shape"]).astype(np.float64)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        raw = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, sort_keys=True).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load_layers(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Dense layers (w: out x in, b: out) from `w0, b0, w1, b1, ...` tensors or JSON."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"weights {path}: no such file")
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
            layers = [(np.asarray(x["w"], float), np.asarray(x["b"], float))
                      for x in data["layers"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"weights {path}: expected {{'layers': [{{'w', 'b'}}]}}: "
                             f"{exc}") from None
    else:
        t = read_safetensors(p)
        layers, i = [], 0
        while f"w{i}" in t:
            layers.append((t[f"w{i}"], t[f"b{i}"]))
            i += 1
    width = len(FEATURES)
    for k, (w, b) in enumerate(layers):
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ValueError(f"weights {path}: layer {k}: w {w.shape}, b {b.shape}; "
                             f"expected w (n, {width}), b (n,)")
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise ValueError(f"weights {path}: layer {k}: non-finite weights")
        width = w.shape[0]
    if not layers or width != 1:
        raise ValueError(f"weights {path}: expected layers ending in one output "
                         f"({len(FEATURES)} features in: {', '.join(FEATURES)})")
    return layers


@register
class LearnedPolicy(Policy):
    name = "learned"

    def __init__(self, *, weights: str = "", preempt_margin: float | None = None) -> None:
        super().__init__()
        if not weights:
            raise ValueError("params.weights: a safetensors or JSON weight file is required")
        self.layers = load_layers(weights)
        self.margin = preempt_margin

    @property
    def preempts(self) -> bool:
        return self.margin is not None

    def scores(self, views, snap: Snapshot, running: bool) -> np.ndarray:
        if not views:
            return np.empty(0)
        x = np.array([request_features(r, snap, running) for r in views])
        for k, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if k < len(self.layers) - 1:
                x = np.maximum(x, 0.0)
        return np.round(x[:, 0], 12)  # rounding: the same order on every platform

    def order(self, snap: Snapshot) -> list[int]:
        s = self.scores(snap.waiting, snap, False)
        w = snap.waiting
        return sorted(range(len(w)), key=lambda i: (-s[i], w[i].queue_entry_s, i))

    def victims(self, snap: Snapshot) -> list[int]:
        if self.margin is None or snap.candidate is None or not snap.running:
            return []
        cand = self.scores((snap.waiting[snap.candidate],), snap, False)[0]
        s = self.scores(snap.running, snap, True)
        chosen, need = [], snap.tokens_needed
        for i in sorted(range(len(s)), key=lambda i: (s[i], i)):
            if cand - s[i] <= self.margin:
                break
            chosen.append(i)
            need -= snap.running[i].reserved_tokens
            if need <= 0:
                break
        return chosen if chosen and need <= 0 else []
