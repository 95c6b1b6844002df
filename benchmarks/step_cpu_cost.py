"""SGLang 0.5.23's CPU work per decode step, excluding the model's forward, against the
batch size, measured inside a live CPU-harness server.

    python benchmarks/step_cpu_cost.py [--batches 1 8 32 64 128 256 512] [--prompt 32]
                                       [--output 48] [--rounds 1] [--json OUT]

The scheduler's loop (`event_loop_normal`: the harness runs `--disable-overlap-schedule`)
is timed from inside the server by servetwin's step probe (runtime/plugin/step_probe.py,
loaded through SGLang's own plugin entry point with `SERVETWIN_STEP_PROBE`; the sweep and
the fit are `servetwin live step-cpu`'s, calibration/step_cpu.py): per iteration, `ingest_requests`, `get_next_batch_to_run` (filtering the
batch, memory checks, `prepare_for_decode`), `run_batch` and `process_batch_result`
(`process_batch_result_decode`: the per-request loop, `stream_output` to the
detokenizer), each in wall time and in the scheduler thread's CPU time; inside
`run_batch`, the model's own compute (`ModelRunner.forward`, `ModelRunner.sample`) is
timed too and taken out. What is left is the CPU work a GPU host's scheduler does per
step whatever the GPU; under SGLang's overlap loop a step lasts max(GPU, that CPU work).

For each batch size B, B streamed requests with fixed lengths (`ignore_eos`) are sent at
once; the decode steps that ran all B are kept, and their median per-step CPU time is one
point (`--rounds R` sweeps the sizes R times on the one server and pools the steps). The
points are fitted as `a + b x B` (least squares) and printed with the raw points, the
machine, the load and the date. Beside them, the two other processes a token passes on
its way out, which run on their own cores on a GPU host: the detokenizer (its
`handle_batch_token_id_out` per batch, timed by the probe) and the tokenizer manager
(the server's main process, which runs the HTTP server and writes every stream: its CPU
time from /proc, sampled every 20 ms, between the first and the last full-batch decode
step, per step, so the requests' arrival and finish are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.profiles import machine  # noqa: E402
from calibration.step_cpu import fit, full_batch, sweep  # noqa: E402


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """A process's CPU seconds sampled on the wall clock every `every_s` (a thread)."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), process_cpu_s(self.pid)))
            self._stop.wait(self.every_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def per_step(self, steps: list[dict]) -> float | None:
        """CPU seconds per step between the first and the last of `steps` (probe rows with
        their end time `t`): the steady decode, without the requests' arrival and finish."""
        if len(steps) < 3 or len(self.samples) < 2:
            return None
        t, c = np.array(self.samples).T
        t0, t1 = steps[0]["t"], steps[-1]["t"]
        return float(np.interp(t1, t, c) - np.interp(t0, t, c)) / (len(steps) - 1)


def measure(batches: list[int], prompt: int, output: int, rounds: int = 1,
            progress=print) -> list[dict]:
    """One point per batch size from one live server (runtime.cpu.serve.CpuServer with the
    step probe), the sizes swept `rounds` times (`calibration.step_cpu.sweep`), plus the
    tokenizer manager's CPU per full-batch decode step (the server's main process: it runs
    the HTTP server too; sampled from /proc beside the sweep)."""
    from runtime.cpu.install import ensure_plugin, require_harness
    from runtime.cpu.serve import CpuServer
    from runtime.plugin.env import step_probe_env

    ensure_plugin(require_harness(), log=lambda line: None)
    top = max(batches)
    args = ["--max-running-requests", str(top),
            "--max-total-tokens", str(max(16384, 2 * top * (prompt + output)))]
    tok: dict[int, list[float]] = {b: [] for b in batches}
    with tempfile.TemporaryDirectory(prefix="step-probe-") as tmp:
        prefix = Path(tmp) / "steps.jsonl"
        with CpuServer(args, env=step_probe_env(prefix)) as server:
            progress(f"server ready in {server.start_seconds:.0f} s (probe {prefix}.<pid>)")
            with CpuSampler(server.pid) as sampler:
                def on_run(b, rows, _res):
                    per_step = sampler.per_step(full_batch(rows, b))
                    if per_step is not None:
                        tok[b].append(per_step)
                points = sweep(server.url, prefix, batches, prompt, output, rounds,
                               progress=progress, on_run=on_run)
    for p, b in zip(points, batches, strict=True):
        p["tokenizer_s"] = statistics.median(tok[b]) if tok[b] else None
    return points


def report(points: list[dict], workload: str, load: tuple[float, float]) -> list[str]:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"Measured {stamp} on {machine()}; SGLang 0.5.23 CPU harness "
             f"(--disable-overlap-schedule, 1 torch thread); load average "
             f"{load[0]:.1f} -> {load[1]:.1f}.",
             f"Workload per batch size B: {workload}; decode steps that ran all B "
             "requests (within 2 %); the batch column is their median size.",
             "",
             "| batch | steps | CPU/step (thread) | wall | ingest | schedule | run_batch "
             "less compute | process result | model compute | detokenizer/step | "
             "tokenizer manager/step |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.3f} ms"  # noqa: E731
    for p in points:
        lines.append(f"| {p['batch']:g} | {p['steps']} | {ms(p['cpu_s'])} | {ms(p['wall_s'])} | "
                     f"{ms(p['ingest_s'])} | {ms(p['sched_s'])} | {ms(p['run_s'])} | "
                     f"{ms(p['proc_s'])} | {ms(p['compute_s'])} | {ms(p['detok_s'])} | "
                     f"{ms(p.get('tokenizer_s'))} |")
    a, b, res = fit(points)
    aw, bw, resw = fit(points, "wall_s")
    lines += ["",
              f"fit (thread CPU time): per step {a * 1e3:.3f} ms + {b * 1e6:.2f} us x batch "
              f"(max |residual| {res * 1e3:.3f} ms)",
              f"fit (wall time):       per step {aw * 1e3:.3f} ms + {bw * 1e6:.2f} us x batch "
              f"(max |residual| {resw * 1e3:.3f} ms)"]
    for name in ("sched", "run", "proc", "detok", "tokenizer"):
        if any(p.get(f"{name}_s") is None for p in points):
            continue
        an, bn, _ = fit(points, f"{name}_s")
        lines.append(f"  {name:5s}: {an * 1e3:.3f} ms + {bn * 1e6:.2f} us x batch")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="SGLang's per-decode-step CPU cost (excluding the forward) against the "
                    "batch size, measured on the CPU harness; fitted as a + b x batch.")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512],
                    help="batch sizes, one point each (default: 1 8 32 64 128 256 512)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--output", type=int, default=48, help="output tokens (default 48)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sweeps of the batch sizes on the one server (default 1)")
    ap.add_argument("--json", type=Path, help="write the points and the fit here")
    a = ap.parse_args(argv)
    if min(a.batches) < 1 or a.prompt < 1 or a.output < 4 or a.rounds < 1:
        ap.error("--batches must be >= 1, --prompt >= 1, --output >= 4, --rounds >= 1")
    batches = sorted(set(a.batches))
    workload = f"arrival=closed,concurrency=B,n=B,prompt=fixed:{a.prompt},output=fixed:{a.output}"
    print(f"workload: {workload}; batches {batches}", flush=True)
    load0 = os.getloadavg()[0]
    points = measure(batches, a.prompt, a.output, a.rounds,
                     progress=lambda s: print(s, flush=True))
    lines = report(points, workload, (load0, os.getloadavg()[0]))
    print("\n".join(lines))
    if a.json:
        fa, fb, _ = fit(points)
        a.json.write_text(json.dumps({"points": points, "per_step_s": fa,
                                      "per_request_s": fb, "report": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
