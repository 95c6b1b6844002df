"""A learned policy: a small dense ReLU network from a weight file, evaluated with numpy.

Two kinds, told apart by the weight file's metadata (`kind`):

- `scorer` (the default): the network scores each waiting request from `request_features`
  (a fixed-size, normalised vector documented there); the queue is ordered by descending
  score (ties: queue entry). With `preempt_margin` set, a running request whose score is
  lower than the candidate's by more than the margin may be preempted (lowest score first,
  each credited with its future reservation, as SGLang credits victims).
- `selector` (what `servetwin rl train` exports): the network reads the pass's features
  (`twin.policy.features.pass_features`, in the feature set the file names, `features`:
  `pass-v1` when absent; with the SLO targets stored in the file) and its
  largest output picks one rule from the menu (`twin.policy.menu`) for this pass: a
  queue order, or an order with admission withheld (`Plan.admit`; the plan rules, with
  the prefill model in the metadata's `prefill`). It never preempts. With `chunk_cap` in the metadata it also caps the running chunked
  prefill as SGLang's shortest-prefill-first does (twin/policy/menu.py); with `chunks`
  (`[chunk_tokens, park_steps]`, the chunk answer it was trained with) it answers the
  chunk question as `deadline` does with those params (`short_question_chunks`); a menu
  entry `RULE@TOKENSxPARK` carries its own chunk answer, and the chunk question is then
  answered by the entry the network picks on the chunk question's snapshot.

Weights come from a safetensors file (read here with numpy: an 8-byte header length, a
JSON header, raw little-endian tensors; the header's `__metadata__["servetwin"]` holds the
kind, menu and targets as JSON) or a JSON file `{"meta": {...}, "layers": [{"w": [[...]],
"b": [...]}, ...]}`; never from pickle. `learned:NAME` names a file shipped in
`twin/policy/data/` (`learned:finance-qa`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from twin.policy.base import ChunkPlan, Plan, Policy, RequestView, Snapshot
from twin.policy.deadline import answer_chunk, model_of
from twin.policy.features import (
    K_SLOTS,
    SloTargets,
    check_feature_set,
    feature_names,
    pass_features,
)
from twin.policy.menu import (
    check_chunk_answer,
    check_menu,
    entry_chunk_answers,
    prefill_params,
    rule_plan,
)
from twin.policy.registry import register
from twin.policy.sglang import ShortestPrefillFirst

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
    return read_safetensors_meta(path)[0]


def read_safetensors_meta(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (as float64) and the header's `__metadata__` (string to string)."""
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
    return out, dict(header.get("__metadata__") or {})


