"""One registry of policy names and the spec loader.

A policy is built from a spec, never from pickle: a registered name (`fcfs`, `slices`, ...)
or a JSON/YAML file `{"name": ..., "params": {...}}`. Parameters are the keyword arguments
of the policy's `__init__`; unknown keys and wrong types are refused with the allowed ones.
A learned policy names its weight file (safetensors or JSON) in its params. Modules that
define policies register them when the registry is first asked (no import-time side
effects on `import twin.policy`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MODULES = ("twin.policy.sglang", "twin.policy.slices", "twin.policy.menu",
            "twin.policy.deadline", "twin.policy.learned")
#: weight files shipped with the package, named by `learned:NAME`
DATA_DIR = Path(__file__).parent / "data"
LEARNED_PREFIX = "learned:"
_REGISTRY: dict[str, type] = {}
_loaded = False


class PolicyError(ValueError):
    """A bad policy name, spec file or parameter; the message says what is allowed."""


def register(cls: type) -> type:
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in _MODULES:
            importlib.import_module(m)


def policy_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type:
    _load()
    if name not in _REGISTRY:
        raise PolicyError(f"policy {name!r}: allowed values: {', '.join(policy_names())}")
    return _REGISTRY[name]


def policy_params(name: str) -> dict[str, Any]:
    """The parameters a policy takes, with their defaults."""
    cls = policy_class(name)
    out: dict[str, Any] = {}
    for klass in cls.__mro__:  # an __init__ that passes **kw on takes its base's too
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        for p in params:
            if p.kind is p.KEYWORD_ONLY:
                out.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out


@dataclass(frozen=True)
class PolicySpec:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it came from ("" for a bare name)
    text: str = ""  # a spec string that gives this spec from any directory ("": none)

    def to_json(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}


def read_spec(text: str) -> PolicySpec:
    """`NAME`, `learned:NAME|FILE` (a shipped weight file by name, or a weight file) or a
    path to a `.json`/`.yaml`/`.yml` spec file."""
    if text.startswith(LEARNED_PREFIX):
        return learned_spec(text[len(LEARNED_PREFIX):])
    p = Path(text)
    if p.suffix.lower() in (".json", ".yaml", ".yml"):
        return read_spec_file(p)
    policy_class(text)
    return PolicySpec(text)


def shipped_weights() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.safetensors")) if DATA_DIR.is_dir() else []


def learned_spec(ref: str) -> PolicySpec:
    """`learned:NAME` (a weight file shipped in twin/policy/data) or `learned:FILE`."""
    p = Path(ref)
    if p.suffix.lower() not in (".safetensors", ".json"):
        if not (DATA_DIR / f"{ref}.safetensors").is_file() or "/" in ref:
            raise PolicyError(f"policy learned:{ref}: not a shipped policy (shipped: "
                              f"{', '.join(shipped_weights()) or 'none'}) and not a "
                              f".safetensors or .json weight file")
        p = DATA_DIR / f"{ref}.safetensors"
    if not p.is_file():
        raise PolicyError(f"policy learned:{ref}: no such file")
    path = str(p.resolve())
    return PolicySpec("learned", {"weights": path}, text=LEARNED_PREFIX + path)


def read_spec_file(path: Path) -> PolicySpec:
    try:
        raw = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise PolicyError(f"policy spec {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"policy spec {path}: cannot read: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PolicyError(f"policy spec {path}:{exc.lineno}: not JSON: {exc.msg}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise PolicyError(f"policy spec {path}: YAML needs PyYAML (pip install pyyaml)") \
                from None
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise PolicyError(f"policy spec {path}: not YAML: {exc}") from None
    return spec_from_dict(data, str(path), raw)


def spec_from_dict(data: Any, where: str = "policy spec", raw: str = "") -> PolicySpec:
    """A checked spec from parsed JSON/YAML; `raw` (the file's text) lets errors in
    params name their line."""
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: expected an object with 'name' and 'params'")
    unknown = set(data) - {"name", "params"}
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"allowed: name, params")
    name = data.get("name")
    if not isinstance(name, str):
        raise PolicyError(f"{where}: field 'name': expected a policy name, one of "
                          f"{', '.join(policy_names())}")
    params = data.get("params", {}) or {}
    if not isinstance(params, dict):
        raise PolicyError(f"{where}: field 'params': expected an object")
    try:
        policy_class(name)
    except PolicyError as exc:
        raise PolicyError(f"{where}: field 'name': {exc}") from None
    check_params(name, params, where, raw)
    return PolicySpec(name, dict(params), where)


def check_params(name: str, params: dict, where: str, raw: str = "") -> None:
    allowed = policy_params(name)
    for key, value in params.items():
        at = f"{where}{_line_of(raw, key)}"
        if key not in allowed:
            raise PolicyError(f"{at}: policy {name!r} has no parameter {key!r}; "
                              f"allowed: {', '.join(sorted(allowed)) or '(none)'}")
        default = allowed[key]
        if not _type_ok(value, default):
            raise PolicyError(f"{at}: params.{key} = {value!r}: expected "
                              f"{_type_name(default)}")
        problem = _range_problem(key, value)
        if problem:
            raise PolicyError(f"{at}: params.{key} = {value!r}: {problem}")


def _line_of(raw: str, key: str) -> str:
    """':LINE' of the first line of `raw` that names `key` as a key ('' if none)."""
    pattern = re.compile(rf"""(^|[{{,\s])["']?{re.escape(key)}["']?\s*:""")
    for n, line in enumerate(raw.splitlines(), 1):
        if pattern.search(line):
            return f":{n}"
    return ""


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What a parameter's value must be, by name (a name means the same in every policy that
# takes it); each test gets a number (lists: see _LISTS). The policies check more.
_AT_LEAST_0 = ("must be >= 0", lambda v: v >= 0)
_ABOVE_0 = ("must be > 0", lambda v: v > 0)
_COUNT = ("must be an integer >= 1", lambda v: _int(v) and v >= 1)
_INT32 = ("must be an integer in [-2147483648, 2147483647] (SGLang's priority range)",
          lambda v: _int(v) and -(2**31) <= v < 2**31)
_SCALARS = {
    "seed": ("must be an integer >= 0", lambda v: _int(v) and v >= 0),
    "time_slice_ms": _ABOVE_0, "ttft_s": _ABOVE_0, "tpot_s": _ABOVE_0,
    "doc_tokens": _COUNT, "chunk": _COUNT, "preemption_threshold": _INT32,
    "doc_ttft_s_per_token": _AT_LEAST_0, "s_per_chunk": _AT_LEAST_0,
    "s_per_token": _AT_LEAST_0, "s_per_token_ctx": _AT_LEAST_0, "max_defer_s": _AT_LEAST_0,
    "s_per_ctx_sq": _AT_LEAST_0, "chunk_budget_s": _AT_LEAST_0,
}
# list-valued parameters: (what it must be, the test of each item, how many items or None)
_LISTS = {
    "weights": ("must be [tier, wait, speed], three numbers >= 0",
                lambda v: _num(v) and v >= 0, 3),
    "prefill": ("must be [s_per_chunk, s_per_token, s_per_token_ctx, chunk]: numbers >= 0 "
                "and chunk an integer >= 1", None, 4),
    "tier_ttft_s": ("must be a list of [priority, ttft_s] pairs: an integer priority and a "
                    "TTFT target > 0", lambda v: isinstance(v, list | tuple) and len(v) == 2
                    and _INT32[1](v[0]) and _num(v[1]) and v[1] > 0, None),
}


def _range_problem(key: str, value: Any) -> str | None:
    if not _finite_all(value):
        return "every number must be finite"
    if key in _SCALARS and _num(value):
        what, ok = _SCALARS[key]
        return None if ok(value) else what
    if key in _LISTS and isinstance(value, list | tuple):
        what, ok, n = _LISTS[key]
        if n is not None and len(value) != n:
            return what
        if key == "prefill":
            good = all(_num(x) and x >= 0 for x in value[:3]) and _int(value[3]) and value[3] >= 1
        else:
            good = all(ok(x) for x in value)
        return None if good else what
    return None


def _finite_all(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_finite_all(x) for x in value)
    if isinstance(value, dict):
        return all(_finite_all(x) for x in value.values())
    return True


def _type_ok(value: Any, default: Any) -> bool:
    if default is None:
        return value is None or isinstance(value, str | int | float | list)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list | tuple):
        return isinstance(value, list | tuple)
    return True


def _type_name(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a finite number"
    if isinstance(default, str):
        return "a string"
    if isinstance(default, list | tuple):
        return "a list"
    return "a value"


def build_policy(spec: PolicySpec | str, **server: Any):
    """Build a policy. `server` holds what the server arguments decide
    (`priority_scheduling`, `low_values_first`, `preemption_threshold`); the spec's own
    params win over them."""
    if isinstance(spec, str):
        spec = read_spec(spec)
    cls = policy_class(spec.name)
    allowed = policy_params(spec.name)
    kw = {k: v for k, v in server.items() if k in allowed}
    kw.update(spec.params)
    weights = kw.get("weights")
    if isinstance(weights, str) and spec.source and not Path(weights).is_absolute():
        kw["weights"] = str(Path(spec.source).parent / weights)  # relative to the spec
    try:
        return cls(**kw)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{spec.source or 'policy'} {spec.name!r}: {exc}") from None
