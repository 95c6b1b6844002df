"""Microseconds per `calc_priority` and per `preempt_to_schedule` with servetwin's plugin
hooks against SGLang 0.5.23's own, at 16, 256 and 1,024 waiting requests.

Runs inside the CPU harness venv (it re-executes itself there), outside a server: a
published runtime context (`sglang.test.test_utils.published_topology`), real `Req` and
`SchedulePolicy` objects, a simulated radix cache, and the plugin's hooks applied by
SGLang's own `HookRegistry`. The plugin runtime gets a small stand-in for the scheduler
(its KV numbers); the `PrefillAdder` is built without `__init__` and given the fields
`preempt_to_schedule` reads (a KV allocator needs a model). Both preemption paths find no
victim (equal priorities), so the numbers are the decision's cost, not the release's.
Times are CPU time per call (`process_time`, garbage collector off): on the shared machine
wall time mostly measures the wait for a core. Each round measures SGLang's own and every
row back to back; the table gives min / median over the rounds and the paired difference.

Workload: prompts of 100 tokens, max_new_tokens 16..527, priorities 0..2 in a fixed
pseudo-random pattern; 16 running requests (10 tokens generated each); the server's
policy is `fcfs` with priority scheduling (SGLang sorts by priority, then queue entry);
before each plugin pass the queue's head is forgotten, as `add_one_req` does for the
request a pass examined, so its view is rebuilt.

"added" is against SGLang's own sort of the same order where SGLang has one (`lof`
against SGLang's `lof`), else against its fcfs with priority (what the native `priority`
is). "the policy's decide alone" is what the twin runs for the same order question (a
snapshot already built): with it, a policy's own arithmetic (`slices`' score) is told
apart from what the plugin adds.

    python benchmarks/policy_overhead.py [--rounds N] [--sizes N ...] [--write]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "policies.md"
SIZES = (16, 256, 1024)
RUNNING = 16
OWN, OWN_LOF = "SGLang's own (fcfs)", "SGLang's own lof"
START, END = "<!-- plugin-overhead:start -->", "<!-- plugin-overhead:end -->"


def _reexec_in_harness() -> int:
    sys.path.insert(0, str(ROOT))
    from runtime.cpu.install import harness_env, require_harness

    harness = require_harness()
    cmd = [str(harness.python), str(Path(__file__).resolve()), *sys.argv[1:]]
    return subprocess.run(cmd, env=harness_env() | {"SERVETWIN_IN_HARNESS": "1"},
                          cwd=harness.prefix).returncode


def make_reqs(n: int, prefix: str):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for i in range(n):
        r = Req(f"{prefix}{i}", "", array("q", range(3 + i % 7, 103 + i % 7)),
                SamplingParams(max_new_tokens=16 + (i * 37) % 512, ignore_eos=True),
                priority=(i * 5) % 3)
        r.time_stats.wait_queue_entry_time = 1000.0 + i * 0.001
        out.append(r)
    return out


def per_call_us(fn, calls: int) -> float:
    """CPU time per call (`process_time`: on the shared machine wall time mostly measures
    how long the process waited for a core), with the garbage collector off as `timeit`
    has it."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        return (time.process_time() - t0) / calls * 1e6
    finally:
        gc.enable()


def stand_in_scheduler():
    return SimpleNamespace(
        new_token_ratio_tracker=SimpleNamespace(current=0.7), max_running_requests=RUNNING,
        max_total_num_tokens=200_000,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 150_000),
        tree_cache=SimpleNamespace(evictable_size=lambda: 1000,
                                   supports_fast_match_prefix=lambda: False))


def make_adder(cls, running):
    adder = cls.__new__(cls)
    adder.running_batch = SimpleNamespace(reqs=running)
    adder.preempt_list = []
    adder.new_token_ratio = 0.7
    adder.memory_budget = SimpleNamespace(remaining_total=100, total_offset=0)
    adder.priority_scheduling_preemption_threshold = 10
    adder.token_to_kv_pool_allocator = SimpleNamespace(request_slot_reserve=lambda **kw: 0)
    adder.max_running_requests = RUNNING
    return adder


def measure(rounds: int, sizes: tuple[int, ...] = SIZES) -> list[Row]:
    from sglang.srt.managers.schedule_policy import PrefillAdder, SchedulePolicy
    from sglang.srt.plugins.hook_registry import HookRegistry

    from runtime.plugin import hooks
    from twin.policy.registry import build_policy, read_spec

    hooks.install(read_spec("fcfs"))
    HookRegistry.apply_hooks()
    own_calc = SchedulePolicy.calc_priority.__wrapped__
    adder_cls = hooks._make_adder_class(PrefillAdder)
    args = {"priority_scheduling": True, "low_values_first": False, "preemption_threshold": 10}
    runtimes = {"no policy (hooks only)": None}
    for name, native in (("priority", True), ("lof", False), ("slices", False)):
        spec = read_spec(name)
        label = f"{name} ({'native: SGLang sorts' if native else 'the twin policy sorts'})"
        runtimes[label] = hooks.PluginRuntime(spec, build_policy(spec, **args), args, "fcfs",
                                              native, 5.0, None, stand_in_scheduler())
    running = make_reqs(RUNNING, "run")
    for r in running:
        r.output_ids.extend(range(10))
    rows = []
    for n in sizes:
        rows += rows_at(n, runtimes, running, adder_cls, own_calc, rounds)
    hooks._RUNTIME = None
    return rows


@dataclass
class Row:
    label: str
    n: int
    calc: list[float]  # µs per call, one sample per round
    preempt: list[float]
    alone: list[float] = field(default_factory=list)  # the policy's decide on a snapshot


