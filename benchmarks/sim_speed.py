"""Simulator speed: simulated requests per CPU-second of the whole `servetwin simulate`
process (imports, step-time tables, simulation, records and summary written), and its
peak memory, for this tree and, side by side in the same run, a previous commit.

Workloads: Vidur's (Poisson 1.5 req/s, prompt U(1000, 4000), output U(100, 500),
Llama-3.1-8B on one A100-SXM-80GB), the same shapes at 5 req/s on one H100-SXM (a load it
sustains: the 1M-request day), and the finance-qa mix on the users' deployment at its
peak (the default `servetwin simulate`: 50 closed-loop clients, 2x A100-80GB PCIe at TP 2;
`finance-qa,n=N` for N requests, the bare preset for its 600), and the same mix under
SGLang's cache-aware `--schedule-policy lpm` (finance-qa-lpm: its shared templates are
what lpm is for), shortest-prefill-first (finance-qa-spf) and SGLang's priority scheduling
(finance-qa-priority: its VIP tiers), and the twin's own policies (finance-qa-deadline,
finance-qa-learned: the shipped `learned:finance-qa-v2`); and fleets on that mix
(fleet-finance-pool: five
SGLang replicas behind round_robin; fleet-finance-hybrid: the users' design, SGLang and
vLLM pools by prompt length).

    python benchmarks/sim_speed.py [--sizes 10000 100000] [--base COMMIT] [--base-max N]
        [--workloads vidur h100] [--rounds 1]

The previous commit is checked out with `git worktree add` into a fresh temporary directory
(/tmp/servetwin-base-XXXX: two benchmarks at once do not share a tree) and run as
`PYTHONPATH=/tmp/servetwin-base-XXXX/tree python -m servetwin.cli simulate ...` in the
same venv, from a directory outside both trees (so neither shadows the other). Each
child's CPU time and peak RSS come from `os.wait4` (its own `rusage`). Each tree's
bytecode is compiled once into a cache of its own and read from it, as a user's Python
does (`--bytecode inherit`: as this environment says; with PYTHONDONTWRITEBYTECODE set,
every run compiles every module).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIDUR = "arrival=poisson,rate={rate},n={n},prompt=uniform:1000:4000,output=uniform:100:500"
LLAMA = ["--model-path", "meta-llama/Llama-3.1-8B"]
WORKLOADS = {
    "vidur": lambda n: [*LLAMA, "--gpu", "a100-sxm-80gb", "--step-time-backend", "opdb",
                        "--workload", VIDUR.format(rate=1.5, n=n)],
    "h100": lambda n: [*LLAMA, "--gpu", "h100-sxm-80gb", "--step-time-backend", "opdb",
                       "--workload", VIDUR.format(rate=5, n=n)],
    # the same without the radix cache: the typed core's coverage (twin/core.py)
    "vidur-noradix": lambda n: [*WORKLOADS["vidur"](n), "--disable-radix-cache"],
    "h100-noradix": lambda n: [*WORKLOADS["h100"](n), "--disable-radix-cache"],
    # the users' 50 clients for n requests; the bare preset (the default run) at its 600
    "finance-qa": lambda n: ["--workload", "finance-qa" if n == 600 else f"finance-qa,n={n}"],
    "finance-qa-lpm": lambda n: [*WORKLOADS["finance-qa"](n), "--schedule-policy", "lpm"],
    # SGLang's shortest-prefill-first (the RL comparisons' best SGLang rule, docs/rl.md)
    "finance-qa-spf": lambda n: [*WORKLOADS["finance-qa"](n), "--schedule-policy",
                                 "shortest-prefill-first"],
    # its VIP tiers (0, 10, 20) under SGLang's priority scheduling: tier 20 preempts tier 0
    "finance-qa-priority": lambda n: [*WORKLOADS["finance-qa"](n),
                                      "--enable-priority-scheduling"],
    # the twin's own policies on it: deadline (documents held while short questions wait
    # or run) and the shipped learned selector (asked of Python by the typed core)
    "finance-qa-deadline": lambda n: [*WORKLOADS["finance-qa"](n), "--policy", "deadline"],
    "finance-qa-learned": lambda n: [*WORKLOADS["finance-qa"](n), "--policy",
                                     "learned:finance-qa-v2"],
    # fleets (`--deployment`, twin/fleet_presets.py) on the finance-qa mix replayed as its
    # arrivals: the users' 10 GPUs as five SGLang replicas behind round_robin, and their
    # hybrid (two SGLang replicas behind cache_aware, two vLLM pools by prompt length)
    "fleet-finance-pool": lambda n: ["--deployment", "finance-sglang-pool", "--workload",
                                     f"finance-qa,n={n},clients=replay"],
    "fleet-finance-hybrid": lambda n: ["--deployment", "finance-hybrid", "--workload",
                                       f"finance-qa,n={n},clients=replay"],
}


def takes_preset_keys(tree: Path) -> bool:
    """Whether a tree reads `finance-qa,n=N` (866040f on): older ones run only the bare
    preset's 600 requests."""
    return "def split_preset" in (tree / "twin" / "workload.py").read_text()


