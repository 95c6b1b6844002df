"""The twin against SGLang's published serving points: aiconfigurator-core's silicon_sample.csv.

    python benchmarks/serving_points.py [--groups SUBSTR ...] [--limit N] [--waves 4]
                                        [--rows] [--no-aic] [--json OUT] [--server KEY=VALUE ...]
                                        [--clients bench,replay]

Every SGLang aggregated row of `aiconfigurator_core/systems/silicon_sample.csv` (mean TTFT
and TPOT measured with bench_serving at a fixed concurrency C, fixed input and output
lengths, `ignore_eos`) whose model and GPU the twin covers with measured step times (the
`opdb` backend: aiconfigurator-core's per-op data for that GPU) is replayed in the twin as
a closed loop: `arrival=closed,concurrency=C,n=WAVES*C,prompt=fixed:ISL,output=fixed:OSL`
with SGLang's default server arguments for that GPU and TP size. Rows the twin cannot run
on measured data are listed as skipped, with the reason. `--clients` says whose closed-loop
clients the twin models (twin/workload.py CLIENTS): `bench` (bench_serving's, with its
warm-up copy of the first request left in the radix cache; the default, as the rows were
measured) and/or `replay` (servetwin's replay client: every client starts at 0); with
several, the table shows them side by side (first one first). `uniform` is a diagnostic,
not a client model: the clients' first requests spread evenly over one request's latency,
so the loop runs de-synchronised (the bound opposite to the lock-step a burst start gives;
docs/calibration.md, "Reading the serving-points table").

Beside the twin: AIConfigurator's own estimate of the same row, as its `cli estimate` agg
path computes it (`backend.run_agg(model, database, RuntimeConfig(isl, osl, batch_size=C),
ctx_tokens=isl)` on the latest SGLang database of that system; cli_estimate's defaults).

Errors are `(predicted - measured) / measured`; a group's score is the mean of their
absolute values over its rows (MAE, %), the overall score the mean over all rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from twin.config import ServerArgs, derive_capacity  # noqa: E402
from twin.errors import ConfigError, InfeasibleError  # noqa: E402
from twin.models import aic_model_id  # noqa: E402
from twin.perf import default_backend, make_step_time  # noqa: E402
from twin.sim import SimConfig, simulate  # noqa: E402
from twin.workload import CLIENTS, Request, Workload, from_spec  # noqa: E402

SPEC = ("arrival=closed,concurrency={c},n={n},prompt=fixed:{isl},output=fixed:{osl},"
        "clients={clients}")
# aiconfigurator system -> the twin's GPU entry
UNIFORM = "uniform"  # --clients: the de-synchronised bound (uniform_point)
GPUS = {"h100_sxm": "h100-sxm-80gb", "h200_sxm": "h200-sxm-141gb", "a100_sxm": "a100-sxm-80gb"}
# an instruct checkpoint has its base model's architecture
MODEL_ALIASES = {"meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B"}


@dataclass(frozen=True)
class Row:
    rid: str
    model: str  # the CSV's model path
    system: str
    precision: str  # bf16 | fp8 | ...
    sglang: str  # the SGLang version the row was measured with
    tp: int
    isl: int
    osl: int
    conc: int
    ttft_ms: float
    tpot_ms: float
    gemm_quant: str | None
    moe_quant: str | None
    attn_dp: int
    moe_ep: int

    @property
    def group(self) -> str:
        return f"{self.model.split('/')[-1]} {self.precision} {self.system} TP{self.tp}"


def csv_path() -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).parent / "systems" / "silicon_sample.csv"


def load_rows() -> list[Row]:
    import pandas as pd

    df = pd.read_csv(csv_path())
    df = df[(df.backend == "sglang") & (df["mode"] == "agg")]

    def opt(v) -> str | None:
        return None if (isinstance(v, float) and math.isnan(v)) else str(v)

    return [Row(r.id, r.model_path, r.system, opt(r.precision) or "bf16",
                str(r.backend_version), int(r.tp_size), int(r.isl), int(r.osl),
                int(r.batch_size), float(r.silicon_ttft_ms), float(r.silicon_tpot_ms),
                opt(r.gemm_quant_mode), opt(r.moe_quant_mode),
                int(_num(r.attention_dp_size)), int(_num(r.moe_ep_size)))
            for r in df.itertuples()]


def _num(v) -> float:
    return 1.0 if isinstance(v, float) and math.isnan(v) else float(v)


def server_args(row: Row, extra: dict) -> ServerArgs:
    quant = "fp8" if row.precision == "fp8" else None
    model = MODEL_ALIASES.get(row.model, row.model)
    return ServerArgs(model_path=model, tp_size=row.tp, quantization=quant, **extra)


def step_time(row: Row, extra: dict, cache: dict):
    """The row's `opdb` step time (cached per group), or why the twin cannot run it."""
    args, gpu = server_args(row, extra), GPUS.get(row.system)
    if gpu is None:
        return f"no GPU entry for {row.system}"
    if row.attn_dp > 1 or row.moe_ep > 1:
        return "attention DP / expert parallelism: not modelled by the twin"
    key = (args, gpu)
    if key not in cache:
        try:
            cap = derive_capacity(args, gpu)
            if default_backend(cap) != "opdb":
                cache[key] = "no measured per-op data for this model (roofline only)"
            else:
                cache[key] = make_step_time("opdb", cap, args)
        except (ConfigError, InfeasibleError) as exc:
            cache[key] = str(exc).splitlines()[0][:100]
    return cache[key]