def write_safetensors(path: Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Tensors as little-endian float32 (names sorted: the same bytes for the same input)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, off = [], 0
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


Layers = list[tuple[np.ndarray, np.ndarray]]


def load_layers(path: str) -> Layers:
    """Dense layers of a scorer file (see `load_weights`)."""
    layers, meta = load_weights(path)
    if meta.get("kind", "scorer") != "scorer":
        raise ValueError(f"weights {path}: a {meta['kind']} file, not a scorer")
    return layers


def load_weights(path: str) -> tuple[Layers, dict]:
    """Dense layers (w: out x in, b: out) from `w0, b0, w1, b1, ...` tensors or JSON, and
    the metadata (`{}` for a plain scorer file). The shapes are checked against the kind:
    a scorer takes `FEATURES` and gives one score; a selector takes its pass features and
    gives one output per menu entry."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"weights {path}: no such file")
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            layers = [(np.asarray(x["w"], float), np.asarray(x["b"], float))
                      for x in data["layers"]]
            meta = dict(data.get("meta") or {})
        else:
            t, raw = read_safetensors_meta(p)
            layers, i = [], 0
            while f"w{i}" in t:
                layers.append((t[f"w{i}"], t[f"b{i}"]))
                i += 1
            meta = json.loads(raw["servetwin"]) if "servetwin" in raw else {}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"weights {path}: expected {{'layers': [{{'w', 'b'}}]}} or "
                         f"safetensors w0, b0, ...: {exc}") from None
    n_in, n_out = _io_width(meta, path)
    width = n_in
    for k, (w, b) in enumerate(layers):
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise ValueError(f"weights {path}: layer {k}: w {w.shape}, b {b.shape}; "
                             f"expected w (n, {width}), b (n,)")
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise ValueError(f"weights {path}: layer {k}: non-finite weights")
        width = w.shape[0]
    if not layers or width != n_out:
        raise ValueError(f"weights {path}: expected layers from {n_in} inputs to {n_out} "
                         f"output(s)")
    return layers, meta


def _io_width(meta: dict, path: str) -> tuple[int, int]:
    kind = meta.get("kind", "scorer")
    if kind == "scorer":
        return len(FEATURES), 1
    if kind != "selector":
        raise ValueError(f"weights {path}: kind {kind!r}: allowed values: scorer, selector")
    try:
        check_menu(meta.get("menu", ()))
    except ValueError as exc:
        raise ValueError(f"weights {path}: {exc}") from None
    try:
        features = check_feature_set(meta.get("features", "pass-v1"))
    except ValueError as exc:
        raise ValueError(f"weights {path}: {exc}") from None
    return len(feature_names(int(meta.get("k_slots", K_SLOTS)), features)), len(meta["menu"])


def forward(layers: Layers, x: np.ndarray) -> np.ndarray:
    """The network on rows of `x`: dense layers with ReLU between them."""
    for k, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if k < len(layers) - 1:
            x = np.maximum(x, 0.0)
    return x


@register
class LearnedPolicy(Policy):
    name = "learned"

    def __init__(self, *, weights: str = "", preempt_margin: float | None = None) -> None:
        super().__init__()
        if not weights:
            raise ValueError("params.weights: a safetensors or JSON weight file is required")
        self.layers, self.meta = load_weights(weights)
        self.kind = self.meta.get("kind", "scorer")
        if self.kind == "selector":
            if preempt_margin is not None:
                raise ValueError("preempt_margin: a selector never preempts")
            self.menu = tuple(self.meta["menu"])
            self.k = int(self.meta.get("k_slots", K_SLOTS))
            self.targets = SloTargets.from_json(self.meta.get("targets", {}))
            if self.meta.get("chunk_cap"):
                self.chunk_limit = ShortestPrefillFirst.chunk_limit
            self.prefill = prefill_params(self.meta.get("prefill"))
            self.model = model_of(self.prefill)  # for budget chunk answers
            self.features = self.meta.get("features", "pass-v1")
            answer = self.meta.get("chunks")  # the chunk answer it was trained with
            if answer is not None:
                answer = check_chunk_answer(answer, f"{weights}: metadata chunks")
            #: each entry's chunk answer (its own, else the file's `chunks`)
            self.chunk_answers = entry_chunk_answers(self.menu, answer)
            self.chunks = any(a is not None for a in self.chunk_answers)
        self.margin = preempt_margin

    @property
    def preempts(self) -> bool:
        return self.margin is not None

    def chunk(self, snap: Snapshot, chunked: RequestView, budget: int,
              page_size: int) -> ChunkPlan:
        """The chunk answer of the entry the network picks for this pass."""
        answer = self.chunk_answers[self.choice(snap)] if len(self.menu) > 1 \
            else self.chunk_answers[0]
        return answer_chunk(self.targets, snap, answer, page_size, chunked, budget,
                            self.model)

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return self.kind == "selector"  # its features and rules read prefix matches

    def choice(self, snap: Snapshot) -> int:
        """The selector's menu index for this pass: the largest output (first on ties)."""
        x = pass_features(snap, self.targets, self.k, self.features, self.prefill)
        x = x.astype(np.float32).astype(np.float64)
        return int(np.argmax(np.round(forward(self.layers, x[None, :])[0], 9)))

    def scores(self, views, snap: Snapshot, running: bool) -> np.ndarray:
        if not views:
            return np.empty(0)
        x = np.array([request_features(r, snap, running) for r in views])
        return np.round(forward(self.layers, x)[:, 0], 12)  # the same order on every platform

    def decide(self, snap: Snapshot) -> Plan:
        if self.kind != "selector":
            return super().decide(snap)
        if snap.candidate is not None:
            return Plan(victims=())
        if len(snap.waiting) < 2:
            return Plan(order=tuple(range(len(snap.waiting))))
        return rule_plan(self.menu[self.choice(snap)], snap, self.targets, self.prefill)

    def order(self, snap: Snapshot) -> list[int]:
        if self.kind == "selector":
            return list(self.decide(snap).order)
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
