"""`servetwin perf`: capacity and step-time breakdown for one model, GPU, TP and dtype.

    servetwin perf --model-path Qwen/Qwen3-32B --gpu h100-sxm-80gb --tp-size 2 \\
        --prefill 8192:0,1024:4096 --decode 32x2048 [--step-time-backend opdb] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging

from twin.config import KV_CACHE_DTYPES, QUANTIZATIONS, ServerArgs, derive_capacity
from twin.errors import ConfigError
from twin.hardware import GIB, GPUS
from twin.inputs import MAX_TOKENS, TOKENS, Rule, check


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "perf", help="capacity and step-time breakdown for a model on a GPU",
        description="Print what SGLang would size at start-up (weights, KV bytes per token, "
        "KV tokens, max concurrent requests) and the step time of a batch by operation.")
    p.add_argument("--model-path", default=ServerArgs.model_path,
                   help="Hugging Face id (built-in or aiconfigurator-core catalog) or a "
                   "directory with config.json")
    p.add_argument("--gpu", default="a100-pcie-80gb", choices=sorted(GPUS))
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q])
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs-decode", type=int)
    p.add_argument("--step-time-backend", choices=["roofline", "opdb"],
                   help="default: opdb where aiconfigurator-core's data covers the "
                   "model, GPU and dtypes, else roofline")
    p.add_argument("--prompt-len", type=int, default=1024,
                   help="prompt tokens per request, for max concurrency")
    p.add_argument("--output-len", type=int, default=256,
                   help="output tokens per request, for max concurrency")
    p.add_argument("--prefill", default="", metavar="N:PREFIX,...",
                   help="prefill chunks as new_tokens:cached_prefix, comma-separated")
    p.add_argument("--decode", default="", metavar="BxKV[,BxKV]",
                   help="decode requests as count x KV length, comma-separated")
    p.add_argument("--list-models", action="store_true",
                   help="list the models of both catalogs and exit")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=run)


MAX_BATCH = Rule(integer=True, lo=1, hi=2**20)  # requests in one --decode item


def parse_prefill(text: str) -> list[tuple[int, int]]:
    chunks = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        new, _, prefix = item.partition(":")
        chunks.append((_count(new, "--prefill", item), _count(prefix or "0", "--prefill", item,
                                                                 zero=True)))
    return chunks


def parse_decode(text: str) -> list[int]:
    lens: list[int] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        count, sep, kv = item.partition("x")
        if not sep:
            raise ConfigError(f"--decode {item!r}: expected COUNTxKV, e.g. 32x2048")
        n = check(f"--decode {item!r}: count", _count(count, "--decode", item), MAX_BATCH)
        lens += [_count(kv, "--decode", item)] * int(n)
    return lens


def _count(text: str, flag: str, item: str, zero: bool = False) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} {item!r}: {text!r} is not an integer") from None
    if not (0 if zero else 1) <= value <= MAX_TOKENS:
        raise ConfigError(f"{flag} {item!r}: {value} must be in [{0 if zero else 1}, "
                          f"{MAX_TOKENS}]")
    return value


def run(ns: argparse.Namespace) -> int:
    if ns.list_models:
        return _list_models()
    from twin.perf import default_step_time, make_step_time

    args = ServerArgs(
        model_path=ns.model_path, tp_size=ns.tp_size, mem_fraction_static=ns.mem_fraction_static,
        max_total_tokens=ns.max_total_tokens, context_length=ns.context_length,
        chunked_prefill_size=ns.chunked_prefill_size, kv_cache_dtype=ns.kv_cache_dtype,
        quantization=ns.quantization, disable_cuda_graph=ns.disable_cuda_graph,
        cuda_graph_max_bs_decode=ns.cuda_graph_max_bs_decode)
    check("--prompt-len", ns.prompt_len, TOKENS)
    check("--output-len", ns.output_len, TOKENS)
    chunks, decode = parse_prefill(ns.prefill), parse_decode(ns.decode)
    if not chunks and not decode:
        decode = [ns.prompt_len + ns.output_len // 2] * 32
    cap = derive_capacity(args, ns.gpu)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    st = (make_step_time(ns.step_time_backend, cap, args) if ns.step_time_backend
          else default_step_time(cap, args))
    backend = st.name
    parts = st.breakdown(chunks, decode)
    total = st.step_time(chunks, decode)
    per_req = ns.prompt_len + ns.output_len
    report = {
        "model": cap.model.name, "gpu": cap.gpu.name, "tp_size": cap.tp_size,
        "mem_fraction_static": cap.mem_fraction_static,
        "weight_bytes_per_gpu": cap.weight_bytes_per_gpu,
        "kv_bytes_per_token": cap.kv_bytes_per_token,
        "max_total_num_tokens": cap.max_total_num_tokens,
        "max_running_requests": cap.max_running_requests,
        "cuda_graph_max_bs": 0 if args.disable_cuda_graph else cap.cuda_graph_max_bs,
        "max_concurrency": min(cap.max_total_num_tokens // per_req, cap.max_running_requests),
        "prompt_len": ns.prompt_len, "output_len": ns.output_len,
        "backend": backend, "backend_description": st.describe(),
        "batch": {"prefill": chunks, "decode_kv_lens": _summ(decode)},
        "step_time_s": total, "breakdown_s": parts,
    }
    print(json.dumps(report, indent=2) if ns.json else _text(cap, report))
    return 0


def _summ(lens: list[int]) -> dict:
    return {"count": len(lens), "sum": sum(lens), "max": max(lens, default=0)}


def _text(cap, r: dict) -> str:
    lines = [cap.startup_log(), "",
             f"weights {r['weight_bytes_per_gpu'] / GIB:.2f} GiB/GPU; KV "
             f"{r['kv_bytes_per_token'] / 1024:.1f} KiB/token/GPU; "
             f"{r['max_total_num_tokens']} KV tokens; max concurrency "
             f"{r['max_concurrency']} requests at {r['prompt_len']}+{r['output_len']} tokens",
             f"backend: {r['backend_description']}",
             f"batch: prefill {r['batch']['prefill'] or '-'}; decode "
             f"{r['batch']['decode_kv_lens']['count']} requests, KV sum "
             f"{r['batch']['decode_kv_lens']['sum']}",
             f"step time {r['step_time_s'] * 1e3:.3f} ms"]
    for name, sec in r["breakdown_s"].items():
        share = sec / r["step_time_s"] * 100 if r["step_time_s"] else 0.0
        lines.append(f"  {name:<18} {sec * 1e3:9.3f} ms  {share:5.1f}%")
    return "\n".join(lines)


def _list_models() -> int:
    from twin.models import CATALOG, aic_catalog

    print("built-in:", *CATALOG, sep="\n  ")
    print("aiconfigurator-core:", *aic_catalog(), sep="\n  ")
    return 0