def twin_point(row: Row, extra: dict, waves: int, st, clients: str) -> tuple[float, float]:
    if clients == UNIFORM:
        return uniform_point(row, extra, waves, st)
    spec = SPEC.format(c=row.conc, n=waves * row.conc, isl=row.isl, osl=row.osl,
                       clients=clients)
    return _means(_run(from_spec(spec, seed=0), row, extra, st))


def _run(workload: Workload, row: Row, extra: dict, st) -> list[dict]:
    res = simulate(workload, SimConfig(args=server_args(row, extra), gpu=GPUS[row.system]),
                   step_time=st)
    return [r for r in res.records if r["status"] == "ok"]


def _means(ok: list[dict]) -> tuple[float, float]:
    return (statistics.fmean(r["ttft_s"] for r in ok) * 1e3,
            statistics.fmean(r["tpot_s"] for r in ok if r["tpot_s"] is not None) * 1e3)


def uniform_point(row: Row, extra: dict, waves: int, st) -> tuple[float, float]:
    """The closed loop de-synchronised (a diagnostic bound, not what bench_serving sends):
    the C clients' first requests are sent evenly over one request's latency in the
    lock-step loop (a one-wave burst run of the same row), so their phases are uniform;
    with fixed lengths SGLang's loop keeps phases (only a prefill backlog merges them),
    so the loop stays de-synchronised. Means over the requests from the third wave on."""
    c = row.conc
    burst = _run(_closed(row, 1, 0.0), row, extra, st)
    span = statistics.fmean(r["e2e_s"] for r in burst)
    ok = _run(_closed(row, max(waves, 4), span), row, extra, st)
    return _means([r for r in ok if int(r["rid"][1:]) >= 2 * c])


def _closed(row: Row, waves: int, span: float) -> Workload:
    """waves x C fixed-length requests, unique prompts; the first C sent `span` / C
    apart (0: together), each next one when a client's last request ends."""
    c = row.conc
    reqs = tuple(Request.make(f"r{i}", i * span / c if i < c else 0.0, [(i + 1, row.isl)],
                              row.osl) for i in range(waves * c))
    return Workload(f"closed-{c}", reqs, concurrency=c)


