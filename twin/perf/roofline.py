"""Roofline step time: no measurements needed, only the model's shapes and the GPU's rates.

Per step: every linear layer is max(FLOPs / compute, weight bytes / HBM bandwidth); prefill
attention is quadratic in the chunk and linear in its cached prefix; decode attention reads
each request's KV; tensor parallelism adds two ring all-reduces per layer; the overhead
is SGLang's scheduler CPU work (a part per step and a part per request in the batch,
measured: twin/perf/step_cpu.py) plus kernel launches (smaller for decode steps that
replay a CUDA graph).
The efficiency factors are stated in `RooflineParams` and can be fitted by calibration.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from twin.config import Capacity, ServerArgs
from twin.perf import PrefillChunk, register_backend
from twin.perf.step_cpu import SGLANG_0_5_23 as STEP_CPU


@dataclass(frozen=True)
class RooflineParams:
    gemm_efficiency: float = 0.70  # share of peak tensor FLOP/s reached by large GEMMs
    attn_efficiency: float = 0.50  # share of peak reached by prefill attention kernels
    mem_efficiency: float = 0.85  # share of HBM bandwidth reached by memory-bound kernels
    link_efficiency: float = 0.70  # share of the TP link bandwidth reached by all-reduce
    allreduce_latency_s: dict | None = None  # per call, by link kind
    # SGLang's scheduler loop, CPU work per step and per request in the batch (measured on
    # the CPU harness: twin/perf/step_cpu.py)
    scheduler_overhead_s: float = STEP_CPU.per_step_s
    scheduler_per_request_s: float = STEP_CPU.per_request_s
    launch_per_layer_s: float = 60e-6  # eager kernel launches, per layer per step
    graph_launch_per_layer_s: float = 6e-6  # the same when a CUDA graph is replayed

    def allreduce_latency(self, link: str) -> float:
        table = self.allreduce_latency_s or {"nvlink": 8e-6, "pcie": 20e-6}
        return table[link]

    def overheads(self, num_layers: int) -> tuple[float, float, float]:
        """(eager, CUDA-graph) per-step overhead and the scheduler CPU per request: the
        step's CPU part plus its kernel launches (shared by `roofline` and `opdb`)."""
        return (self.scheduler_overhead_s + self.launch_per_layer_s * num_layers,
                self.scheduler_overhead_s + self.graph_launch_per_layer_s * num_layers,
                self.scheduler_per_request_s)

    def with_step_cpu(self, cpu) -> RooflineParams:
        """These parameters with SGLang's scheduler CPU part set to `cpu` (a `StepCpu`)."""
        return replace(self, scheduler_overhead_s=cpu.per_step_s,
                       scheduler_per_request_s=cpu.per_request_s)


