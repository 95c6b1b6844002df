"""The monitoring metrics of a live server: its scraped `/metrics` and a replay's records.

The same definitions as the twin's (`twin.monitoring`): the record-based metrics (latency
quantiles, `radix_sharing_ratio`, `batch_efficiency`) run the same code over the live
records; the sampled gauges come from SGLang's own gauges, scraped during the replay by
`Scraper` (`metrics_series.jsonl`): `memory_pressure_score` = 1 - kv_available_tokens /
max_total_num_tokens (what the twin's allocated / capacity is), `num_running_reqs`,
`num_queue_reqs`. SGLang 0.5.23 exports no fragmentation (its token pool has none) and no
eviction counter, so those two are twin-only. `run_totals` reads the counters of the
before/after snapshots a replay always writes (`metrics_before.prom`, `metrics_after.prom`).
Parsing is prometheus-client's (`text_string_to_metric_families`).
"""

from __future__ import annotations

import csv
import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from twin.errors import ConfigError

# SGLang gauges sampled by the scraper (summed over label sets: one scheduler per TP group)
GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
          "sglang:kv_available_tokens", "sglang:kv_evictable_tokens", "sglang:kv_used_tokens",
          "sglang:max_total_num_tokens", "sglang:cache_hit_rate", "sglang:gen_throughput")
COUNTERS = ("sglang:num_requests_total", "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total", "sglang:cached_tokens_total")
HISTOGRAM_COUNTS = ("sglang:time_to_first_token_seconds_count",
                    "sglang:e2e_request_latency_seconds_count",
                    "sglang:queue_time_seconds_count")
SERIES_FILE = "metrics_series.jsonl"


def parse_samples(text: str, names=GAUGES + COUNTERS + HISTOGRAM_COUNTS) -> dict[str, float]:
    """The values of `names` in a Prometheus text exposition, each summed over its label
    sets (every `is_streaming`, `cache_source`, TP rank); a name absent is left out.
    A gauge that SGLang exports once per TP rank (`max_total_num_tokens`, the KV counts)
    is taken from its first label set instead: every rank holds the same pool."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    per_rank = {"sglang:max_total_num_tokens", "sglang:kv_available_tokens",
                "sglang:kv_evictable_tokens", "sglang:kv_used_tokens", "sglang:token_usage",
                "sglang:cache_hit_rate", "sglang:num_running_reqs", "sglang:num_queue_reqs"}
    wanted = set(names)
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ConfigError(f"not Prometheus text exposition: {exc}") from None
    for fam in families:
        for s in fam.samples:
            if s.name not in wanted:
                continue
            if s.name in per_rank and s.labels.get("tp_rank", "0") != "0":
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def run_totals(before: str, after: str) -> dict[str, float]:
    """Counter increases over a replay (after - before) and the final gauges, by SGLang's
    names, plus `radix_sharing_ratio` = delta cached_tokens_total / delta prompt_tokens_total
    (None when no prompt token was counted)."""
    b, a = parse_samples(before), parse_samples(after)
    out = {n: a[n] - b.get(n, 0.0) for n in COUNTERS + HISTOGRAM_COUNTS if n in a}
    out.update({n: a[n] for n in GAUGES if n in a})
    prompt = out.get("sglang:prompt_tokens_total")
    cached = out.get("sglang:cached_tokens_total", 0.0)
    out["radix_sharing_ratio"] = cached / prompt if prompt else None
    return out


class Scraper:
    """Scrape `url/metrics` every `every_s` seconds on a thread while a replay runs.
    `hook` is a replay progress callback (`runtime.client.replay(progress=...)`) that
    learns the replay's time origin, so samples line up with the records' `arrival_s`."""

    def __init__(self, url: str, every_s: float = 1.0, chain=None) -> None:
        self.url, self.every_s, self.chain = url.rstrip("/"), every_s, chain
        self.samples: list[tuple[float, dict[str, float]]] = []  # (perf_counter, values)
        self.errors: list[str] = []
        self.t0: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper",
                                        daemon=True)

    def hook(self, run) -> None:
        if self.t0 is None and getattr(run, "t0", 0.0):
            self.t0 = run.t0
        if self.chain is not None:
            self.chain(run)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._scrape()  # the final state, after the last request

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._scrape()
            self._stop.wait(self.every_s)

    def _scrape(self) -> None:
        at = time.perf_counter()
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
                text = resp.read().decode("utf-8", "replace")
            self.samples.append((at, parse_samples(text)))
        except (OSError, ConfigError) as exc:
            self.errors.append(f"{at:.3f}: {exc}")

    def rows(self) -> list[dict]:
        """Samples as rows `{"t_s": seconds since the replay's origin, name: value}`."""
        t0 = self.t0 if self.t0 is not None else (self.samples[0][0] if self.samples else 0)
        return [{"t_s": round(at - t0, 6), **vals} for at, vals in self.samples]

    def write(self, out: Path) -> Path:
        from twin.outputs import atomic_write_text

        path = Path(out) / SERIES_FILE
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n"
                                        for r in self.rows()))
        return path


def live_gauges(rows: list[dict]) -> dict[str, tuple[list[float], list[float | None]]]:
    """Scraped rows as the sampled gauges `twin.monitoring.metric_windows` reads, under the
    twin's names (see the module doc)."""
    rows = [r for r in rows if r.get("t_s", -1) >= 0]
    t = [r["t_s"] for r in rows]
    out: dict[str, tuple[list[float], list[float | None]]] = {}
    pressure = [1 - r["sglang:kv_available_tokens"] / r["sglang:max_total_num_tokens"]
                if r.get("sglang:max_total_num_tokens") and "sglang:kv_available_tokens" in r
                else None for r in rows]
    if any(v is not None for v in pressure):
        out["memory_pressure_score"] = (t, pressure)
    for name in ("num_running_reqs", "num_queue_reqs"):
        vals = [r.get(f"sglang:{name}") for r in rows]
        if any(v is not None for v in vals):
            out[name] = (t, vals)
    return out


