"""Alert rules over a fleet: per replica and for the fleet as a whole.

A fleet run (twin/fleet.py) writes one record per request tagged with its `replica` and
`pool`, and one sampled series per replica. `evaluate_fleet` runs each rule once per
replica (that replica's records and series, its own request budget and pool capacity:
what a Prometheus rule `by (instance)` sees when it scrapes each SGLang server) and once
for the fleet (every record: what the clients see), with the windows of all scopes on
one grid from time 0 to the fleet's end. Every alert names its replica, or `fleet`.

The fleet-wide value of each metric (docs/monitoring.md):
- latency quantiles, burn rates, `radix_sharing_ratio`: over every record (requests the
  router could not place included: clients saw them);
- `batch_efficiency`: the running requests of every replica over the sum of their budgets;
- `memory_pressure_score`: the replicas' window means weighted by their capacity (sum of
  allocated KV over the sum of the pools); `num_running_reqs`, `num_queue_reqs`,
  `kv_eviction_rate`: summed. A replica samples only while it schedules, so in a window
  where it has no sample it counts with its last window's value (a gauge holds while
  nothing happens; 0 before its first sample), unless it was crashed then: a server that
  is down answers no scrape, so it is left out (capacity included);
- `kv_external_fragmentation` and every `defragment` rule: per replica only (one
  allocator's property; compaction is a replica's).

`twin.prometheus_rules.prometheus_fleet_rules` writes the same split as a Prometheus rules
file. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from twin.alerts import Alert, Rule, evaluate_windows, needs_series, read_by
from twin.errors import ConfigError
from twin.monitoring import Window, metric_windows, run_end, series_windows

FLEET = "fleet"
# how a gauge's fleet-wide window value is formed from the replicas' (None: per replica only)
GAUGE_AGG = {"memory_pressure_score": "capacity", "num_running_reqs": "sum",
             "num_queue_reqs": "sum", "kv_eviction_rate": "sum",
             "kv_external_fragmentation": None}


@dataclass(frozen=True)
class ReplicaView:
    """What the rules read of one replica: its name and pool, its engine kind, the KV pool's
    capacity in tokens, its request budget, and its sampled gauges (`twin_gauges`)."""

    name: str
    pool: str
    kind: str
    capacity_tokens: int
    max_running: int | None
    gauges: dict = field(default_factory=dict, compare=False)
    down: tuple = ()  # (from, to) of each crash: the engine process was not there


def fleet_scoped(rule: Rule) -> bool:
    """Whether `rule` also has a fleet-wide value (every rule has a per-replica one)."""
    if rule.action == "defragment":
        return False
    return rule.kind == "burn_rate" or GAUGE_AGG.get(rule.metric, "records") is not None


def fleet_end(records: Sequence[dict], replicas: Sequence[ReplicaView]) -> float:
    """The fleet's last moment: a record's last event or any replica's last sample."""
    ends = [ts[-1] for v in replicas for ts, _ in v.gauges.values() if ts]
    return max([run_end(records), *ends])


def fleet_budget(replicas: Sequence[ReplicaView]) -> int | None:
    budgets = [v.max_running for v in replicas]
    return sum(budgets) if budgets and all(budgets) else None


def evaluate_fleet(rules: Sequence[Rule], records: Sequence[dict],
                   replicas: Sequence[ReplicaView], window_s: float = 60.0,
                   t_end: float | None = None) -> list[Alert]:
    """The alerts of `rules` for the fleet (`replica="fleet"`) and for each replica, in rule
    order, then the fleet before the replicas (in the deployment's order), then time."""
    missing = [r.name for r in rules if needs_series(r)
               and not any(r.metric in v.gauges for v in replicas)]
    if missing:
        raise ConfigError(f"alert rules {', '.join(missing)} read a sampled series no "
                          "replica of the run has")
    end = fleet_end(records, replicas) if t_end is None else t_end
    scoped = [r for r in rules if fleet_scoped(r)]
    out: list[tuple[int, int, Alert]] = []
    order = {r.name: i for i, r in enumerate(rules)}
    if scoped:
        windows = fleet_windows(records, replicas, window_s, end, read_by(scoped))
        for a in evaluate_windows(scoped, windows, records, window_s, end):
            out.append((order[a.rule], 0, replace(a, replica=FLEET)))
    for k, v in enumerate(replicas, 1):
        mine = [r for r in records if r.get("replica") == v.name]
        usable = [r for r in rules if not needs_series(r) or r.metric in v.gauges]
        windows = metric_windows(mine, v.gauges or None, v.max_running, window_s, end,
                                 read_by(usable))
        for a in evaluate_windows(usable, windows, mine, window_s, end):
            out.append((order[a.rule], k, replace(a, replica=v.name, pool=v.pool)))
    out.sort(key=lambda x: (x[0], x[1]))  # stable: each scope's alerts stay in time order
    return [a for _, _, a in out]


