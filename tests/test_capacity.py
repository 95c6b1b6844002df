"""KV capacity the way SGLang 0.5.x sizes it, checked against hand arithmetic."""

from __future__ import annotations

import json

import pytest

from servetwin.cli import main
from twin.config import ServerArgs, derive_capacity, gpu_memory_defaults
from twin.errors import ConfigError, InfeasibleError
from twin.models import aic_catalog, get_model

pytestmark = pytest.mark.offline
GIB = 2**30


def test_llama_8b_on_one_a100_80gb_matches_hand_arithmetic():
    cap = derive_capacity(ServerArgs(model_path="meta-llama/Llama-3.1-8B"), "a100-sxm-80gb")
    # SGLang _handle_gpu_memory_settings, 80 GiB = 81920 MiB: chunk 8192, graph bs 256, tp 1
    reserved_mib = 512 + 8192 * 1.5 + 256 * 2 + 1 / 8 * 1024  # 13440
    frac = round((81920 - reserved_mib) / 81920, 3)
    assert frac == 0.836 == cap.mem_fraction_static
    # weights: embedding + LM head, 32 layers of (q, k, v, o) and (gate, up, down), bf16
    params = 2 * 128256 * 4096 + 32 * (4096 * 128 * (32 + 8 + 8 + 32) + 3 * 4096 * 14336)
    assert cap.weight_bytes_per_gpu == params * 2
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head dim 128, bf16
    assert cap.kv_bytes_per_token == per_token == 128 * 1024
    # profile_max_num_token: frac x memory available at load (80 GiB - 1.4 GiB) - weights
    tokens = int((frac * (80 - 1.4) * GIB - params * 2) // per_token)
    assert cap.max_total_num_tokens == tokens
    assert f"#tokens: {tokens}" in cap.startup_log()


def test_reserve_floor_of_10_gib_on_large_gpus():
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", chunked_prefill_size=2048,
                      cuda_graph_max_bs_decode=8)
    # 512 + 2048 * 1.5 + 8 * 2 + 128 = 3728 MiB < 10 GiB floor
    assert derive_capacity(args, "h100-sxm-80gb").mem_fraction_static == round(
        (81920 - 10240) / 81920, 3)


def test_gpu_memory_defaults_are_sglang_0_5_23s():
    # memory_hook.handle_gpu_memory_settings: (chunked_prefill_size, decode graph max_bs)
    assert gpu_memory_defaults(16 * 1024, 1) == (2048, 8)
    assert gpu_memory_defaults(24 * 1024, 1) == (4096, 48)  # A10/4090: 4k, 48 (tp < 4)
    assert gpu_memory_defaults(24 * 1024, 4) == (4096, 160)
    assert gpu_memory_defaults(40 * 1024, 2) == (4096, 32)
    assert gpu_memory_defaults(80 * 1024, 2) == (8192, 256)
    assert gpu_memory_defaults(140 * 1024, 4) == (8192, 512)
    assert gpu_memory_defaults(180 * 1024, 1) == (16384, 512)


def test_given_max_running_requests_caps_the_default_graph_batch_and_is_not_pool_bound():
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", max_running_requests=12)
    cap = derive_capacity(args, "a100-sxm-80gb")
    assert cap.cuda_graph_max_bs == 12  # min(256, max_running_requests)
    # the graph reserve shrinks with it: 512 + 8192 x 1.5 + 12 x 2 + 128 MiB
    assert cap.mem_fraction_static == round((81920 - (512 + 12288 + 24 + 128)) / 81920, 3)
    explicit = ServerArgs(model_path="meta-llama/Llama-3.1-8B", max_running_requests=12,
                          cuda_graph_max_bs_decode=64)
    assert derive_capacity(explicit, "a100-sxm-80gb").cuda_graph_max_bs == 64
    # resolve_max_num_reqs: a given cap is bounded by half the pool only, not by the
    # estimated request pool (at most 4096)
    big = ServerArgs(model_path="meta-llama/Llama-3.1-8B", max_running_requests=5000)
    cap = derive_capacity(big, "a100-sxm-80gb")
    assert cap.max_running_requests == min(5000, cap.max_total_num_tokens // 2) == 5000
    default = derive_capacity(ServerArgs(model_path="meta-llama/Llama-3.1-8B"),
                              "a100-sxm-80gb")
    assert default.max_running_requests == min(max(min(int(
        default.max_total_num_tokens / 131072 * 512), 4096), 2048),
        default.max_total_num_tokens // 2)


def test_explicit_fraction_and_max_total_tokens():
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", mem_fraction_static=0.5,
                      max_total_tokens=100_000)
    cap = derive_capacity(args, "a100-sxm-80gb")
    assert cap.mem_fraction_static == 0.5 and cap.max_total_num_tokens == 100_000


def test_deepseek_v3_on_two_a100s_is_refused_with_numbers():
    with pytest.raises(InfeasibleError, match=r"weights need 312\.5 GiB per GPU.*16 GPUs"):
        derive_capacity(ServerArgs(model_path="deepseek-ai/DeepSeek-V3", tp_size=2),
                        "a100-pcie-80gb")


def test_max_total_tokens_beyond_what_fits_is_refused():
    with pytest.raises(InfeasibleError, match=r"--max-total-tokens 10000000 exceeds .* tokens"):
        derive_capacity(ServerArgs(model_path="meta-llama/Llama-3.1-8B",
                                   max_total_tokens=10_000_000), "a100-sxm-80gb")


def test_mla_kv_is_one_latent_per_layer_replicated_across_tp_and_quantization_aware():
    v3 = get_model("deepseek-ai/DeepSeek-V3")
    assert v3.kv_bytes_per_token(8, 2) == 61 * (512 + 64) * 2 == v3.kv_bytes_per_token(1, 2)
    cap = derive_capacity(ServerArgs(model_path="deepseek-ai/DeepSeek-V3", tp_size=8,
                                     kv_cache_dtype="fp8_e4m3"), "h200-sxm-141gb")
    assert cap.kv_bytes_per_token == 61 * 576
    assert cap.weight_bytes_per_gpu == pytest.approx(671e9 / 8, rel=0.01)  # fp8 weights


def test_models_from_aiconfigurator_catalog():
    names = aic_catalog()
    assert len(names) >= 85 and "Qwen/Qwen3-30B-A3B" in names
    moe = get_model("Qwen/Qwen3-30B-A3B")
    assert moe.is_moe and moe.total_params() == pytest.approx(30.5e9, rel=0.02)
    assert moe.kv_bytes_per_token(4) == 2 * 48 * 1 * 128 * 2  # 4 KV heads split 4 ways
    assert get_model("Qwen/Qwen3-32B-FP8").weight_bytes_per_param == 1.0
    with pytest.raises(ConfigError, match="unknown model"):
        get_model("nobody/NoSuchModel-7B")


def test_perf_command_json(capsys):
    assert main(["perf", "--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm-80gb",
                 "--context-length", "8192", "--prefill", "1024:4096", "--decode", "8x2048",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "opdb" and out["kv_bytes_per_token"] == 131072
    assert sum(out["breakdown_s"].values()) == pytest.approx(out["step_time_s"])
    assert out["batch"]["prefill"] == [[1024, 4096]]


def test_perf_command_user_errors_are_one_line(capsys):
    assert main(["perf", "--decode", "8by2048"]) == 2
    assert "expected COUNTxKV" in capsys.readouterr().err