@dataclass
class RunData:
    """A run directory read back: records, sampled gauges, the request budget."""

    kind: str  # "twin", "fleet" or "live"
    records: list[dict]
    gauges: dict = field(default_factory=dict)
    max_running: int | None = None
    totals: dict = field(default_factory=dict)  # live: counter deltas over the replay
    replicas: list = field(default_factory=list)  # fleet: twin.fleet_alerts.ReplicaView


def load_run(path: Path | str, deployment: str | None = None) -> RunData:
    """A `servetwin simulate --out` (one server or `--deployment`) or `servetwin live
    replay --out` directory. A fleet's replica capacities and budgets come from its
    summary's `alerts` section, else from `deployment` (a file or preset; default: the
    summary's `deployment` when that is a preset)."""
    from twin.metrics import SERIES_FIELDS, read_records

    d = Path(path)
    if not (d / "requests.jsonl").is_file():
        raise ConfigError(f"{d}: no requests.jsonl (an --out directory of `servetwin "
                          "simulate` or `servetwin live replay` expected)")
    records = read_records(d / "requests.jsonl")
    if _is_fleet(d / "timeseries.csv"):
        return _fleet_run(d, records, deployment)
    if (d / "timeseries.csv").is_file():
        from twin.monitoring import twin_gauges

        summary = _json(d / "summary.json")
        cap = (summary.get("memory") or {}).get("capacity_tokens")
        if not cap:
            raise ConfigError(f"{d / 'summary.json'}: no memory.capacity_tokens")
        rows = _csv_rows(d / "timeseries.csv", SERIES_FIELDS)
        mr = (summary.get("alerts") or {}).get("max_running_requests")
        return RunData("twin", records, twin_gauges(rows, SERIES_FIELDS, cap), mr)
    gauges, totals = {}, {}
    if (d / SERIES_FILE).is_file():
        gauges = live_gauges(_jsonl(d / SERIES_FILE))
    if (d / "metrics_before.prom").is_file() and (d / "metrics_after.prom").is_file():
        totals = run_totals((d / "metrics_before.prom").read_text(),
                            (d / "metrics_after.prom").read_text())
    info = _json(d / "server_info_after.json") if (d / "server_info_after.json").is_file() \
        else {}
    mr = max_running_of(info)
    return RunData("live", records, gauges, mr, totals, live_replicas(records, mr))


def live_replicas(records: list[dict], max_running: int | None) -> list:
    """The replicas a live fleet replay's records name (`replica`, from each worker's
    `--weight-version replica-N`), in order of name, without series (the router's
    /metrics is not a server's); [] for a single server. Each is given the budget the
    run's /server_info reported (the servers of `servetwin live fleet` are alike)."""
    from twin.fleet_alerts import ReplicaView

    names = sorted({r["replica"] for r in records if r.get("replica") is not None})
    pools = {r["replica"]: r.get("pool") or "live" for r in records if r.get("replica")}
    return [ReplicaView(n, pools[n], "sglang", 0, max_running) for n in names]


