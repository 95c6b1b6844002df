"""The typed core's switch (issue 14): whether a run is inside its coverage, and running
it there. twin/_corec.pyx is one SGLang replica's whole scheduler loop over state in C
arrays; the Python replica (twin/replica.py) is its specification and runs everything
else, and wherever the module is not built or `SERVETWIN_PURE_PYTHON` is set.

The coverage, checked here before anything runs (the first of docs/perf.md's plan): one
replica fed alone, open loop or by closed-loop clients (bench_serving's warm-up too),
SGLang's token pool with page 1, the radix cache on or off, mixed
chunks on or off, no host tier, swap or defragmentation, a policy whose every answer is
the queue as it is (fcfs), any other of SGLang's policies (lpm, dfs-weight, hrrn, lof,
random, shortest-prefill-first), or fcfs under SGLang's priority scheduling (with its
preemption), or any other policy without time slices or the users' preemption for KV,
asked pass by pass as the Python replica asks it (`run_order`: ORDER_ASK; its order,
admission limit, chunk questions, shortest-prefill-first's chunk cap, and under priority
scheduling its preempt questions), the step-time memo over a model whose
answers never change, no step log, no per-pass integrity checks. `why_not` names the
first thing outside it.

The gymnasium environment's replica asks an outside decider (twin/decider.py
`AgentDecider`): `start` makes its core, whose `run` returns at each question the agent
takes (the snapshot built from the core's columns) and goes on after the agent's answer
(docs/perf.md, eighteenth round).

In a fleet (docs/perf.md, fourteenth round) each SGLang replica inside `why_not_fleet`'s
coverage gets a core at `Deployment.start` (`adopt`) that SimPy runs pass by pass
(`life`): SimPy keeps ordering the replicas, the feeder, the health checks and the
faults."""

from __future__ import annotations

import os
from collections.abc import Iterator

import simpy

from twin.collector import paused
from twin.compiled import load
from twin.decider import AgentDecider, PolicyDecider
from twin.decode_cut import wait_or_cut
from twin.interrupt import sigint_taken
from twin.memory import TokenPool
from twin.policy.base import Policy
from twin.policy.sglang import (
    FCFS,
    HRRN,
    LOF,
    LPM,
    DFSWeight,
    Priority,
    Random,
    ShortestPrefillFirst,
)
from twin.prefix import RadixCache
from twin.replica import Replica

_CORE, WHY_NO_CORE = load("_corec", "typed core")


def why_not(rep) -> str | None:
    """None when `rep` (a replica built by twin/sim.py `build_replica`, not yet run) is
    inside the typed core's coverage; else what is outside it."""
    if _CORE is None:
        return WHY_NO_CORE or "the typed core is switched off"
    if os.environ.get("SERVETWIN_PYTHON_LOOP"):
        return "SERVETWIN_PYTHON_LOOP is set"
    feed = rep.feed
    src = getattr(feed, "source", None)
    checks = (
        (src is None or len(feed.replicas) != 1 or feed.fleet or feed.faults
         or feed._retry_at, "not one replica fed alone"),
        (src is not None and bool(src._warm), "warm-up requests not yet released"),
    )
    for bad, why in checks:
        if bad:
            return why
    return _outside(rep, run_order(rep))


def why_not_fleet(rep) -> str | None:
    """None when `rep`, a replica of a fleet (twin/fleet.py `build_fleet`, started:
    `Deployment.start` has set how runs are cut), is inside the coverage of the typed
    core run by SimPy (`life`; crashes and restarts by `Core.crash` and `Core.restart`);
    else what is outside it."""
    if _CORE is None:
        return WHY_NO_CORE or "the typed core is switched off"
    if os.environ.get("SERVETWIN_PYTHON_LOOP"):
        return "SERVETWIN_PYTHON_LOOP is set"
    if type(rep) is not Replica:
        return "not an SGLang replica"
    if type(rep.decider) is not PolicyDecider:
        return "an outside decider"
    return _outside(rep, run_order(rep))  # (a `slow` fault: no step-time memo)


