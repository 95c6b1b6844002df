"""The closing-note table of issue 3, and the CUDA-graph gain, from both backends.

    python benchmarks/perf_table.py

Decode step time at batch 1/32/128 x KV 2k/32k and prefill time at 1k/8k/32k tokens
(one chunk, no prefix), Llama-3.1-8B and Qwen3-32B on one A100 SXM and one H100 SXM; then
the decode throughput gain from CUDA graphs for the users' deployment
(DeepSeek-R1-Distill-Qwen-32B, TP 2 on A100 PCIe).
"""

from __future__ import annotations

import logging

from twin.config import ServerArgs, derive_capacity
from twin.perf import make_step_time

logging.basicConfig(level=logging.ERROR)
MODELS = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-32B")
GPUS = ("a100-sxm-80gb", "h100-sxm-80gb")


def table() -> None:
    print("| model | GPU | backend | " + " | ".join(
        f"decode b{b} kv{kv // 1024}k" for b in (1, 32, 128) for kv in (2048, 32768))
        + " | prefill 1k | prefill 8k | prefill 32k |")
    print("|" + "---|" * 12)
    for model in MODELS:
        for gpu in GPUS:
            args = ServerArgs(model_path=model)
            cap = derive_capacity(args, gpu)
            for backend in ("opdb", "roofline"):
                st = make_step_time(backend, cap, args)
                dec = [st.step_time([], [kv] * b) for b in (1, 32, 128) for kv in (2048, 32768)]
                pre = [st.step_time([(n, 0)], []) for n in (1024, 8192, 32768)]
                cells = [f"{t * 1e3:.1f}" for t in dec + pre]
                print(f"| {model.split('/')[1]} | {gpu} | {backend} | " + " | ".join(cells) + " |")


def graph_gain() -> None:
    on = ServerArgs(model_path="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", tp_size=2)
    off = ServerArgs(model_path=on.model_path, tp_size=2, disable_cuda_graph=True)
    cap = derive_capacity(on, "a100-pcie-80gb")
    print("\n| backend | batch | KV | step with graph (ms) | without (ms) | decode throughput gain |")
    print("|---|---|---|---|---|---|")
    for backend in ("opdb", "roofline"):
        g, e = make_step_time(backend, cap, on), make_step_time(backend, cap, off)
        for b in (1, 16, 50, 128):
            tg, te = g.step_time([], [2048] * b), e.step_time([], [2048] * b)
            print(f"| {backend} | {b} | 2048 | {tg * 1e3:.2f} | {te * 1e3:.2f} | "
                  f"+{(te / tg - 1) * 100:.1f}% |")


if __name__ == "__main__":
    table()
    graph_gain()
