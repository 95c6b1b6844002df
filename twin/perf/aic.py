"""Adapter to aiconfigurator-core's measured per-operation latencies (SGLang data).

One `AicModelOps` compiles a model for a system, TP size and dtypes, sorts the model's op
list into the groups the twin composes a step from, and queries a group at a shape:

- `gemm`: token-major linear work (QKV/O projections, dense MLP or MoE, router, dispatch),
- `norms`: embedding, RMSNorm/residual adds, activation,
- `allreduce`: TP collectives,
- `lm_head`: the logits GEMM (rows that emit a token),
- `attention`: context attention (per chunk, with its cached prefix) or decode attention
  (batch x KV length); for MLA models the whole MLA block, whose projections are then
  charged per chunk rather than at the step's token count.

aiconfigurator-core returns milliseconds summed over the model's layers; this module
returns seconds. It is imported only by the opdb backend, lazily.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from twin.errors import ConfigError
from twin.models import ModelSpec, aic_model_id

log = logging.getLogger("twin.perf.opdb")

GROUPS = ("gemm", "norms", "allreduce", "lm_head", "attention")
_COMM_TYPES = {"CustomAllReduce", "NCCL", "P2P", "AllReduce", "AllGather", "ReduceScatter"}
_NORM_TYPES = {"ElementWise", "Embedding"}


def classify(op_type: str, name: str) -> str:
    """The twin's group for one aiconfigurator op."""
    if name.endswith("logits_gemm"):
        return "lm_head"
    if op_type in _COMM_TYPES or re.search(r"_ar(_\d+)?$", name) or name.endswith("p2p"):
        return "allreduce"
    if "attention" in name or "mla" in name.split("_", 1)[-1]:
        return "attention"
    if op_type in _NORM_TYPES:
        return "norms"
    return "gemm"


@dataclass(frozen=True)
class Extents:
    """The measured grid of the tables this model's queries land in (upper bounds)."""

    gemm_tokens: int = 0
    context_tokens: int = 0  # chunk (+ prefix) length of context attention
    decode_batch: int = 0
    decode_kv: int = 0


@dataclass
class AicModelOps:
    """A compiled aiconfigurator-core engine for one model on one system."""

    system: str
    model_id: str
    tp: int
    quant: dict
    handle: object
    ctx_groups: dict[str, list[int]]
    gen_groups: dict[str, list[int]]
    extents: Extents
    provenance: set[str] = field(default_factory=set)

    # -- queries (seconds) ---------------------------------------------------------
    def ctx(self, group: str, tokens: int, prefix: int = 0) -> float:
        """A context-phase group for one chunk of `tokens` new tokens after `prefix`
        cached ones (token-major groups see `tokens` rows; `lm_head` one row per chunk
        is asked for with `rows` via `rows()`)."""
        idx = self.ctx_groups[group]
        if not idx:
            return 0.0
        vals = self.handle.evaluate_context_ops(idx, batch_size=1, s=int(tokens),
                                                prefix=int(prefix), x=int(tokens))
        self._note()
        return sum(v[1] for v in vals) / 1e3

    def gen(self, group: str, batch: int, kv: int) -> float:
        """A decode-phase group for `batch` requests of KV length `kv`."""
        idx = self.gen_groups[group]
        if not idx:
            return 0.0
        vals = self.handle.evaluate_generation_ops(idx, batch_size=int(batch), s=int(kv))
        self._note()
        return sum(v[1] for v in vals) / 1e3

    def _note(self) -> None:
        tier = self.handle.last_provenance()
        if tier:
            self.provenance.add(tier)


def quant_modes(model: ModelSpec, kv_dtype_bytes: float, quantization: str | None) -> dict:
    """aiconfigurator-core quant-mode kwargs for SGLang's dtypes (None: the model's own)."""
    modes: dict = {"kvcache_quant_mode": "fp8" if kv_dtype_bytes <= 1 else "bfloat16"}
    if kv_dtype_bytes <= 1:
        modes["fmha_quant_mode"] = "fp8"
    if quantization in ("fp8", "w8a8_fp8"):
        modes["gemm_quant_mode"] = modes["moe_quant_mode"] = "fp8"
    elif quantization in ("awq", "gptq"):
        modes["gemm_quant_mode"] = modes["moe_quant_mode"] = "int4_wo"
    if model.is_mla:  # aiconfigurator has no fp8 context-MLA data for SGLang
        modes["fmha_quant_mode"] = "bfloat16"
    return modes