class RooflineStepTime:
    name = "roofline"
    quiet_kv_mean = float("inf")  # decode_times has no side effect (twin/perf/step_cache.py)

    def __init__(self, capacity: Capacity, args: ServerArgs,
                 params: RooflineParams | None = None) -> None:
        p = self.params = params or RooflineParams()
        m, g, tp = capacity.model, capacity.gpu, capacity.tp_size
        self.capacity = capacity
        peak = g.fp8_flops if (m.weight_bytes_per_param <= 1 and g.fp8_flops) else g.bf16_flops
        self._gemm_rate = peak * p.gemm_efficiency
        self._attn_rate = g.bf16_flops * p.attn_efficiency
        self._mem_rate = g.hbm_bw * p.mem_efficiency
        wb = m.weight_bytes_per_param
        dense = sum(m.mlp_params(i, active=False) for i in range(m.num_layers)
                    if not m.is_moe or i < m.first_dense_layers)
        self._dense_params = (m.num_layers * m.attention_params() + dense) / tp
        moe_layers = m.num_layers - m.first_dense_layers if m.is_moe else 0
        self._expert_params = 3 * m.hidden * m.moe_intermediate / tp if m.is_moe else 0.0
        self._moe_layers = moe_layers
        self._lm_head_params = m.vocab * m.hidden / tp
        self._wb = wb
        self._fpqk = m.attn_flops_per_query_key(tp)
        self._kvb = capacity.kv_bytes_per_token
        self._ar_calls = 2 * m.num_layers if tp > 1 else 0
        self._ar_bytes_per_token = m.hidden * 2 * 2 * (tp - 1) / tp  # bf16, ring: 2(n-1)/n
        self._link_rate = g.link_bw * p.link_efficiency
        self._ar_latency = p.allreduce_latency(g.link)
        self._eager, self._graph, self._per_request = p.overheads(m.num_layers)
        self._graph_bs = 0 if args.disable_cuda_graph else capacity.cuda_graph_max_bs
        self._m = m
        # decode attention is linear in total KV: seconds per KV token
        self._decode_attn_per_kv = max(self._fpqk / self._attn_rate, self._kvb / self._mem_rate)
        self._decode_const: dict[int, float] = {}

    # -- parts ------------------------------------------------------------------------
    def _linear(self, tokens: int, rows_out: int) -> tuple[float, float]:
        """(GEMM seconds, LM-head seconds) for `tokens` through the layers."""
        m = self._m
        flops = 2.0 * tokens * self._dense_params
        weight_bytes = self._dense_params * self._wb
        if m.is_moe:
            flops += 2.0 * tokens * self._moe_layers * self._expert_params * (
                m.experts_per_token + m.num_shared_experts)
            touched = m.num_experts * (1 - (1 - m.experts_per_token / m.num_experts) ** tokens)
            weight_bytes += self._moe_layers * self._expert_params * self._wb * (
                touched + m.num_shared_experts)
        gemm = max(flops / self._gemm_rate, weight_bytes / self._mem_rate)
        head = max(2.0 * rows_out * self._lm_head_params / self._gemm_rate,
                   self._lm_head_params * self._wb / self._mem_rate) if rows_out else 0.0
        return gemm, head

    def _allreduce(self, tokens: int) -> float:
        if not self._ar_calls:
            return 0.0
        return self._ar_calls * (self._ar_latency + tokens * self._ar_bytes_per_token
                                 / self._link_rate)

    def _overhead(self, n_prefill: int, n_decode: int) -> float:
        """Scheduler CPU (per step and per request) plus kernel launches (a decode-only
        batch within the CUDA-graph sizes replays a graph)."""
        graph = not n_prefill and n_decode <= self._graph_bs
        return ((self._graph if graph else self._eager)
                + self._per_request * (n_prefill + n_decode))

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        n_dec = len(decode_kv_lens)
        tokens = sum(n for n, _ in prefill_chunks) + n_dec
        gemm, head = self._linear(tokens, len(prefill_chunks) + n_dec)
        pf_flops = sum(self._fpqk * n * (p + (n + 1) / 2) for n, p in prefill_chunks)
        pf_bytes = sum(self._kvb * (p + n) for n, p in prefill_chunks)
        prefill_attn = max(pf_flops / self._attn_rate, pf_bytes / self._mem_rate)
        decode_attn = self._decode_attn_per_kv * sum(decode_kv_lens)
        return {
            "gemm": gemm, "lm_head": head, "prefill_attention": prefill_attn,
            "decode_attention": decode_attn, "tp_allreduce": self._allreduce(tokens),
            "overhead": self._overhead(len(prefill_chunks), n_dec),
        }

    def with_step_cpu(self, cpu) -> RooflineStepTime:
        """This model with SGLang's scheduler CPU part set to `cpu` (the GPU's work and the
        kernel launches unchanged)."""
        out = copy.copy(self)
        out.params = self.params.with_step_cpu(cpu)
        out._eager, out._graph, out._per_request = out.params.overheads(self._m.num_layers)
        out._decode_const = {}  # memoised decode constants hold the old CPU part
        return out

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float:
        return sum(self.breakdown(prefill_chunks, decode_kv_lens).values())

    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray:
        const = self._decode_const.get(batch_size)
        if const is None:
            parts = self.breakdown([], [0] * batch_size)
            const = self._decode_const[batch_size] = sum(parts.values())
        return const + self._decode_attn_per_kv * np.asarray(kv_sums, dtype=float)

    def describe(self) -> str:
        c = self.capacity
        return (f"roofline on {c.gpu.name} x{c.tp_size} ({c.model.name}); efficiencies "
                f"gemm {self.params.gemm_efficiency}, attention {self.params.attn_efficiency}, "
                f"HBM {self.params.mem_efficiency}, link {self.params.link_efficiency}")


@register_backend("roofline")
def _make(capacity: Capacity, args: ServerArgs) -> RooflineStepTime:
    return RooflineStepTime(capacity, args)
