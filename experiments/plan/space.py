"""The search space: a YAML/JSON file (or flags) whose every key is a list of values, and the
candidates it expands to (the cross product, in file order, numbered c0001, c0002, ...).

    gpus: [a100-pcie-80gb, h100-sxm-80gb]
    tp: [1, 2, 4, 8]
    replicas: [1, 2, 4]
    models: [deepseek-ai/DeepSeek-R1-Distill-Qwen-32B]
    quantization: [null, fp8, awq, gptq]
    server_args: {chunked_prefill_size: [4096, 8192], disable_radix_cache: [false, true]}
    policies: [fcfs, lpm, slices]
    kv_allocators: [token, paged]
    routers: [round_robin, cache_aware]
    step_time_backends: [roofline]     # null: opdb where it has data, else roofline

A scalar stands for a list of one. Unknown keys or values are refused with the file, the
line, the key path and the allowed values. The router matters only with two replicas or
more: a single-replica candidate is generated once, with the first router.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from twin.config import QUANTIZATIONS, SCHEDULE_POLICIES, ServerArgs
from twin.errors import ConfigError, ServetwinError
from twin.fleet import _Where
from twin.hardware import GPUS
from twin.inputs import read_text

KEYS = ("gpus", "tp", "replicas", "models", "quantization", "server_args", "policies",
        "kv_allocators", "routers", "step_time_backends")
# set by their own keys, not under server_args
OWN_KEYS = {"model_path": "models", "tp_size": "tp", "quantization": "quantization",
            "schedule_policy": "policies", "enable_priority_scheduling": "policies"}
DEFAULT_MODEL = ServerArgs().model_path
# the users' question (no --space): every GPU, TP 1/2/4/8, 1-8 replicas, SGLang's fcfs;
# then every policy of the registry on the best hardware (experiments/plan/run.py)
DEFAULT_SPACE = {"gpus": sorted(GPUS), "tp": [1, 2, 4, 8], "replicas": list(range(1, 9)),
                 "policies": ["fcfs"]}


@dataclass(frozen=True)
class Candidate:
    id: str
    gpu: str
    tp: int
    replicas: int
    model: str = DEFAULT_MODEL
    quantization: str | None = None
    server_args: tuple = ()  # sorted (name, value) pairs beyond the keys above
    policy: str = "fcfs"
    kv_allocator: str = "token"
    router: str = "round_robin"
    step_time_backend: str | None = None  # None: the twin's default choice

    def key(self) -> tuple:
        """Everything but the id."""
        return (self.gpu, self.tp, self.replicas, self.model, str(self.quantization),
                self.server_args, self.policy, self.kv_allocator, self.router,
                str(self.step_time_backend))

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    def args(self) -> ServerArgs:
        """SGLang's arguments: a policy SGLang has is its --schedule-policy ('priority' is
        fcfs with --enable-priority-scheduling); any other runs through the twin's policy
        module (live: servetwin's SGLang plugin)."""
        extra = dict(self.server_args)
        if self.policy in SCHEDULE_POLICIES:
            extra["schedule_policy"] = self.policy
        elif self.policy == "priority":
            extra["enable_priority_scheduling"] = True
        return ServerArgs(model_path=self.model, tp_size=self.tp,
                          quantization=self.quantization, **extra)

    @property
    def twin_policy(self) -> str | None:
        return None if self.policy in (*SCHEDULE_POLICIES, "priority") else self.policy

    @property
    def label(self) -> str:
        parts = [f"{self.replicas}x {self.gpu} TP{self.tp}", self.policy]
        if self.model != DEFAULT_MODEL:
            parts.append(self.model)
        if self.quantization:
            parts.append(self.quantization)
        parts += [f"{k}={v}" for k, v in self.server_args]
        if self.kv_allocator != "token":
            parts.append(f"kv={self.kv_allocator}")
        if self.replicas > 1:
            parts.append(f"router={self.router}")
        if self.step_time_backend:
            parts.append(f"backend={self.step_time_backend}")
        return " ".join(parts)

    def config(self) -> dict:
        return {"gpu": self.gpu, "tp": self.tp, "replicas": self.replicas, "model": self.model,
                "quantization": self.quantization, "server_args": dict(self.server_args),
                "policy": self.policy, "kv_allocator": self.kv_allocator,
                "router": self.router, "step_time_backend": self.step_time_backend}


@dataclass(frozen=True)
class Space:
    values: dict = field(default_factory=dict)  # key: list of values (server_args: dict)
    source: str = "<default>"

    def to_json(self) -> dict:
        return {"source": self.source, **self.values}

    def candidates(self, first_id: int = 1) -> list[Candidate]:
        v = {**{k: [d] for k, d in _DEFAULTS.items()}, **self.values}
        sa = v.get("server_args") or {}
        sa_names = list(sa)
        sa_combos = list(itertools.product(*(sa[k] for k in sa_names)))
        out, seen = [], set()
        for gpu, tp, reps, model, quant, combo, pol, kv, router, be in itertools.product(
                v["gpus"], v["tp"], v["replicas"], v["models"], v["quantization"], sa_combos,
                v["policies"], v["kv_allocators"], v["routers"], v["step_time_backends"]):
            key = (gpu, tp, reps, model, quant, combo, pol, kv, router if reps > 1 else None,
                   be)
            if key in seen:
                continue
            seen.add(key)
            out.append(Candidate(f"c{first_id + len(out):04d}", gpu, tp, reps, model, quant,
                                 tuple(sorted(zip(sa_names, combo, strict=True))), pol, kv,
                                 router if reps > 1 else v["routers"][0], be))
        return out


_DEFAULTS = {"gpus": "a100-pcie-80gb", "tp": 2, "replicas": 1, "models": DEFAULT_MODEL,
             "quantization": None, "policies": "fcfs", "kv_allocators": "token",
             "routers": "round_robin", "step_time_backends": None}


def load_space(path: str | Path) -> Space:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--space {path}: no such file")
    return parse_space(read_text(p, "--space"), str(p))


def parse_space(doc: str | dict, path: str = "<space>") -> Space:
    where = _Where(path, doc if isinstance(doc, str) else json.dumps(doc, indent=1))
    d = where.data
    if not isinstance(d, dict) or not d:
        raise where.err("<document>", f"a search space is a mapping with keys among: "
                        f"{', '.join(KEYS)}")
    values = {}
    for key, raw in d.items():
        if key not in KEYS:
            raise where.err(key, f"unknown key; allowed: {', '.join(KEYS)}")
        if key == "server_args":
            values[key] = _server_args(where, raw)
        else:
            values[key] = [_value(where, f"{key}[{i}]", key, x)
                           for i, x in enumerate(_as_list(where, key, raw))]
    return Space(values, path)


def _as_list(where: _Where, at: str, raw) -> list:
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise where.err(at, "must not be empty (give at least one value)")
    return items


def _value(where: _Where, at: str, key: str, x):
    allowed = _allowed(key)
    if allowed is not None:
        if isinstance(x, bool) or x not in allowed:
            names = ", ".join("null" if a is None else str(a) for a in allowed)
            raise where.err(at, f"{x!r}: allowed values: {names}")
        return x
    if key in ("tp", "replicas"):
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 1024:
            raise where.err(at, f"{x!r}: must be an integer from 1 to 1024")
        return x
    if key == "models":
        from twin.models import get_model

        if not isinstance(x, str):
            raise where.err(at, f"{x!r}: must be a model id (a string)")
        try:
            get_model(x)
        except ServetwinError as exc:
            raise where.err(at, str(exc)) from None
        return x
    raise AssertionError(key)


def _allowed(key: str) -> list | None:
    if key == "gpus":
        return sorted(GPUS)
    if key == "quantization":
        return list(QUANTIZATIONS)
    if key == "policies":
        from twin.policy import policy_names

        return policy_names()
    if key == "kv_allocators":
        from twin.memory import allocator_names

        return allocator_names()
    if key == "routers":
        from twin.routers import router_names

        return [r for r in router_names() if r != "length"]  # length needs pools
    if key == "step_time_backends":
        from twin.perf import backend_names

        return [None, *(b for b in backend_names() if b != "fitted")]  # fitted: a profile
    return None


def _server_args(where: _Where, raw) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise where.err("server_args", "must be a mapping of SGLang server argument names "
                        "to lists of values")
    allowed = [n for n in ServerArgs.field_names() if n not in OWN_KEYS]
    out = {}
    for name, vals in raw.items():
        at = f"server_args.{name}"
        if name in OWN_KEYS:
            raise where.err(at, f"set by the space's own key {OWN_KEYS[name]!r}")
        if name not in allowed:
            raise where.err(at, f"not an SGLang server argument the twin models; allowed: "
                            f"{', '.join(allowed)}")
        items = _as_list(where, at, vals)
        for i, x in enumerate(items):
            try:
                ServerArgs(**{name: x})
            except (TypeError, ServetwinError) as exc:
                raise where.err(f"{at}[{i}]", str(exc)) from None
        out[name] = items
    return out
