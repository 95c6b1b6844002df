"""The users' claims, re-checked with the twin.

Each check builds the scenario, runs the twin and returns a `Claim`: what the users said,
what the twin computes, and the configuration that produced it. Whatever the twin computes
is the answer; agreement is not the goal.

Deployment throughout: the users' 2x A100-80GB PCIe at TP 2 with
DeepSeek-R1-Distill-Qwen-32B (their DeepSeek model does not fit; see the default run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from twin.config import ServerArgs, derive_capacity
from twin.perf import make_step_time
from twin.sim import SimConfig, SimResult, simulate
from twin.workload import Request, Workload, finance_qa

GPU = "a100-pcie-80gb"
MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
BASE = ServerArgs(model_path=MODEL, tp_size=2)


@dataclass(frozen=True)
class Claim:
    claim: str
    users: str
    twin: str
    config: str
    agrees: bool | None  # None: no yes/no comparison makes sense


def _sim(workload: Workload, args: ServerArgs = BASE, **cfg: object) -> SimResult:
    return simulate(workload, SimConfig(args=args, gpu=GPU, **cfg))


# ---- 1. head-of-line blocking by one 32k request -------------------------------------------
def _hol_workload(with_long: bool) -> Workload:
    reqs = [Request.make(f"s{i}", 0.1 * i, [(100 + i, 500)], 300) for i in range(16)]
    if with_long:
        reqs.append(Request.make("long", 3.0, [(999, 32_000)], 100))
    return Workload("hol", tuple(sorted(reqs, key=lambda r: r.arrival_s)))


#: the chunk answer (docs/rl.md): every chunk of a document capped at 1,024 tokens while a
#: short question waits or runs, and 8 decode-only passes before each later one
CHUNK_ANSWER = {"name": "deadline", "params": {"withhold": "none", "chunk_tokens": 1024,
                                               "park_steps": 8}}


def head_of_line() -> list[Claim]:
    import json
    import tempfile
    from pathlib import Path

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "chunk-answer.json"
        answer.write_text(json.dumps(CHUNK_ANSWER))
        for label, args, policy in (
                ("chunked prefill 8192 (SGLang default)", BASE, None),
                ("chunked prefill off", replace(BASE, chunked_prefill_size=-1), None),
                ("chunked 8192 + --enable-mixed-chunk", replace(BASE, enable_mixed_chunk=True),
                 None),
                ("chunked 8192 + the chunk answer (deadline 1024 x 8, through the plugin)",
                 BASE, str(answer))):
            base = {r["rid"]: r for r in _sim(_hol_workload(False), args,
                                              policy=policy).records}
            with_long = {r["rid"]: r for r in _sim(_hol_workload(True), args,
                                                   policy=policy).records}
            added = np.mean([with_long[k]["e2e_s"] - base[k]["e2e_s"] for k in base])
            stall = max(max(with_long[k]["itl_s"] or [0]) for k in base)
            long_ttft = with_long["long"]["ttft_s"]
            out.append(Claim(
                "one 32k request adds delay to its batch-mates", "800 ms+",
                f"{added * 1e3:,.0f} ms mean added E2E; longest token gap "
                f"{stall * 1e3:,.0f} ms; the 32k prompt's TTFT {long_ttft:,.1f} s",
                f"16 decoding requests (500 in / 300 out) + one 32k prompt at t=3 s; {label}",
                bool(added >= 0.8)))
    return out


# ---- 2. short requests' waiting: FIFO vs preemptive scheduling -------------------------
def short_wait() -> list[Claim]:
    w = finance_qa(seed=1)
    short = {r.rid for r in w.requests if r.prompt_tokens < 1000}

    def mean_wait(res: SimResult) -> float:
        return float(np.mean([r["queue_s"] for r in res.records
                              if r["rid"] in short and r["queue_s"] is not None]))

    fifo = mean_wait(_sim(w))
    out = []
    for mode in ("conservative", "moderate", "aggressive"):
        pre = mean_wait(_sim(w, replace(BASE, enable_priority_scheduling=False),
                             preemption_mode=mode))
        change = pre / fifo - 1
        out.append(Claim(
            "preemptive scheduling cuts short requests' waiting", "-67%",
            f"{change:+.0%} mean queue time of prompts < 1k ({fifo:.1f} s FIFO -> {pre:.1f} s)",
            f"finance-qa (600 requests, 50 clients); SGLang fcfs vs --preemption-mode {mode} "
            "(50 ms slices)", bool(change <= -0.5)))
    return out


# ---- 3./4. memory: allocators at long contexts, pre-allocation ---------------------------
def _long_context(seed: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(40):
        n = int(rng.integers(64_000, 128_001)) if i % 4 == 0 else int(rng.integers(8_000, 32_001))
        reqs.append(Request.make(f"L{i}", 0.0, [(10_000 + i, n)], int(rng.integers(100, 400))))
    return Workload("long-context", tuple(reqs), concurrency=8)


def _avg(res: SimResult, column: int, busy_only: bool = True) -> float:
    rows = [r for r in res.series if not busy_only or r[1] > 0]
    return float(np.mean([r[column] for r in rows])) if rows else 0.0


def memory() -> list[Claim]:
    out = []
    w = _long_context()
    for name in ("token", "paged", "buddy", "contiguous"):
        args = replace(BASE, page_size=16) if name == "paged" else BASE
        try:
            res = _sim(w, args, kv_allocator=name)
        except Exception as exc:  # an allocator that cannot run this mix says why
            out.append(Claim("effective KV utilization at 128k contexts", "< 60%",
                             f"could not run: {exc}", f"--kv-allocator {name}", None))
            continue
        cap = res.capacity.max_total_num_tokens
        util = _avg(res, 3) / cap
        allocated = _avg(res, 4) / cap
        ok = res.summary["status"]["ok"]
        out.append(Claim(
            "effective KV utilization at 128k contexts", "< 60% (fragmentation)",
            f"{util:.0%} of the pool holds KV; {allocated:.0%} allocated "
            f"({ok}/{len(w.requests)} ok)",
            f"40 requests, 1 in 4 of 64k-128k tokens, 8 clients; --kv-allocator {name}",
            bool(util < 0.6)))
        if name == "contiguous":
            idle = allocated - util
            out.append(Claim(
                "pre-allocation leaves KV memory idle", "30%",
                f"{idle:.0%} of the pool allocated but empty, plus the 15% reserve",
                "same mix; --kv-allocator contiguous --kv-reserve-fraction 0.15",
                bool(abs(idle - 0.30) < 0.1)))
    return out


# ---- 5. prefix sharing ---------------------------------------------------------------------
def prefix_sharing() -> list[Claim]:
    w = finance_qa(seed=3)
    on = _sim(w).counters["prefill_tokens"]
    off = _sim(w, replace(BASE, disable_radix_cache=True)).counters["prefill_tokens"]
    saved = 1 - on / off
    out = [Claim("radix prefix sharing (>= 32 shared tokens) cuts recomputation", "40%",
                 f"{saved:.0%} fewer prefill tokens ({on:,} vs {off:,})",
                 "finance-qa: 256-token system prompt, 20 legal-clause templates of 2,048 "
                 "tokens; radix cache on vs --disable-radix-cache", bool(saved >= 0.3))]
    # same-template compliance documents: most of each prompt is one of a few templates
    rng = np.random.default_rng(4)
    docs = tuple(Request.make(f"c{i}", 0.0, [(1, 256), (500 + int(rng.integers(0, 8)), 6_000),
                                             (10_000 + i, int(rng.integers(1_000, 4_000)))],
                              200) for i in range(200))
    cw = Workload("compliance", docs, concurrency=20)
    on = _sim(cw).counters["prefill_tokens"]
    off = _sim(cw, replace(BASE, disable_radix_cache=True)).counters["prefill_tokens"]
    saved = 1 - on / off
    out.append(Claim("radix prefix sharing (>= 32 shared tokens) cuts recomputation", "40%",
                     f"{saved:.0%} fewer prefill tokens ({on:,} vs {off:,})",
                     "200 compliance documents: 8 templates of 6,000 tokens + 1k-4k own "
                     "tokens, 20 clients; radix on vs off", bool(saved >= 0.3)))
    return out


# ---- 6. CUDA graphs --------------------------------------------------------------------------
def cuda_graphs() -> list[Claim]:
    out = []
    for backend in ("opdb", "roofline"):
        gains = []
        for batch in (1, 16, 50):
            t = {}
            for off in (False, True):
                args = replace(BASE, disable_cuda_graph=off)
                st = make_step_time(backend, derive_capacity(args, GPU), args)
                t[off] = st.step_time([], [2048] * batch)
            gains.append(f"b{batch} {t[True] / t[False] - 1:+.1%}")
        out.append(Claim("CUDA graphs raise inference efficiency", "+15%",
                         "decode throughput " + ", ".join(gains),
                         f"decode steps at KV 2048, {backend} backend, graphs on vs "
                         "--disable-cuda-graph", None))
    return out


CHECKS: dict[str, Callable[[], list[Claim]]] = {
    "head-of-line": head_of_line,
    "short-wait": short_wait,
    "memory": memory,
    "prefix-sharing": prefix_sharing,
    "cuda-graphs": cuda_graphs,
}


def run_all(names: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> list[Claim]:
    out = []
    for name in names or list(CHECKS):
        if progress:
            progress(name)
        out.extend(CHECKS[name]())
    return out


def table(claims: list[Claim]) -> str:
    lines = ["| claim | users | twin | configuration |", "|---|---|---|---|"]
    for c in claims:
        mark = "" if c.agrees is None else (" (agrees)" if c.agrees else " (disagrees)")
        lines.append(f"| {c.claim} | {c.users} | {c.twin}{mark} | {c.config} |")
    return "\n".join(lines)
