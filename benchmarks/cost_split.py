"""Where a whole `servetwin simulate` process spends its CPU, per simulated request: the
budget the speed target leaves each part (docs/perf.md, "A typed core: the plan").

Runs the CLI's own `simulate` in this process with wrappers that only time (the records
are unchanged) and splits the process's CPU time (`time.process_time`, every thread) into:
- the scheduler loop: SimPy's run of the replica (twin/interrupt.py `run_interruptible`),
  or the typed core's (twin/core.py `run`, as twin/sim.py calls it: `run_core`),
  less the records formatted inside it;
- the records and summary: `requests.jsonl` formatted and written, spilled chunks merged,
  the summary computed (twin/record_sink.py `RecordSink.flush`, `finish`, `finish_with`);
- the workload generated, the replica built (its step-time tables read from the disk
  cache or built), `summary.json` and `timeseries.csv` written;
- everything else: imports and the command line.
Each is printed in microseconds per request beside the target's whole budget (1/47,000
of a CPU-second, about 21 us, for the whole process), and the records' time once more by
part (`RECORD_PARTS`: which of them a compiled writer would have to take over).

    python benchmarks/cost_split.py [--workload vidur|h100|finance-qa|finance-qa-lpm]
                                    [--n 20000] [--base COMMIT [--rounds 2]]

With --base, this tree and the commit (a git worktree) run in turn, each in a process of
its own whose packages are that tree's, and the parts are printed side by side: on a
machine whose speed drifts between runs, the ratios are what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--tree" not in sys.argv:  # a child measuring another tree puts that one first instead
    sys.path.insert(0, str(ROOT))
from sim_speed import (  # noqa: E402
    WORKLOADS,
    base_tree,
    drop_tree,
    header,
    loop_core,
    records_core,
)

TARGET = 47_000  # simulated requests per CPU-second, issue 14's target at 100k
RECORDS = "the records and summary"
OTHER = "everything else (imports, the command line)"
REST = "the rest (sorting, windows, the in-memory table)"
# the records' parts, timed apart (exclusive of one another): (owner, function, label)
RECORD_PARTS = [
    ("RecordTable", "_plan", "token-gap pieces per request (`RecordTable._plan`)"),
    ("RecordTable", "_times", "rounded times per request (`RecordTable._times`)"),
    ("RecordTable", "_step_unique", "distinct step gaps (`RecordTable._step_unique`)"),
    ("RecordSink", "_keep_columns", "columns kept per chunk (`RecordSink._keep_columns`)"),
    ("RecordSink", "_spill_lines", "lines formatted and spilled (`RecordSink._spill_lines`)"),
    ("record_sink", "write_records", "lines formatted and written, one chunk "
                                     "(`write_records`)"),
    ("RecordSink", "_merge", "spilled lines merged (`RecordSink._merge`)"),
    ("RecordSink", "_summary", "summary from the columns (`RecordSink._summary`)"),
    ("record_sink", "summarize", "summary of one chunk (`summarize`)"),
]


class Clock:
    """Exclusive CPU time per label: a wrapped call nested in another is taken out of the
    outer one's time."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._stack: list[list] = []  # [label, start, time of nested calls]

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)
        clock = self

        def timed(*a, **k):
            frame = [label, time.process_time(), 0.0]
            clock._stack.append(frame)
            try:
                return inner(*a, **k)
            finally:
                clock._stack.pop()
                took = time.process_time() - frame[1]
                clock.spent[label] = clock.spent.get(label, 0.0) + took - frame[2]
                if clock._stack:
                    clock._stack[-1][2] += took

        setattr(owner, name, timed)


