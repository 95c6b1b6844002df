"""`servetwin live replay` and `servetwin live compare`: argument parsing and printing.

replay drives a live SGLang server with a workload (`runtime.client`) and writes the same
files as `servetwin simulate --out`; compare prints two such directories side by side
(`twin.compare`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from servetwin.args import add_workload_args, workload_from
from twin.errors import ConfigError
from twin.outputs import atomic_write_text, check_out_dir
from twin.workload import SPEC_HELP


def register_replay(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay a workload on a live SGLang server and record it",
        description="Drive a live SGLang server with the requests the twin simulates "
        "(streaming /generate), and write requests.jsonl, summary.json, replay.json and "
        "/server_info and /metrics snapshots to --out. Exits non-zero when the server stops "
        "answering or the load generator itself is late (records are written anyway).",
        epilog=SPEC_HELP)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    add_workload_args(p)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--max-lateness-ms", type=float, default=50.0,
                   help="fail when the client's P99 send lateness exceeds this (default 50)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="give up on a request after S s without data (default 600)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocab size (default: read from the server's model "
                   "config.json when the server runs on this machine)")
    p.add_argument("--no-flush-cache", action="store_true",
                   help="keep the server's radix cache (default: flush it before the run)")
    p.add_argument("--scrape-every", type=float, default=None, metavar="S",
                   help="scrape the server's /metrics every S seconds during the replay into "
                   "metrics_series.jsonl (for `servetwin alerts eval`; docs/monitoring.md)")
    p.set_defaults(func=run_replay)


def run_replay(ns: argparse.Namespace) -> int:
    from runtime.client import INTERRUPTED, ReplayConfig, replay
    from runtime.server_api import ReplayError, probe
    from twin.inputs import POSITIVE, Rule, check, check_optional
    from twin.metrics import format_summary, summarize

    workload = workload_from(ns)
    check("--max-lateness-ms", ns.max_lateness_ms, POSITIVE)
    check("--request-timeout", ns.request_timeout, POSITIVE)
    check_optional("--scrape-every", ns.scrape_every, POSITIVE)
    check_optional("--vocab-size", ns.vocab_size, Rule(integer=True, lo=5))  # ids from 3
    check_out_dir(ns.out)
    url = ns.url.rstrip("/")
    cfg = ReplayConfig(url=url, seed=ns.seed, max_lateness_s=ns.max_lateness_ms / 1e3,
                       request_timeout_s=ns.request_timeout, vocab_size=ns.vocab_size,
                       flush_cache=not ns.no_flush_cache)
    n = len(workload.requests)
    try:
        facts = probe(url, ns.vocab_size)
    except ReplayError as exc:
        _write_empty(ns.out)
        raise ReplayError(f"{exc}; nothing was sent, {ns.out}/requests.jsonl is empty") from None
    _print_header(workload, facts)
    progress = Progress(n)
    scraper = None
    if ns.scrape_every:
        from runtime.live_metrics import Scraper

        scraper = Scraper(url, ns.scrape_every, chain=progress)
        with scraper:
            result = replay(workload, cfg, scraper.hook, facts)
    else:
        result = replay(workload, cfg, progress, facts)
    progress.close()
    result.write(ns.out)
    if scraper is not None:
        scraper.write(ns.out)
    print(format_summary(summarize(result.records)))
    late = result.lateness
    if late["n"]:
        print(f"client lateness (ms): P50 {late['p50']:.2f}  P99 {late['p99']:.2f}  "
              f"max {late['max']:.2f}  (bound P99 <= {ns.max_lateness_ms:g})")
    print(f"wrote {ns.out}/requests.jsonl ({len(result.records)} records), summary.json, "
          "replay.json, server_info_*.json, metrics_*.prom"
          + (f", metrics_series.jsonl ({len(scraper.samples)} scrapes)" if scraper else ""))
    if result.stop_reason == INTERRUPTED:
        m = result.meta
        print(f"servetwin live replay: {INTERRUPTED}: {m['sent']} of {m['requests']} requests "
              f"were sent; {ns.out}/requests.jsonl has all {len(result.records)} (in flight "
              "and never sent: aborted), summary.json is marked partial", file=sys.stderr)
        return 130
    result.check()
    return 0


def _write_empty(out: Path) -> None:
    """An unreachable server still leaves an (empty) record file: nothing was sent."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "requests.jsonl", "")


def _print_header(workload, facts) -> None:
    mode = (f"closed loop, {workload.concurrency} clients" if workload.concurrency
            else "open loop")
    print(f"workload: {workload.name} ({len(workload.requests)} requests, {mode})")
    print(f"server: SGLang {facts.version}, model {facts.info.get('model_path')}; "
          f"vocab {facts.vocab_size} ({facts.vocab_source}); priority "
          f"{'sent' if facts.priority_scheduling else 'off'}")
    limit = facts.context_length
    too_long = [r.rid for r in workload.requests
                if limit and r.prompt_tokens + r.output_tokens > limit]
    if too_long:
        print(f"note: {len(too_long)} requests exceed the server's context length {limit} "
              f"(e.g. {too_long[0]}); the server will refuse them (status rejected)")


class Progress:
    """Progress lines on stderr: in place on a terminal, every 10 s otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.last, self.tty = total, 0.0, sys.stderr.isatty()
        self.start = time.monotonic()

    def __call__(self, run) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 10:
            return
        self.last = now
        done = run.done_counts()
        text = (f"{now - self.start:6.0f} s: sent {len(run.logs)}/{self.total}, in flight "
                f"{run.in_flight}, done {sum(done.values())} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(done.items())) or '-'})")
        print("\r" + text if self.tty else text, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.last:
            print(file=sys.stderr)


def register_compare(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare two runs (twin vs live) of the same workload",
        description="Print the comparison table of two output directories (each with a "
        "requests.jsonl from `servetwin simulate --out` or `servetwin live replay --out`): "
        "P50/P90/P99 of TTFT, TPOT, ITL, E2E and queue time, throughput and the "
        "cached-token share, with signed relative errors (A - B) / B: B is the reference.")
    p.add_argument("dir_a", type=Path, metavar="DIR_A", help="e.g. the twin's run")
    p.add_argument("dir_b", type=Path, metavar="DIR_B", help="the reference, e.g. the live run")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=run_compare)


def run_compare(ns: argparse.Namespace) -> int:
    from twin.compare import compare_records, format_markdown, format_table
    from twin.metrics import read_records

    recs = []
    for d in (ns.dir_a, ns.dir_b):
        path = d / "requests.jsonl"
        if not path.is_file():
            raise ConfigError(f"{d}: no requests.jsonl (an --out directory of `servetwin "
                              "simulate` or `servetwin live replay` expected)")
        recs.append(read_records(path))
    cmp = compare_records(*recs)
    fmt = format_markdown if ns.markdown else format_table
    print(f"A = {ns.dir_a}\nB = {ns.dir_b}")
    print(fmt(cmp, "A", "B"))
    return 0
