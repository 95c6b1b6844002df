"""What ends each decode run: the count behind the next speed lead (docs/perf.md).

Between events the replica advances a whole run of decode steps at once
(`Replica._run_decode`); a run ends at the first of: a request finishing, the KV pool, or a
boundary where the scheduler must look again (`Replica._next_boundary`: the next
time-series sample, an arrival, the overlap loop's one-step boundary, a time slice, the
horizon). Fewer runs per request is what a faster loop needs most, so this counts, for
one `servetwin simulate` workload, how many runs each cause ended, and how many of the
sample's cuts had nothing waiting (those a run could sample inside itself without a
scheduling pass: the "sampling inside a decode run" lead).

It runs the CLI's own `simulate` in this process with two wrappers on `Replica` that only
observe (records unchanged): one remembers which boundary `_next_boundary` returned, one
compares each run's steps with the request closest to its end and the KV pool's steps.

    python benchmarks/decode_cuts.py [--workload vidur|h100|finance-qa|finance-qa-lpm]
                                     [--n 20000]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sim_speed import WORKLOADS, header  # noqa: E402


def boundary_label(rep, t: float, arrivals: bool) -> str:
    """Which of `_next_boundary`'s candidates `t` is (the first that equals it, in the
    order an overlap boundary, the sample, an arrival, a slice, the horizon)."""
    if t == rep.env.now:
        return "the overlap loop's one-step boundary"
    if t == rep._next_sample:
        return "the time-series sample"
    if arrivals and t == rep.feed.next_arrival():
        return "an arrival"
    if rep.horizon is not None and t == rep.horizon:
        return "the horizon"
    return "a time slice"


def instrument(counts: collections.Counter):
    """Count each decode run's cause in `counts`; returns the function that takes the
    wrappers off again. The Python replica and its Python decode pass run meanwhile (the
    typed core, twin/_corec.pyx, and the compiled pass, twin/_loopc.pyx, compute the
    boundary inline: the same runs, nothing to observe)."""
    from twin import core, replica
    from twin.replica import Replica

    next_boundary, run_decode = Replica._next_boundary, Replica._run_decode
    loop_c, typed = replica._LOOP_C, core._CORE
    replica._LOOP_C = core._CORE = None

    def observed_boundary(self, arrivals: bool = True):
        t = next_boundary(self, arrivals)
        self._bench_boundary = boundary_label(self, t, arrivals)
        return t

    def observed_decode(self):
        running = self.running
        fewest = min(r.max_new_tokens - r.generated_tokens for r in running)
        room = self.room()
        k_mem = room // len(running) if self._counts_only else self.alloc.decode_steps(
            [r.index for r in running], room)
        parked = bool(self._park_until)
        idle = not self.waiting and self.chunked is None
        self._bench_boundary = None
        n0 = self.n_dec_steps
        yield from run_decode(self)
        k = self.n_dec_steps - n0
        if k == 0:
            cause = "no step (the KV pool refused it: a retraction)"
        elif k >= fewest:
            cause = "a request finishing"
        elif k >= max(k_mem, 1):
            cause = "the KV pool"
        elif parked:
            cause = "a parked pass (one step)"
        elif self._bench_boundary is not None:
            cause = self._bench_boundary
            if cause == "the time-series sample" and idle:
                cause += ", nothing waiting"
        else:
            cause = "a submit (a fleet's cut)"
        counts[cause] += 1

    Replica._next_boundary, Replica._run_decode = observed_boundary, observed_decode

    def restore() -> None:
        Replica._next_boundary, Replica._run_decode = next_boundary, run_decode
        replica._LOOP_C, core._CORE = loop_c, typed

    return restore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="vidur", choices=list(WORKLOADS),
                    help="benchmarks/sim_speed.py's workloads (default: vidur)")
    ap.add_argument("--n", type=int, default=20_000, help="requests (default: 20000)")
    ns = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    instrument(counts)
    from servetwin.cli import main as cli

    argv = WORKLOADS[ns.workload](ns.n)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        status = cli(["simulate", *argv, "--out", out])
    if status:
        raise SystemExit(f"servetwin simulate {' '.join(argv)} exited {status}")
    total = sum(counts.values())
    print(f"# {header('decode_cuts')}")
    print(f"# {ns.workload}, {ns.n:,} requests: servetwin simulate {' '.join(argv)}")
    print(f"# {total:,} decode runs, {total / ns.n:.2f} per request")
    print("| the run ended at | runs | share |")
    print("|---|---|---|")
    for cause, n in counts.most_common():
        print(f"| {cause} | {n:,} | {100 * n / total:.1f} % |")


if __name__ == "__main__":
    main()