class Aic:
    """AIConfigurator's agg estimate, as `cli estimate --mode agg` computes it."""

    def __init__(self) -> None:
        self._dbs: dict = {}
        self._models: dict = {}

    def point(self, row: Row) -> tuple[float, float]:
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.config import RuntimeConfig

        db, model = self._db(row.system), self._model(row)
        rc = RuntimeConfig(isl=row.isl, osl=row.osl, batch_size=row.conc)
        out = get_backend("sglang").run_agg(model, db, rc, ctx_tokens=row.isl)
        d = out.get_result_dict()
        return float(d["ttft"]), float(d["tpot"])

    def _db(self, system: str):
        from aiconfigurator_core.sdk.perf_database import get_database, get_latest_database_version

        if system not in self._dbs:
            ver = get_latest_database_version(system=system, backend="sglang")
            self._dbs[system] = get_database(system, "sglang", ver)
        return self._dbs[system]

    def _model(self, row: Row):
        from aiconfigurator_core.sdk import common
        from aiconfigurator_core.sdk.config import ModelConfig
        from aiconfigurator_core.sdk.models import get_model

        key = (row.model, row.tp, row.gemm_quant, row.moe_quant)
        if key not in self._models:
            kw = {}
            if row.gemm_quant:
                kw["gemm_quant_mode"] = common.GEMMQuantMode[row.gemm_quant]
            if row.moe_quant:
                kw["moe_quant_mode"] = common.MoEQuantMode[row.moe_quant]
            cfg = ModelConfig(tp_size=row.tp, moe_tp_size=row.tp, moe_ep_size=1, **kw)
            name = MODEL_ALIASES.get(row.model, row.model)
            self._models[key] = get_model(aic_model_id(name) or name, cfg, "sglang")
        return self._models[key]


def aic_point(aic: Aic | None, row: Row) -> tuple[float | None, float | None]:
    if aic is None:
        return None, None
    try:
        return aic.point(row)
    except Exception as exc:  # noqa: BLE001 - a gap in its data skips its column only
        print(f"\nAIConfigurator failed on {row.rid}: {str(exc)[:120]}", file=sys.stderr)
        return None, None


def err(pred: float | None, meas: float) -> float | None:
    return None if pred is None else (pred - meas) / meas


def mae(xs: list[float | None]) -> str:
    vals = [abs(x) for x in xs if x is not None]
    return f"{100 * statistics.fmean(vals):.1f}%" if vals else "-"


def bias(xs: list[float | None]) -> str:
    vals = [x for x in xs if x is not None]
    return f"{100 * statistics.fmean(vals):+.1f}%" if vals else "-"


def table(results: list[dict], clients: list[str]) -> str:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["group"], []).append(r)
    head = "".join(f"| twin ({c}) TTFT MAE (bias) | twin ({c}) TPOT MAE (bias) " for c in clients)
    lines = [f"| group (SGLang measured) | rows {head}| AIC TTFT MAE | AIC TPOT MAE |",
             "| --- | ---: " + "| ---: " * (2 * len(clients)) + "| ---: | ---: |"]
    for name, rs in [*groups.items(), ("**all rows**", results)]:
        ver = "" if name.startswith("**") else f" ({rs[0]['sglang']})"
        cells = ""
        for c in clients:
            e_t, e_p = [r[f"e_ttft_{c}"] for r in rs], [r[f"e_tpot_{c}"] for r in rs]
            cells += f"| {mae(e_t)} ({bias(e_t)}) | {mae(e_p)} ({bias(e_p)}) "
        a_t, a_p = [r["a_ttft"] for r in rs], [r["a_tpot"] for r in rs]
        lines.append(f"| {name}{ver} | {len(rs)} {cells}| {mae(a_t)} | {mae(a_p)} |")
    return "\n".join(lines)


def row_table(results: list[dict]) -> str:
    lines = ["| row | ISL/OSL | C | TTFT meas / twin / AIC (ms) | TPOT meas / twin / AIC (ms) |",
             "| --- | --- | ---: | --- | --- |"]
    for r in results:
        a_t = "-" if r["aic_ttft"] is None else f"{r['aic_ttft']:.0f}"
        a_p = "-" if r["aic_tpot"] is None else f"{r['aic_tpot']:.1f}"
        lines.append(f"| {r['group']} | {r['isl']}/{r['osl']} | {r['conc']} "
                     f"| {r['ttft_ms']:.0f} / {r['twin_ttft']:.0f} / {a_t} "
                     f"| {r['tpot_ms']:.1f} / {r['twin_tpot']:.1f} / {a_p} |")
    return "\n".join(lines)


