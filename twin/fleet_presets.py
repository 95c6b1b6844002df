"""Built-in deployments (`servetwin simulate --deployment NAME`); docs/fleet.md sizes them.

All on A100-80GB PCIe with the 128k-context model that fits (DeepSeek-R1-Distill-Qwen-32B;
the users' DeepSeek-V3-class model does not fit two of these cards, see README):
- `finance-hybrid`: the users' design. Prompts up to 32,000 tokens to an SGLang pool (2
  replicas at TP 2, the users' tuned `max_total_tokens` 140,000, sglang-router's default
  `cache_aware` inside the pool); 32,000-64,000 to a medium vLLM pool (1 replica, TP 2,
  `max_model_len` 65,536); above 64,000 to a high-memory vLLM pool (1 replica, TP 4:
  twice the KV memory, `max_model_len` 131,072). 10 GPUs.
- `finance-sglang-pool`: the same 10 GPUs as one SGLang pool (5 replicas at TP 2, default
  KV pool) behind `round_robin`; `finance-sglang-cache-aware`: the same behind
  `cache_aware`.
"""

from __future__ import annotations

MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
GPU = "a100-pcie-80gb"


def finance_hybrid() -> dict:
    return {
        "name": "finance-hybrid",
        "gpu": GPU,
        "router": {"name": "length", "thresholds": [32000, 64000]},
        "pools": [
            {"name": "sglang", "router": {"name": "cache_aware"},
             "replicas": [{"name": "sg", "count": 2, "engine": "sglang",
                           "server_args": {"model_path": MODEL, "tp_size": 2,
                                           "max_total_tokens": 140000}}]},
            {"name": "vllm-medium", "router": {"name": "least_load"},
             "replicas": [{"name": "vm", "engine": "vllm",
                           "server_args": {"model": MODEL, "tensor_parallel_size": 2,
                                           "max_model_len": 65536}}]},
            {"name": "vllm-high", "router": {"name": "least_load"},
             "replicas": [{"name": "vh", "engine": "vllm",
                           "server_args": {"model": MODEL, "tensor_parallel_size": 4,
                                           "max_model_len": 131072}}]},
        ],
    }


def _one_pool(name: str, router: str) -> dict:
    return {
        "name": name,
        "gpu": GPU,
        "router": {"name": router},
        "replicas": [{"name": "sg", "count": 5, "engine": "sglang",
                      "server_args": {"model_path": MODEL, "tp_size": 2}}],
    }


PRESETS = {
    "finance-hybrid": finance_hybrid,
    "finance-sglang-pool": lambda: _one_pool("finance-sglang-pool", "round_robin"),
    "finance-sglang-cache-aware": lambda: _one_pool("finance-sglang-cache-aware", "cache_aware"),
}