def rows_at(n: int, runtimes: dict, running: list, adder_cls: type, own_calc,
            rounds: int) -> list[Row]:
    """Every round measures SGLang's own and each runtime back to back, so a paired
    difference sees the same machine load. Each runtime orders its own copy of the queue
    (the same `Req`s), so SGLang's own sort never starts from another policy's order."""
    from sglang.srt.managers.schedule_policy import PrefillAdder, SchedulePolicy
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from runtime.plugin import hooks
    from runtime.plugin.views import views

    calls = max(20, 6000 // n)
    cache = RadixCache.create_simulated()
    sp = SchedulePolicy("fcfs", cache, False, True, False)
    own_policies = {OWN: sp, OWN_LOF: SchedulePolicy("lof", cache, False, True, False)}
    base = make_reqs(n, "w")
    candidate = base[n // 2]
    batch = SimpleNamespace(reqs=running)
    rows = {label: Row(label, n, [], []) for label in (*own_policies, *runtimes)}
    queues = {label: list(base) for label in rows}

    def own(label: str) -> tuple[float, float]:
        q, policy = queues[label], own_policies[label]
        return (per_call_us(lambda: own_calc(policy, q, batch, 0), calls),
                per_call_us(lambda: PrefillAdder.preempt_to_schedule(
                    make_adder(PrefillAdder, running), candidate), calls))

    def plugin(label: str) -> tuple[float, float]:
        rt = hooks._RUNTIME = runtimes[label]
        q = queues[label]
        sp.calc_priority(q, batch, processed_tokens=0)  # this pass's views

        def one_pass() -> None:
            # the pass before examined the queue's head (`add_one_req` forgets it), so
            # its view is rebuilt, as in a server whose head waits for room
            if rt is not None:
                rt.waiting_views.forget(q[0])
            sp.calc_priority(q, batch, processed_tokens=0)

        if rt is not None and not rt.native:  # what the twin runs for the same question
            snap = rt.order_snapshot(views(q, False, 0.7), batch)
            rows[label].alone.append(per_call_us(lambda: rt.policy.decide(snap), calls))
        return (per_call_us(one_pass, calls),
                per_call_us(lambda: make_adder(adder_cls, running)
                            .preempt_to_schedule(candidate), calls))

    for _ in range(rounds):
        for label, row in rows.items():
            c, p = own(label) if label in own_policies else plugin(label)
            row.calc.append(c)
            row.preempt.append(p)
    return list(rows.values())


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.node()}: {platform.machine()}, {cpu}, {os.cpu_count()} cores, " \
           f"Python {platform.python_version()}, load average {load} (shared machine)"


def table(rows: list[Row]) -> str:
    """min / median over the rounds; "added" is the median of the per-round differences
    with SGLang's own sort of the same order where SGLang has one (lof against SGLang's
    lof; the others against its fcfs with priority scheduling, which the native
    `priority` is), paired (the same moment's load), and the difference of the minima."""
    by = {(r.label, r.n): r for r in rows}
    out = ["| hooks | waiting | calc_priority µs min / med | added med (min) | × own "
           "| the policy's decide alone µs med | preempt_to_schedule µs min / med "
           "| added med (min) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        o = by[(OWN_LOF if r.label.startswith("lof ") else OWN, r.n)]
        alone = f"{statistics.median(r.alone):.1f}" if r.alone else ""
        cells = [r.label, f"{r.n:,}", _min_med(r.calc), "", "", alone, _min_med(r.preempt),
                 ""]
        if r.label not in (OWN, OWN_LOF):
            cells[3], cells[7] = _added(r.calc, o.calc), _added(r.preempt, o.preempt)
            cells[4] = f"{statistics.median(r.calc) / statistics.median(o.calc):.2f}"
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _min_med(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f}"


def _added(xs: list[float], own: list[float]) -> str:
    paired = statistics.median(x - o for x, o in zip(xs, own, strict=True))
    return f"{paired:+.1f} ({min(xs) - min(own):+.1f})"


def report(rows: list[Row], rounds: int) -> str:
    import sglang

    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f"Measured {stamp} on {machine()}; SGLang {sglang.__version__}, "
            f"`python benchmarks/policy_overhead.py --rounds {rounds}` ({rounds} rounds, each "
            f"SGLang's own and every row back to back).\n\nWorkload: "
            f"{__doc__.split('Workload: ', 1)[1].split(chr(10) + chr(10))[0]}\n\n"
            f"{table(rows)}\n")


def write_doc(text: str) -> None:
    body = DOC.read_text() if DOC.exists() else "# Scheduling policies\n"
    block = f"{START}\n{text}{END}"
    if START in body:
        head, rest = body.split(START, 1)
        body = head + block + rest.split(END, 1)[1]
    else:
        if "## The plugin" not in body:
            body = body.rstrip("\n") + "\n\n## The plugin\n\nPer-call cost of the plugin's " \
                   "hooks (docs/plugin.md).\n"
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC}")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (default 9)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="waiting-queue lengths (default %(default)s)")
    ns = parser.parse_args()
    if os.environ.get("SERVETWIN_IN_HARNESS") != "1":
        return _reexec_in_harness()
    import logging

    logging.disable(logging.WARNING)  # the hooks' application messages
    from sglang.test.test_utils import published_topology

    with published_topology(device="cpu"):
        text = report(measure(ns.rounds, tuple(ns.sizes)), ns.rounds)
    print(text)
    if ns.write:
        write_doc(text)
        print(f"written to {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
