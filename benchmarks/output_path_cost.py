"""SGLang 0.5.23's output path (scheduler -> detokenizer -> tokenizer manager -> HTTP stream)
at large batches: its CPU cost per request per step, whether it coalesces steps, and how
late the client sees each token against the scheduler step that made it.

    python benchmarks/output_path_cost.py [--batches 16 64 128 256 512] [--prompt 16]
                                          [--output 64] [--spin-us 8000]
                                          [--spin-batches 8 16] [--json OUT]
    python benchmarks/output_path_cost.py --serving-points [--groups Llama] [--rows]
                                          [--cost OUT]

The second form starts no server: it runs benchmarks/serving_points.py's rows in the twin
and prints their errors without and with `twin.request_path.OutputPath` applied to the
records (`through_output_path`, its costs from `--cost` or the measured default).

What SGLang does (managers/tokenizer_manager.py, detokenizer_manager.py,
entrypoints/http_server.py): the scheduler sends one `BatchTokenIDOutput` per step (every
request whose `stream_interval` is due: 1 by default, so all of them); the detokenizer
decodes it and sends one `BatchStrOutput`; the tokenizer manager's `handle_loop` takes one
message at a time and `_handle_batch_output` walks it request by request (meta info, the
request's `out_list.append`, and every `batch_notify_size` = 16 requests it sets their
events and yields with `asyncio.sleep(0)`); each woken request's `_wait_one_response`
drains its whole `out_list` (coalescing when more than one step queued) and the HTTP
handler writes one SSE chunk. One asyncio thread does all of it, so the tokenizer manager
is a single server; whether its handlers coalesce depends on whether they run between
messages, which is what this measures.

Per batch size B, on one live CPU-harness server (runtime.cpu.serve.CpuServer, a probe
loaded as a plugin through SGLang's `sglang.srt.plugins` entry points: the scheduler's
steps from servetwin's step probe (runtime/plugin/step_probe.py), and here the tokenizer manager's
`_handle_batch_output` per message): B streamed requests at once (fixed lengths,
`ignore_eos`), each chunk's arrival and token count taken by the client. Printed per B:
the tokenizer manager's process CPU per full-batch decode step (/proc), the part of it in
`_handle_batch_output`, the detokenizer's per message, tokens per chunk, and the lag from
the step's end (the scheduler's clock, the same host) to the client's chunk. `--spin-us`
then repeats the smallest batch with the probe spinning that long per request inside
`_handle_batch_output` (`--spin-batches` other sizes: a slower tokenizer manager than the
step: does it coalesce, and how late is the last chunk; the twin's `OutputPath` over the
run's own steps beside it). The fit is `a + b x B` per step. Workload, machine, date.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_cpu_cost import CpuSampler  # noqa: E402

from calibration.profiles import machine  # noqa: E402
from calibration.step_cpu import fit, read_probe  # noqa: E402

PROBE = "servetwin_output_probe"
# The tokenizer manager's side: `_handle_batch_output` per message (wall start/end, the
# thread's CPU), with an optional busy spin per request read from `<out>.spin` (microseconds).
PROBE_SRC = '''
import json, os, time
_OUT = os.environ.get("SERVETWIN_OUTPUT_PROBE", "")
_st = {"fh": None, "spin": 0.0, "seen": 0.0}

def _fh():
    if _st["fh"] is None:
        _st["fh"] = open(f"{_OUT}.{os.getpid()}", "a", buffering=1)
    return _st["fh"]

def _spin_us():
    now = time.time()
    if now - _st["seen"] > 0.2:
        _st["seen"] = now
        try:
            with open(_OUT + ".spin") as fh:
                _st["spin"] = float(fh.read() or 0)
        except (OSError, ValueError):
            _st["spin"] = 0.0
    return _st["spin"]

def _tm(original, self, recv_obj, *args, **kwargs):
    async def run():
        n = len(getattr(recv_obj, "rids", ()) or ())
        w0, c0 = time.time(), time.thread_time_ns()
        spin = _spin_us() * n / 1e6
        end = time.perf_counter() + spin
        while spin and time.perf_counter() < end:
            pass
        try:
            return await original(self, recv_obj, *args, **kwargs)
        finally:
            _fh().write(json.dumps({"mode": "tm", "bs": n, "t0": w0, "t1": time.time(),
                                    "cpu": time.thread_time_ns() - c0}) + "\\n")
    return run()

def load():
    if not _OUT:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
        _tm, HookType.AROUND)
'''


def write_probes(where: Path) -> Path:
    """This probe as a plugin of its own on the server's PYTHONPATH (the step probe is
    servetwin's plugin's, switched on by SERVETWIN_STEP_PROBE: runtime/plugin/step_probe.py)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{PROBE}.py").write_text(PROBE_SRC)
    info = where / f"{PROBE}-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PROBE} = {PROBE}:load\n")
    return where