def header(tool: str) -> str:
    """The first line of a benchmark's output: what ran, when and on which machine."""
    return (f"{tool} {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
            f"{platform.node()} ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()})")


def run_once(tree: Path, argv: list[str], out: Path, pyc: Path | None = None
             ) -> tuple[float, float, bool]:
    """(CPU seconds, peak RSS in MB, ok) of one `servetwin simulate` process. `pyc`: the
    tree's own bytecode cache (PYTHONPYCACHEPREFIX), written and read as a user's Python
    does; None: whatever this environment says (PYTHONDONTWRITEBYTECODE: every import
    compiles)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if pyc is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pyc)
    cmd = [sys.executable, "-m", "servetwin.cli", "simulate", *argv, "--out", str(out)]
    with tempfile.TemporaryDirectory() as cwd:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        _, status, ru = os.wait4(p.pid, 0)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, status == 0


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def same_files(a: Path, b: Path) -> str:
    """Whether both runs wrote the same files, read in blocks: this process must stay
    small, or the children it forks would inherit its peak RSS as their own floor
    (Linux counts the forked copy of the parent's memory in the child's ru_maxrss)."""
    for name in ("requests.jsonl", "summary.json", "timeseries.csv"):
        if _digest(a / name) != _digest(b / name):
            return f"{name} differs"
    return "identical"


def base_tree(commit: str, name: str = "servetwin-base") -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "tree"  # its own: runs may overlap
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path),
                    commit], check=True, capture_output=True)
    build_extension(path, commit)
    return path


def build_extension(path: Path, commit: str) -> None:
    """A worktree's compiled records writer, as pip install builds it (a tree from before
    it has no setup.py: nothing to build)."""
    if not (path / "setup.py").exists():
        return
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                          cwd=path, capture_output=True, text=True)
    if done.returncode or not list((path / "twin").glob("_recordsc.*.so")) or (
            (path / "twin" / "_loopc.pyx").exists()
            and not list((path / "twin").glob("_loopc.*.so"))):
        print(f"# {commit}: its compiled modules were not built (is Cython "
              f"installed? pip install -e '.[test]'): {done.stderr.strip()[-300:]}",
              file=sys.stderr)


def _core(tree: Path, module: str, why_name: str, absent: str, compiled: str) -> str:
    done = subprocess.run([sys.executable, "-c", f"import {module} as m; "
                           f"print(getattr(m, '{why_name}', '{absent}') or '')"],
                          env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                          capture_output=True, text=True)
    why = done.stdout.strip()
    return compiled if done.returncode == 0 and not why else f"Python ({why})"


def records_core(tree: Path) -> str:
    """Which code writes a tree's records: its compiled writer, or the Python code and why
    (a tree from before the compiled writer: the Python code)."""
    return _core(tree, "twin.record_table", "WHY_PYTHON", "no compiled writer",
                 "the compiled writer")


def loop_core(tree: Path) -> str:
    """Which code runs a tree's decode passes: compiled (twin/_loopc.pyx), or Python and why
    (a tree from before it: Python)."""
    return _core(tree, "twin.replica", "WHY_LOOP_PYTHON", "no compiled decode pass",
                 "compiled")


def drop_tree(tree: Path) -> None:
    """Remove a `base_tree` worktree and the temporary directory it was made in."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                   capture_output=True)
    tree.parent.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--workloads", nargs="+", default=["vidur"], choices=list(WORKLOADS))
    ap.add_argument("--base", default=None, help="a previous commit to compare with")
    ap.add_argument("--base-max", type=int, default=100_000,
                    help="run the base only up to this many requests (before issue 14 "
                    "a 1M run needed about 21 GB)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; best of")
    ap.add_argument("--new", default=None, help="measure this commit (a worktree) instead of "
                    "the working tree (which may hold others' unfinished edits)")
    ap.add_argument("--bytecode", choices=["cached", "inherit"], default="cached",
                    help="cached (default): each tree's modules compiled once into a cache "
                    "of its own, by a warm-up run, and read from it, as a user's Python does; "
                    "inherit: this environment's setting (PYTHONDONTWRITEBYTECODE=1 makes "
                    "every run compile every module, about 0.1 CPU-s)")
    ns = ap.parse_args()
    new = base_tree(ns.new, "servetwin-new") if ns.new else ROOT
    head = subprocess.run(["git", "-C", str(new), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    base = base_tree(ns.base) if ns.base else None
    print(f"# {header('sim_speed')}; tree {head}"
          + (" (+ uncommitted)" if subprocess.run(
              ["git", "-C", str(new), "diff", "--quiet", "HEAD", "--", "twin"]).returncode
             else "") + (f", base {ns.base}" if base else ""))
    print(f"# records written by: tree {records_core(new)}"
          + (f"; base {records_core(base)}" if base else ""))
    print(f"# decode passes: tree {loop_core(new)}"
          + (f"; base {loop_core(base)}" if base else ""))
    for w in ns.workloads:
        print(f"# {w}: servetwin simulate {' '.join(WORKLOADS[w]('N'))}")
    caches = tempfile.TemporaryDirectory(prefix="servetwin-pyc-")
    pyc = {}
    if ns.bytecode == "cached":
        print("# bytecode: each tree's own cache (PYTHONPYCACHEPREFIX), filled by a warm-up run "
              "of 100 requests, as a user's Python caches it")
        for label, tree in (("new", new), ("base", base)):
            if tree is not None:
                pyc[tree] = Path(caches.name) / label
                with tempfile.TemporaryDirectory() as tmp:
                    run_once(tree, WORKLOADS[ns.workloads[0]](100), Path(tmp), pyc[tree])
    else:
        print(f"# bytecode: as this environment says (PYTHONDONTWRITEBYTECODE="
              f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r})")
    print("| workload | requests | CPU s | requests / CPU-s | peak RSS MB | base CPU s | "
          "base peak MB | speed-up | records |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in ns.workloads:
        for n in ns.sizes:
            argv = WORKLOADS[w](n)
            with tempfile.TemporaryDirectory() as tmp:
                new_out, base_out = Path(tmp) / "new", Path(tmp) / "base"
                best_new = best_base = (float("inf"), 0.0, True)
                run_base = base is not None and n <= ns.base_max and (
                    not w.startswith("finance-qa") or n == 600 or takes_preset_keys(base))
                for _ in range(ns.rounds):
                    if run_base:
                        best_base = min(best_base, run_once(base, argv, base_out,
                                                            pyc.get(base)))
                    best_new = min(best_new, run_once(new, argv, new_out, pyc.get(new)))
                cpu, rss, ok = best_new
                row = [w, f"{n:,}", f"{cpu:.2f}", f"{n / cpu:,.0f}", f"{rss:,.0f}"]
                if run_base:
                    bcpu, brss, _ = best_base
                    row += [f"{bcpu:.2f}", f"{brss:,.0f}", f"{bcpu / cpu:.2f}x",
                            same_files(new_out, base_out) if ok else "run failed"]
                else:
                    row += ["-", "-", "-", "ok" if ok else "run failed"]
                print("| " + " | ".join(row) + " |", flush=True)
    for tree in (base, new if ns.new else None):
        if tree is not None:
            drop_tree(tree)
    caches.cleanup()


if __name__ == "__main__":
    main()