def compile_model(model: ModelSpec, system: str, tp: int, quant: dict,
                  framework: str = "sglang") -> AicModelOps:
    """Compile `model` for `system` with `framework`'s data (sglang, vllm); ConfigError
    when aiconfigurator cannot cover it."""
    try:
        from aiconfigurator_core.sdk import engine as aic_engine
        from aiconfigurator_core.sdk.models import get_model as aic_get_model
        from aiconfigurator_core.sdk.perf_database import get_version_slots
    except ModuleNotFoundError as exc:
        raise ConfigError("the opdb backend needs aiconfigurator-core "
                          "(pip install aiconfigurator-core==0.12.0)") from exc
    if not get_version_slots(system, framework):
        raise ConfigError(f"aiconfigurator-core has no {framework} data for {system}")
    with _model_path(model) as path, _quiet():
        try:
            mc = aic_engine.build_model_config(
                tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=tp, moe_ep_size=1,
                gemm_quant_mode=quant.get("gemm_quant_mode"),
                kvcache_quant_mode=quant.get("kvcache_quant_mode"),
                fmha_quant_mode=quant.get("fmha_quant_mode"),
                moe_quant_mode=quant.get("moe_quant_mode"), comm_quant_mode=None,
                forward_model=None, attention_backend=None)
            aic_model = aic_get_model(path, mc, framework)
            handle = aic_engine.EngineHandle.compile(
                path, system, framework, backend_version="current", tp_size=tp,
                moe_tp_size=tp, moe_ep_size=1, **quant)
        except Exception as exc:  # aiconfigurator raises many types for "not covered"
            raise ConfigError(f"aiconfigurator-core cannot model {model.name} on {system} "
                              f"tp {tp} ({_one_line(exc)})") from exc
    ops = AicModelOps(
        system=system, model_id=path if aic_model_id(model.name) else model.name, tp=tp,
        quant=quant, handle=handle,
        ctx_groups=_groups(aic_model.context_ops), gen_groups=_groups(aic_model.generation_ops),
        extents=measured_extents(system, model, tp, framework),
    )
    _probe(ops)
    return ops


def _probe(ops: AicModelOps) -> None:
    """Fail now, with the reason, if a group's data is missing."""
    try:
        with _quiet():
            for group in GROUPS:
                ops.ctx(group, 128, 128)
                ops.gen(group, 8, 1024)
    except Exception as exc:
        raise ConfigError(f"aiconfigurator-core lacks data for {ops.model_id} on "
                          f"{ops.system} ({_one_line(exc)})") from exc


def _groups(op_list) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {g: [] for g in GROUPS}
    for i, op in enumerate(op_list):
        groups[classify(type(op).__name__, getattr(op, "_name", ""))].append(i)
    return groups


@contextlib.contextmanager
def _model_path(model: ModelSpec):
    """aiconfigurator's id for a catalog model, else a temporary config.json directory."""
    aic_id = aic_model_id(model.name)
    if aic_id is not None:
        yield aic_id
        return
    if Path(model.name).exists():
        yield str(Path(model.name).parent if Path(model.name).is_file() else model.name)
        return
    import tempfile  # only for a model outside the catalog (start-up time)

    with tempfile.TemporaryDirectory(prefix="servetwin-model-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(dict(model.hf_config)))
        yield tmp


@contextlib.contextmanager
def _quiet():
    """aiconfigurator prints fallback notices on stdout/stderr; route them to our log."""
    out, err = io.StringIO(), io.StringIO()
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield
    for line in (out.getvalue() + err.getvalue()).splitlines():
        if line.strip():
            log.debug("aiconfigurator: %s", line.strip())


def _one_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def measured_extents(system: str, model: ModelSpec, tp: int,
                     framework: str = "sglang") -> Extents:
    """Largest measured shapes in the parquet tables this model's queries use."""
    try:
        from importlib import resources

        import pandas as pd

        root = Path(str(resources.files("aiconfigurator_core"))) / "systems" / "data" / system
    except ModuleNotFoundError:
        return Extents()

    def col_max(pattern: str, column: str, where: dict | None = None) -> int:
        best = 0
        for f in sorted(root.glob(pattern)):
            try:
                df = pd.read_parquet(f)
            except Exception:  # a pointer file or an unreadable table: no extent
                continue
            for key, value in (where or {}).items():
                if key in df.columns and (df[key] == value).any():
                    df = df[df[key] == value]
            if column in df.columns and len(df):
                best = max(best, int(df[column].max()))
        return best

    heads = {"num_heads": max(1, model.num_heads // tp),
             "num_key_value_heads": max(1, model.num_kv_heads // tp)}
    fam = "mla" if model.is_mla else "attention"
    return Extents(
        gemm_tokens=col_max(f"gemm/{framework}/*/gemm_perf.parquet", "m"),
        context_tokens=col_max(f"{fam}/{framework}/*/context*_perf.parquet", "isl", heads),
        decode_batch=col_max(f"{fam}/{framework}/*/generation*_perf.parquet", "batch_size", heads),
        decode_kv=col_max(f"{fam}/{framework}/*/generation*_perf.parquet", "step", heads),
    )
