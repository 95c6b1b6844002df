"""The twin's vLLM V1 replica against a real vLLM 0.32 CPU server, scenario by scenario.

Used by tests/test_vllm_live.py and benchmarks/vllm_live.py. One server
(`SERVER_ARGS`: 4 sequences, a 512-token budget, 24 KV blocks of 128 tokens, of which
vLLM's null block takes one) behind the length router (its `/generate` front for a vLLM
pool); each scenario is replayed with `servetwin live replay`'s client on a reset prefix
cache, and vLLM's own counters (`/metrics`: preemptions, engine steps, queue time) are
read before and after. The twin is the same server (`VllmArgs` of the same values) with
the step times of a vLLM profile (calibration/vllm.py) and its request path added to
TTFT and end-to-end times.

Scenarios, each aimed at one rule:
- `prefix`: two 256-token templates (two 128-token blocks) under Poisson arrivals: which
  requests hit the prefix cache, and how many tokens;
- `seqs`: 10 requests 50 ms apart, 120 output tokens each: `max_num_seqs` 4 (never more
  than 4 generate at once) and FCFS admission (first tokens in arrival order);
- `chunk`: a 1,500-token prompt arriving while a 64-token request decodes (200 output
  tokens, so it still decodes through the prompt's prefill on a fast machine too): with
  `max_num_batched_tokens` 512 its prefill takes 3 steps (511 tokens each beside the
  decode), so the decoding request emits 3 tokens (4 if the prompt arrived mid-step)
  between the prompt's arrival and its first token (`chunk_steps`);
- `preempt`: 4 requests of 300 + 500 tokens (7 blocks each at the end, 23 usable):
  recompute preemption when blocks run out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.request_path import token_times as record_token_times
from twin.workload import Request, Workload, from_spec

SERVER_ARGS = {"max_num_seqs": 4, "max_num_batched_tokens": 512, "num_gpu_blocks_override": 24,
               "max_model_len": 2048, "block_size": 128}
VOCAB = 4096  # the harness's tiny Llama
# the profile's limits (calibration/vllm.py): 23 usable blocks of 128 tokens
LIMITS_ARGS = (4, 512, 23 * 128, 2048)
PREFIX_SPEC = ("arrival=poisson,rate=2,n=16,prompt=uniform:32:96,output=fixed:8,"
               "templates=2,template_len=256,share=0.75")
SCENARIOS = ("prefix", "seqs", "chunk", "preempt")


def limits():
    from calibration.vllm import VllmLimits

    return VllmLimits(*LIMITS_ARGS)


def cli_args(server_args: dict = SERVER_ARGS) -> list[str]:
    """The vLLM command-line flags of these arguments (the harness sets block size 128)."""
    out = []
    for k, v in server_args.items():
        if k != "block_size":
            out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _own(i: int, n: int) -> tuple[int, int]:
    return (10_000 + i, n)  # a segment no other request shares


def workload(name: str, seed: int = 0) -> Workload:
    if name == "prefix":
        return from_spec(PREFIX_SPEC, seed)
    if name == "seqs":
        # 120 tokens: r0 still generates when r3 comes 150 ms later unless a step is under
        # about 1.25 ms (with 24 tokens, under about 6 ms: close to a fast CI machine's 9)
        reqs = [Request.make(f"r{i}", 0.05 * i, [_own(i, 64)], 120) for i in range(10)]
    elif name == "chunk":
        reqs = [Request.make("r0", 0.0, [_own(0, 64)], 200),
                Request.make("r1", 0.4, [_own(1, 1500)], 8)]
    elif name == "preempt":
        reqs = [Request.make(f"r{i}", 0.05 * i, [_own(i, 300)], 500) for i in range(4)]
    else:
        raise ValueError(f"scenario {name!r}: one of {', '.join(SCENARIOS)}")
    return Workload(name, tuple(reqs), None)


# ---- the twin -------------------------------------------------------------------------
@dataclass
class TwinRun:
    records: list[dict]
    counters: dict  # the replica's VCounters as a dict


def simulate(work: Workload, model_dir: str, profile: dict | str | Path,
             server_args: dict = SERVER_ARGS) -> TwinRun:
    """The twin of the server on `work`, step times from the vLLM `profile`: a profile
    file goes through a deployment's `calibration:` key (twin/fleet.py, as `servetwin
    simulate --deployment` reads it), a dict is used as it is. The profile's request path
    is added to TTFT and E2E (the twin models the engine; the client sees the path too)."""
    from dataclasses import asdict

    import simpy

    from twin.fleet import Kinds, build_fleet, parse_spec, run_deployment
    from twin.vllm_replica import VllmArgs, vllm_kind

    gpu = "a100-pcie-80gb"  # only for the capacity arithmetic: blocks are overridden
    args = {"model": model_dir, **server_args}
    replica = {"name": "replica-vllm", "engine": "vllm", "server_args": args}
    kinds = Kinds()
    if isinstance(profile, dict):
        va = VllmArgs(**args)
        kinds.cache[("vllm", gpu, va, None, None)] = vllm_kind(va, gpu, None, profile)
        prof = profile
    else:
        replica["calibration"] = str(Path(profile).resolve())
        prof = json.loads(Path(profile).read_text())
    spec = parse_spec({"name": "vllm-cpu", "gpu": gpu, "router": {"name": "round_robin"},
                       "replicas": [replica]}, "<vllm_live>")
    dep = build_fleet(simpy.Environment(), spec, work, kinds=kinds)
    res = run_deployment(dep)
    path = float((prof.get("request_path") or {}).get("total_s") or 0.0)
    recs = [dict(r) for r in res.records]
    for r in recs:
        for k in ("ttft_s", "e2e_s"):
            if r.get(k) is not None:
                r[k] += path
    return TwinRun(recs, asdict(dep.workers[0].replica.counters))


def step_check(records: Sequence[dict], profile: dict) -> dict:
    """How the live scenario's own steps compare with the profile's step times: the
    median over the token-gap samples of a replay (vLLM's rules) of measured / predicted
    (above 1: the server ran slower than when it was profiled: other load on the
    machine)."""
    from calibration.derive import timelines_from_records
    from calibration.vllm_derive import token_gap_samples
    from twin.perf.fitted import vllm_step_time

    lim = limits()
    st = vllm_step_time(profile, 1, "profile")
    samples = token_gap_samples(timelines_from_records(records), lim.max_num_batched_tokens,
                                lim.max_num_seqs)
    measured, predicted = [], []
    for s in samples:
        (chunks, (b, kv)), = s["steps"]
        q, rem = divmod(kv, b) if b else (0, 0)
        lens = [q + 1] * rem + [q] * (b - rem)
        measured.append(s["dur_s"])
        predicted.append(st.step_time([tuple(c) for c in chunks], lens))
    m, p = np.array(measured), np.array(predicted)
    return {"samples": len(m),
            "ratio": round(float(np.median(m / p)), 3) if len(m) else None,
            "total_ratio": round(float(m.sum() / p.sum()), 3) if len(m) else None}


def scaled(profile: dict, factor: float) -> dict:
    """The profile with every step `factor` times as long (a diagnostic: the twin on the
    machine as slow as a live run measured it, `step_check`'s `total_ratio`)."""
    out = json.loads(json.dumps(profile))
    coef = out["step_time"]["coefficients"]
    for k in coef:
        coef[k] *= factor
    return out


# ---- what is compared -----------------------------------------------------------------
def max_concurrency(records: Sequence[dict]) -> int:
    """Most requests between their first and last token at one time. The last token, not
    E2E: a live record's E2E ends when the client sees the stream close, which on a loaded
    machine can come after the next request's first token (the last CI saw 5 on a
    4-sequence server that way)."""
    ev = []
    for r in records:
        times = record_token_times(r)
        if times:
            ev += [(times[0], 1), (times[-1], -1)]
    level = best = 0
    for _, d in sorted(ev, key=lambda e: (e[0], e[1])):
        level += d
        best = max(best, level)
    return best


def token_times(r: dict) -> np.ndarray:
    return np.array(record_token_times(r), dtype=float)


def chunk_steps(records: Sequence[dict], eps_s: float = 0.005) -> int | None:
    """`chunk`: the steps that carried a chunk of r1's prompt, seen in r0's token gaps:
    between r1's arrival and its first token, the gaps over 3 times r0's median gap (a
    511-token chunk step takes several decode steps' time)."""
    by = {r["rid"]: r for r in records}
    if "r1" not in by or by["r1"].get("ttft_s") is None:
        return None
    t_in, t_first = by["r1"]["arrival_s"], by["r1"]["arrival_s"] + by["r1"]["ttft_s"]
    t0 = token_times(by["r0"])
    ends = (t0[1:] > t_in) & (t0[1:] <= t_first + eps_s)
    gaps = np.diff(t0)[ends]
    return int((gaps > 3 * np.median(np.diff(t0))).sum())


def first_token_order(records: Sequence[dict]) -> list[str]:
    done = [r for r in records if r.get("ttft_s") is not None]
    # tokens of one step share its end (to the microsecond): then arrival order
    return [r["rid"] for r in sorted(done, key=lambda r: (
        round(r["arrival_s"] + r["ttft_s"], 6), r["arrival_s"]))]


def fcfs(records: Sequence[dict], eps_s: float = 0.005) -> bool:
    """First tokens in arrival order: none earlier than a first token of a request that
    arrived before it, by more than `eps_s` (tokens of one step reach the client a
    fraction of a millisecond apart)."""
    done = sorted((r for r in records if r.get("ttft_s") is not None),
                  key=lambda r: r["arrival_s"])
    latest = -np.inf
    for r in done:
        t = r["arrival_s"] + r["ttft_s"]
        if t < latest - eps_s:
            return False
        latest = max(latest, t)
    return True


def arrival_order(records: Sequence[dict]) -> list[str]:
    return [r["rid"] for r in sorted(records, key=lambda r: r["arrival_s"])]


def row(side: str, scenario: str, records: Sequence[dict], preemptions: float,
        steps: float, queue_mean_s: float | None, decode_s: float) -> dict:
    """`decode_s`: the engine's decode time summed over the requests, first token to last
    (live: `vllm:request_decode_time_seconds`, from the engine's own clock, which the
    client's and the front's delays do not touch)."""
    ttft = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    e2e = [r["e2e_s"] for r in records if r.get("e2e_s") is not None]
    return {"scenario": scenario, "side": side, "requests": len(records),
            "ok": sum(r["status"] == "ok" for r in records),
            "hits": sum((r.get("cached_tokens") or 0) > 0 for r in records),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in records),
            "preemptions": int(preemptions), "steps": int(steps),
            "chunk_steps": chunk_steps(records) if scenario == "chunk" else None,
            "max_running": max_concurrency(records),
            "fcfs": fcfs(records),
            "queue_mean_s": queue_mean_s, "decode_s": decode_s,
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
            "ttft_p50_s": float(np.median(ttft)) if ttft else None,
            "e2e_mean_s": float(np.mean(e2e)) if e2e else None}


def twin_row(scenario: str, run: TwinRun) -> dict:
    q = [r["queue_s"] for r in run.records if r.get("queue_s") is not None]
    decode = sum(r["e2e_s"] - r["ttft_s"] for r in run.records
                 if r.get("e2e_s") is not None and r.get("ttft_s") is not None)
    return row("twin", scenario, run.records, run.counters["preemptions"],
               run.counters["emitting_steps"], float(np.mean(q)) if q else None, decode)


def live_row(scenario: str, records: Sequence[dict], d: dict) -> dict:
    n = d.get("vllm:request_queue_time_seconds_count") or 0
    q = d["vllm:request_queue_time_seconds_sum"] / n if n else None
    return row("live", scenario, records, d["vllm:num_preemptions_total"],
               d["vllm:iteration_tokens_total_count"], q,
               d.get("vllm:request_decode_time_seconds_sum") or 0.0)


# ---- the live side --------------------------------------------------------------------
def replay_scenario(front: str, engine: str, work: Workload) -> tuple[list[dict], dict]:
    """Replay `work` through the front on a reset prefix cache: (records, counter delta)."""
    from runtime.client import ReplayConfig, replay
    from runtime.server_api import probe
    from runtime.vllm_cpu import metrics

    facts = probe(front, VOCAB)
    before = metrics.counters(engine)
    result = replay(work, ReplayConfig(url=front, max_lateness_s=60.0, vocab_size=VOCAB),
                    facts=facts)
    return result.records, metrics.delta(before, metrics.counters(engine))


def fmt_table(rows: Sequence[dict]) -> str:
    cols = ("scenario", "side", "requests", "ok", "hits", "cached_tokens", "preemptions",
            "steps", "chunk_steps", "max_running", "fcfs", "queue_mean_s", "ttft_mean_s", "ttft_p50_s",
            "e2e_mean_s")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_cell(r[c]) for c in cols) + " |")
    return "\n".join(out)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
