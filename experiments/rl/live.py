"""The RL comparison live: the CPU SGLang server against the twin calibrated on it.

The users' deployment cannot run here, so the comparison of `benchmarks/rl.py` is scaled
to the CPU harness: a finance-qa-shaped mix (short questions and multi-chunk documents,
`CPU_FAMILY`) at `load` x the capacity of the twin calibrated on the server, with SLO
targets scaled to the server's step times (`cpu_targets`). Every policy runs on a fresh
server started with `--schedule-policy shortest-prefill-first` (so that SGLang applies
its chunk cap to whatever order the plugin gives): `shortest-prefill-first` itself
natively, the others through the plugin; the twin simulates each run at its live send
times with the same spec. The deadline policy's prefill model is fitted to the calibrated
step times (`fit_prefill`), and the learned policy's weight file is re-stamped with the
CPU scale's targets and prefill model (`restamp`): its network is unchanged. Chunk answers
(`deadline:MODE+chunks`, a learned menu's `RULE@TOKENSxPARK` entries) keep their
decode-only passes and scale their chunk tokens by the server's chunk budget over the users'
8,192 (`scaled_answer`), so a capped chunk is the same share of a full chunk; the time
budget of `deadline:MODE+budget` rules is scaled by a full fresh chunk's step
(`scaled_budget`). The deadline rules' prefill model here has the square term
(`fit_prefill(square=True)`: this server's attention computes each chunk's whole causal
square), and so has the re-stamped learned file's.

Withholding (`Plan.admit`) is applied by the plugin (it stops SGLang's admission loop at
the first withheld request); `plugin_tree` points the servers at another source tree's
plugin (PYTHONPATH), e.g. to try a plugin change.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from experiments.rl.config import FamilySpec, draw_workload
from twin.policy.features import SloTargets

SERVER_FLAGS = ["--schedule-policy", "shortest-prefill-first", "--max-running-requests", "64"]
#: finance-qa's shapes at the CPU server's scale (context 8,192, chunk 1,024)
CPU_FAMILY = FamilySpec(n=60, load=(1.5, 1.5), burst_cv=(2.0, 2.0), system_tokens=32,
                        short_median=100.0, short_output_median=24.0, doc_output_median=32.0,
                        doc_tokens=(1_000, 2_000), long_tokens=(2_500, 4_000),
                        template_tokens=256)
DOC_TOKENS = 800
#: the users' deployment's chunk budget, which the chunk answers' tokens are relative to
USERS_CHUNK = 8192
#: the chunk answer the rules run with live (the users' scale; `scaled_answer`)
LIVE_CHUNK_ANSWER = (256, 4)


def scaled_answer(tokens: int, park: int, chunk: int) -> tuple[int, int]:
    """A chunk answer at the users' scale moved to a server with chunk budget `chunk`."""
    return (max(8, round(tokens * chunk / USERS_CHUNK)) if tokens else 0), park


def scaled_menu(menu: list[str], chunk: int, budget_scale: float = 1.0) -> list[str]:
    """The menu's chunk answers at this server's scale: token caps by `scaled_answer`,
    time budgets times `budget_scale` (this server's full fresh chunk step over the
    users', `scaled_budget`)."""
    from twin.policy.deadline import BudgetAnswer
    from twin.policy.menu import menu_entry

    out = []
    for entry in menu:
        rule, answer = menu_entry(entry)
        if isinstance(answer, BudgetAnswer):
            entry = f"{rule}@{round(answer.seconds * budget_scale, 4):g}sx{answer.park}"
        elif answer is not None:
            t, k = scaled_answer(*answer, chunk)
            entry = f"{rule}@{t}x{k}"
        out.append(entry)
    return out


def step_model(info: dict, prof: dict):
    from calibration.validate import HARNESS_GPU
    from runtime.server_api import twin_server_args
    from twin.config import derive_capacity
    from twin.perf.fitted import from_step_time_section

    args = twin_server_args(info)
    cap = derive_capacity(args, HARNESS_GPU)
    return from_step_time_section(prof["step_time"], cap, args), cap