def adopt(rep, dep) -> None:
    """Give `rep` (inside `why_not_fleet`'s coverage) its typed core, before any process
    of the fleet runs: `life` runs it, the load poller reads its queues
    (`Core.queue_load`)."""
    order = run_order(rep)
    ranks = None
    if order == _CORE.ORDER_HRRN:  # hrrn's tie-break: every rid's place in sorted order
        ranks = dep.__dict__.get("_rid_ranks")
        if ranks is None:
            src = dep.source
            every = [e[2].rid for e in src._ready] + [r.rid for r in src._pending or ()]
            ranks = dep._rid_ranks = {rid: j for j, rid in enumerate(sorted(every))}
    rep._core = _new_core(rep, None, None, None, True, ranks)


def _outside(rep, order: int | None) -> str | None:
    """What of the replica itself is outside the coverage (None: nothing)."""
    args = rep.args
    pol = rep.policy
    checks = (
        (rep.tree is not None and (type(rep.tree) is not RadixCache
                                   or rep.tree.on_insert is not None or rep.tree.n_nodes),
         "a radix cache with a host tier, or already filled"),
        (type(rep.alloc) is not TokenPool or rep.page != 1, "not the token pool of page 1"),
        (args.enable_hierarchical_cache, "the host tier"),
        (rep.slice_s or rep.preempt and order not in (_CORE.ORDER_PRIORITY,
                                                       _CORE.ORDER_ASK),
         "preemption other than by priority, or time slices"),
        (type(rep.decider) not in (PolicyDecider, AgentDecider)
         or getattr(rep.decider, "log", None) is not None, "a logged decider"),
        (order is None, f"the policy {pol.name}"),
        (rep.swap.min_tokens is not None or rep.defrag.enabled, "swap or defragmentation"),
        (rep.debug or rep.step_log is not None, "--debug-checks or a step log"),
        (rep._cache is None or rep._cache_st is not rep.st, "no step-time memo"),
        (rep._stall or rep.env.now != 0.0 or rep._n_seen or rep.waiting or rep.running
         or rep._inbox, "a replica that already ran"),
    )
    for bad, why in checks:
        if bad:
            return why
    return None


# SGLang's own policies, each with the order the core gives it (without priority scheduling)
_SGLANG_ORDERS = {} if _CORE is None else {
    LPM: _CORE.ORDER_LPM, HRRN: _CORE.ORDER_HRRN, Random: _CORE.ORDER_RANDOM,
    DFSWeight: _CORE.ORDER_DFS, LOF: _CORE.ORDER_LOF,
    ShortestPrefillFirst: _CORE.ORDER_SPF}  # (with its cap on the active chunk)


def run_order(rep) -> int | None:
    """How the core orders a replica's queue (`run`, `start`, a fleet's `adopt`): as
    `order_kind` says for its policy, or else asked of Python pass by pass (ORDER_ASK) as
    the Python replica asks it: a policy's `decide`, or an outside decider (the
    gymnasium environment's agent), its chunk questions too, and a policy's preempt
    questions under priority scheduling; None: outside the coverage (the users'
    preemption for KV, an outside agent under priority scheduling, a chunk cap other
    than shortest-prefill-first's)."""
    pol = rep.policy
    if type(rep.decider) is PolicyDecider:
        kind = order_kind(pol)
        if kind is not None:
            return kind
    if pol.preempts_for_kv or (rep.preempt and type(rep.decider) is not PolicyDecider):
        return None  # (an outside agent's preempt question could not wait mid-pass)
    if getattr(pol, "chunk_limit", None) not in (None, ShortestPrefillFirst.chunk_limit):
        return None
    return _CORE.ORDER_ASK


def order_kind(pol: Policy) -> int | None:
    """How the core orders the queue for `pol`: as it is (a policy whose every answer is
    the queue as it is: fcfs), by one of SGLang's other policies (themselves, without
    priority scheduling), by priority with SGLang's preemption (fcfs under
    `--enable-priority-scheduling`), or None: outside the coverage."""
    if pol.chunks or pol.preempts_for_kv:
        return None
    if not pol.priority_scheduling and type(pol) in _SGLANG_ORDERS:
        return _SGLANG_ORDERS[type(pol)]
    if getattr(pol, "chunk_limit", None) is not None:
        return None
    if (pol.keeps_queue_order()
            and type(pol).wants_prefix_match is Policy.wants_prefix_match):
        return _CORE.ORDER_FCFS
    if (type(pol) in (FCFS, Priority) and pol.priority_scheduling
            and type(pol).order is Policy.order
            and type(pol).decide is Policy.decide and type(pol).victims is Policy.victims):
        return _CORE.ORDER_PRIORITY
    return None


