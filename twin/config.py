"""SGLang server arguments, mirrored by name and default, plus the deployment around them.

`ServerArgs` uses SGLang 0.5.x's own field names (the CLI flags with `-` for `_`), so one
configuration drives both the twin and a real `python -m sglang.launch_server`.
`derive_capacity()` turns a configuration into the numbers SGLang computes at start-up
(memory fraction, KV pool size, chunk size, request limit) once, into a frozen `Capacity`.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields

from twin.errors import ConfigError, InfeasibleError
from twin.hardware import GIB, GpuSpec, get_gpu
from twin.hicache import check_hicache_args
from twin.inputs import MAX_TOKENS, PRIORITY, TOKENS, Rule, check_optional
from twin.models import ModelSpec, get_model

SCHEDULE_POLICIES = ("fcfs", "lpm", "lof", "hrrn", "dfs-weight", "shortest-prefill-first",
                     "random")  # SGLang 0.5.23 names the twin implements (routing-key: no)
KV_CACHE_DTYPES = {"auto": None, "bf16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
QUANTIZATIONS = {None: None, "fp8": 1.0, "w8a8_fp8": 1.0, "awq": 0.5, "gptq": 0.5}

# SGLang schedule_batch / schedule_policy constants (0.5.x).
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20  # ScheduleBatch.retract_decode
LPM_FALLBACK_QUEUE_LEN = 128  # lpm falls back to fcfs above this many waiting requests
# GPU memory already taken before SGLang loads weights (CUDA context, torch, NCCL): SGLang
# sizes the pool from the memory *available* then, `profile_max_num_token`:
# rest = avail_after_load - avail_before_load * (1 - mem_fraction_static). On 80 GB cards
# SGLang logs "Load weight begin. avail mem=78.6 GB", i.e. about 1.4 GiB in use (estimate).
PRELOAD_USED_BYTES = 1.4 * 2**30


# Every numeric server argument and what SGLang (or sense) allows; None = SGLang derives it.
NUMBER_RULES = {
    "tp_size": Rule(integer=True, lo=1, hi=1024),
    "context_length": TOKENS,
    "mem_fraction_static": Rule(lo=0, hi=1, lo_open=True, hi_open=True),
    "max_total_tokens": TOKENS,
    "chunked_prefill_size": Rule(integer=True, lo=-1, hi=MAX_TOKENS),
    "max_prefill_tokens": TOKENS,
    "max_running_requests": Rule(integer=True, lo=1, hi=MAX_TOKENS),
    "schedule_conservativeness": Rule(lo=0, lo_open=True, hi=1e6),
    "page_size": Rule(integer=True, lo=1, hi=2**20),
    "priority_scheduling_preemption_threshold": PRIORITY,
    "cuda_graph_max_bs_decode": Rule(integer=True, lo=1, hi=2**20),
    "hicache_ratio": Rule(lo=0, lo_open=True, hi=1e6),
    "hicache_size": Rule(integer=True, lo=0, hi=2**30),
}


@dataclass(frozen=True)
class ServerArgs:
    """The SGLang server arguments the twin models, with SGLang's defaults
    (None = SGLang derives it at start-up; see `derive_capacity`)."""

    model_path: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
    tp_size: int = 1
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    page_size: int = 1
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False  # the overlap loop is on by default (twin/overlap.py)
    cuda_graph_max_bs_decode: int | None = None  # SGLang 0.5.23's name (no --cuda-graph-max-bs)
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # SGLang's hierarchical cache, host-memory tier (twin/hicache.py); off by default
    enable_hierarchical_cache: bool = False
    hicache_ratio: float | None = None  # None: 2.0 (SGLang's default in cache mode)
    hicache_size: int = 0  # GB per rank; overrides the ratio
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "page_first"
    hicache_host_memory_mode: str = "cache"
    hicache_storage_backend: str | None = None  # refused: the twin has no storage tier

    def __post_init__(self) -> None:
        def bad(flag: str, value: object, allowed: str) -> ConfigError:
            return ConfigError(f"--{flag.replace('_', '-')} {value!r}: {allowed}")

        for f in fields(self):  # a null or a wrong kind of value (a file's "yes" for a flag)
            v, d = getattr(self, f.name), f.default
            if d is MISSING or d is None:
                continue
            if v is None:
                raise bad(f.name, v, f"must be given (default {d!r}), not null")
            if isinstance(d, bool) and not isinstance(v, bool):
                raise bad(f.name, v, "must be true or false")
            if isinstance(d, str) and not isinstance(v, str):
                raise bad(f.name, v, "must be a string")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", self.schedule_policy,
                      f"allowed values: {', '.join(SCHEDULE_POLICIES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", self.kv_cache_dtype,
                      f"allowed values: {', '.join(KV_CACHE_DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", self.quantization,
                      f"allowed values: {', '.join(q for q in QUANTIZATIONS if q)}")
        for name, rule in NUMBER_RULES.items():
            check_optional("--" + name.replace("_", "-"), getattr(self, name), rule)
        check_hicache_args(self)
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and chunk < 1:
            raise bad("chunked_prefill_size", chunk, "use -1 to disable chunking, or a size >= 1")
        if chunk is not None and chunk > 0 and chunk % self.page_size:
            raise ConfigError(f"--chunked-prefill-size {chunk} with --page-size "
                              f"{self.page_size}: chunked_prefill_size must be divisible by "
                              "page_size (SGLang refuses it)")
        if self.enable_mixed_chunk and chunk == -1:
            raise ConfigError("--enable-mixed-chunk needs chunked prefill: with "
                              "--chunked-prefill-size -1 SGLang runs no mixed steps")
        if self.enable_priority_scheduling and self.schedule_policy not in ("fcfs", "lof"):
            raise ConfigError("--enable-priority-scheduling works only with --schedule-policy "
                              "fcfs or lof (as in SGLang)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class Capacity:
    """What SGLang computes at start-up for one replica (one TP group)."""

    model: ModelSpec
    gpu: GpuSpec
    tp_size: int
    mem_fraction_static: float
    weight_bytes_per_gpu: float
    kv_bytes_per_token: float  # per GPU
    max_total_num_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None  # None: chunking disabled
    max_prefill_tokens: int
    cuda_graph_max_bs: int
    context_len: int
    page_size: int
    notes: tuple[str, ...] = ()

    @property
    def kv_pool_bytes(self) -> float:
        return self.max_total_num_tokens * self.kv_bytes_per_token

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt SGLang accepts (shorter of context and pool, minus one)."""
        return min(self.context_len - 1, self.max_total_num_tokens - 1)

    def startup_log(self) -> str:
        """The budget, the way SGLang logs it at start-up."""
        gib = GIB
        return (
            f"Load weight end. mem usage={self.weight_bytes_per_gpu / gib:.2f} GB. "
            f"(per GPU, tp_size={self.tp_size}, {self.model.name} on {self.gpu.name})\n"
            f"KV Cache is allocated. #tokens: {self.max_total_num_tokens}, "
            f"KV size: {self.kv_pool_bytes / gib:.2f} GB\n"
            f"max_total_num_tokens={self.max_total_num_tokens}, "
            f"chunked_prefill_size={self.chunked_prefill_size or -1}, "
            f"max_prefill_tokens={self.max_prefill_tokens}, "
            f"max_running_requests={self.max_running_requests}, "
            f"context_len={self.context_len}, "
            f"mem_fraction_static={self.mem_fraction_static:.3f}"
        )