def _is_fleet(p: Path) -> bool:
    if not p.is_file():
        return False
    with p.open(encoding="utf-8") as fh:
        return fh.readline().startswith("replica,")


def _fleet_run(d: Path, records: list[dict], deployment: str | None) -> RunData:
    """A fleet's directory: every replica's series (timeseries.csv's `replica` column)."""
    from twin.fleet_alerts import ReplicaView
    from twin.metrics import SERIES_FIELDS
    from twin.monitoring import twin_gauges

    summary = _json(d / "summary.json") if (d / "summary.json").is_file() else {}
    known = (summary.get("alerts") or {}).get("replicas")
    if deployment is None and isinstance(known, dict) and known:
        views = [ReplicaView(n, v["pool"], v["kind"], v["capacity_tokens"],
                             v.get("max_running_requests")) for n, v in known.items()]
    else:
        views = _spec_views(d, summary, deployment)
    rows = _csv_rows(d / "timeseries.csv", ("replica", *SERIES_FIELDS), first_text=True)
    series: dict[str, list[tuple]] = {v.name: [] for v in views}
    for i, row in enumerate(rows, 2):
        if row[0] not in series:
            raise ConfigError(f"{d / 'timeseries.csv'}:{i}: replica {row[0]!r} is not in "
                              f"the deployment ({', '.join(series)})")
        series[row[0]].append(row[1:])
    crashes = {n: tuple(tuple(c) for c in (r or {}).get("crashes") or ())
               for n, r in (summary.get("replicas") or {}).items()}
    views = [replace(v, gauges=twin_gauges(series[v.name], SERIES_FIELDS, v.capacity_tokens),
                     down=crashes.get(v.name, ())) for v in views]
    return RunData("fleet", records, replicas=views)


def _spec_views(d: Path, summary: dict, deployment: str | None) -> list:
    from twin.fleet import load_spec
    from twin.fleet_alerts import spec_views
    from twin.fleet_presets import PRESETS

    name = deployment or summary.get("deployment")
    if deployment is None and name not in PRESETS:
        raise ConfigError(f"{d}: a fleet run without an alerts section (run with --alerts) "
                          f"and deployment {name!r} is not a preset: give --deployment FILE "
                          "(the run's deployment: its replicas' capacities and budgets)")
    return spec_views(load_spec(name))


def max_running_of(info: dict) -> int | None:
    """The server's request budget from `/server_info`: SGLang reports what it derived in
    `internal_states[0].max_running_requests` (the argument itself may be None)."""
    for src in (*(info.get("internal_states") or [])[:1], info):
        v = src.get("max_running_requests") if isinstance(src, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def _json(p: Path) -> dict:
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read JSON: {exc}") from None
    return doc if isinstance(doc, dict) else {}


def _jsonl(p: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise ConfigError(f"{p}:{i}: not JSON: {exc}") from None
    return rows


def _csv_rows(p: Path, fields: tuple, first_text: bool = False) -> list[tuple]:
    """The rows of a series CSV as numbers (an empty cell: None; `first_text`: the first
    column, a fleet's replica name, kept as text)."""
    with p.open(encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        head = tuple(next(reader, ()))
        if head != tuple(fields):
            raise ConfigError(f"{p}:1: columns {', '.join(head)}; expected "
                              f"{', '.join(fields)}")
        rows = []
        for i, row in enumerate(reader, 2):
            if len(row) != len(fields):
                raise ConfigError(f"{p}:{i}: {len(row)} columns; expected {len(fields)}")
            cells = [_cell(p, i, f, x) for f, x in zip(fields[first_text:], row[first_text:],
                                                        strict=True)]
            rows.append(tuple(row[:1] + cells if first_text else cells))
        return rows


# columns a vLLM replica leaves empty in a fleet's series
_MAY_BE_EMPTY = ("new_token_ratio", "kv_internal_fragmentation", "kv_external_fragmentation")


def _cell(p: Path, line: int, name: str, text: str) -> float | None:
    if text == "" and name in _MAY_BE_EMPTY:
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{p}:{line}: {name} {text!r}: not a number") from None