def fit_prefill(step, chunk: int, square: bool = False) -> list[float]:
    """[s_per_chunk, s_per_token, s_per_token_ctx, chunk] fitted (least squares) to the
    step model's prefill steps of 32..chunk tokens after 0..6,000 cached; with `square`,
    s_per_ctx_sq after them (the chunk's causal square, context included: the CPU
    harness's torch_native attention, where a chunk deep in a prompt costs its context)."""
    rows, y = [], []
    for n in sorted({32, 64, 256, chunk // 2, chunk}):
        for c in (0, 1000, 2000, 3000, 6000):
            rows.append([1.0, n, n * (c + n / 2)] + ([(c + n) ** 2] if square else []))
            y.append(step.step_time([(n, c)], []))
    from scipy.optimize import nnls

    coef = nnls(np.array(rows), np.array(y))[0]  # every term a cost: none negative
    out = [float(coef[0]), float(coef[1]), float(coef[2]), int(chunk)]
    return out + [float(coef[3])] if square else out


def scaled_budget(budget_s: float, step, chunk: int) -> float:
    """A chunk budget at the users' scale (seconds) moved to this server: the same share of
    a full fresh chunk's step (theirs: 8,192 tokens on their prefill model; here: `chunk`
    on the calibrated step model), as `scaled_answer` keeps a token cap's share."""
    from twin.policy.deadline import S_PER_CHUNK, S_PER_TOKEN, S_PER_TOKEN_CTX, prefill_s

    theirs = prefill_s(USERS_CHUNK, 0, USERS_CHUNK, S_PER_CHUNK, S_PER_TOKEN, S_PER_TOKEN_CTX)
    return round(budget_s * step.step_time([(chunk, 0)], []) / theirs, 4)


def doc_prefill_s(step, tokens: int, chunk: int) -> float:
    """A document's whole prefill on the step model, chunk by chunk."""
    t, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        t += step.step_time([(n, done)], [])
        done += n
    return t


def cpu_targets(step, prefill: list[float]) -> SloTargets:
    """The users' SLO in the server's units. Theirs: TTFT 1.5 s, 0.85x one full prefill
    chunk step (8,192 tokens, 1.76 s); documents +0.5 ms per prompt token, about 2.5x the
    per-token prefill cost; TPOT 0.1 s, 3x a decode step of a few dozen requests (20-30). Here: the
    same multiples of this server's chunk step, per-token cost (of a 2,000-token document)
    and decode step of 32."""
    chunk = int(prefill[3])
    per_token = doc_prefill_s(step, 2_000, chunk) / 2_000
    return SloTargets(ttft_s=round(0.85 * step.step_time([(chunk, 0)], []), 3),
                      tpot_s=round(3 * step.step_time([], [300] * 32), 4),
                      doc_tokens=DOC_TOKENS, doc_ttft_s_per_token=round(2.5 * per_token, 6))


def workload(capacity_rps: float, seed: int = 7, family: FamilySpec = CPU_FAMILY):
    rng = np.random.default_rng(seed)
    return draw_workload(family, capacity_rps, rng)[0]


def capacity(info: dict, prof: dict, family: FamilySpec = CPU_FAMILY) -> float:
    """Requests per second the calibrated twin completes for the mix when overloaded
    (the same shapes sent at 20x the load)."""
    from calibration.validate import simulate_like
    from twin.metrics import summarize

    records, _ = simulate_like(workload(1.0, family=replace(family, load=(20.0, 20.0))),
                               info, prof)
    return summarize(records)["throughput"]["requests_per_s"]


def restamp(src: Path, dst: Path, targets: SloTargets, prefill: list[float],
            budget_scale: float = 1.0) -> Path:
    """A copy of a selector weight file with the CPU scale's targets and prefill model (and
    its budget entries scaled by `budget_scale`)."""
    from twin.policy.learned import read_safetensors_meta, write_safetensors

    tensors, raw = read_safetensors_meta(src)
    meta = json.loads(raw["servetwin"])
    meta["targets"], meta["prefill"] = targets.to_json(), list(prefill)
    chunk = int(prefill[3])
    meta["menu"] = scaled_menu(meta["menu"], chunk, budget_scale)
    if meta.get("chunks"):
        meta["chunks"] = list(scaled_answer(*meta["chunks"], chunk))
    write_safetensors(dst, tensors, {"servetwin": json.dumps(meta, sort_keys=True)})
    return dst


def slo_stats(records: list[dict], t: SloTargets) -> dict:
    """SLO attainment (all, short questions, documents) and P99 TTFT by class."""
    def met(r: dict) -> bool:
        return r["status"] == "ok" and t.met(r["ttft_s"], r["tpot_s"], r["prompt_tokens"],
                                             r["priority"])

    out = {"slo_attainment": float(np.mean([met(r) for r in records]))}
    for name, doc in (("short", False), ("documents", True)):
        rs = [r for r in records if t.is_document(r["prompt_tokens"]) == doc]
        out[f"slo_{name}"] = float(np.mean([met(r) for r in rs])) if rs else None
        ttft = [r["ttft_s"] for r in rs if r["status"] == "ok"]
        out[f"p99_ttft_{name}_s"] = float(np.percentile(ttft, 99)) if ttft else None
    tpot = [r["tpot_s"] for r in records if r["status"] == "ok" and r["tpot_s"] is not None
            and not t.is_document(r["prompt_tokens"])]
    out["median_tpot_short_s"] = float(np.median(tpot)) if tpot else None
    out["not_ok"] = sum(r["status"] != "ok" for r in records)
    return out


def rebuild(out: Path) -> dict:
    """`out/result.json` recomputed from the records each run kept (live.jsonl,
    twin.jsonl, twin-drift.jsonl) with the current `slo_stats`."""
    result = json.loads((out / "result.json").read_text())
    t = _targets_of(out)
    for label, runs in result["runs"].items():
        for seed, row in runs.items():
            d = out / f"{label.replace(':', '-')}-{seed}"
            rec = {name: [json.loads(x) for x in (d / f"{name}.jsonl").read_text().splitlines()]
                   for name in ("live", "twin", "twin-drift")}
            tk = scale_targets(t, row["drift"])
            row.update(live=slo_stats(rec["live"], t), twin=slo_stats(rec["twin"], t),
                       live_k=slo_stats(rec["live"], tk),
                       twin_k=slo_stats(rec["twin-drift"], tk))
    result["policies"] = {k: mean_row(v) for k, v in result["runs"].items()}
    return result


def spec_files(out: Path, targets: SloTargets, prefill: list[float],
               learned: str | None, chunk_answer: tuple[int, int] | None = None,
               budget: tuple[float, int] | None = None, budget_scale: float = 1.0
               ) -> dict[str, str]:
    """label -> policy spec (a file for the parameterised ones). `prefill` the deadline
    rules' model (`fit_prefill`, with or without its square term); `chunk_answer`
    (tokens, park) at the server's scale for the `+chunks` rules, None: the users' answer
    scaled (`scaled_answer`); `budget` (seconds, park) at the server's scale for the
    `+budget` rules, None: none of them; `budget_scale` moves a learned menu's budget
    entries to this server."""
    from twin.policy import read_spec
    from twin.policy.menu import prefill_params

    specs = {"shortest-prefill-first": "shortest-prefill-first"}
    t = targets.to_json()
    (out / "targets.json").write_text(json.dumps(t))
    base = {**t, **prefill_params(prefill), "chunk_cap": True}

    def deadline(label: str, name: str, **params) -> None:
        p = out / f"{name}.json"
        p.write_text(json.dumps({"name": "deadline", "params": {**params, **base}}))
        specs[label] = str(p)

    for mode in ("laxity", "documents"):
        deadline(f"deadline:{mode}", f"deadline-{mode}", withhold=mode)
    tokens, park = chunk_answer or scaled_answer(*LIVE_CHUNK_ANSWER, int(prefill[3]))
    for mode in ("hopeless", "documents"):  # the same rules with the chunk answer
        deadline(f"deadline:{mode}+chunks{tokens}x{park}",
                 f"deadline-{mode}-chunks{tokens}x{park}", withhold=mode,
                 chunk_tokens=tokens, park_steps=park)
    if budget is not None:
        seconds, park = budget
        for mode in ("hopeless", "documents"):  # the cap as a time (deadline.budget_limit)
            deadline(f"deadline:{mode}+budget{seconds:g}x{park}",
                     f"deadline-{mode}-budget{seconds:g}x{park}", withhold=mode,
                     chunk_budget_s=seconds, park_steps=park)
    if learned:
        src = Path(read_spec(learned).params["weights"])
        specs["learned"] = "learned:" + str(restamp(src, out / "learned-cpu.safetensors",
                                                    targets, prefill, budget_scale))
    return specs


def run(out: Path, load: float = 1.5, budget_s: float = 60, learned: str | None = None,
        plugin_tree: Path | None = None, only: list[str] | None = None, reuse: bool = True,
        seeds: tuple[int, ...] = (7, 8, 9), log=print,
        chunk_answer: tuple[int, int] | None = None,
        budget: tuple[float, int] | None = None) -> dict:
    """Calibrate (or reuse `out`'s calibration), size the workloads (one per seed), then
    each policy (or those labelled in `only`) live and in the twin on each; results merge
    into `out/result.json` (per seed, and the means over seeds)."""
    from calibration.session import server_facts
    from experiments.policy_effect import calibrate

    out.mkdir(parents=True, exist_ok=True)
    extra = {"PYTHONPATH": str(plugin_tree)} if plugin_tree else {}
    d = out / "calibration"
    d.mkdir(exist_ok=True)
    if (d / "info.json").is_file() and reuse:  # an earlier run's calibration
        prof = json.loads((d / "profile.json").read_text())
        info = json.loads((d / "info.json").read_text())
        log(f"calibration reused from {d}")
    else:
        from runtime.cpu.serve import CpuServer
        from runtime.plugin.env import plugin_env

        with CpuServer(SERVER_FLAGS, env=plugin_env("shortest-prefill-first") | extra,
                       log_path=d / "server.log") as server:
            prof = calibrate(server.url, d, budget_s, log)
            info = server_facts(server.url).info
        (d / "info.json").write_text(json.dumps(info))
    step, cap = step_model(info, prof)
    chunk = cap.chunked_prefill_size or 1024
    prefill = fit_prefill(step, chunk)
    model = fit_prefill(step, chunk, square=True)  # the deadline rules'
    targets = cpu_targets(step, prefill)
    rps = capacity(info, prof)
    if budget is None:
        from experiments.rl.evaluate import BUDGET_ANSWER

        budget = scaled_budget(BUDGET_ANSWER[0], step, chunk), BUDGET_ANSWER[1]
    log(f"capacity {rps:.3f} req/s; targets {targets.to_json()}; prefill model {prefill}; "
        f"the deadline rules' (with the square term) {model}; budget answer {budget}")
    result = {"capacity_rps": rps, "load": load, "targets": targets.to_json(),
              "prefill": prefill, "deadline_prefill": model, "budget_answer": list(budget),
              "seeds": list(seeds), "workload": workload(rps).name,
              "policies": {}, "runs": {}}
    old = out / "result.json"
    if old.is_file() and json.loads(old.read_text()).get("seeds") == list(seeds):
        result["runs"] = json.loads(old.read_text())["runs"]
    specs = {k: v for k, v in spec_files(out, targets, model, learned, chunk_answer,
                                         budget, scaled_budget(1.0, step, chunk)).items()
             if not only or k in only or k.split("+chunks")[0] + "+chunks" in only
             or k.split("+budget")[0] + "+budget" in only}
    for seed in seeds:  # the policies of one seed back to back: similar machine load
        for label, spec in specs.items():
            if str(seed) in result["runs"].get(label, {}):
                continue  # done in an earlier, interrupted run
            row = one_run(out, label, spec, workload(load * rps, seed), prof, extra, seed)
            result["runs"].setdefault(label, {})[str(seed)] = row
            log(f"{label} seed {seed}: live {row['live']['slo_attainment']:.1%} twin "
                f"{row['twin']['slo_attainment']:.1%} faults {row['faults']} "
                f"({row['wall_s']} s)")
            result["policies"] = {k: mean_row(v) for k, v in result["runs"].items()}
            (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    result["policies"] = {k: mean_row(v) for k, v in result["runs"].items()}
    return result


def one_run(out: Path, label: str, spec: str, wl, prof: dict, extra: dict, seed: int) -> dict:
    """One workload on a fresh server running `spec`, and in the twin at its send times."""
    from calibration.session import server_facts
    from calibration.validate import at_send_times, drift, simulate_like, step_check
    from experiments.policy_effect import fallbacks
    from runtime.client import ReplayConfig, replay
    from runtime.cpu.serve import CpuServer
    from runtime.plugin.env import plugin_env
    from twin.metrics import write_records

    d = out / f"{label.replace(':', '-')}-{seed}"
    d.mkdir(exist_ok=True)
    t0 = time.monotonic()
    env = plugin_env(spec, d / "decisions.jsonl") | extra
    with CpuServer(SERVER_FLAGS, env=env, log_path=d / "server.log",
                   start_timeout=600) as server:  # the shared machine can be slow to start
        facts = server_facts(server.url)
        res = replay(wl, ReplayConfig(url=server.url), None, facts)
    live = res.records
    sent = at_send_times(wl, live)
    pol = None if label == "shortest-prefill-first" else spec
    twin, step = simulate_like(sent, facts.info, prof, policy=pol)
    k = drift(step_check(live, facts.info, step)) or 1.0
    scaled, _ = simulate_like(sent, facts.info, prof, k, policy=pol)
    write_records(d / "live.jsonl", live)
    write_records(d / "twin.jsonl", list(twin))
    write_records(d / "twin-drift.jsonl", list(scaled))
    counts = fallbacks(d)
    if pol is not None and not counts.get("applied"):
        # the plugin refused the spec or never loaded: SGLang's own scheduling ran
        why = [x for x in (d / "server.log").read_text(errors="replace").splitlines()
               if "servetwin" in x and ("ERROR" in x or "Error" in x)]
        raise RuntimeError(f"{label} seed {seed}: the plugin applied no decision "
                           f"({d / 'decisions.jsonl.counters.json'}: {counts or 'missing'}); "
                           f"{d / 'server.log'}: {why[-1] if why else 'no servetwin error'}")
    t = _targets_of(out)
    tk = scale_targets(t, k)
    return {"live": slo_stats(live, t), "twin": slo_stats(list(twin), t), "drift": k,
            "live_k": slo_stats(live, tk), "twin_k": slo_stats(list(scaled), tk),
            "faults": {k: counts.get(k, 0) for k in ("raised", "invalid", "slow")},
            "applied": counts.get("applied", 0), "wall_s": round(time.monotonic() - t0)}


def scale_targets(t: SloTargets, k: float) -> SloTargets:
    """The SLO in units of a server running `k` times slower than profiled (the targets
    are multiples of the server's own step times, `cpu_targets`)."""
    return replace(t, ttft_s=t.ttft_s * k, tpot_s=t.tpot_s * k if t.tpot_s else t.tpot_s,
                   doc_ttft_s_per_token=t.doc_ttft_s_per_token * k)


def _targets_of(out: Path) -> SloTargets:
    return SloTargets.from_json(json.loads((out / "targets.json").read_text()))


def mean_row(runs: dict) -> dict:
    """Means over seeds of every number of the per-seed rows (faults summed)."""
    rows = list(runs.values())
    out: dict = {}
    for side in ("live", "twin", "live_k", "twin_k"):
        out[side] = {k: _mean([r[side][k] for r in rows]) for k in rows[0][side]}
    out["drift"] = _mean([r["drift"] for r in rows])
    out["faults"] = {k: sum(r["faults"][k] for r in rows) for k in rows[0]["faults"]}
    out["applied"] = sum(r["applied"] for r in rows)
    out["wall_s"] = sum(r["wall_s"] for r in rows)
    return out


def _mean(vals: list):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def table(result: dict, live: str = "live", twin: str = "twin") -> str:
    """Per policy, means over the seeds: SLO attainment live and in the twin (`live_k` /
    `twin_k`: at the targets scaled by each run's drift, the twin's steps too)."""
    head = ("| policy | SLO live | SLO twin | short live | short twin | documents live | "
            "documents twin | P99 TTFT short live / twin (s) | P99 TTFT documents live / "
            "twin (s) | median TPOT short live / twin (s) | drift | not ok | "
            "faults (raised/invalid/slow) |")
    lines = [head, "|" + "---|" * 13]
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    sec = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    tpot = lambda m: sec(m.get("median_tpot_short_s"))  # noqa: E731
    for label, row in result["policies"].items():
        lv, tw, f = row[live], row[twin], row["faults"]
        lines.append(
            f"| {label} | {pct(lv['slo_attainment'])} | {pct(tw['slo_attainment'])} | "
            f"{pct(lv['slo_short'])} | {pct(tw['slo_short'])} | {pct(lv['slo_documents'])} | "
            f"{pct(tw['slo_documents'])} | {sec(lv['p99_ttft_short_s'])} / "
            f"{sec(tw['p99_ttft_short_s'])} | {sec(lv['p99_ttft_documents_s'])} / "
            f"{sec(tw['p99_ttft_documents_s'])} | {tpot(lv)} / {tpot(tw)} | "
            f"{sec(row.get('drift'))} | {lv['not_ok']} | "
            f"{f['raised']}/{f['invalid']}/{f['slow']} |")
    return "\n".join(lines)


def gains(result: dict, base: str = "shortest-prefill-first", live: str = "live",
          twin: str = "twin") -> list[str]:
    """Each policy's relative SLO-attainment gain over `base`, live and in the twin."""
    pol = result["policies"]
    if base not in pol:
        return []
    out = []
    for label, row in pol.items():
        if label == base:
            continue
        g = {}
        for w in (live, twin):
            b, a = pol[base][w]["slo_attainment"], row[w]["slo_attainment"]
            g[w] = f"{a / b - 1:+.1%}" if b else f"{a:.1%} vs 0"
        out.append(f"{label} vs {base}: live {g[live]}, twin {g[twin]}")
    return out
