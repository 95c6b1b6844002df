"""Would compiling the simulator's Python as it is make it faster? Cython-compiles a copy of
this tree's hot modules unchanged (no type declarations: the same source, as a pure-Python
fallback would keep it) and times the whole `servetwin simulate` process of both trees
side by side, alternating, with the records compared.

    pip install cython        # not a project dependency: only this check needs it
    python benchmarks/compiled_check.py [--modules twin/replica.py ...] [--sizes 20000]
        [--workloads vidur] [--rounds 2]

The copy is `git archive HEAD` in a temporary directory (the working tree's uncommitted
edits are not in it); the plain side is that same copy without the extensions, so both
run the same commit. Needs a C compiler and Python's headers (Debian: gcc,
libpython3.11-dev).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_speed import WORKLOADS, header, run_once, same_files  # noqa: E402

HOT = ["twin/replica.py", "twin/replica_memory.py", "twin/admission.py", "twin/prefix.py",
       "twin/memory/__init__.py", "twin/perf/step_cache.py", "twin/cluster.py"]

BUILD = """
import sys
from setuptools import setup
from Cython.Build import cythonize
setup(ext_modules=cythonize(sys.argv[1:], language_level=3, quiet=True,
                            compiler_directives={"binding": True}),
      script_args=["build_ext", "--inplace", "-q"])
"""


def copy_tree(dest: Path) -> None:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", nargs="+", default=HOT,
                    help="modules to compile, paths in the tree (default: the loop's)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000])
    ap.add_argument("--workloads", nargs="+", default=["vidur"], choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; best of")
    ns = ap.parse_args()
    try:
        import Cython
    except ImportError:
        sys.exit("compiled_check: needs Cython (pip install cython)")
    with tempfile.TemporaryDirectory(prefix="servetwin-compiled-") as tmp:
        plain, compiled = Path(tmp) / "plain", Path(tmp) / "compiled"
        copy_tree(plain)
        copy_tree(compiled)
        (compiled / "_build.py").write_text(BUILD)
        build = subprocess.run([sys.executable, "_build.py", *ns.modules], cwd=compiled,
                               capture_output=True, text=True)
        if build.returncode:
            sys.exit(f"compiled_check: the build failed:\n{build.stderr[-3000:]}")
        built = sorted(str(p.relative_to(compiled)) for p in compiled.rglob("*.so")
                       if "build" not in p.relative_to(compiled).parts)
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        print(f"# {header('compiled_check')}; tree {head}; Cython {Cython.__version__}; compiled: {', '.join(built)}")
        print("| workload | requests | plain CPU s | compiled CPU s | compiled / plain | "
              "records |")
        print("|---|---|---|---|---|---|")
        for w in ns.workloads:
            for n in ns.sizes:
                argv = WORKLOADS[w](n)
                a_out, b_out = Path(tmp) / "out-plain", Path(tmp) / "out-compiled"
                best_a = best_b = (float("inf"), 0.0, True)
                for _ in range(ns.rounds):
                    best_a = min(best_a, run_once(plain, argv, a_out))
                    best_b = min(best_b, run_once(compiled, argv, b_out))
                same = same_files(a_out, b_out) if best_a[2] and best_b[2] else "run failed"
                print(f"| {w} | {n:,} | {best_a[0]:.2f} | {best_b[0]:.2f} | "
                      f"{best_b[0] / best_a[0]:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
