"""`servetwin claims`: the users' claims re-checked with the twin, as a table."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def register(sub: argparse._SubParsersAction) -> None:
    from experiments.claims import CHECKS

    p = sub.add_parser("claims", help="re-check the users' claims with the twin",
                       description="Re-check the users' claims (head-of-line blocking, "
                       "preemptive scheduling, memory, prefix sharing, CUDA graphs) on their "
                       "deployment and print claim, their number, the twin's, the config.")
    p.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run, _parser=p)


def run(ns: argparse.Namespace) -> int:
    from experiments.claims import run_all, table

    claims = run_all(ns.only, progress=lambda n: print(f"checking {n} ...", file=sys.stderr,
                                                        flush=True))
    if ns.json:
        print(json.dumps([asdict(c) for c in claims], indent=2))
    else:
        print(table(claims))
    return 0
