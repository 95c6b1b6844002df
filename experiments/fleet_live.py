"""Twin against live for a fleet: 2 CPU SGLang servers behind the real sglang-router.

Used by tests/test_fleet_live.py and benchmarks/fleet_live.py. The live side is a
`runtime.fleet.Fleet` (the servers) with one `RouterProcess` per router policy over the same
workers; the twin side is `twin.fleet.simulate_fleet` of the same deployment (the servers'
own arguments, read from `/server_info`; `round_robin` / `cache_aware` with sglang-router's
defaults; crash faults for failover). Both write records with `replica`, so the split
tables come from one function.

The twin is calibrated on one of the fleet's own servers (`calibrate`: the
machinery of `servetwin calibrate`, a profile in the output directory reused when it is
there), and every twin replica takes that profile (`calibration:`; memory sized on the
CPU harness's GPU entry, as `calibration/validate.py` does). The twin replays the very
requests the live client sent, each at its live send time (`at_send_times`), with the
profile's request path (ingress before the scheduler, egress after each step) added as
`servetwin validate` adds it; so latencies (TTFT/E2E per replica) compare, and so does
which requests are in flight on a server when it is killed. Without a profile the twin is
the roofline on a GPU (tens of ms a request, 1-3 s live): routing that does not depend
on time only.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.client import ReplayConfig, ReplayResult, replay
from runtime.router import RouterOptions, RouterProcess
from runtime.server_api import probe, twin_server_values
from twin.workload import Request, Workload, from_spec

# Three 256-token templates; 90 % of requests open with one. Short own parts and 8 output
# tokens keep a run to about 15-30 s on the 2-core machine.
WORKLOAD = ("arrival=poisson,rate=1.5,n=24,prompt=uniform:32:96,output=fixed:8,"
            "templates=3,template_len=256,share=0.9")
# The failover run: 48 output tokens keep requests in flight (1-3 s each live) when a
# server is killed.
FAILOVER_WORKLOAD = WORKLOAD.replace("output=fixed:8", "output=fixed:48").replace(
    "rate=1.5", "rate=2")
TWIN_GPU = "a100-pcie-80gb"  # uncalibrated; a calibrated replica's is the profile's rule
# seconds of profiling for the live test (the benchmark takes more); every run kind is
# sampled even in a short budget (calibration/profile.py interleaves them)
TEST_BUDGET_S = 25.0
SERVER_KEYS = ("model_path", "tp_size", "max_total_tokens", "chunked_prefill_size",
               "max_running_requests", "context_length", "max_prefill_tokens",
               "schedule_policy", "page_size", "disable_radix_cache", "disable_cuda_graph")


def workload(seed: int = 0, spec: str = WORKLOAD) -> Workload:
    return from_spec(spec, seed)


def template_of(req: Request) -> int | None:
    """The shared template a request opens with (its segment hash), None without one."""
    return req.segments[0][0] if len(req.segments) > 1 else None


# ---- the twin's deployment ----------------------------------------------------------
def twin_spec(server_info: dict, policy: str, replicas: int = 2,
              faults: Sequence[dict] = (), failover: dict | None = None,
              profile: Path | None = None, order: Sequence[str] = ()) -> dict:
    """The twin deployment of the live fleet: its servers' arguments, the router policy;
    with `profile`, every replica calibrated by it (and all the server's arguments the
    twin models, as `servetwin validate` takes them). `order`: the replicas' names in the
    live router's order (its `/workers` list: round robin starts at the first, and
    cache_aware's ties go to it; sglang-router 0.3.2 registers workers concurrently, so
    the order changes from one router start to the next); default replica-0, replica-1."""
    values = twin_server_values(server_info)
    args = values if profile else {k: values[k] for k in SERVER_KEYS if k in values}
    names = list(order) or [f"replica-{i}" for i in range(replicas)]
    reps = [{"name": n, "engine": "sglang", "server_args": args} for n in names]
    if profile:
        for rep in reps:
            rep["calibration"] = str(Path(profile).resolve())
    spec = {"name": f"cpu-fleet-{policy}", "gpu": TWIN_GPU, "router": {"name": policy},
            "replicas": reps}
    if faults:
        spec["faults"] = list(faults)
    if failover:
        spec["failover"] = dict(failover)
    return spec


def simulate(server_info: dict, policy: str, work: Workload, profile: Path | None = None,
             step_scale: float = 1.0, **kw) -> list[dict]:
    """The twin's records of `work` through the deployment; with `profile`, calibrated
    replicas and the profile's request path (arrivals `ingress` later at the router,
    TTFT and E2E `ingress + egress` longer, `arrival_s` the client's send time again);
    `step_scale` multiplies every step (a diagnostic: the drift a live run measured)."""
    from twin.fleet import Kinds, parse_spec, simulate_fleet

    spec = parse_spec(twin_spec(server_info, policy, profile=profile, **kw), "<fleet_live>")
    if profile is None:
        return simulate_fleet(spec, work).records
    from calibration.profiles import read_profile
    from calibration.validate import path_latency

    ingress, egress = path_latency(read_profile(Path(profile)))
    shifted = replace(work, requests=tuple(replace(r, arrival_s=r.arrival_s + ingress)
                                           for r in work.requests))
    kinds = _scaled_kinds(spec, step_scale) if step_scale != 1.0 else Kinds()
    return [_client_view(r, ingress, egress)
            for r in simulate_fleet(spec, shifted, kinds=kinds).records]


def _scaled_kinds(spec, k: float):
    """A `Kinds` whose (one) calibrated SGLang kind steps `k` times slower."""
    from calibration.validate import Scaled
    from twin.config import ServerArgs
    from twin.fleet import Kinds
    from twin.sim import SimConfig

    kinds = Kinds()
    for r in spec.replicas:
        cfg = SimConfig(args=ServerArgs(**dict(r.server_args)), gpu=r.gpu,
                        calibration=r.calibration)
        cap, st, backend = kinds.sglang(cfg)
        key = ("sglang", cfg.gpu, cfg.args, None, cfg.calibration)
        if not isinstance(st, Scaled):
            kinds.cache[key] = (cap, Scaled(st, k), backend)
    return kinds


def _client_view(rec: dict, ingress: float, egress: float) -> dict:
    out = dict(rec)
    out["arrival_s"] = round(rec["arrival_s"] - ingress, 6)
    for key in ("ttft_s", "e2e_s"):
        if rec.get(key) is not None:
            out[key] = round(rec[key] + ingress + egress, 6)
    return out


# ---- calibration ------------------------------------------------------------------------
def calibrate(url: str, out: Path, budget_s: float, log=print) -> Path:
    """The profile of the server at `url`: `out/profile.json` when it is there (refused,
    naming the file, if it is another server's: another model, version or device), else
    a calibration of `budget_s` seconds (resumed from `out`'s runs if one was cut short)."""
    from calibration.profiles import check_profile, read_profile
    from experiments.policy_effect import calibrate as run_calibration

    path = out / "profile.json"
    if path.is_file():
        check_profile(read_profile(path), server_info(url))
        log(f"calibration reused: {path}")
        return path
    out.mkdir(parents=True, exist_ok=True)
    run_calibration(url, out, budget_s, log)
    return path


def drift_of(records: Sequence[dict], info: dict, profile: Path) -> dict[str, float | None]:
    """Per replica: this live run's isolated steps over the profile's (`drift` of
    `calibration.validate.step_check` on that replica's records alone: a server's token
    gaps are its own steps); None where no step could be isolated."""
    from calibration.profiles import read_profile
    from calibration.validate import drift, step_check
    from runtime.server_api import twin_server_args
    from twin.config import derive_capacity
    from twin.fleet_calibration import CPU_PROFILE_GPU
    from twin.perf.fitted import from_step_time_section

    args = twin_server_args(info)
    step = from_step_time_section(read_profile(profile)["step_time"],
                                  derive_capacity(args, CPU_PROFILE_GPU), args)
    out = {}
    for replica in sorted({str(r.get("replica")) for r in records}):
        mine = [r for r in records if str(r.get("replica")) == replica and r["status"] == "ok"]
        out[replica] = drift(step_check(mine, info, step))
    return out


def drift_scale(records: Sequence[dict], info: dict, profile: Path) -> float:
    """One factor for the whole run: the geometric mean of `drift_of`'s per-replica ratios
    (1.0 when no step could be isolated)."""
    ks = [k for k in drift_of(records, info, profile).values() if k]
    return float(np.exp(np.mean(np.log(ks)))) if ks else 1.0


# ---- tables ---------------------------------------------------------------------------
def split(records: Sequence[dict]) -> dict[str, dict]:
    """Per replica: requests, their share, prompt and cached tokens, cached-token share."""
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(str(r.get("replica")), {"requests": 0, "prompt_tokens": 0,
                                                      "cached_tokens": 0})
        row["requests"] += 1
        row["prompt_tokens"] += int(r["prompt_tokens"])
        row["cached_tokens"] += int(r["cached_tokens"] or 0)
    n = sum(row["requests"] for row in rows.values())
    for row in rows.values():
        row["request_share"] = round(row["requests"] / n, 4) if n else None
        row["cached_share"] = (round(row["cached_tokens"] / row["prompt_tokens"], 4)
                               if row["prompt_tokens"] else 0.0)
    return dict(sorted(rows.items()))


def cached_share(records: Sequence[dict]) -> float:
    prompt = sum(int(r["prompt_tokens"]) for r in records)
    return round(sum(int(r["cached_tokens"] or 0) for r in records) / prompt, 4) if prompt else 0.0


def template_affinity(work: Workload, records: Sequence[dict]) -> float:
    """The share of templated requests served by their template's most used replica."""
    where = {r["rid"]: r.get("replica") for r in records}
    by_template: dict[int, Counter] = {}
    for req in work.requests:
        t = template_of(req)
        if t is not None and req.rid in where:
            by_template.setdefault(t, Counter())[where[req.rid]] += 1
    total = sum(sum(c.values()) for c in by_template.values())
    top = sum(c.most_common(1)[0][1] for c in by_template.values())
    return round(top / total, 4) if total else 0.0


def latency(records: Sequence[dict]) -> dict[str, dict]:
    """Per replica and for `all`: ok requests, TTFT and E2E mean and P50 (seconds)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r["status"] == "ok":
            groups.setdefault(str(r.get("replica")), []).append(r)
    groups = dict(sorted(groups.items()))
    groups["all"] = [r for g in groups.values() for r in g]
    out = {}
    for name, recs in groups.items():
        row: dict = {"n": len(recs)}
        for key in ("ttft_s", "e2e_s"):
            v = np.array([r[key] for r in recs if r[key] is not None], dtype=float)
            row[f"{key[:-2]}_mean"] = round(float(v.mean()), 4) if v.size else None
            row[f"{key[:-2]}_p50"] = round(float(np.median(v)), 4) if v.size else None
        out[name] = row
    return out


def split_distribution(info: dict, policy: str, work: Workload, profile: Path,
                       order: Sequence[str], scales: Sequence[float] = (0.6, 0.8, 1.0, 1.25,
                                                                        1.6),
                       jitters: int = 4, jitter_s: float = 0.02) -> Counter:
    """How the twin's request split (largest share first, as counts) varies when every step
    is `scales` times the profile's (a loaded or calm machine) and each send time moves by
    up to `jitter_s` (seeded uniform noise, `jitters` draws besides none): the
    distribution of a race the twin cannot call request for request."""
    out: Counter = Counter()
    for k in scales:
        for j in range(jitters + 1):
            shaken = _jittered(work, j, jitter_s) if j else work
            recs = simulate(info, policy, shaken, profile=profile, step_scale=k, order=order)
            counts = sorted((row["requests"] for row in split(recs).values()), reverse=True)
            out["/".join(map(str, counts))] += 1
    return out


def _jittered(work: Workload, seed: int, jitter_s: float) -> Workload:
    rng = np.random.default_rng(seed)
    noise = rng.uniform(-jitter_s, jitter_s, len(work.requests))
    moved = [replace(r, arrival_s=max(0.0, r.arrival_s + float(d)))
             for r, d in zip(work.requests, noise, strict=True)]
    return replace(work, requests=tuple(sorted(moved, key=lambda r: r.arrival_s)))


def shares_sorted(table: dict[str, dict]) -> list[float]:
    """Request shares largest first (which replica is "first" differs between runs)."""
    return sorted((row["request_share"] for row in table.values()), reverse=True)


# ---- the live side ----------------------------------------------------------------------
@dataclass
class LiveRun:
    result: ReplayResult
    router_log: str
    kill_at_s: float | None = None  # replay clock
    order: tuple[str, ...] = ()  # the replicas in the router's `/workers` order

    def sent(self, work: Workload) -> Workload:
        """`work` with each request at its live send time (the twin's input)."""
        from calibration.validate import at_send_times

        return at_send_times(work, self.records)

    @property
    def records(self) -> list[dict]:
        return self.result.records


def replay_through_router(fleet, options: RouterOptions, work: Workload,
                          kill: tuple[int, int] | None = None) -> LiveRun:
    """A router with `options` over the fleet's servers, `work` replayed through it (caches
    flushed first). `kill=(replica index, n)`: SIGKILL that replica at the first progress
    tick (about once a second) after `n` requests were sent; the kill time is recorded on
    the replay's clock (the records' `arrival_s`)."""
    log_path = fleet.log_dir / f"router-{options.policy}-{time.time():.0f}.log"
    with RouterProcess(fleet.worker_urls, options, env=fleet.router_env,
                       log_path=log_path) as router:
        facts = probe(router.url)
        cfg = ReplayConfig(url=router.url, seed=0, max_lateness_s=60.0, request_timeout_s=120.0)
        killed: dict[str, float] = {}

        def progress(run) -> None:
            if kill is not None and "at" not in killed and len(run.logs) >= kill[1]:
                killed["at"] = time.perf_counter() - run.t0
                fleet.kill(kill[0], wait=False)

        result = replay(work, cfg, progress=progress, facts=facts)
        router_log = router.log_path.read_text(errors="replace")
    order = tuple(fleet.replica_of(u) for u in facts.workers if u in fleet.worker_urls)
    return LiveRun(result, router_log, killed.get("at"), order)


# lone short requests (one output token, no shared prefix) to time the router's own hop
HOP_WORKLOAD = "arrival=poisson,rate=2,n=8,prompt=fixed:64,output=fixed:1"


def router_hop(fleet, spec: str = HOP_WORKLOAD) -> dict:
    """TTFT median of the same lone requests sent straight to each server and through a
    round_robin router over both (the router's hop: its HTTP proxying, on these cores)."""
    work = from_spec(spec, 0)
    direct: list[float] = []
    for url in fleet.worker_urls:
        res = replay(work, ReplayConfig(url=url, seed=0), None, probe(url))
        direct += [r["ttft_s"] for r in res.records if r["status"] == "ok"]
    routed = [r["ttft_s"] for r in replay_through_router(
        fleet, RouterOptions(policy="round_robin"), work).records if r["status"] == "ok"]
    return {"direct_ttft_p50_s": round(float(np.median(direct)), 4),
            "router_ttft_p50_s": round(float(np.median(routed)), 4),
            "n": (len(direct), len(routed))}


def failover_summary(records: Sequence[dict], kill_at: float, dead: str = "replica-0") -> dict:
    """Who failed and who was retried around a crash at `kill_at` (records with
    `attempts`)."""
    after = [r for r in records if r["arrival_s"] > kill_at]
    return {
        "sent_before": sum(1 for r in records if r["arrival_s"] <= kill_at),
        "on_dead_before": sorted((r["rid"] for r in records if r["arrival_s"] <= kill_at
                                  and r.get("replica") in (dead, None)), key=_rid_key),
        "failed": sorted((r["rid"] for r in records if r["status"] != "ok"), key=_rid_key),
        "sent_after": len(after),
        "after_ok_elsewhere": sum(1 for r in after if r["status"] == "ok"
                                  and r.get("replica") != dead),
        "retried": sorted((r["rid"] for r in records if r.get("attempts", 1) > 1), key=_rid_key),
        "attempts": sum(r.get("attempts", 1) for r in records),
    }


def _rid_key(rid: str) -> tuple:
    digits = "".join(c for c in rid if c.isdigit())
    return (int(digits) if digits else -1, rid)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REFUSED = re.compile(r'request_id="([^"]+)"\}.*Failed to send typed request worker_url=(\S+)')


def router_attempts(router_log: str) -> dict[str, list[str]]:
    """Per request id (the replay sends its rid as X-Request-Id), the workers the router
    failed to reach before the attempt that answered: sglang-router logs each as
    "Failed to send typed request worker_url=..." under the request's id."""
    out: dict[str, list[str]] = {}
    for line in _ANSI.sub("", router_log).splitlines():
        m = _REFUSED.search(line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def circuit_events(router_log: str) -> list[str]:
    """The router's circuit-breaker transitions, in order ("closed -> open", ...)."""
    text = _ANSI.sub("", router_log)
    return re.findall(r"Circuit breaker state transition: (\w+ -> \w+)", text)


def with_attempts(records: Sequence[dict], router_log: str) -> list[dict]:
    """Live records with `attempts` (1 + the router's refused attempts), as the twin's."""
    refused = router_attempts(router_log)
    return [r | {"attempts": 1 + len(refused.get(r["rid"], []))} for r in records]


def server_info(url: str) -> dict:
    return probe(url).info
