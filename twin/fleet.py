"""A fleet from a deployment spec: pools of replicas behind a router, failover, faults.

A spec (YAML or JSON file, or a preset by name; docs/fleet.md):

    name: finance-hybrid
    gpu: a100-pcie-80gb                # default for replicas
    seed: 0
    router: {name: length, thresholds: [32000, 64000]}   # or round_robin, cache_aware, ...
    pools:
      - name: sglang
        router: {name: cache_aware, cache_threshold: 0.3}  # a pool's inner router (length)
        replicas:
          - {name: sg, count: 2, engine: sglang,
             server_args: {model_path: ..., tp_size: 2, max_total_tokens: 140000}}
      - name: medium
        calibration: vllm-profile.json   # a pool's profile (`servetwin calibrate`), for each
        replicas: [{name: vm, engine: vllm, server_args: {tp_size: 2, max_model_len: 65536}}]
    failover: {retry_max_retries: 5, health_check_interval_secs: 60, streaming: true}
    faults: [{kind: crash, replica: sg0, at_s: 120, repair_s: 60}]

`count: n` makes replicas `name0..name{n-1}`. `calibration: FILE` (a replica's or a pool's;
relative to the deployment file) gives a replica the step times of a calibration profile
of its engine, model and device (refused otherwise); a vLLM replica also takes the
profile's server arguments as defaults (docs/calibration.md). Capacity and step-time tables are built once
per distinct replica kind (engine, GPU, server arguments, backend) and shared. Errors name
the file, line and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import simpy

from twin.cluster import Deployment, ScaledStepTime
from twin.collector import paused
from twin.config import ServerArgs, derive_capacity
from twin.errors import ConfigError, ServetwinError
from twin.faults import Fault, failover_from
from twin.inputs import (
    COUNT,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    PROBABILITY,
    SEED,
    TOKENS,
    Rule,
)
from twin.interrupt import run_interruptible
from twin.metrics import SERIES_FIELDS, SLO, write_records
from twin.outputs import atomic_write_text, atomic_writer
from twin.record_sink import CHUNK
from twin.record_sink_fleet import UNFINISHED
from twin.routers import make_router
from twin.sim import SimConfig, make_replica, step_time_for
from twin.source import Source
from twin.workload import Workload

ENGINES = ("sglang", "vllm")
_TOP = ("name", "gpu", "seed", "router", "pools", "replicas", "failover", "faults",
        "description", "poll_interval_s")
_POOL = ("name", "router", "replicas", "calibration")
_REPLICA = ("name", "count", "engine", "gpu", "server_args", "step_time_backend", "twin",
            "calibration")


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    pool: str
    engine: str
    gpu: str
    server_args: tuple  # sorted (key, value) pairs
    step_time_backend: str | None = None
    twin: tuple = ()  # SimConfig fields (sglang)
    calibration: str | None = None  # a calibration profile (its step times), resolved path


@dataclass
class FleetSpec:
    name: str
    replicas: list[ReplicaSpec]
    router: dict
    pool_routers: dict[str, dict]
    pools: list[str]
    failover: dict
    faults: list[Fault]
    seed: int = 0
    poll_interval_s: float | None = None
    source: str = "<spec>"


class _Where:
    """Line numbers of a YAML/JSON document's fields (from the composed node tree)."""

    def __init__(self, path: str, text: str) -> None:
        import yaml

        self.path, self.lines = path, {}
        try:
            node = yaml.compose(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark else 0
            raise ConfigError(f"{path}:{line}: not valid YAML/JSON: "
                              f"{getattr(exc, 'problem', exc)}") from None
        self._walk(node, "")
        self.data = yaml.safe_load(text)

    def _walk(self, node, at: str) -> None:
        if node is None:
            return
        self.lines.setdefault(at, node.start_mark.line + 1)  # a key's own line first
        if hasattr(node, "value") and isinstance(node.value, list):
            for i, item in enumerate(node.value):
                if isinstance(item, tuple):
                    key, val = item
                    self.lines[f"{at}.{key.value}".lstrip(".")] = key.start_mark.line + 1
                    self._walk(val, f"{at}.{key.value}".lstrip("."))
                else:
                    self._walk(item, f"{at}[{i}]")

    def err(self, at: str, problem: str) -> ConfigError:
        probe = at
        while probe and probe not in self.lines:
            probe = probe.rsplit(".", 1)[0] if "." in probe else ""
        return ConfigError(f"{self.path}:{self.lines.get(probe, 1)}: {at}: {problem}")


def load_spec(source: str) -> FleetSpec:
    """A preset name or a YAML/JSON file."""
    from twin.fleet_presets import PRESETS

    if source in PRESETS:
        return parse_spec(PRESETS[source](), f"<preset {source}>")
    p = Path(source)
    if not p.exists():
        raise ConfigError(f"--deployment {source!r}: no such file and not a preset; presets: "
                          f"{', '.join(sorted(PRESETS))}")
    from twin.inputs import read_text

    return parse_spec(read_text(p, "deployment"), str(p))


def parse_spec(doc: str | dict, path: str) -> FleetSpec:
    where = _Where(path, doc if isinstance(doc, str) else json.dumps(doc, indent=1))
    d = where.data
    if not isinstance(d, dict):
        raise where.err("<document>", "a deployment is a mapping with pools or replicas")
    _keys(where, "", d, _TOP)
    gpu = _gpu(where, "gpu", d.get("gpu", "a100-pcie-80gb"))
    _text(where, "name", d.get("name", ""))
    seed = _number(where, "seed", d.get("seed", 0), SEED)
    poll = d.get("poll_interval_s")
    if poll is not None:
        _number(where, "poll_interval_s", poll, POSITIVE)
    for key in ("failover", "faults"):
        kind = dict if key == "failover" else list
        if d.get(key) is not None and not isinstance(d[key], kind):
            raise where.err(key, f"must be a {'mapping' if kind is dict else 'list'}")
    pools_in = d.get("pools")
    if pools_in is None:
        pools_in = [{"name": "default", "replicas": d.get("replicas") or []}]
    elif "replicas" in d:
        raise where.err("replicas", "give pools or replicas, not both")
    if not isinstance(pools_in, list) or not pools_in:
        raise where.err("pools", "must be a non-empty list")
    replicas, pool_routers, pools = [], {}, []
    for i, pool in enumerate(pools_in):
        at = f"pools[{i}]"
        if not isinstance(pool, dict):
            raise where.err(at, "a pool is a mapping with name, router, replicas")
        _keys(where, at, pool, _POOL)
        name = _text(where, f"{at}.name", pool.get("name", f"pool{i}"))
        if name in pools:
            raise where.err(f"{at}.name", f"pool {name!r} given twice")
        pools.append(name)
        if "router" in pool:
            pool_routers[name] = _router_dict(where, f"{at}.router", pool["router"])
        reps = pool.get("replicas")
        rat = f"{at}.replicas" if "pools" in d else "replicas"
        if not isinstance(reps, list) or not reps:
            raise where.err(rat, "must be a non-empty list")
        pool_cal = (pool.get("calibration"), f"{at}.calibration")
        for j, rep in enumerate(reps):
            replicas += _replica_specs(where, f"{rat}[{j}]", rep, name, gpu, pool_cal)
    names = [r.name for r in replicas]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise where.err("pools", f"replica name {dup!r} used twice")
    router = _router_dict(where, "router", d.get("router", "round_robin"))
    if pool_routers and router["name"] != "length":
        raise where.err("pools", "a pool's own router needs the top-level router 'length'")
    _check_router(where, "router", router, pools)
    for i, pool in enumerate(pools):
        if pool in pool_routers:
            _check_router(where, f"pools[{i}].router", pool_routers[pool], pools)
    try:
        failover_from(d.get("failover"), "failover")
    except ServetwinError as exc:  # "failover KEY: ..." names the key: point at its line
        key = str(exc).removeprefix("failover ").split(":", 1)[0]
        at = f"failover.{key}" if key in (d.get("failover") or {}) else "failover"
        raise where.err(at, str(exc)) from None
    faults = []
    for k, f in enumerate(d.get("faults") or []):
        try:
            fault = Fault(**f) if isinstance(f, dict) else Fault.parse(str(f))
        except (TypeError, ServetwinError) as exc:
            raise where.err(f"faults[{k}]", str(exc)) from None
        if fault.replica not in names:
            raise where.err(f"faults[{k}].replica", f"{fault.replica!r}: allowed values: "
                            f"{', '.join(names)}")
        faults.append(fault)
    return FleetSpec(str(d.get("name", Path(path).stem)), replicas, router, pool_routers, pools,
                     dict(d.get("failover") or {}), faults, int(seed), poll, path)


def _number(where: _Where, at: str, value, rule: Rule) -> int | float:
    """A number from the file under `rule` (a string is not a number here)."""
    try:
        if isinstance(value, str):
            raise ValueError
        return rule.parse(value)
    except ValueError:
        raise where.err(at, f"{value!r}: must be {rule.describe()}") from None


def _text(where: _Where, at: str, value) -> str:
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise where.err(at, f"{value!r}: must be a name (a string)")
    return str(value)


def _gpu(where: _Where, at: str, value) -> str:
    from twin.hardware import GPUS

    if not isinstance(value, str) or value not in GPUS:
        raise where.err(at, f"{value!r}: allowed values: {', '.join(sorted(GPUS))}")
    return value


# Router parameters that are numbers, by name: what each must be (sglang-router's meaning)
_ROUTER_NUMBERS = {
    "poll_interval_s": POSITIVE, "prefix_tokens": COUNT, "virtual_nodes": COUNT,
    "load_factor": Rule(lo=1), "cache_threshold": PROBABILITY,
    "balance_abs_threshold": NON_NEGATIVE_INT, "balance_rel_threshold": NON_NEGATIVE,
    "eviction_interval_s": POSITIVE, "max_tree_size": COUNT, "chars_per_token": POSITIVE,
}


def _keys(where: _Where, at: str, d: dict, allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise where.err(f"{at}.{k}".lstrip("."), f"unknown key; allowed: {', '.join(allowed)}")


def _check_router(where: _Where, at: str, r: dict, pools: list[str]) -> None:
    """Build the router once so that a bad name or parameter is named with its line."""
    params = {k: v for k, v in r.items() if k != "name"}
    if r["name"] == "length":
        thresholds = params.get("thresholds", (32000, 64000)[:len(pools) - 1])
        if not isinstance(thresholds, list | tuple) or len(thresholds) != len(pools) - 1:
            raise where.err(f"{at}.thresholds", f"{thresholds!r}: needs one fewer than the "
                            f"{len(pools)} pools ({', '.join(pools)})")
        params.update(pools=pools, inner={}, thresholds=thresholds)
    for k, rule in _ROUTER_NUMBERS.items():
        if k in params:
            _number(where, f"{at}.{k}", params[k], rule)
    if r["name"] == "length":
        for i, t in enumerate(params["thresholds"]):
            _number(where, f"{at}.thresholds[{i}]", t, TOKENS)
    import inspect

    from twin.routers import ROUTERS

    if r["name"] in ROUTERS:
        allowed = [k for k in inspect.signature(ROUTERS.get(r["name"])).parameters
                   if k not in ("seed", "pools", "inner")]
        for k in r:
            if k != "name" and k not in allowed:
                raise where.err(f"{at}.{k}", f"unknown parameter of router {r['name']!r}; "
                                f"allowed: {', '.join(allowed) or 'none'}")
    try:
        make_router(r["name"], params, where=at)
    except ServetwinError as exc:
        raise where.err(at, str(exc).removeprefix(f"{at}: ")) from None


def _router_dict(where: _Where, at: str, r) -> dict:
    if isinstance(r, str):
        return {"name": r}
    if not isinstance(r, dict) or "name" not in r:
        raise where.err(at, "a router is a name or a mapping with name and parameters")
    if not isinstance(r["name"], str):
        raise where.err(f"{at}.name", f"{r['name']!r}: must be a router name")
    return dict(r)


def _replica_specs(where: _Where, at: str, rep, pool: str, gpu: str,
                   pool_cal: tuple = (None, "")) -> list[ReplicaSpec]:
    if not isinstance(rep, dict):
        raise where.err(at, "a replica is a mapping with engine, server_args, ...")
    _keys(where, at, rep, _REPLICA)
    engine = rep.get("engine", "sglang")
    if engine not in ENGINES:
        raise where.err(f"{at}.engine", f"{engine!r}: allowed values: {', '.join(ENGINES)}")
    args = rep.get("server_args") or {}
    if not isinstance(args, dict):
        raise where.err(f"{at}.server_args", "must be a mapping of server arguments")
    cal, cal_at = (rep["calibration"], f"{at}.calibration") if "calibration" in rep \
        else pool_cal
    if cal is not None:
        if rep.get("step_time_backend") is not None:
            raise where.err(f"{at}.step_time_backend", "a calibrated replica takes its step "
                            "times from its calibration profile: drop step_time_backend")
        from twin.fleet_calibration import calibrated

        cal, args, gpu = calibrated(where, cal_at, cal, engine, args, rep, gpu)
    allowed = _engine_args(engine)
    for k in args:
        if k not in allowed:
            raise where.err(f"{at}.server_args.{k}", f"not a {engine} server argument the twin "
                            f"models; allowed: {', '.join(sorted(allowed))}")
    try:
        if engine == "sglang":
            ServerArgs(**args)
        else:
            from twin.vllm_replica import VllmArgs

            VllmArgs(**args)
    except (TypeError, ServetwinError) as exc:
        flag = str(exc).split(" ", 1)[0]  # "--max-running-requests -1: ..." names the key
        key = flag.removeprefix("--").replace("-", "_")
        raise where.err(f"{at}.server_args" + (f".{key}" if key in args else ""),
                        str(exc)) from None
    if "gpu" in rep:
        _gpu(where, f"{at}.gpu", rep["gpu"])
    if "name" in rep:
        _text(where, f"{at}.name", rep["name"])
    backend = rep.get("step_time_backend")
    if backend is not None:
        from twin.perf import backend_names

        if backend not in backend_names():
            raise where.err(f"{at}.step_time_backend", f"{backend!r}: allowed values: "
                            f"{', '.join(backend_names())}")
    count = rep.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise where.err(f"{at}.count", f"{count!r}: must be an integer >= 1")
    base = str(rep.get("name", f"{pool}-{engine}"))
    twin = rep.get("twin") or {}
    if not isinstance(twin, dict):
        raise where.err(f"{at}.twin", "must be a mapping of the twin's settings")
    # horizon_s is the whole deployment's (--horizon), not one replica's
    # (calibration is the replica's own key)
    sim_fields = {f.name for f in fields(SimConfig)} - {"args", "gpu", "step_time_backend",
                                                        "horizon_s", "calibration"}
    twin = dict(twin)
    for k in twin:
        if engine != "sglang" or k not in sim_fields:
            raise where.err(f"{at}.twin.{k}", f"allowed: {', '.join(sorted(sim_fields))} "
                            "(sglang replicas)")
        if k == "step_cpu":
            twin[k] = _step_cpu(where, f"{at}.twin.{k}", twin[k])
        if k == "kv_allocator":
            from twin.memory import allocator_names

            if twin[k] not in allocator_names():
                raise where.err(f"{at}.twin.{k}", f"{twin[k]!r}: allowed values: "
                                f"{', '.join(allocator_names())}")
        try:  # each setting on its own, so the error names its line
            SimConfig(**{k: twin[k]})
        except (TypeError, ValueError, ServetwinError) as exc:
            raise where.err(f"{at}.twin.{k}", str(exc)) from None
    names = [base] if count == 1 else [f"{base}{i}" for i in range(count)]
    return [ReplicaSpec(n, pool, engine, rep.get("gpu", gpu), tuple(sorted(args.items())),
                        rep.get("step_time_backend"), tuple(sorted(twin.items())), cal)
            for n in names]


def _step_cpu(where: _Where, at: str, value):
    """`step_cpu: FILE` (`benchmarks/step_cpu_cost.py --json` output or a profile with a
    `step_cpu` section; relative to the deployment file) or `{per_step_s, per_request_s}`."""
    from twin.perf.step_cpu import from_dict, load

    try:
        if isinstance(value, dict):
            return from_dict(value, "step_cpu")
        if isinstance(value, str) and value:
            path = Path(value)
            if not path.is_absolute() and Path(where.path).is_file():
                path = Path(where.path).resolve().parent / path  # as calibration: FILE
            return load(path)
    except ServetwinError as exc:
        raise where.err(at, str(exc)) from None
    raise where.err(at, f"{value!r}: must be a JSON file of the step CPU cost or a mapping "
                    "{per_step_s, per_request_s} (seconds)")


def _engine_args(engine: str) -> set[str]:
    if engine == "sglang":
        return {f.name for f in fields(ServerArgs)}
    from twin.vllm_replica import VllmArgs

    return {f.name for f in fields(VllmArgs)}


# ---- building and running -----------------------------------------------------------
class Kinds:
    """Capacity and step time, once per distinct replica kind."""

    def __init__(self) -> None:
        self.cache: dict[tuple, tuple] = {}

    def sglang(self, cfg: SimConfig):
        key = ("sglang", cfg.gpu, cfg.args, cfg.step_time_backend, cfg.calibration,
               cfg.step_cpu)
        if key not in self.cache:
            cap = derive_capacity(cfg.args, cfg.gpu)
            st = step_time_for(cfg, cap)
            self.cache[key] = (cap, st, "fitted" if cfg.calibration else st.name)
        return self.cache[key]

    def vllm(self, args, gpu: str, backend: str | None, calibration: str | None = None):
        key = ("vllm", gpu, args, backend, calibration)
        if key not in self.cache:
            from twin.vllm_replica import vllm_kind

            profile = None
            if calibration is not None:
                from twin.perf.fitted import load_profile

                profile = load_profile(calibration)
            self.cache[key] = vllm_kind(args, gpu, backend, profile, calibration)
        return self.cache[key]


def build_fleet(env: simpy.Environment, spec: FleetSpec, workload: Workload,
                horizon_s: float | None = None, kinds: Kinds | None = None,
                debug_checks: bool = False) -> Deployment:
    if workload.clients != "replay":  # the fleet keeps every request's record
        raise ConfigError(f"workload {workload.name}: clients={workload.clients} is for one "
                          "server (servetwin simulate); a fleet takes clients=replay")
    kinds = kinds or Kinds()
    seeds = np.random.SeedSequence(spec.seed).generate_state(len(spec.pools) + 1).tolist()
    router = _top_router(spec, seeds)
    dep = Deployment(env, Source(workload), router, horizon_s,
                     failover=failover_from(spec.failover), faults=spec.faults, seed=spec.seed,
                     poll_interval_s=spec.poll_interval_s or _poll_need(router))
    slowed = {f.replica for f in spec.faults if f.kind == "slow"}
    for r in spec.replicas:
        rep, gpus, st = _make_one(env, r, kinds, horizon_s, debug_checks, r.name in slowed)
        dep.add(rep, r.pool, r.name, gpus, r.engine, st)
    return dep


def _make_one(env, r: ReplicaSpec, kinds: Kinds, horizon_s, debug_checks, slowed: bool):
    args = dict(r.server_args)
    if r.engine == "vllm":
        from twin.vllm_replica import VllmArgs, VllmReplica

        va = VllmArgs(**args)
        cap, st = kinds.vllm(va, r.gpu, r.step_time_backend, r.calibration)
        scaled = ScaledStepTime(st) if slowed else None
        rep = VllmReplica(env, va, cap, scaled or st, horizon_s=horizon_s,
                          debug_checks=debug_checks)
        return rep, va.tp_size, scaled
    try:
        sa = ServerArgs(**args)
        cfg = SimConfig(args=sa, gpu=r.gpu, step_time_backend=r.step_time_backend,
                        horizon_s=horizon_s, debug_checks=debug_checks,
                        calibration=r.calibration, **dict(r.twin))
    except (TypeError, ServetwinError) as exc:
        raise ConfigError(f"replica {r.name}: {exc}") from None
    cap, st, backend = kinds.sglang(cfg)
    scaled = ScaledStepTime(st) if slowed else None
    rep, _ = make_replica(env, replace(cfg, step_time_backend=backend), scaled or st)
    return rep, sa.tp_size, scaled


def _top_router(spec: FleetSpec, seeds: list[int]):
    top = dict(spec.router)
    name = top.pop("name")
    if name != "length":
        return make_router(name, top, seed=seeds[0], where=f"{spec.source}: router")
    inner = {}
    for i, pool in enumerate(spec.pools):
        pr = dict(spec.pool_routers.get(pool, {"name": "round_robin"}))
        inner[pool] = make_router(pr.pop("name"), pr, seed=seeds[i + 1],
                                  where=f"{spec.source}: pools[{i}].router")
    top.setdefault("thresholds", (32000, 64000)[:len(spec.pools) - 1])
    if len(top["thresholds"]) != len(spec.pools) - 1:
        raise ConfigError(f"{spec.source}: router.thresholds: {top['thresholds']}: needs one "
                          f"fewer than the {len(spec.pools)} pools ({', '.join(spec.pools)})")
    return make_router("length", {**top, "pools": spec.pools, "inner": inner}, seed=seeds[0],
                       where=f"{spec.source}: router")


def _poll_need(router) -> float | None:
    routers = [router, *getattr(router, "inner", {}).values()]
    wanted = [r.poll_interval_s for r in routers if getattr(r, "load_source", "") == "polled"]
    return min(wanted) if wanted else None


@dataclass
class FleetResult:
    records: list[dict]
    summary: dict
    series: list[tuple]
    deployment: Deployment
    interrupted: str | None = None  # Ctrl-C: why the records are partial

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        path, done = out / "requests.jsonl", getattr(self.records, "path", None)
        if not (done is not None and path.exists() and path.samefile(done)):
            write_records(path, self.records)  # (a streamed run wrote its own already)
        atomic_write_text(out / "summary.json", json.dumps(self.summary, indent=2) + "\n")
        write_fleet_series(out / "timeseries.csv", self.series)


def write_fleet_series(path: Path, series: list) -> None:
    """A fleet's timeseries.csv: the replica's name, then its sample's fields (a row cut
    or padded with empty cells to the header's width; None as an empty cell), by the
    compiled writer's `csv_block` where it is built: the same bytes."""
    from twin.record_table import _C

    width = len(SERIES_FIELDS) + 1
    with atomic_writer(path, binary=True) as fh:
        fh.write((",".join(("replica", *SERIES_FIELDS)) + "\n").encode())
        for i in range(0, len(series), 8192):
            j = min(i + 8192, len(series))
            if _C is not None:
                fh.write(_C.csv_block(series, i, j, width, True))
                continue
            for row in series[i:j]:
                cells = list(row[:width]) + [""] * (width - len(row))
                fh.write((",".join("" if x is None else str(x) for x in cells)
                          + "\n").encode())


def simulate_fleet(spec: FleetSpec | str, workload: Workload, slo: SLO | None = None,
                   horizon_s: float | None = None, kinds: Kinds | None = None,
                   debug_checks: bool = False, on_start=None, out: Path | None = None,
                   record_chunk: int = CHUNK) -> FleetResult:
    """Run `workload` through the deployment `spec` (a FleetSpec, a preset name or a file);
    `on_start()` is called once the fleet is built, as the simulation starts. With `out`
    the records are streamed to `out/requests.jsonl` (`run_deployment`)."""
    if isinstance(spec, str):
        spec = load_spec(spec)
    env = simpy.Environment()
    dep = build_fleet(env, spec, workload, horizon_s, kinds, debug_checks)
    if on_start is not None:
        on_start()
    result = run_deployment(dep, slo, out, record_chunk)
    result.summary["deployment"] = spec.name
    return result


# In memory, a fleet's records are dicts built from the same per-replica tables the
# streamed path formats, and its summaries come from their columns (twin/record_sink_fleet.py
# `FleetList`); False: `Deployment.records` and `summarize` over the dicts, the path both
# are checked against (tests/test_record_stream.py).
IN_MEMORY_COLUMNS = True


def run_deployment(dep: Deployment, slo: SLO | None = None, out: Path | None = None,
                   record_chunk: int = CHUNK) -> FleetResult:
    """Start a built deployment, run it to the end, and collect its results. With `out`
    (a directory) the records are streamed to `out/requests.jsonl` as requests finish
    (twin/record_sink_fleet.py: `record_chunk` at a time; the same bytes) and
    `result.records` reads them back."""
    from twin.record_sink_fleet import TicketSink

    sink = None
    if out is not None:
        from twin.record_sink import Count

        sink = dep.done_tickets = TicketSink(dep, Path(out) / "requests.jsonl", record_chunk)
        for w in dep.workers:  # the tickets hold the final attempts; nothing else needs them
            w.replica.finished = Count()
    elif IN_MEMORY_COLUMNS:  # every ticket held to the end, then the records in memory
        sink = dep.done_tickets = TicketSink(dep, None, 1 << 62)
    dep.start(run_replicas=True)
    interrupted = None
    # Python's cyclic collector off: nothing a fleet's run makes forms cycles (SimPy's
    # events, the tickets, the typed core's and the Python replicas' requests, an evicted
    # radix node; `gc.collect()` during a run finds only the builders' closures), nor do
    # the records and summaries; each collection would only walk the live requests and
    # the router's tree again (docs/perf.md, fourteenth round)
    with paused():
        # keep what is done: finalize gives the rest `aborted` (stopped between events)
        if run_interruptible(dep.env, dep.wait_in_events):
            interrupted = f"interrupted (Ctrl-C) at simulated time {dep.env.now:.3f} s"
        dep.finalize()
        if sink is not None:
            sink.interrupted = interrupted  # its merge rewrites the errors, as below
            records = sink.finish()
        else:
            records = dep.records()
        summary = dep.summary(records, slo)
    if interrupted:
        if out is None:
            for r in records:
                if r["status"] == "aborted" and (r["error"] or "").startswith(UNFINISHED):
                    r["error"] = f"{interrupted}, before it finished"
        summary["partial"] = {"stop_reason": interrupted, "simulated_s": round(dep.env.now, 6),
                              "unfinished": summary["status"]["aborted"]}
    return FleetResult(records, summary, dep.series(), dep, interrupted)


def with_router(spec: FleetSpec, router: dict, pool_routers: dict | None = None) -> FleetSpec:
    """The same replicas behind another router (benchmarks, tests)."""
    return replace(spec, router=dict(router), pool_routers=dict(pool_routers or {}))