async def _one(session, url: str, ids: list[int], output: int, out: list) -> None:
    from runtime.client import stream_generate

    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output, "ignore_eos": True,
                                "temperature": 0.0}}
    async for now, chunk in stream_generate(session, url, json=body):
        out.append((now, int(chunk["meta_info"]["completion_tokens"])))


async def burst(url: str, b: int, prompt: int, output: int, tag: int,
                vocab: int) -> list[list]:
    """B streamed requests at once: per request its chunks, (time.time(), tokens so far)."""
    import aiohttp

    offset = time.time() - time.perf_counter()
    chunks: list[list] = [[] for _ in range(b)]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, read_bufsize=1 << 22,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        prompts = [[(tag * 7919 + i * 131 + j * 17) % (vocab - 100) + 50 for j in range(prompt)]
                   for i in range(b)]  # unique prompts: no radix-cache hits
        await asyncio.gather(*(_one(session, url, p, output, c)
                               for p, c in zip(prompts, chunks, strict=True)))
    for c in chunks:
        if not c or c[-1][1] != output:
            raise RuntimeError(f"batch {b}: a request ended with {c[-1][1] if c else 0} of "
                               f"{output} tokens")
    return [[(t + offset, k) for t, k in c] for c in chunks]


def lags(chunks: list[list], steps: list[dict]) -> dict:
    """Each chunk's lag after the decode step that produced its newest token (token k >= 2
    of a lock-step burst comes from the run's decode step k - 1), and tokens per chunk."""
    dec = [s for s in steps if s["mode"] == "decode"]
    per_chunk = [len(c) for c in chunks]
    tokens = chunks[0][-1][1]
    out = {"tokens_per_chunk": tokens * len(chunks) / sum(per_chunk),
           "max_tokens_in_chunk": max(c[i][1] - (c[i - 1][1] if i else 0)
                                      for c in chunks for i in range(len(c)))}
    if len(dec) != tokens - 1:  # not lock-step (a straggler): only the final chunk's lag
        out.update(lag_p50_s=None, lag_p99_s=None, lag_first_s=None)
        out["final_lag_s"] = statistics.median(c[-1][0] for c in chunks) - dec[-1]["t"]
        return out
    ends = [s["t"] for s in dec]
    all_lags = [t - ends[k - 2] for c in chunks for t, k in c if k >= 2]
    out["lag_p50_s"] = float(np.percentile(all_lags, 50))
    out["lag_p99_s"] = float(np.percentile(all_lags, 99))
    out["lag_first_s"] = statistics.median(t - ends[k - 2] for c in chunks
                                           for t, k in c[1:2] if k >= 2)
    out["final_lag_s"] = statistics.median(c[-1][0] - ends[-1] for c in chunks)
    return out


