"""Model architectures: parameter and KV-cache sizes, FLOPs per token.

A model comes from the built-in catalog (Hugging Face ids, their `config.json` fields
copied below), from aiconfigurator-core's catalog of cached `config.json` files (85
architectures: Qwen3, Llama-3.1/4, DeepSeek-V3/R1, Kimi, GLM, gpt-oss, ...), or from a local
directory or file holding a Hugging Face `config.json`. All go through the same parser,
`ModelSpec.from_hf_config`; `get_model` is the single entry point.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from twin.errors import ConfigError
from twin.inputs import Rule, check, read_text

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1, "int4": 0.5}
# Weight bytes per parameter by `quantization_config.quant_method` (scales ignored).
QUANT_WEIGHT_BYTES = {"fp8": 1.0, "compressed-tensors": 1.0, "modelopt": 1.0, "awq": 0.5,
                      "gptq": 0.5, "mxfp4": 0.5, "modelopt_fp4": 9 / 16}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide memory and compute. MoE and MLA fields are zero when unused."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width
    vocab: int
    context_len: int
    weight_bytes_per_param: float = 2.0
    tie_embeddings: bool = False
    # Mixture of experts
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate: int = 0
    first_dense_layers: int = 0  # leading layers with a dense MLP in a MoE model
    # Multi-head latent attention (DeepSeek-V2/V3)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # The config.json the spec was parsed from (for backends that re-read the architecture).
    hf_config: Mapping = field(default_factory=dict, compare=False, repr=False)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, name: str, cfg: dict) -> ModelSpec:
        if not isinstance(cfg, dict):
            raise ConfigError(f"model {name}: config.json is not a JSON object")

        def num(key: str | tuple[str, ...], default: int | None = None, lo: int = 1) -> int:
            """An integer field (the first of `key` that is set), checked."""
            keys = (key,) if isinstance(key, str) else key
            value = cfg.get(keys[0]) if default is None else next(
                (cfg[k] for k in keys if cfg.get(k)), default)  # optional: 0/null = unset
            if value is None:
                raise ConfigError(f"model {name}: config.json lacks field {keys[0]!r}")
            return int(check(f"model {name}: config.json field {keys[0]}", value,
                             Rule(integer=True, lo=lo, hi=2**31 - 1)))

        hidden, heads = num("hidden_size"), num("num_attention_heads")
        quant = cfg.get("quantization_config")
        quant = quant.get("quant_method", "") if isinstance(quant, dict) else ""
        dtype = cfg.get("torch_dtype", "bfloat16")
        wbytes = QUANT_WEIGHT_BYTES.get(str(quant)) or DTYPE_BYTES.get(str(dtype), 2)
        n_routed = num(("n_routed_experts", "num_experts", "num_local_experts"), 0, lo=0)
        moe = bool(n_routed)
        return cls(
            name=name,
            num_layers=num("num_hidden_layers"),
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=num("num_key_value_heads", heads),
            head_dim=num("head_dim", max(1, hidden // heads)),
            intermediate=num("intermediate_size", 4 * hidden),
            vocab=num("vocab_size"),
            context_len=num("max_position_embeddings", 4096),
            weight_bytes_per_param=wbytes,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=n_routed,
            experts_per_token=num("num_experts_per_tok", 0, lo=0) if moe else 0,
            num_shared_experts=num("n_shared_experts", 0, lo=0) if moe else 0,
            moe_intermediate=num(("moe_intermediate_size", "intermediate_size"), 0, lo=0)
            if moe else 0,
            first_dense_layers=num("first_k_dense_replace", 0, lo=0) if moe else 0,
            kv_lora_rank=num("kv_lora_rank", 0, lo=0),
            q_lora_rank=num("q_lora_rank", 0, lo=0),
            qk_rope_head_dim=num("qk_rope_head_dim", 0, lo=0),
            qk_nope_head_dim=num("qk_nope_head_dim", 0, lo=0),
            v_head_dim=num("v_head_dim", 0, lo=0),
            hf_config=dict(cfg),
        )

    # ---- shape facts ----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        """Parameters of one layer's attention projections."""
        h, n = self.hidden, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        return h * self.head_dim * (2 * n + 2 * self.num_kv_heads)

    def mlp_params(self, layer: int, active: bool) -> int:
        """One layer's MLP parameters; `active` counts only the experts a token uses."""
        if not self.is_moe or layer < self.first_dense_layers:
            return 3 * self.hidden * self.intermediate
        experts = self.experts_per_token if active else self.num_experts
        routed = (experts + self.num_shared_experts) * 3 * self.hidden * self.moe_intermediate
        return routed + self.hidden * self.num_experts  # plus the router

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def total_params(self) -> int:
        layers = sum(self.mlp_params(i, active=False) for i in range(self.num_layers))
        return layers + self.num_layers * self.attention_params() + self.embedding_params()

    def active_linear_params(self) -> int:
        """Parameters one token multiplies through, excluding embedding and LM head."""
        mlp = sum(self.mlp_params(i, active=True) for i in range(self.num_layers))
        return mlp + self.num_layers * self.attention_params()

    def weight_bytes_per_gpu(self, tp: int) -> float:
        """Weights per GPU under tensor parallelism (every matrix split tp ways; the small
        replicated pieces, norms and MLA's down-projections, are ignored)."""
        return self.total_params() * self.weight_bytes_per_param / tp

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: float = 2.0) -> float:
        """KV-cache bytes one token occupies on one GPU. MLA keeps one latent vector per
        layer, replicated on every TP rank; GQA splits KV heads across ranks (replicated
        when tp exceeds the KV head count)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        heads = max(1, self.num_kv_heads // tp) if self.num_kv_heads >= tp else 1
        return 2 * self.num_layers * heads * self.head_dim * kv_dtype_bytes

    def attn_flops_per_query_key(self, tp: int) -> float:
        """FLOPs per (query token, key token) pair over all layers, on one GPU:
        QK^T and PV, 2 FLOPs per multiply-add each."""
        heads = self.num_heads / tp
        if self.is_mla:  # absorbed MLA attends in the latent space
            d = self.kv_lora_rank * 2 + self.qk_rope_head_dim
        else:
            d = 2 * self.head_dim
        return 2.0 * self.num_layers * heads * d


# Fields copied from each model's Hugging Face config.json.
CATALOG: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]),
    "meta-llama/Llama-3.1-70B": dict(
        hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
        torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]),
    "Qwen/Qwen3-8B": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
        torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"]),
    "Qwen/Qwen3-32B": dict(
        hidden_size=5120, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=64,
        head_dim=128, intermediate_size=25600, vocab_size=151936, max_position_embeddings=40960,
        torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"]),
    # DeepSeek's 128k-context distillation on the Qwen2.5-32B architecture: the closest
    # DeepSeek model to the users' that fits 2x A100-80GB.
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": dict(
        hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, num_hidden_layers=64,
        intermediate_size=27648, vocab_size=152064, max_position_embeddings=131072,
        torch_dtype="bfloat16", architectures=["Qwen2ForCausalLM"]),
    "deepseek-ai/DeepSeek-V3": dict(
        hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=61,
        intermediate_size=18432, vocab_size=129280, max_position_embeddings=163840,
        torch_dtype="bfloat16", quantization_config={"quant_method": "fp8"},
        architectures=["DeepseekV3ForCausalLM"],
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=2048, first_k_dense_replace=3, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
}


# Built-in ids whose aiconfigurator-core catalog file has another name.
AIC_ALIASES = {
    "meta-llama/Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B",
    "meta-llama/Llama-3.1-405B": "meta-llama/Meta-Llama-3.1-405B",
}


def _aic_config_dir() -> Path | None:
    try:
        return Path(str(resources.files("aiconfigurator_core") / "model_configs"))
    except ModuleNotFoundError:
        return None


def aic_catalog() -> list[str]:
    """Hugging Face ids in aiconfigurator-core's model catalog (empty if not installed)."""
    root = _aic_config_dir()
    if root is None or not root.is_dir():
        return []
    names = (p.name.removesuffix("_config.json") for p in root.glob("*_config.json"))
    return sorted(n.replace("--", "/", 1) for n in names if not n.endswith("_hf_quant"))