def _columns(src) -> tuple[list[float], list[float], list]:
    """The source's requests in the order the scheduler takes them in (its heap's
    order: arrival at the scheduler, then seq): arrival times, client send times, and
    the requests."""
    ready = sorted(src._ready)
    cols = ([t for t, _, _ in ready], [src._sent.get(seq, t) for t, seq, _ in ready],
            [req for _, _, req in ready])
    src._ready, src._sent = [], {}  # the core holds them now (a day's worth of tuples)
    return cols


def run(rep) -> bool:
    """Run `rep` (inside the coverage: `why_not` is None) to its end in the typed core;
    its `finished`, `series`, counters, allocator and timeline end as the Python loop
    leaves them. True when Ctrl-C stopped it (between passes: every request is whole;
    the caller records the unfinished ones, as twin/interrupt.py's callers do)."""
    # Python's cyclic collector off meanwhile: what the run allocates forms no cycles (an
    # evicted radix node is unlinked from its parent), so each collection would only walk
    # the live requests and records again (docs/perf.md, thirteenth round)
    try:
        with paused(), sigint_taken() as stopped:  # (checked by the core every 256 passes)
            src = rep.feed.source
            cols = _columns(src) if src.open_loop else None  # (the source's lists go)
            core = _new_core(rep, cols, src, stopped)
            return core.run()
    except KeyboardInterrupt:  # raised, not signalled (a progress callback, a test)
        return True


def _new_core(rep, cols, src, stopped, fed: bool = False, ranks: dict | None = None):
    kind = run_order(rep)
    if kind != _CORE.ORDER_ASK:
        return _CORE.Core(rep, cols, src, stopped, kind, fed, ranks)
    d = rep.decider
    skip = type(d) is PolicyDecider and d.policy.keeps_queue_order()
    return _CORE.Core(rep, cols, src, stopped, kind, fed, ranks, asker=d.ask,
                      ask_all=rep.decider_takes_all, ask_skip=skip)


def start(rep):
    """The typed core for `rep` (inside `why_not`'s coverage; an outside decider's:
    the gymnasium environment's episode), built and not yet run: its `run()` runs to
    the next question the decider leaves pending (`asking`) or to the end (`ended`);
    the decider's `answer` hands the core its plan. The replica's fields are written
    back at each return, as `run` leaves them."""
    src = rep.feed.source
    cols = _columns(src) if src.open_loop else None
    core = _new_core(rep, cols, src, None)
    if isinstance(rep.decider, AgentDecider):
        rep.decider.core = core
    return core


def life(rep) -> Iterator[simpy.Event]:
    """A fleet replica's process (`Replica.run`'s place; inside `why_not_fleet`'s
    coverage), each pass run by the typed core up to where the Python replica yields:
    the same sleeps, idles and cut runs at the same times, so SimPy orders them among the
    other replicas', the feeder's and the health checks' events as it orders the Python
    replica's. Its requests come from the deployment's submits (the core's columns
    grow); they leave through the deployment (`feed.left`). `rep._core` keeps the core:
    `Deployment.finalize` settles the replica's fields from it (a run stopped early)."""
    core = rep._core  # (`adopt`)
    env = rep.env
    step = core.fleet_pass
    prefill, run, cut, idle, end = (_CORE.F_PREFILL, _CORE.F_RUN, _CORE.F_CUT,
                                    _CORE.F_IDLE, _CORE.F_END)
    while True:
        got = step(env.now)
        if got == run or got == prefill:
            ev = rep._sleep(core.sleep_s)
            if ev is not None:
                yield ev
            if got == run:
                core.after_decode(env.now)
            else:
                core.after_prefill(env.now)
        elif got == cut:
            yield from wait_or_cut(rep, core.sleep_s, core.cut)
            core.after_decode(env.now)
        elif got == idle:
            yield from rep._idle(env.now)
        elif got == end:
            core.settle()
            return