def parse_server(items: list[str]) -> dict:
    """`key=value` server arguments; values are read as JSON (1, 0.5, true), else strings."""
    out: dict = {}
    for item in items:
        k, _, v = item.partition("=")
        k = k.replace("-", "_")
        if k not in ServerArgs.field_names():
            raise SystemExit(f"--server {item}: not a server argument")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", nargs="*", default=[],
                    help="only groups whose name contains one of these (e.g. 'TP1', 'h200')")
    ap.add_argument("--limit", type=int, default=None, help="at most N rows per group")
    ap.add_argument("--waves", type=int, default=4, help="requests per client (n = waves x C)")
    ap.add_argument("--rows", action="store_true", help="print every row, not only groups")
    ap.add_argument("--no-aic", action="store_true", help="skip AIConfigurator's estimate")
    ap.add_argument("--json", type=Path, default=None, help="write per-row results here")
    ap.add_argument("--server", nargs="*", default=[], metavar="KEY=VALUE",
                    help="server arguments for every row (e.g. disable_overlap_schedule=1)")
    ap.add_argument("--clients", default="bench",
                    help="whose closed-loop clients the twin models, ','-separated: bench "
                         "(bench_serving's, as the rows were measured; default), replay "
                         "(servetwin's replay client), uniform (a diagnostic bound: the "
                         "clients' phases spread evenly over one request's latency, the "
                         "loop de-synchronised; means from the third wave on); several "
                         "are shown side by side")
    a = ap.parse_args()
    clients = [c.strip() for c in a.clients.split(",") if c.strip()]
    bad = [c for c in clients if c not in (*CLIENTS, UNIFORM)]
    if bad or not clients:
        raise SystemExit(f"--clients {a.clients}: allowed values: "
                         f"{', '.join((*CLIENTS, UNIFORM))}")
    logging.disable(logging.WARNING)  # aiconfigurator's gap-filling notices
    extra = parse_server(a.server)
    rows = [r for r in load_rows() if not a.groups or any(g in r.group for g in a.groups)]
    skipped: dict[str, tuple[int, str]] = {}
    per_group: dict[str, int] = {}
    aic = None if a.no_aic else Aic()
    st_cache: dict = {}
    results, t0 = [], time.perf_counter()
    for r in rows:
        st = step_time(r, extra, st_cache)
        if isinstance(st, str):
            n, _ = skipped.get(r.group, (0, st))
            skipped[r.group] = (n + 1, st)
            continue
        per_group[r.group] = per_group.get(r.group, 0) + 1
        if a.limit is not None and per_group[r.group] > a.limit:
            continue
        twin = {}
        for c in clients:
            tt, tp = twin_point(r, extra, a.waves, st, c)
            twin.update({f"twin_ttft_{c}": tt, f"twin_tpot_{c}": tp,
                         f"e_ttft_{c}": err(tt, r.ttft_ms), f"e_tpot_{c}": err(tp, r.tpot_ms)})
        at, ap_ = aic_point(aic, r)
        first = clients[0]
        results.append({**r.__dict__, "group": r.group, **twin,
                        "twin_ttft": twin[f"twin_ttft_{first}"],
                        "twin_tpot": twin[f"twin_tpot_{first}"],
                        "aic_ttft": at, "aic_tpot": ap_, "a_ttft": err(at, r.ttft_ms),
                        "a_tpot": err(ap_, r.tpot_ms)})
        print(f"\r{len(results)} rows, {time.perf_counter() - t0:.0f} s", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"Measured {stamp} on {platform.node()}: {platform.machine()}, "
          f"{platform.processor() or 'cpu'}, Python {platform.python_version()}; "
          f"{len(results)} rows in {time.perf_counter() - t0:.0f} s.")
    spec = SPEC.format(c='C', n=f'{a.waves}xC', isl='ISL', osl='OSL', clients=a.clients)
    print(f"Workload per row: `{spec}`"
          f" (seed 0), SGLang's default server arguments"
          + (f" with {', '.join(a.server)}" if a.server else "") + ", step times `opdb`.")
    print(f"Data: {csv_path().name} (aiconfigurator-core), SGLang aggregated rows.\n")
    print(table(results, clients))
    if a.rows:
        print("\n" + row_table(results))
    reasons: dict[str, list] = {}
    for g, (n, why) in skipped.items():
        reasons.setdefault(why, []).append((g, n))
    for why, gs in reasons.items():
        print(f"- skipped {sum(n for _, n in gs)} rows in {len(gs)} groups ({why}): "
              + ", ".join(g for g, _ in gs[:4]) + (", ..." if len(gs) > 4 else ""))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