def aic_model_id(name: str) -> str | None:
    """The id under which aiconfigurator-core's catalog holds `name`, or None."""
    name = AIC_ALIASES.get(name, name)
    root = _aic_config_dir()
    if root is None or "/" not in name:
        return None
    return name if (root / f"{name.replace('/', '--', 1)}_config.json").is_file() else None


def get_model(name_or_path: str) -> ModelSpec:
    """A model by Hugging Face id (built-in catalog first, then aiconfigurator-core's
    catalog), or a local `config.json` (file or directory)."""
    if name_or_path in CATALOG:
        return ModelSpec.from_hf_config(name_or_path, CATALOG[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelSpec.from_hf_config(str(name_or_path), _read_json(path))
    aic_id = aic_model_id(name_or_path)
    if aic_id is not None:
        cfg_path = _aic_config_dir() / f"{aic_id.replace('/', '--', 1)}_config.json"
        return ModelSpec.from_hf_config(name_or_path, _read_json(cfg_path))
    raise ConfigError(
        f"unknown model {name_or_path!r}: not in the built-in catalog ({', '.join(CATALOG)}), "
        f"not in aiconfigurator-core's catalog ({len(aic_catalog())} models; "
        f"`servetwin perf --list-models` lists them) and no config.json there"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(read_text(path, "--model-path"))
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
