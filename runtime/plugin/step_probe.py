"""The step probe: the scheduler loop's CPU work per step, timed inside a live SGLang 0.5.23
server (`SERVETWIN_STEP_PROBE=PREFIX` with the plugin loaded; docs/calibration.md).

Per scheduler-loop iteration with a batch, one JSON line to `PREFIX.<pid>`: the batch's mode
and size, and for each phase of the loop (`ingest_requests`, `get_next_batch_to_run`,
`run_batch`, `process_batch_result`) its wall time and the scheduler thread's CPU time in
nanoseconds (and the step's end on the wall clock, `t`), plus the model's own compute inside
`run_batch` (`ModelRunner.forward`, `ModelRunner.sample`), so the loop's CPU work excluding
the forward is the four phases less those two (calibration/step_cpu.py). The detokenizer's
`handle_batch_token_id_out` is timed per call the same way.

The hooks wrap SGLang's own functions (AROUND) and only read clocks: the original always
runs and its result or exception passes through untouched; the bookkeeping after it is
guarded, and a probe that cannot write switches itself off (logged once). Importing this
module imports no SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import time

PHASES = {
    "sglang.srt.managers.scheduler.Scheduler.ingest_requests": "ingest",
    "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run": "sched",
    "sglang.srt.managers.scheduler.Scheduler.run_batch": "run",
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": "fwd",
    "sglang.srt.model_executor.model_runner.ModelRunner.sample": "sample",
}
T_PROCESS = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
T_DETOK = ("sglang.srt.managers.detokenizer_manager.DetokenizerManager."
           "handle_batch_token_id_out")

log = logging.getLogger("servetwin.step_probe")


class Probe:
    """One process's probe: the phases timed since the last step, and its file."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.fh = None
        self.cur: dict[str, tuple[int, int]] = {}
        self.on = True

    def write(self, rec: dict) -> None:
        if not self.on:
            return
        try:
            if self.fh is None:
                self.fh = open(f"{self.prefix}.{os.getpid()}", "a", buffering=1,
                               encoding="utf-8")
            self.fh.write(json.dumps(rec) + "\n")
        except Exception as exc:  # never the scheduler's problem
            self.on = False
            log.warning("servetwin step probe %s.%d switched off: %s", self.prefix,
                        os.getpid(), exc)

    def timed(self, name: str):
        def hook(original, *args, **kwargs):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                try:
                    dw, dc = time.perf_counter_ns() - w0, time.thread_time_ns() - c0
                    if name == "ingest":  # the top of an iteration: idle passes drop out
                        self.cur = {"ingest": (dw, dc)}
                    else:
                        w, c = self.cur.get(name, (0, 0))
                        self.cur[name] = (w + dw, c + dc)
                except Exception:  # noqa: BLE001 - a clock read cannot fail the loop
                    pass
        return hook

    def process(self, original, sched, batch, result, *args, **kwargs):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return original(sched, batch, result, *args, **kwargs)
        finally:
            try:
                w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                cur, self.cur = self.cur, {}
                mode = batch.forward_mode
                rec = {"mode": "decode" if mode.is_decode() else
                       ("extend" if mode.is_extend() else str(mode)),
                       "bs": batch.batch_size(), "proc": [w1 - w0, c1 - c0], "t": time.time()}
                rec.update({k: list(v) for k, v in cur.items()})
                self.write(rec)
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass

    def detok(self, original, manager, recv_obj, *args, **kwargs):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return original(manager, recv_obj, *args, **kwargs)
        finally:
            try:
                n = len(getattr(recv_obj, "rids", ()) or ())
                self.write({"mode": "detok", "bs": n,
                            "detok": [time.perf_counter_ns() - w0,
                                      time.thread_time_ns() - c0]})
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass


def install(prefix: str) -> Probe:
    """Register the probe's hooks with SGLang's hook registry (in every process SGLang
    starts; only the scheduler's and the detokenizer's functions are ever called)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    probe = Probe(prefix)
    for target, name in PHASES.items():
        HookRegistry.register(target, probe.timed(name), HookType.AROUND)
    HookRegistry.register(T_PROCESS, probe.process, HookType.AROUND)
    HookRegistry.register(T_DETOK, probe.detok, HookType.AROUND)
    return probe