def fleet_windows(records: Sequence[dict], replicas: Sequence[ReplicaView],
                  window_s: float, t_end: float,
                  only: set[str] | None = None) -> dict[str, list[Window]]:
    """Every metric's fleet-wide windows (see the module doc); `only`: just these."""
    out = metric_windows(records, None, fleet_budget(replicas), window_s, t_end, only)
    for name, how in GAUGE_AGG.items():
        if how is not None and (only is None or name in only) \
                and any(name in v.gauges for v in replicas):
            out[name] = _aggregate(replicas, name, how, window_s, t_end)
    return out


def _aggregate(replicas: Sequence[ReplicaView], name: str, how: str, window_s: float,
               t_end: float) -> list[Window]:
    per = [(v, series_windows(*v.gauges[name], window_s, t_end)) for v in replicas
           if name in v.gauges]
    held = [0.0] * len(per)
    out = []
    for k, w in enumerate(per[0][1]):
        n, live = 0, [True] * len(per)
        for i, (v, ws) in enumerate(per):
            if ws[k].value is not None:
                held[i] = ws[k].value
            elif _was_down(v.down, w.start_s, w.end_s):
                held[i], live[i] = 0.0, False  # no scrape answers; empty after its restart
            elif name == "kv_eviction_rate":
                held[i] = 0.0  # nothing sampled: nothing evicted
            n += ws[k].n
        if how == "capacity":
            caps = [v.capacity_tokens * up for (v, _), up in zip(per, live, strict=True)]
            value = (sum(h * c for h, c in zip(held, caps, strict=True)) / sum(caps)
                     if sum(caps) else None)
        else:
            value = sum(h for h, up in zip(held, live, strict=True) if up)
        out.append(Window(w.start_s, w.end_s, None if value is None else round(value, 6), n))
    return out


def _was_down(down: tuple, start_s: float, end_s: float) -> bool:
    return any(lo < end_s and hi > start_s for lo, hi in down)


def replica_views(deployment, gauges_of) -> list[ReplicaView]:
    """The views of a finished `twin.cluster.Deployment`'s replicas; `gauges_of(series,
    capacity_tokens)` turns a replica's series into its gauges."""
    out = []
    for w in deployment.workers:
        cap = w.replica.cap
        out.append(ReplicaView(w.name, w.pool, w.kind, cap.max_total_num_tokens,
                               cap.max_running_requests,
                               gauges_of(w.replica.series, cap.max_total_num_tokens),
                               tuple(tuple(c) for c in w.crashes)))
    return out


def spec_views(spec) -> list[ReplicaView]:
    """Views (without series) of a `twin.fleet.FleetSpec`'s replicas: each one's capacity
    and request budget, derived as the fleet derives them."""
    from twin.config import ServerArgs, derive_capacity
    from twin.errors import ConfigError, ServetwinError

    out = []
    for r in spec.replicas:
        try:
            if r.engine == "vllm":
                from twin.vllm_replica import VllmArgs, vllm_kind

                cap = vllm_kind(VllmArgs(**dict(r.server_args)), r.gpu, r.step_time_backend)[0]
            else:
                cap = derive_capacity(ServerArgs(**dict(r.server_args)), r.gpu)
        except (TypeError, ServetwinError) as exc:
            raise ConfigError(f"replica {r.name}: {exc}") from None
        out.append(ReplicaView(r.name, r.pool, r.engine, cap.max_total_num_tokens,
                               cap.max_running_requests))
    return out