def one_point(server, b: int, prompt: int, output: int, tag: int, out: Path, seen: dict,
              vocab: int, spin_us: float = 0.0) -> dict:
    (out.parent / (out.name + ".spin")).write_text(str(spin_us))
    time.sleep(0.3)  # the probe re-reads the spin file every 0.2 s
    read_probe(out, seen)
    cpu0 = time.process_time()
    with CpuSampler(server.pid) as sampler:
        chunks = asyncio.run(burst(server.url, b, prompt, output, tag, vocab))
    client_cpu = time.process_time() - cpu0  # this client's own, beside the server's
    rows = read_probe(out, seen)
    steps = [r for r in rows if r["mode"] in ("decode", "extend") and "t" in r]
    full = [r for r in steps if r["mode"] == "decode" and r["bs"] >= b - b // 50]
    tm = [r for r in rows if r["mode"] == "tm" and r["bs"] >= b - b // 50]
    detok = [r for r in rows if r["mode"] == "detok" and r["bs"] >= b - b // 50]
    p = {"batch": b, "spin_us": spin_us, "steps": len(full),
         "step_wall_s": statistics.median(np.diff([r["t"] for r in full])) if len(full) > 2
         else None,
         "tokenizer_s": sampler.per_step(full),
         "handle_cpu_s": statistics.median(r["cpu"] / 1e9 for r in tm) if tm else None,
         "handle_wall_s": statistics.median(r["t1"] - r["t0"] for r in tm) if tm else None,
         "messages": len(tm),
         "detok_s": statistics.median(r["detok"][1] / 1e9 for r in detok) if detok else None,
         "client_s": client_cpu / max(len(steps), 1)}
    p.update(lags(chunks, steps))
    p.update(predicted(steps, spin_us))
    return p


def predicted(steps: list[dict], spin_us: float, path=None) -> dict:
    """The twin's output path (twin.request_path.OutputPath, its default costs plus the
    spin per request) over the run's own scheduler steps (their ends and sizes): the
    final chunk's lag and the median decode token's lag it predicts."""
    from dataclasses import replace

    from twin.request_path import SGLANG_0_5_23_OUT

    path = replace(path or SGLANG_0_5_23_OUT, tm_per_request_s=(
        path or SGLANG_0_5_23_OUT).tm_per_request_s + spin_us * 1e-6)
    steps = sorted(steps, key=lambda r: r["t"])
    seen, _ = path.visible([r["t"] for r in steps], [r["bs"] for r in steps])
    dec = [(v - r["t"]) for v, r in zip(seen, steps, strict=True) if r["mode"] == "decode"]
    return {"model_final_lag_s": dec[-1] if dec else None,
            "model_lag_p50_s": float(np.median(dec)) if dec else None}


def measure(batches: list[int], prompt: int, output: int, spin_us: float,
            progress=print, spin_batches: list[int] | None = None) -> list[dict]:
    from runtime.cpu.install import ensure_plugin, require_harness
    from runtime.cpu.serve import CpuServer
    from runtime.server_api import probe

    ensure_plugin(require_harness(), log=lambda line: None)  # the step probe is servetwin's
    top = max(batches)
    args = ["--max-running-requests", str(top),
            "--max-total-tokens", str(max(16384, 2 * top * (prompt + output)))]
    points = []
    with tempfile.TemporaryDirectory(prefix="output-probe-") as tmp:
        probe_dir = write_probes(Path(tmp) / "probe")
        out = Path(tmp) / "steps.jsonl"
        env = {"PYTHONPATH": str(probe_dir), "SERVETWIN_STEP_PROBE": str(out),
               "SERVETWIN_OUTPUT_PROBE": str(out)}
        with CpuServer(args, env=env) as server:
            progress(f"server ready in {server.start_seconds:.0f} s")
            vocab = probe(server.url).vocab_size
            seen: dict[str, int] = {}
            spun = spin_batches or [min(batches)]
            runs = [(b, 0.0) for b in batches] + ([(b, spin_us) for b in spun] if spin_us else [])
            for i, (b, spin) in enumerate(runs):
                p = one_point(server, b, prompt, output, i, out, seen, vocab, spin)
                if not p["messages"]:
                    raise RuntimeError(f"the tokenizer manager's probe wrote nothing "
                                       f"({server.log_path})")
                progress(f"  batch {b:4d} spin {spin:g} us: {p['steps']} steps of "
                         f"{_ms(p['step_wall_s'])}, tokenizer manager {_ms(p['tokenizer_s'])}"
                         f"/step, {p['tokens_per_chunk']:.2f} tokens/chunk, final lag "
                         f"{_ms(p['final_lag_s'])}")
                points.append(p)
    return points


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.3f} ms"


def report(points: list[dict], workload: str, load: tuple[float, float]) -> list[str]:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"Measured {stamp} on {machine()}; SGLang 0.5.23 CPU harness "
             f"(--disable-overlap-schedule); load average {load[0]:.1f} -> {load[1]:.1f}.",
             f"Workload per batch size B: {workload}; decode steps that ran all B (within "
             "2 %); lags from the scheduler's step end to the client's chunk.", "",
             "| batch | spin/request | steps | decode step (wall) | tokenizer manager CPU/step | "
             "_handle_batch_output CPU (wall) | detokenizer/message | client CPU/step | "
             "tokens/chunk (max) | "
             "lag p50 (twin) | lag p99 | first-decode-token lag | final-chunk lag (twin) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for p in points:
        lines.append(
            f"| {p['batch']} | {p['spin_us']:g} us | {p['steps']} | {_ms(p['step_wall_s'])} | "
            f"{_ms(p['tokenizer_s'])} | {_ms(p['handle_cpu_s'])} ({_ms(p['handle_wall_s'])}) | "
            f"{_ms(p['detok_s'])} | {_ms(p['client_s'])} | "
            f"{p['tokens_per_chunk']:.2f} ({p['max_tokens_in_chunk']}) | "
            f"{_ms(p['lag_p50_s'])} ({_ms(p['model_lag_p50_s'])}) | {_ms(p['lag_p99_s'])} | "
            f"{_ms(p['lag_first_s'])} | {_ms(p['final_lag_s'])} ({_ms(p['model_final_lag_s'])}) |")
    base = [p for p in points if not p["spin_us"] and p["tokenizer_s"] is not None]
    lines.append("")
    for key, name in (("tokenizer_s", "tokenizer manager per step"),
                      ("handle_cpu_s", "_handle_batch_output per message"),
                      ("detok_s", "detokenizer per message")):
        pts = [p for p in base if p.get(key) is not None]
        if len(pts) >= 2:
            a, b, res = fit(pts, key)
            lines.append(f"fit {name}: {a * 1e3:.3f} ms + {b * 1e6:.2f} us x batch "
                         f"(max |residual| {res * 1e3:.3f} ms)")
    return lines


def sp_spec() -> str:
    import serving_points as sp

    return sp.SPEC.format(c="C", n="4xC", isl="ISL", osl="OSL", clients="bench")


def path_from(cost: Path | None):
    """The output path's costs: this benchmark's `--json` fits, or the twin's default."""
    from twin.request_path import SGLANG_0_5_23_OUT, OutputPath

    if cost is None:
        return SGLANG_0_5_23_OUT
    pts = [p for p in json.loads(cost.read_text())["points"]
           if not p["spin_us"] and p["tokenizer_s"] is not None]
    ta, tb, _ = fit(pts, "tokenizer_s")
    da, db, _ = fit(pts, "detok_s")
    return OutputPath(max(da, 0.0), db, max(ta, 0.0), tb)


def serving_points(groups: list[str], path, show_rows: bool) -> list[str]:
    """Every serving-points row (benchmarks/serving_points.py: bench_serving's closed loop,
    `opdb`) in the twin as it is, and its records passed through `path`
    (twin.request_path.through_output_path): mean TTFT and TPOT error per group."""
    import serving_points as sp

    from twin.request_path import through_output_path

    rows = [r for r in sp.load_rows() if not groups or any(g in r.group for g in groups)]
    cache: dict = {}
    res: list[dict] = []
    t0 = time.perf_counter()
    for r in rows:
        st = sp.step_time(r, {}, cache)
        if isinstance(st, str):
            continue
        spec = sp.SPEC.format(c=r.conc, n=4 * r.conc, isl=r.isl, osl=r.osl, clients="bench")
        recs = sp.simulate(sp.from_spec(spec, seed=0),
                           sp.SimConfig(args=sp.server_args(r, {}), gpu=sp.GPUS[r.system]),
                           step_time=st).records
        recs = list(recs)
        late, util = through_output_path(recs, path)
        pts = {}
        for name, rs in (("before", recs), ("after", late)):
            tt, tp = sp._means([x for x in rs if x["status"] == "ok"])
            pts[name] = (tt, tp, sp.err(tt, r.ttft_ms), sp.err(tp, r.tpot_ms))
        res.append({"row": r, "util": util, **pts})
        print(f"\r{len(res)} rows, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    by: dict[str, list[dict]] = {}
    for x in res:
        by.setdefault(x["row"].group, []).append(x)
    lines = ["| group (SGLang measured) | rows | TTFT MAE (bias) without | with | TPOT MAE "
             "(bias) without | with | tokenizer manager utilisation (max) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, xs in [*by.items(), ("**all rows**", res)]:
        cells = []
        for k in (2, 3):
            for when in ("before", "after"):
                e = [x[when][k] for x in xs]
                cells.append(f"{sp.mae(e)} ({sp.bias(e)})")
        u = [x["util"] for x in xs]
        lines.append(f"| {name} | {len(xs)} | {cells[0]} | {cells[1]} | {cells[2]} | "
                     f"{cells[3]} | {statistics.fmean(u):.2f} ({max(u):.2f}) |")
    if show_rows:
        lines += ["", "| row | ISL/OSL | C | TTFT meas / without / with (ms) | TPOT meas / "
                  "without / with (ms) | utilisation |", "| --- | --- | ---: | --- | --- | ---: |"]
        for x in res:
            r, b, a = x["row"], x["before"], x["after"]
            lines.append(f"| {r.group} | {r.isl}/{r.osl} | {r.conc} | {r.ttft_ms:.0f} / "
                         f"{b[0]:.0f} / {a[0]:.0f} | {r.tpot_ms:.1f} / {b[1]:.1f} / "
                         f"{a[1]:.1f} | {x['util']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="SGLang's output path at large batches on the CPU harness: the tokenizer "
                    "manager's CPU per request per step, coalescing, and the client's lag "
                    "behind the scheduler's steps; fitted a + b x batch.")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256, 512],
                    help="batch sizes, one burst each (default: 16 64 128 256 512)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--output", type=int, default=64, help="output tokens (default 64)")
    ap.add_argument("--spin-us", type=float, default=4000.0,
                    help="then the smallest batch again with the tokenizer manager spinning "
                         "this long per request per message (0: skip; default 4000)")
    ap.add_argument("--spin-batches", type=int, nargs="+", default=None,
                    help="the batch sizes run again with --spin-us (default: the smallest)")
    ap.add_argument("--json", type=Path, help="write the points and the report here")
    ap.add_argument("--serving-points", action="store_true",
                    help="no server: run benchmarks/serving_points.py's rows in the twin and "
                         "print their errors without and with the output path (its costs "
                         "from --cost, else twin.request_path.SGLANG_0_5_23_OUT)")
    ap.add_argument("--cost", type=Path, help="with --serving-points: a --json of this script")
    ap.add_argument("--groups", nargs="*", default=[],
                    help="with --serving-points: only groups containing one of these")
    ap.add_argument("--rows", action="store_true", help="with --serving-points: every row")
    a = ap.parse_args(argv)
    if a.serving_points:
        path = path_from(a.cost)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"Measured {stamp} on {machine()}; the output path {path}; workload per row: "
              f"{sp_spec()} (seed 0), SGLang's default server arguments, step times opdb.")
        print("\n".join(serving_points(a.groups, path, a.rows)))
        return 0
    if min(a.batches) < 1 or a.prompt < 1 or a.output < 4 or a.spin_us < 0:
        ap.error("--batches must be >= 1, --prompt >= 1, --output >= 4, --spin-us >= 0")
    batches = sorted(set(a.batches))
    workload = (f"B streamed /generate requests at once, input_ids of {a.prompt} tokens, "
                f"{a.output} output tokens, ignore_eos, temperature 0")
    print(f"workload: {workload}; batches {batches}", flush=True)
    load0 = os.getloadavg()[0]
    points = measure(batches, a.prompt, a.output, a.spin_us,
                     progress=lambda s: print(s, flush=True), spin_batches=a.spin_batches)
    lines = report(points, workload, (load0, os.getloadavg()[0]))
    print("\n".join(lines))
    if a.json:
        a.json.write_text(json.dumps({"points": points, "report": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
