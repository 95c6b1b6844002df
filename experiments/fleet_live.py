"""Twin against live for a fleet: 2 CPU SGLang servers behind the real sglang-router.

Used by tests/test_fleet_live.py and benchmarks/fleet_live.py. The live side is a
`runtime.fleet.Fleet` (the servers) with one `RouterProcess` per router policy over the same
workers; the twin side is `twin.fleet.simulate_fleet` of the same deployment (the servers'
own arguments, read from `/server_info`; `round_robin` / `cache_aware` with sglang-router's
defaults; crash faults for failover). Both write records with `replica`, so the split
tables come from one function.

The twin here is uncalibrated (the roofline on a GPU type: far faster than the 2-core CPU
server), so routing decisions that do not depend on time (round robin, cache-aware prefix
matches) are compared, not latencies.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

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
TWIN_GPU = "a100-pcie-80gb"
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
              faults: Sequence[dict] = (), failover: dict | None = None) -> dict:
    """The twin deployment of the live fleet: its servers' arguments, the router policy."""
    values = twin_server_values(server_info)
    args = {k: values[k] for k in SERVER_KEYS if k in values}
    spec = {"name": f"cpu-fleet-{policy}", "gpu": TWIN_GPU, "router": {"name": policy},
            "replicas": [{"name": "replica-", "count": replicas, "engine": "sglang",
                          "server_args": args}]}
    if faults:
        spec["faults"] = list(faults)
    if failover:
        spec["failover"] = dict(failover)
    return spec


def simulate(server_info: dict, policy: str, work: Workload, **kw) -> list[dict]:
    from twin.fleet import parse_spec, simulate_fleet

    return simulate_fleet(parse_spec(twin_spec(server_info, policy, **kw), "<fleet_live>"),
                          work).records


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


def shares_sorted(table: dict[str, dict]) -> list[float]:
    """Request shares largest first (which replica is "first" differs between runs)."""
    return sorted((row["request_share"] for row in table.values()), reverse=True)


# ---- the live side ----------------------------------------------------------------------
@dataclass
class LiveRun:
    result: ReplayResult
    router_log: str
    kill_at_s: float | None = None  # replay clock

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
    return LiveRun(result, router_log, killed.get("at"))


def failover_summary(records: Sequence[dict], kill_at: float, dead: str = "replica-0") -> dict:
    """Who failed and who was retried around a crash at `kill_at` (records with
    `attempts`)."""
    after = [r for r in records if r["arrival_s"] > kill_at]
    return {
        "sent_before": sum(1 for r in records if r["arrival_s"] <= kill_at),
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