def measure(workload: str, n: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(the process's CPU seconds, the parts, the records' parts) of one `simulate` run in
    this process: the twin and servetwin packages are the first on sys.path."""
    from servetwin import cmd_simulate
    from servetwin.cli import main as cli
    from twin import fleet, interrupt, record_sink, record_table, sim

    clock = Clock()
    loop = "the scheduler loop"
    clock.wrap(interrupt, "run_interruptible", loop)
    sim.run_interruptible = fleet.run_interruptible = interrupt.run_interruptible  # by name
    if hasattr(sim, "run_core"):  # the typed core's run (twin/core.py), where it covers one
        clock.wrap(sim, "run_core", loop)
    for name in ("flush", "finish", "finish_with"):
        clock.wrap(record_sink.RecordSink, name, RECORDS)
    owners = {"RecordTable": record_table.RecordTable, "RecordSink": record_sink.RecordSink,
              "record_sink": record_sink}
    for owner, name, label in RECORD_PARTS:
        if hasattr(owners[owner], name):  # an older tree (--base) may not have it
            clock.wrap(owners[owner], name, label)
    clock.wrap(cmd_simulate, "workload_from", "the workload (generated)")
    clock.wrap(sim, "build_replica", "the replica and its step-time tables")
    clock.wrap(sim.SimResult, "write", "summary.json and timeseries.csv")
    argv = WORKLOADS[workload](n)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        status = cli(["simulate", *argv, "--out", out])
        total = time.process_time()
    if status:
        raise SystemExit(f"servetwin simulate {' '.join(argv)} exited {status}")
    if loop not in clock.spent:
        raise SystemExit("cost_split: the loop was not timed (twin/sim.py no longer calls "
                         "run_interruptible or run_core by that name)")
    sub = {label: clock.spent.pop(label) for _, _, label in RECORD_PARTS
           if label in clock.spent}
    rest = clock.spent.get(RECORDS, 0.0)
    parts = dict(clock.spent)
    parts[RECORDS] = rest + sum(sub.values())
    parts[OTHER] = total - sum(parts.values())
    sub[REST] = rest
    return total, parts, sub


def _us(seconds: float | None, n: int) -> str:
    return "-" if seconds is None else f"{1e6 * seconds / n:.1f}"


def child(tree: Path, workload: str, n: int) -> tuple[float, dict, dict]:
    """`measure` in a new process whose packages are `tree`'s."""
    out = subprocess.run([sys.executable, __file__, "--workload", workload, "--n", str(n),
                          "--tree", str(tree), "--json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"cost_split: the run of {tree} failed:\n{out.stderr[-2000:]}")
    d = json.loads(out.stdout)
    return d["total"], d["parts"], d["records"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="vidur", choices=list(WORKLOADS),
                    help="benchmarks/sim_speed.py's workloads (default: vidur)")
    ap.add_argument("--n", type=int, default=20_000, help="requests (default: 20000)")
    ap.add_argument("--base", default=None,
                    help="a previous commit: both trees run in turn, each in its own process "
                         "(a git worktree of it), and the parts are printed side by side")
    ap.add_argument("--rounds", type=int, default=2,
                    help="with --base: alternating rounds; each side's least-CPU round")
    ap.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.tree is not None:
        sys.path.insert(0, str(ns.tree.resolve()))
    if ns.json:
        total, parts, sub = measure(ns.workload, ns.n)
        print(json.dumps({"total": total, "parts": parts, "records": sub}))
        return
    argv = WORKLOADS[ns.workload](ns.n)
    print(f"# {header('cost_split')}" + ("; bytecode not cached (PYTHONDONTWRITEBYTECODE):"
                                          " imports compile" if sys.flags.dont_write_bytecode
                                          else ""))
    print(f"# {ns.workload}, {ns.n:,} requests: servetwin simulate {' '.join(argv)}")
    if ns.base is None:
        print(f"# records written by {records_core(ROOT)}; decode passes {loop_core(ROOT)}")
        total, parts, sub = measure(ns.workload, ns.n)
        print(f"# whole process {total:.2f} CPU-s: {ns.n / total:,.0f} requests per CPU-second "
              f"(target {TARGET:,}: {1e6 / TARGET:.1f} us per request)")
        print("| part | CPU s | us per request | share | of the target's budget |")
        print("|---|---|---|---|---|")
        for label, t in parts.items():
            per = 1e6 * t / ns.n
            print(f"| {label} | {t:.2f} | {per:.1f} | {100 * t / total:.0f} % | "
                  f"{per * TARGET / 1e6:.1f}x |")
        print()
        print(f"{RECORDS}, by part:")
        print("| part | CPU s | us per request | share of the records |")
        print("|---|---|---|---|")
        for label, t in sub.items():
            print(f"| {label} | {t:.2f} | {1e6 * t / ns.n:.1f} | "
                  f"{100 * t / max(parts[RECORDS], 1e-9):.0f} % |")
        return
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--",
                            "twin", "servetwin"]).returncode
    base = base_tree(ns.base, "servetwin-cost-base")
    print(f"# records written by: tree {records_core(ROOT)}; base {records_core(base)}")
    print(f"# decode passes: tree {loop_core(ROOT)}; base {loop_core(base)}")
    try:
        best_new = best_base = None
        for _ in range(ns.rounds):
            b, nw = child(base, ns.workload, ns.n), child(ROOT, ns.workload, ns.n)
            best_base = b if best_base is None or b[0] < best_base[0] else best_base
            best_new = nw if best_new is None or nw[0] < best_new[0] else best_new
    finally:
        drop_tree(base)
    print(f"# tree {head}{' (+ uncommitted)' if dirty else ''} against {ns.base}, side by "
          f"side: {ns.rounds} alternating rounds, each side's least-CPU round")
    print(f"# whole process {best_new[0]:.2f} CPU-s against {best_base[0]:.2f} "
          f"({best_base[0] / best_new[0]:.2f}x)")
    print("| part | us per request | base us per request | base / tree |")
    print("|---|---|---|---|")
    for i, name in ((1, None), (2, RECORDS)):
        if name:
            print(f"| *{RECORDS}, by part:* | | | |")
        for label in dict.fromkeys([*best_new[i], *best_base[i]]):
            a, b = best_new[i].get(label), best_base[i].get(label)
            ratio = f"{b / a:.2f}x" if a and b else "-"
            print(f"| {label} | {_us(a, ns.n)} | {_us(b, ns.n)} | {ratio} |")


if __name__ == "__main__":
    main()