def gpu_memory_defaults(gpu_mem_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda_graph max_bs) by GPU memory, as SGLang 0.5.23's
    `handle_gpu_memory_settings` (srt/arg_groups/memory_hook.py) chooses them."""
    if gpu_mem_mib < 20 * 1024:  # T4, 4080
        return 2048, 8
    if gpu_mem_mib < 35 * 1024:  # A10, 4090, 5090
        return 4096, 48 if tp < 4 else 160
    if gpu_mem_mib < 60 * 1024:  # A100 40GB, L40
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * 1024:  # H100, A100 80GB, H20, H200
        return 8192, 256 if tp < 4 else 512
    return 16384, 512  # B200, MI300


def default_mem_fraction(gpu_mem_mib: float, chunk: int, max_prefill: int, graph_bs: int,
                         tp: int) -> float:
    """SGLang 0.5.x's default `--mem-fraction-static`: everything but a reserve (MiB) for
    activations (1.5 x the chunk), CUDA-graph buffers (2 per graph batch) and per-rank
    constants (512 + tp/8 GiB), at least 10 GiB on GPUs above 60 GiB."""
    reserved = 512 + max(chunk if chunk > 0 else max_prefill, 2048) * 1.5
    reserved += graph_bs * 2 + tp / 8 * 1024
    if gpu_mem_mib > 60 * 1024:  # SGLang keeps at least 10 GiB free on large GPUs
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


def derive_capacity(args: ServerArgs, gpu_name: str) -> Capacity:
    """SGLang's start-up arithmetic; infeasible configurations are refused with numbers."""
    model, gpu = get_model(args.model_path), get_gpu(gpu_name)
    check_model_fits_args(model, args)
    if args.quantization:
        model = _with_weight_bytes(model, QUANTIZATIONS[args.quantization])
    mem_mib = gpu.mem_bytes / 2**20
    chunk_default, graph_bs_default = gpu_memory_defaults(mem_mib, args.tp_size)
    chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else chunk_default
    graph_bs = args.cuda_graph_max_bs_decode or graph_bs_default
    if args.cuda_graph_max_bs_decode is None and args.max_running_requests is not None:
        graph_bs = min(graph_bs, args.max_running_requests)  # SGLang caps the default
    frac = args.mem_fraction_static or default_mem_fraction(
        mem_mib, chunk, args.max_prefill_tokens, graph_bs, args.tp_size)
    weights = model.weight_bytes_per_gpu(args.tp_size)
    kv_dtype_bytes = KV_CACHE_DTYPES[args.kv_cache_dtype] or 2
    kv_per_token = model.kv_bytes_per_token(args.tp_size, kv_dtype_bytes)
    static = frac * (gpu.mem_bytes - PRELOAD_USED_BYTES)
    fit = int((static - weights) // kv_per_token) // args.page_size * args.page_size
    if fit <= 0:
        raise InfeasibleError(
            f"{model.name} does not fit on {args.tp_size}x {gpu.name}: weights need "
            f"{weights / GIB:.1f} GiB per GPU ({model.total_params() / 1e9:.0f}B params x "
            f"{model.weight_bytes_per_param:g} bytes / tp {args.tp_size}), but "
            f"mem_fraction_static {frac:.3f} x {(gpu.mem_bytes - PRELOAD_USED_BYTES) / GIB:.1f} "
            f"GiB available at load leaves {static / GIB:.1f} "
            f"GiB for weights and KV cache; at least "
            f"{_min_tp(model, gpu, frac)} GPUs of this kind would be needed")
    total = fit
    if args.max_total_tokens is not None:
        if args.max_total_tokens > fit:
            raise InfeasibleError(
                f"--max-total-tokens {args.max_total_tokens} exceeds what fits: "
                f"{(static - weights) / GIB:.1f} GiB of KV room per GPU / "
                f"{kv_per_token / 1024:.0f} KiB per token = {fit} tokens")
        total = args.max_total_tokens // args.page_size * args.page_size
    context = args.context_length or model.context_len
    # SGLang 0.5.23's resolve_max_num_reqs: the estimated request pool bounds only the
    # default; a given --max-running-requests is bounded by half the token pool alone
    req_pool = min(max(int(total / context * 512), 2048), 4096)
    if args.max_running_requests is not None:
        max_running = min(args.max_running_requests, total // 2)
    else:
        max_running = min(req_pool, total // 2)
    return Capacity(
        model=model, gpu=gpu, tp_size=args.tp_size, mem_fraction_static=frac,
        weight_bytes_per_gpu=weights, kv_bytes_per_token=kv_per_token,
        max_total_num_tokens=total, max_running_requests=max(1, max_running),
        chunked_prefill_size=chunk if chunk > 0 else None,
        max_prefill_tokens=args.max_prefill_tokens, cuda_graph_max_bs=graph_bs,
        context_len=context, page_size=args.page_size,
    )


# SGLang lets a longer --context-length than the model's through only with this set.
ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def check_model_fits_args(model: ModelSpec, args: ServerArgs) -> None:
    """SGLang's start-up checks that depend on the model: attention heads split evenly
    over TP ranks (KV heads split or replicated evenly), and a context length no longer
    than the model's unless SGLang's override variable is set."""
    tp = args.tp_size
    if model.num_heads % tp:
        raise ConfigError(f"--tp-size {tp}: {model.name} has {model.num_heads} attention heads, "
                          f"which SGLang splits evenly over TP ranks ('{model.num_heads} is not "
                          f"divisible by {tp}'); allowed: a divisor of {model.num_heads}")
    kv = model.num_kv_heads
    if not model.is_mla and (kv % tp if tp < kv else tp % kv):
        raise ConfigError(f"--tp-size {tp}: {model.name} has {kv} KV heads, which SGLang "
                          "splits evenly over TP ranks or replicates evenly "
                          f"('{max(kv, tp)} is not divisible by {min(kv, tp)}')")
    ctx = args.context_length
    if ctx is not None and ctx > model.context_len and not os.environ.get(
            ALLOW_LONGER_CONTEXT_ENV):
        raise ConfigError(f"--context-length {ctx}: User-specified context_length ({ctx}) is "
                          f"greater than the derived context_length ({model.context_len}) of "
                          f"{model.name} (SGLang refuses it; to allow overriding this maximum, "
                          f"set the env var {ALLOW_LONGER_CONTEXT_ENV}=1)")


def _min_tp(model: ModelSpec, gpu: GpuSpec, frac: float) -> int:
    tp = 1
    while (model.weight_bytes_per_gpu(tp) >= frac * (gpu.mem_bytes - PRELOAD_USED_BYTES)
           and tp < 1024):
        tp *= 2
    return tp


def _with_weight_bytes(model: ModelSpec, nbytes: float) -> ModelSpec:
    from dataclasses import replace

    return replace(model, weight_bytes_per_param=nbytes)
