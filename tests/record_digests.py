"""Digests (sha256) of the files a fixed set of small `servetwin simulate` runs writes.

The speed work (issue 14) must leave every record byte-identical; `test_record_digests.py`
re-runs these and compares against `tests/data/record_digests.json`. Regenerate the file
ONLY when a behaviour change is intended (say so in the commit), from a clean main:

    python -m tests.record_digests --update      # rewrite the stored digests
    python -m tests.record_digests               # print which runs differ (no writes)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).parent / "data" / "record_digests.json"
FILES = ("requests.jsonl", "summary.json", "timeseries.csv")

VIDUR = "arrival=poisson,rate={rate},n={n},prompt=uniform:1000:4000,output=uniform:100:500"
LLAMA = ["--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "a100-sxm-80gb"]
ROOF = ["--step-time-backend", "roofline"]
OPDB = ["--step-time-backend", "opdb"]
TIERS = "tiers=0:0.8/10:0.15/20:0.05"
SHARED = ("arrival=poisson,rate=8,n=300,prompt=uniform:200:3000,output=uniform:20:300,"
          "templates=6,template_len=1024,share=0.7,system_prompt=256")

# name -> `servetwin simulate` arguments (without --out)
RUNS: dict[str, list[str]] = {
    "default": [*LLAMA, *OPDB, "--workload", VIDUR.format(rate=1.5, n=300)],
    "h100-rate5": ["--model-path", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm-80gb", *OPDB,
                   "--workload", VIDUR.format(rate=5, n=1500)],
    "mixed-chunk+lpm": [*LLAMA, *ROOF, "--enable-mixed-chunk", "--schedule-policy", "lpm",
                        "--workload", SHARED],
    "buddy+moderate+slices": [*LLAMA, *ROOF, "--kv-allocator", "buddy",
                              "--buddy-min-block", str(16 * 2**20),
                              "--max-total-tokens", "60000", "--preemption-mode", "moderate",
                              "--time-slice-ms", "50", "--preemption-threshold", "0.5",
                              "--workload", VIDUR.format(rate=6, n=250) + "," + TIERS],
    "paged": [*LLAMA, *OPDB, "--page-size", "16", "--max-total-tokens", "50000",
              "--workload", VIDUR.format(rate=5, n=250)],
    "priority": [*LLAMA, *ROOF, "--enable-priority-scheduling", "--max-running-requests", "12",
                 "--workload", VIDUR.format(rate=6, n=250) + "," + TIERS],
    "shared-prefix-radix": [*LLAMA, *ROOF, "--workload", SHARED],
    # the typed core's coverage (twin/core.py): no radix cache
    "no-radix": [*LLAMA, *OPDB, "--disable-radix-cache", "--workload",
                 VIDUR.format(rate=1.5, n=300)],
    "no-radix-retract": [*LLAMA, *ROOF, "--disable-radix-cache", "--max-total-tokens", "15000",
                         "--no-ignore-eos", "--disable-overlap-schedule",
                         "--chunked-prefill-size", "1024", "--workload",
                         VIDUR.format(rate=10, n=250)],
    "retract-heavy": [*LLAMA, *ROOF, "--max-total-tokens", "15000", "--no-ignore-eos",
                      "--workload", VIDUR.format(rate=10, n=250)],
    "aggressive+swap": [*LLAMA, *ROOF, "--max-total-tokens", "40000",
                        "--preemption-mode", "aggressive", "--swap-min-tokens", "500",
                        "--workload", VIDUR.format(rate=6, n=200) + "," + TIERS],
    "contiguous+defrag": [*LLAMA, *ROOF, "--kv-allocator", "contiguous",
                          "--max-total-tokens", "60000", "--defrag-every", "20",
                          "--workload", VIDUR.format(rate=4, n=200)],
    "finance-qa-horizon": [*ROOF, "--seed", "3", "--horizon", "120"],
    "fleet": ["--deployment", "finance-sglang-pool", "--workload",
              "arrival=closed,concurrency=20,n=150,prompt=uniform:200:6000,"
              "output=uniform:20:300,templates=4,template_len=1024,system_prompt=256"],
    # the users' hybrid (SGLang behind cache_aware, vLLM pools by length) with a crash of an
    # SGLang replica: the fleet core's crash and restart, the vLLM block cache
    "fleet-hybrid+crash": ["--deployment", "finance-hybrid", "--workload",
                           "finance-qa,n=500,clients=replay", "--fault", "crash:sg0:40:30"],
}


def run_digests(name: str) -> dict[str, str]:
    """Run one named case in this process; sha256 of each file it wrote."""
    from servetwin.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["simulate", *RUNS[name], "--out", tmp])
        if rc != 0:
            raise RuntimeError(f"run {name} exited with {rc}")
        out = {}
        for f in FILES:
            p = Path(tmp) / f
            if p.exists():
                out[f] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out


def stored() -> dict[str, dict[str, str]]:
    return json.loads(DATA.read_text()) if DATA.exists() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true",
                    help="rewrite tests/data/record_digests.json (intended behaviour changes only)")
    ap.add_argument("names", nargs="*", default=list(RUNS))
    ns = ap.parse_args(argv)
    old, new, differ = stored(), {}, []
    for name in ns.names:
        new[name] = run_digests(name)
        same = old.get(name) == new[name]
        differ += [] if same else [name]
        print(f"{name:28s} {'same' if same else 'DIFFERS'}", flush=True)
    if ns.update:
        DATA.write_text(json.dumps({**old, **new}, indent=2, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
        return 0
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
