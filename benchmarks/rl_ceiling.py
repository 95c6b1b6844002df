"""The ceiling of the per-pass decisions (issue 11): a clairvoyant rollout search.

Is the issue's bar (+25 % SLO attainment over the best heuristic at 150 % load) reachable
at all with the decisions the environment's action takes? On held-out benchmark episodes
(the seeds `benchmarks/rl.py` uses) the rollout search of `experiments/rl/search.py` tries
every menu rule whose plan differs at each question, simulates each to the episode's end
from a forked copy of the state (knowing the future arrivals), playing the base rule
afterwards, and keeps the best (fewest dropped, then the objective). Prints, per seed and
in the mean, the base rule's SLO attainment and the search's, with the class attainments,
drops and return, and the bar. `--documents` widens the action beyond the menu: where the
base rule lets documents in, each waiting document alone and no document at all.
`--what-ifs N` adds two references outside the action on N seeds (no search, seconds):
every document deferred past the episode's last arrival (the contract forbids it: an idle
server must serve), and SGLang's chunk settings (deployment flags, not policy decisions).

    nice -n 19 python benchmarks/rl_ceiling.py [--env finance-qa-deadline-v2]
        [--base hold-documents] [--objective slo] [--documents] [--episodes 4] [--load 1.5]
        [--what-ifs 8 [--no-search]]
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import replace

import numpy as np

from calibration.profiles import machine
from experiments.rl.config import EnvConfig, preset
from experiments.rl.env import capacity_of, step_time_for
from experiments.rl.episode import run_policy
from experiments.rl.evaluate import episode_workload, evaluate_spec, heuristic_specs, mean_stats
from experiments.rl.search import OBJECTIVES, base_stats, search_episode
from twin.policy import build_policy
from twin.workload import Workload

BENCH_SEED_BASE = 2_000_000  # benchmarks/rl.py's held-out seeds
COLS = ("slo_attainment", "slo_short", "slo_documents", "dropped_short", "dropped_documents",
        "return")


def row(label: str, s: dict) -> str:
    return (f"| {label} | {s['slo_attainment']:.1%} | {s['slo_short']:.1%} | "
            f"{s['slo_documents']:.1%} | {s['dropped_short'] + s['dropped_documents']} | "
            f"{s['return']:+.4f} |")


def defer_to_drain(cfg: EnvConfig, seed: int, opts: dict, label: str) -> dict:
    """The episode with every document held until the episode's last arrival and then
    served (the rule `label` on the shortened queue, short questions alone before that),
    each document judged from its real arrival. Not a policy the contract allows: an idle
    server with documents waiting must serve (`validate_plan`), and in a sustained overload
    there is no last arrival; it says what deferring documents past the overload buys."""
    wl = episode_workload(cfg, seed, opts)
    t = cfg.targets
    last = wl.requests[-1].arrival_s
    held = {r.rid: last - r.arrival_s for r in wl.requests if t.is_document(r.prompt_tokens)}
    reqs = sorted((replace(r, arrival_s=last) if r.rid in held else r for r in wl.requests),
                  key=lambda r: (r.arrival_s, r.rid not in held, r.rid))
    shifted = Workload(wl.name + "+documents-at-the-end", tuple(reqs))
    _, recs, _ = run_policy(cfg, shifted, step_time_for(cfg), capacity_of(cfg),
                            build_policy(heuristic_specs(cfg)[label]))
    out: dict[str, list[bool]] = {"short": [], "documents": []}
    dropped = {"short": 0, "documents": 0}
    for r in recs:
        kind = "documents" if r["rid"] in held else "short"
        if r["status"] != "ok":
            dropped[kind] += r["status"] != "rejected"
            out[kind].append(False)
            continue
        ttft = r["ttft_s"] + held.get(r["rid"], 0.0)
        out[kind].append(t.met(ttft, r["tpot_s"], r["prompt_tokens"], r["priority"]))
    n = len(recs)
    ret = float(np.mean([(sum(v) - dropped[k]) / len(v) for k, v in out.items() if v]))
    return {"slo_attainment": sum(map(sum, out.values())) / n,
            "slo_short": float(np.mean(out["short"])),
            "slo_documents": float(np.mean(out["documents"])) if out["documents"] else 0.0,
            "dropped_short": dropped["short"], "dropped_documents": dropped["documents"],
            "return": ret}


def shorts_alone(cfg: EnvConfig, seed: int, opts: dict, label: str) -> tuple[float, ...]:
    """SLO attainment, P99 TTFT and median TPOT of the episode's short questions served
    with its documents removed: what the documents cost them."""
    wl = episode_workload(cfg, seed, opts)
    t = cfg.targets
    shorts = Workload(wl.name + "-documents", tuple(r for r in wl.requests
                                                    if not t.is_document(r.prompt_tokens)))
    ledger, recs, _ = run_policy(cfg, shorts, step_time_for(cfg), capacity_of(cfg),
                                 build_policy(heuristic_specs(cfg)[label]))
    met = [ledger.outcome[r["rid"]] == "met" for r in recs]
    ttft = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in recs if r["tpot_s"] is not None]
    return float(np.mean(met)), float(np.percentile(ttft, 99)), float(np.median(tpot))


def what_ifs(cfg: EnvConfig, seeds: list[int], opts: dict, base_label: str) -> None:
    """Bounds around the search: the defer-to-drain oracle, and what the deployment's
    own chunk settings (not policy decisions) do to the best rules."""
    print(f"\n## outside the action: documents deferred past the last arrival "
          f"({base_label} otherwise), seeds {seeds[0]}..{seeds[-1]}\n")
    print("| policy | SLO attainment | short questions | documents | dropped | return |")
    print("|---|---|---|---|---|---|")
    rows = [defer_to_drain(cfg, s, opts, base_label) for s in seeds]
    print(row("defer documents to the drain", {k: float(np.mean([r[k] for r in rows]))
                                               for k in COLS}))
    alone = [shorts_alone(cfg, s, opts, base_label) for s in seeds]
    print(f"\nshort questions alone (the documents removed), {base_label}: SLO "
          f"{np.mean([a[0] for a in alone]):.1%}, P99 TTFT {min(a[1] for a in alone):.2f}-"
          f"{max(a[1] for a in alone):.2f} s, median TPOT "
          f"{np.median([a[2] for a in alone]):.3f} s")
    print(f"\n## outside the action: SGLang's chunk settings (deployment what-ifs; the load "
          f"stays at the default deployment's capacity {capacity_of(cfg):.4f} req/s)\n")
    print("| --chunked-prefill-size | --enable-mixed-chunk | policy | SLO attainment | "
          "short questions | documents | return |")
    print("|---|---|---|---|---|---|---|")
    for chunk, mixed in ((None, False), (4096, False), (2048, False), (2048, True),
                         (1024, True)):
        c = replace(cfg, deployment=replace(cfg.deployment, chunked_prefill_size=chunk,
                                            enable_mixed_chunk=mixed),
                    capacity_rps=capacity_of(cfg))
        for label in (base_label, "deadline:laxity", "shortest-prefill-first"):
            m = mean_stats(evaluate_spec(c, heuristic_specs(c)[label], seeds, opts))
            print(f"| {chunk or 'default'} | {'on' if mixed else 'off'} | {label} | "
                  f"{m['slo_attainment']:.1%} | {m['slo_short']:.1%} | "
                  f"{m['slo_documents']:.1%} | {m['return']:+.4f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="finance-qa-deadline-v2",
                    help="environment preset: its menu is the search's action set")
    ap.add_argument("--base", default="hold-documents",
                    help="the rule the rollouts play after the tried answer (a menu rule)")
    ap.add_argument("--objective", default="slo", choices=OBJECTIVES)
    ap.add_argument("--documents", action="store_true",
                    help="also try, where the base rule lets documents in, each waiting "
                         "document alone and no document (a richer action than the menu)")
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=BENCH_SEED_BASE)
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--burst-cv", type=float, default=2.0)
    ap.add_argument("--what-ifs", type=int, default=0, metavar="N",
                    help="also the bounds outside the action on N seeds (fast: no search): "
                         "documents deferred past the last arrival, SGLang's chunk settings")
    ap.add_argument("--no-search", action="store_true", help="only the --what-ifs")
    ap.add_argument("--bar", type=float, default=0.685,
                    help="the SLO attainment the issue asks for (default: +25 %% over "
                         "deadline:documents' 54.8 %% at 150 %% load)")
    ns = ap.parse_args()
    cfg = preset(ns.env)
    if ns.base not in cfg.menu:
        raise SystemExit(f"--base {ns.base}: allowed values (menu of {ns.env}): "
                         f"{', '.join(cfg.menu)}")
    opts = {"load": ns.load, "burst_cv": ns.burst_cv}
    seeds = [ns.first_seed + i for i in range(ns.episodes)]
    print(f"date {datetime.date.today()}; machine {machine()}")
    print(f"env {ns.env} (menu {', '.join(cfg.menu)}); capacity {capacity_of(cfg):.4f} req/s; "
          f"load {ns.load:.0%}, burst CV {ns.burst_cv}; {cfg.family.n} requests per episode",
          flush=True)
    if not ns.no_search:
        print(f"search: seeds {seeds[0]}..{seeds[-1]}; base {ns.base}; objective "
              f"{ns.objective}; single-document answers {'on' if ns.documents else 'off'}",
              flush=True)
    base_label = {"hold-documents": "deadline:documents", "laxity": "deadline:laxity",
                  "hold-hopeless": "deadline:hopeless", "deadline": "deadline:none",
                  "spf": "shortest-prefill-first"}.get(ns.base, "deadline:documents")
    if ns.what_ifs:
        what_ifs(cfg, [ns.first_seed + i for i in range(ns.what_ifs)], opts, base_label)
    if ns.no_search:
        return
    print("\n| episode | SLO attainment | short questions | documents | dropped | return |")
    print("|---|---|---|---|---|---|")
    base_rows, search_rows = [], []
    for seed in seeds:
        t0 = time.process_time()
        b = base_stats(cfg, seed, opts, ns.base)
        res = search_episode(cfg, seed, opts, ns.base, ns.objective, ns.documents,
                             log=lambda m: print("#", m, flush=True))
        cpu = time.process_time() - t0  # the parent's; the children's is on top
        base_rows.append(b)
        search_rows.append(res.stats)
        print(row(f"{seed} {ns.base}", b))
        print(row(f"{seed} search", res.stats))
        print(f"# seed {seed}: {res.decisions} decisions, {res.searched} searched, "
              f"{res.rollouts} rollouts, {res.deviations} deviations; chosen {res.chosen}; "
              f"parent CPU {cpu:.0f} s", flush=True)
    mb = {k: float(np.mean([r[k] for r in base_rows])) for k in COLS}
    ms = {k: float(np.mean([r[k] for r in search_rows])) for k in COLS}
    print("\nmeans:\n")
    print("| policy | SLO attainment | short questions | documents | dropped | return |")
    print("|---|---|---|---|---|---|")
    print(row(ns.base, mb))
    print(row("rollout search", ms))
    print(f"\nsearch vs {ns.base}: {ms['slo_attainment']:.1%} vs {mb['slo_attainment']:.1%} "
          f"({ms['slo_attainment'] / mb['slo_attainment'] - 1:+.1%}); the bar "
          f"{ns.bar:.1%}: {'reached' if ms['slo_attainment'] >= ns.bar else 'not reached'}")


if __name__ == "__main__":
    main()
