"""One SGLang server as a SimPy process: SGLang 0.5.x's scheduler loop.

Each iteration mirrors `Scheduler.get_next_batch_to_run`: pull the requests that arrived,
try to build a prefill batch under SGLang's budgets (`PrefillAdder`: max prefill tokens,
chunk size, running-request cap, KV room minus `new_token_ratio` x the running requests'
future tokens); if one is built it runs (prefill takes precedence; `--enable-mixed-chunk`
adds the decodes to it); otherwise the running batch decodes, retracting requests when KV
runs out. Between events that change the batch, decode steps are advanced together: their
durations come from the backend's vectorised `decode_times`.

What is modelled and what is not is listed in docs/architecture.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

import numpy as np
import simpy

from twin import config as C
from twin.admission import CONTINUE, NO_TOKEN, Adder
from twin.chunk_cache import cache_chunk
from twin.compiled import load
from twin.config import Capacity, ServerArgs
from twin.decider import AgentDecider, Decider, PolicyDecider
from twin.decode_cut import CutRuns
from twin.errors import ServetwinError
from twin.inbox import Inbox
from twin.memory import KVAllocator, TokenPool
from twin.overlap import FreedLater
from twin.perf import StepTimeModel
from twin.perf.step_cache import memo_for
from twin.policy import CLIP_MAX_NEW_TOKENS, Plan, Policy, Snapshot
from twin.policy.base import ChunkPlan, keyed_order
from twin.policy.check import validate_chunk_plan
from twin.prefix import RadixCache
from twin.replica_memory import Counters, DefragConfig, KVMemory, SwapConfig
from twin.request_state import SimRequest
from twin.views import RunningViews, view
from twin.workload import Request

# the decode pass compiled (twin/_loopc.pyx; `_run_decode` below is its specification)
_LOOP_C, WHY_LOOP_PYTHON = load("_loopc", "scheduler loop")

__all__ = ["Counters", "DefragConfig", "Feed", "Replica", "SwapConfig"]


class Feed(Protocol):
    """Where a replica's requests come from (a deployment: a source behind a router).

    `pump(now)` hands every request due by `now` to its replica (`Replica.submit`);
    `next_arrival()` is the time of the next hand-off that may reach this replica (None:
    none until a request finishes, or ever); `done()` says no request will ever come
    again; `left(replica, req)` is told of every request that leaves (closed-loop clients
    send their next one); `unsent()` drains, at the horizon, what was never sent."""

    def pump(self, now: float) -> None: ...
    def next_arrival(self) -> float | None: ...
    cuts_runs: bool  # a submit cuts a decode run short: runs need not end at next_arrival
    def done(self) -> bool: ...
    def left(self, replica: Replica, req: SimRequest) -> None: ...
    def unsent(self) -> list[tuple[float, Request]]: ...


def _time_invariant(st: StepTimeModel) -> bool:
    """Whether a step-time model's answers never change during a run (no wrapper in its
    chain carries a `factor` that a fault may move)."""
    while st is not None:
        if hasattr(st, "factor"):
            return False
        st = getattr(st, "inner", None) or getattr(st, "base", None)
    return True


class Replica(Inbox, KVMemory, CutRuns):
    """The simulated server. `run()` is its SimPy process; `finished` collects every
    request that left (ok, rejected or aborted)."""

    def __init__(self, env: simpy.Environment, args: ServerArgs, cap: Capacity,
                 step_time: StepTimeModel, policy: Policy, feed: Feed | None,
                 allocator: KVAllocator | None = None, *, horizon_s: float | None = None,
                 sample_every_s: float = 1.0, debug_checks: bool = False,
                 swap: SwapConfig | None = None, defrag: DefragConfig | None = None,
                 decider: Decider | None = None, ignore_eos: bool = True,
                 overlap: bool = False) -> None:
        self.env, self.args, self.cap, self.st = env, args, cap, step_time
        self.policy, self.feed = policy, feed
        self.name = "replica"
        self._inbox: list[tuple[float, Request]] = []
        self._wake = env.event()  # succeeds when a request is submitted to an idle replica
        self.decider = decider or PolicyDecider(policy)
        self.ignore_eos = ignore_eos
        self.alloc = allocator or TokenPool(cap.max_total_num_tokens)
        self.tree = None if args.disable_radix_cache else RadixCache(
            on_evict=lambda node: self.alloc.free(-node.nid))
        self.page = cap.page_size
        self.horizon = horizon_s
        self.debug = debug_checks
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.chunked: SimRequest | None = None
        #: the policy's answer for the chunk due: (request, its computed tokens, plan, the
        #: decode step count `n_dec_steps` its decode-only passes end at); stale once that
        #: chunk ran (`_chunk_parked`). A run cut short gives its steps back to the count,
        #: and so to the park (twin/decode_cut.py)
        self._chunk_due: tuple[SimRequest, int, ChunkPlan, int] | None = None
        self._park_until = 0  # this pass parks: its decode run ends at this step count
        self.finished: list[SimRequest] = []
        self.batch_full = False
        self.shrunk = False  # the running batch lost requests since the last pass
        self.preempt = args.enable_priority_scheduling or policy.preempts
        self.slice_s = policy.time_slice_s
        # an outside decider sees every order question; a policy only real choices
        self.decider_takes_all = not isinstance(self.decider, PolicyDecider)
        self.swap = swap or SwapConfig()
        self.defrag = defrag or DefragConfig()
        self._since_defrag = 0
        self._tracks_moves = self.alloc.name in ("buddy", "contiguous")
        self._moved_seen = 0
        self.host_used = 0.0  # bytes of swapped-out KV in host memory
        self._stall = 0.0  # copy time (swap, compaction) to charge before the next step
        self.init_ratio = min(C.INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * C.MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / C.NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        # end times of every step that decoded, in chunks (one per decode run or mixed step)
        self._end_chunks: list[np.ndarray] = []
        self._end_blocks: list[np.ndarray] = []  # older chunks, folded (`_add_ends`)
        self.n_dec_steps = 0
        self.counters = Counters()
        if args.enable_hierarchical_cache:
            self._init_hicache()  # a host tier behind the radix cache (twin/hicache.py)
        self.series: list[tuple] = []  # (t, running, waiting, kv_used, cached, ratio)
        self._sample_every = sample_every_s
        self._next_sample = 0.0
        self._n_seen = 0
        self.progress = None  # optional callback(done, sim_time)
        # with `log_steps`, every step as ("prefill"|"mixed", start, [(rid, extend)], [rids])
        # or ("decode", start, [rids], k steps)
        self.step_log: list[tuple] | None = None
        self._unplaced: list[SimRequest] = []  # requests this pass admitted but not placed
        self._placed_any = True  # whether the last prefill pass placed anything
        self.cur_batch: list[SimRequest] = []  # the prefill batch being run
        # SGLang's overlap loop: finished requests free their slot and KV a pass later,
        # and a request that arrives while a step runs is taken in a pass later
        self.freed_later = FreedLater() if overlap else None
        self._known = 0  # inbox entries the last pass saw and left (received meanwhile)
        self._scheduled_at: float | None = None  # the pass time of the step in flight
        self._pass_at = 0.0  # the time of the current pass
        self._fast_clock = type(env) is simpy.Environment  # see `_sleep`
        self._counts_only = type(self.alloc) is TokenPool  # decode_steps is room // batch
        self._dt_cache: tuple = (None, 0, 0, np.empty(0))  # `_decode_times`
        # exact memo of the step times (twin/perf/step_cache.py) for a model whose answers
        # never change during the run
        self._cache = memo_for(step_time) if _time_invariant(step_time) else None
        self._cache_st = step_time  # the model the memo answers for (`self.st` may change)

    def _sleep(self, dur: float) -> simpy.Event | None:
        """The replica is busy for `dur` seconds: the event to wait on, or None when the
        clock was moved on at once. When the replica's wake-up would be the next event of
        the whole simulation anyway (nothing else is scheduled before it), SimPy would pop
        it at once and resume this process: setting the clock is the same, exactly, and
        skips the event (issue 14). Not on a real-time environment."""
        env = self.env
        t = env._now + dur
        if self._fast_clock and t < env.peek():
            env._now = t
            return None
        return env.timeout(dur)

    def wait_in_events(self) -> None:
        """From now on every busy period waits on an event (`_sleep` moves the clock on no
        more), so that a run stopped between events (twin/interrupt.py) stops soon."""
        self._fast_clock = False

    # ---- memory helpers -------------------------------------------------------------
    def room(self) -> int:
        """KV tokens a scheduling pass may count on: free, evictable cached tokens, and the
        block space only the cache pins (block allocators)."""
        held = self.freed_later.tokens if self.freed_later is not None else 0
        if self.tree is None:
            return self.alloc.available() - held
        return (self.alloc.available() + self.tree.evictable_tokens + self.alloc.cache_slack()
                - held)

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> Iterator[simpy.Event]:
        same_t, spins = -1.0, 0
        while True:
            now = self.env.now
            spins = spins + 1 if now == same_t else 0
            same_t = now
            if spins > 100_000:
                raise RuntimeError(f"scheduler livelock at t={now}: 100,000 passes without "
                                   f"time advancing ({len(self.waiting)} waiting, "
                                   f"{len(self.running)} running)")
            if self.debug:
                self.check_integrity()
            self._pull_arrivals(now)
            if self.freed_later is not None and self.freed_later.turn():
                self.batch_full = False  # the held slots are free from this pass on
            if now >= self._next_sample:
                self._sample(now)
            if self.horizon is not None and now >= self.horizon:
                break
            if self._stall > 0:
                stall, self._stall = self._stall, 0.0
                self.counters.stall_s += stall
                ev = self._sleep(stall)
                if ev is not None:
                    yield ev
                continue
            if self.shrunk:  # SGLang filters the batch at the top of every pass: a
                self.shrunk = False  # smaller batch clears batch_is_full
                self.batch_full = False
            batch = yield from self._schedule_prefill(now)
            if batch:
                yield from self._run_prefill(batch)
                if not self._placed_any and self.running:
                    yield from self._run_decode()  # none could be placed: decode frees KV
            elif self.running:
                yield from self._run_decode()
            elif self.freed_later is not None and self.freed_later.release():
                self.batch_full = False  # nothing in flight: the last result is
                continue  # processed at once, its slots are free
            else:
                self.batch_full = False
                self.new_token_ratio = self.init_ratio  # SGLang re-inits when idle
                if self._inbox:
                    continue
                if self.waiting or self.chunked is not None:
                    if self.feed.next_arrival() is None:
                        self._reject_stuck()
                        continue
                elif self.feed.done():
                    break
                yield from self._idle(now)
        self._end(self.env.now)

    def _pull_arrivals(self, now: float) -> None:
        self.feed.pump(now)
        inbox, self._inbox = self._inbox, []
        cutoff, self._scheduled_at, self._pass_at = self._scheduled_at, None, now
        if not inbox:  # most passes: nothing received (`_seen_by` of an empty inbox)
            self._known = 0
            return
        if self.freed_later is not None:
            inbox, self._inbox = self._seen_by(inbox, cutoff)
        recv = now if cutoff is None else cutoff
        for sent, req in inbox:
            r = SimRequest(req, sent, self._n_seen)
            r.queue_entry_s = r.entered_s = recv  # SGLang's wait_queue_entry_time
            r.arrival_work = self.counters.prefill_tokens  # arrival_processed_tokens
            r.ignore_eos = self.ignore_eos if req.ignore_eos is None else req.ignore_eos
            self._n_seen += 1
            if not self._validate(r):
                continue
            self.waiting.append(r)

    def _seen_by(self, inbox: list[tuple[float, Request]], cutoff: float | None
                 ) -> tuple[list[tuple[float, Request]], list[tuple[float, Request]]]:
        """SGLang's overlap loop receives requests at the top of an iteration, which
        begins as the step before the one in flight ends: the next step is scheduled
        while the one in flight runs. So this pass (scheduling the step that starts now)
        takes what had arrived when the step in flight was scheduled (`cutoff`, that
        pass's time): the requests the last pass left in the inbox, at its front. What
        came later is received now and scheduled a pass later. With nothing in flight
        (cutoff None) the idle scheduler receives everything at once. (Counting entries,
        not comparing times: which pass a request reached first is what matters.)
        Returns (taken, left)."""
        n = len(inbox) if cutoff is None else min(self._known, len(inbox))
        taken, left = inbox[:n], inbox[n:]
        self._known = len(left)
        return taken, left

    def _validate(self, r: SimRequest) -> bool:
        """SGLang's input checks: too long a prompt is refused; `max_new_tokens` beyond the
        request length limit is clipped by SGLang (and the record says so)."""
        cap = self.cap
        if r.prompt_tokens >= cap.max_req_input_len:
            self._leave(r, "rejected", f"prompt of {r.prompt_tokens} tokens exceeds SGLang's "
                        f"max_req_input_len {cap.max_req_input_len} (context_len "
                        f"{cap.context_len}, max_total_num_tokens {cap.max_total_num_tokens})")
            return False
        max_req_len = min(cap.context_len, cap.max_total_num_tokens)
        room = max_req_len - r.prompt_tokens - 1
        if r.max_new_tokens > room:
            r.error = (f"max_new_tokens clipped by SGLang from {r.max_new_tokens} to {room} "
                       f"(max_req_len {max_req_len})")
            r.max_new_tokens = room
        return True

    # ---- prefill ----------------------------------------------------------------------
    def _schedule_prefill(self, now: float) -> Iterator[simpy.Event]:
        """One pass of SGLang's `get_new_batch_prefill`; returns the batch (or None).
        A generator: each decision comes from the decider, which may answer later."""
        if self.preempt:
            self.batch_full = False  # SGLang resets it to try preemption each pass
        if self.chunked is not None:
            self.batch_full = False  # SGLang frees the chunked request's slot each pass
            if self.policy.chunks and self._chunk_parked():
                return None  # a decode-only pass: the chunk sits out, nobody is admitted
        elif not self.waiting or self.batch_full:
            return None
        running_bs = len(self.running)
        held = self.freed_later.slots if self.freed_later is not None else 0  # in flight
        if running_bs + held >= self.cap.max_running_requests and self.chunked is None \
                and not self.preempt:
            self.batch_full = True
            return None
        admit = yield from self._order_waiting(now)
        mixed = running_bs if (self.args.enable_mixed_chunk and self.running) else 0
        adder = Adder(self, mixed)
        if self.chunked is not None:
            self.chunked = adder.add_chunked(self.chunked, self._chunk_limit(adder))
        for i, req in enumerate(list(self.waiting)):
            if admit is not None and i >= admit:
                break  # the policy withholds the rest of the queue this pass
            if len(adder.can_run) + len(self.running) + held >= self.cap.max_running_requests:
                self.batch_full = True
            if self.batch_full:
                if not self.preempt:
                    break
                ok = yield from self._try_preempt(i, req, adder)
                if not ok:
                    break
            if not self.policy.wants_prefix_match(len(self.waiting)):
                self._match(req)
            res = adder.add_one(req)
            if res == NO_TOKEN and self.policy.preempts_for_kv and self.running and not (
                    adder.can_run and adder.can_run[-1][0] is req):
                # the users' design: preempt for KV as well as for request slots
                ok = yield from self._try_preempt(i, req, adder)
                if ok:
                    res = adder.add_one(req)
            if res != CONTINUE:
                if res == NO_TOKEN:
                    self.batch_full = True
                break
        if adder.new_chunked is not None:
            self.chunked = adder.new_chunked
        if not adder.can_run:
            return None
        admitted = {id(r) for r, _ in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        return adder.can_run

    def _chunk_limit(self, adder: Adder) -> int | None:
        r = self.chunked
        if r is None:
            return None
        own = None
        if self.policy.chunks:  # the chunk question's cap; the next chunk asks anew
            due, self._chunk_due = self._chunk_due, None
            if due is not None and due[0] is r and due[1] == r.computed:
                own = due[2].limit
        limit = getattr(self.policy, "chunk_limit", None)
        if limit is None:
            return own
        ratio = self.new_token_ratio
        cap = limit(self._chunked_view(r), tuple(view(w, ratio, False) for w in self.waiting),
                    adder.rem_chunk or 0, self.page)
        return own if cap is None else cap if own is None else min(cap, own)

    def _chunk_parked(self) -> bool:
        """Whether this pass is one of the decode-only passes the policy asked for before
        the chunk due (`ChunkPlan.park`); asks the chunk question once per chunk."""
        r = self.chunked
        due = self._chunk_due
        if due is None or due[0] is not r or due[1] != r.computed:
            plan = self._ask_chunk(r)
            due = self._chunk_due = (r, r.computed, plan, self.n_dec_steps + plan.park)
        parked = bool(self.running) and due[3] > self.n_dec_steps
        self._park_until = due[3] if parked else 0
        return parked

    def first_chunk_limit(self, r: SimRequest) -> int | None:
        """The chunk question for a prompt's first chunk, asked when admission would cut
        `r` (a policy with `chunks`): its `limit`, page-aligned, caps that chunk; `park`
        does not apply (`r` is not running yet: holding it back is the order's question)."""
        if not self.policy.chunks:
            return None
        plan = self._ask_chunk(r, view(r, self.new_token_ratio, False))
        if plan.limit is None:
            return None
        return max(self.page, plan.limit // self.page * self.page)

    def _chunked_view(self, r: SimRequest):
        """The chunked request's view: `prefix_len` is its tokens computed so far."""
        return replace(view(r, self.new_token_ratio, False), prefix_len=r.computed)

    def _ask_chunk(self, r: SimRequest, seen=None) -> ChunkPlan:
        snap = self.snapshot(self.env.now, lazy=True)  # answered at once, not kept
        plan = self.policy.chunk(snap, self._chunked_view(r) if seen is None else seen,
                                 self.cap.chunked_prefill_size or 0, self.page)
        snap.running.close()
        why = validate_chunk_plan(plan, self.page)
        if why:
            raise ServetwinError(f"policy {self.policy.name!r} broke its contract at "
                                 f"t={self.env.now}: chunk question: {why}")
        return plan

    def snapshot(self, now: float, candidate: int | None = None,
                 tokens_needed: float = 0.0, lazy: bool = False) -> Snapshot:
        """The frozen view of this server a decision is made from. `lazy`: the running
        views are built only if the policy reads them (`RunningViews`; the caller closes
        them once answered), for a decision made at once and not kept."""
        ratio = self.new_token_ratio
        return Snapshot(
            now=now, waiting=tuple(view(r, ratio, False) for r in self.waiting),
            running=RunningViews(self.running, ratio) if lazy else
            tuple(view(r, ratio, True) for r in self.running),
            kv_free=self.alloc.available(), kv_evictable=self.evictable(),
            kv_capacity=self.cap.max_total_num_tokens, new_token_ratio=ratio,
            max_running_requests=self.cap.max_running_requests,
            processed_tokens=self.counters.prefill_tokens, candidate=candidate,
            tokens_needed=tokens_needed)

    def _decide(self, now: float, candidate: int | None = None,
                tokens_needed: float = 0.0) -> Iterator[simpy.Event]:
        """The decider's plan for a question asked from a snapshot of now. A decider that
        keeps no snapshot gets the running views on demand: a policy answering at once
        with nothing recorded, or an agent (the gymnasium environment), which reads them
        while this process waits for its answer (nothing moves the batch meanwhile); the
        views are closed once the plan is in."""
        d = self.decider
        lazy = (type(d) is PolicyDecider and d.log is None) or type(d) is AgentDecider
        snap = self.snapshot(now, candidate, tokens_needed, lazy)
        ans = d.ask(snap)
        if not isinstance(ans, Plan):
            ans = yield ans
        if lazy:
            snap.running.close()
        return ans

    def _order_waiting(self, now: float) -> Iterator[simpy.Event]:
        """Order the queue; returns how many of it may be admitted (None: all)."""
        if self.policy.wants_prefix_match(len(self.waiting)):
            for r in self.waiting:
                self._match(r)
        if len(self.waiting) < 2 and not self.decider_takes_all:
            return None
        d = self.decider
        if type(d) is PolicyDecider and d.log is None:  # the policy's answer without a
            if d.policy.keeps_queue_order():  # snapshot, where it needs none (issue 14)
                return None
            key = d.policy.sort_key() if type(d.policy).decide is Policy.decide else None
            if key is not None:  # its `order` is `keyed_order` over the waiting views
                ratio = self.new_token_ratio
                order = keyed_order([view(r, ratio, False) for r in self.waiting], key)
                self.waiting = [self.waiting[i] for i in order]
                return None
        plan = yield from self._decide(now)
        self.waiting = [self.waiting[i] for i in plan.order]
        return plan.admit

    def _try_preempt(self, i: int, req: SimRequest, adder: Adder) -> Iterator[simpy.Event]:
        """Priority preemption (`PrefillAdder.preempt_to_schedule`): the decider names the
        victims; they leave the batch with their reservations credited to the budget."""
        self._match(req)
        needed = (req.fill_len - req.prefix_len + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                  - adder.rem_total())
        if not self.running:
            return False
        plan = yield from self._decide(self.env.now, i, needed)
        if not plan.victims:
            return False
        for j in sorted(plan.victims, reverse=True):
            victim = self.running.pop(j)
            adder.total_offset -= adder.reserved(victim)
            self._release_to_queue(victim, preempted=True)
        return True

    def _run_prefill(self, batch: list[tuple[SimRequest, int]]) -> Iterator[simpy.Event]:
        self.cur_batch = [r for r, _ in batch]  # what a crash loses besides the queues
        if self._stall > 0:  # victims' KV must reach the host before its room is reused
            stall, self._stall = self._stall, 0.0
            self.counters.stall_s += stall
            ev = self._sleep(stall)
            if ev is not None:
                yield ev
        now = self.env.now
        self._scheduled_at = self._pass_at if self.freed_later is not None else None
        restored, swap_in_s = [], 0.0
        self._unplaced = []
        for req, ext in list(batch):
            if req.swapped_tokens:
                batch.remove((req, ext))
                swap_in_s += self._swap_in(req, restored)
                continue
            if req.computed == 0:  # a new round: its matched prefix is cached
                if not self._reserve(req):
                    batch.remove((req, ext))
                    self._requeue_unplaced(req)
                    continue
                req.computed = req.prefix_len
                req.cached_tokens += req.prefix_len
                if req.first_admit_s is None:
                    req.first_admit_s = now
                req.queued_s += now - req.queue_entry_s  # SGLang sums every round's wait
            if not self._take_kv(req.index, ext) and not self._make_room(req.index, ext):
                batch.remove((req, ext))
                self._abort_prefill(req)
                continue
            req.private += ext
        self._placed_any = bool(batch or restored)
        if not batch:
            if not restored and not self.running and self.chunked is None:
                self._abort_unplaceable()  # no progress is possible for them
            if swap_in_s:
                self.counters.stall_s += swap_in_s
                ev = self._sleep(swap_in_s)
                if ev is not None:
                    yield ev
            self._join_running(restored, self.env.now)
            return
        decoders = self.running if self.args.enable_mixed_chunk else []
        # SGLang mixes the decodes in only if they fit (check_decode_mem); else they sit
        # this step out: a mixed step never retracts
        if decoders and (self.room() < len(decoders) or not self._grow_decoders(decoders, 1)):
            decoders = []
        chunks = [(ext, req.computed) for req, ext in batch]
        self.counters.prefill_tokens += sum(ext for _, ext in batch)
        cache = self._cache
        if not decoders and cache is not None and self._cache_st is self.st:
            dur = cache.prefill(chunks) + swap_in_s
        else:
            dur = self.st.step_time(chunks, [r.fill_len for r in decoders]) + swap_in_s
        if self._load_s:  # HiCache load-backs, layer by layer under this step
            dur = self._with_load_back(dur)
        self.counters.stall_s += swap_in_s
        if self.step_log is not None:
            self.step_log.append(("mixed" if decoders else "prefill", now,
                                  [(r.rid, e) for r, e in batch], [r.rid for r in decoders]))
        if decoders:
            self.counters.mixed_steps += 1
        else:
            self.counters.prefill_steps += 1
        self.counters.busy_s += dur
        ev = self._sleep(dur)
        if ev is not None:
            yield ev
        end = self.env.now
        if decoders:
            self._add_ends(np.array([end]))
            self.n_dec_steps += 1
            self._advance(decoders, 1)
        for req, ext in batch:
            req.computed += ext
            if req is self.chunked:
                cache_chunk(self, req, end)  # SGLang caches the finished chunks
                continue
            self._prefill_done(req, end)
        self._join_running(restored, end)
        if decoders:
            self._finish_done(end)

    def _join_running(self, reqs: list[SimRequest], now: float) -> None:
        for req in reqs:
            req.dec_start = self.n_dec_steps
            req.round_start_s = now
            if req.left_batch_s is not None:
                req.lost_s += now - req.left_batch_s
                req.left_batch_s = None
            self.running.append(req)

    def _prefill_done(self, req: SimRequest, end: float) -> None:
        """The round's prefill completed: the next token is out, the prompt is cached."""
        req.generated_tokens += 1
        req.tok_events.append(end)
        if req.first_token_s is None:
            req.first_token_s = end
        if self.tree is not None:
            node, created = self.tree.insert(req.req.segments, end)
            for new in created:  # the cache takes over the request's slots, no copy
                self.alloc.transfer(req.index, -new.nid, new.tokens)
            own_prompt = req.prompt_tokens - req.prefix_len
            dup = own_prompt - sum(n.tokens for n in created)
            if dup:  # another request cached these segments meanwhile
                self.alloc.free_tokens(req.index, dup)
            req.private -= own_prompt
            old = req.node
            self.tree.lock(node)
            req.node = node
            if old is not None:
                self.tree.unlock(old)
        if req.remaining <= 0:
            self.shrunk = True  # SGLang's filter of the last prefill batch clears batch_is_full
            before = self.room()
            self._finish(req, end)
            if self.freed_later is not None:
                self.freed_later.add(1, self.room() - before)
        else:
            self._join_running([req], end)

    # ---- decode -----------------------------------------------------------------------
    def _run_decode(self) -> Iterator[simpy.Event]:
        if _LOOP_C is not None:  # the same pass compiled, where it covers it
            t0 = self.env.now
            got = _LOOP_C.decode(self)
            if got is not None:
                if got is False:  # requests were retracted: the next pass, at once
                    return
                if len(got) > 2:  # a fleet's run, which a submit may cut
                    ends = got[2]
                    yield from self._wait_or_cut(ends, len(ends), t0, got[3], got[4])
                else:
                    ev = self._sleep(got[0])
                    if ev is not None:
                        yield ev
                if got[1]:
                    self._finish_done(self.env.now)
                return
        running = self.running
        b = len(running)
        now = self.env.now
        self._scheduled_at = self._pass_at if self.freed_later is not None else None
        room = self.room()
        # 0 steps: the next one needs a decision (a block re-allocation, or a retraction)
        k_mem = room // b if self._counts_only else self.alloc.decode_steps(
            [r.index for r in running], room)
        fewest = min([r.max_new_tokens - r.generated_tokens for r in running])
        k = min(fewest, max(k_mem, 1))
        if self._park_until:  # decode-only passes before a chunk: one step each
            k = min(k, self._park_until - self.n_dec_steps)
            self._park_until = 0
        kv0 = sum([r.prompt_tokens + r.generated_tokens for r in running])
        cut = self._may_cut(b, k)  # in a fleet: end at own submits only (twin/decode_cut.py)
        limit = self._next_boundary(arrivals=not cut)
        cache = self._cache
        if (cache is not None and self._cache_st is self.st
                and (kv0 + b * (k - 1)) / b <= cache.quiet):
            times = cache.run(b, kv0, k, limit - now)  # bounded by the first step, as below
            k = len(times)
        else:
            times = self._decode_times(b, kv0, k)
            if k > 1:  # steps only lengthen as KV grows: bound k by the first step first
                bound = int((limit - now) / float(times[0])) + 1
                if bound < k:
                    k, times = bound, times[:bound]
        ends = times.cumsum()
        ends += now  # now + cumsum(times), as one array (the same floats)
        if ends[-1] > limit:
            k = min(int(ends.searchsorted(limit, side="left")) + 1, len(ends))
        if not self._grow_decoders(running, k):
            return
        dur_copy = self._stall  # re-allocation copies happen inside this run
        busy0, ratio0 = self.counters.busy_s, self.new_token_ratio
        self._stall = 0.0
        if self.step_log is not None:
            self.step_log.append(("decode", now, [r.rid for r in running], k))
        self._add_ends(ends[:k])
        self.n_dec_steps += k
        dur = float(ends[k - 1]) - now + dur_copy
        c = self.counters
        c.stall_s += dur_copy
        c.decode_steps += k
        c.busy_s += dur
        self.new_token_ratio = max(self.new_token_ratio - k * self.ratio_decay, self.min_ratio)
        for r in running:
            r.generated_tokens += k
            r.private += k
        done = k >= fewest  # the request with the fewest tokens left has them all
        if cut:
            yield from self._wait_or_cut(ends, k, now, busy0, ratio0)
        else:
            ev = self._sleep(dur)
            if ev is not None:
                yield ev
        if done:
            self._finish_done(self.env.now)

    def _decode_times(self, b: int, kv0: int, k: int) -> np.ndarray:
        """Durations of k decode steps of b requests from KV sum kv0. Every step's time is
        elementwise in its KV sum (the backend contract), so one call gives a whole run,
        and a run that continues the last one's batch (cut at a sample, a slice) reads
        the same array on."""
        st, cb, ckv, ctimes = self._dt_cache
        if st is self.st and b == cb and kv0 >= ckv and (kv0 - ckv) % b == 0:
            j = (kv0 - ckv) // b
            if j + k <= len(ctimes):
                return ctimes[j:j + k]
        times = self.st.decode_times(b, np.arange(kv0, kv0 + b * k, b))
        if _time_invariant(self.st):  # not a fleet's `slow` fault wrapper (its factor moves)
            self._dt_cache = (self.st, b, kv0, times)
        return times

    def _add_ends(self, ends: np.ndarray) -> None:
        """Append step end times; many small arrays are folded into one now and then
        (a day of traffic has millions of decode runs)."""
        chunks = self._end_chunks
        chunks.append(ends)
        if len(chunks) > 4096:
            self._end_blocks.append(np.concatenate(chunks[:-1]))
            del chunks[:-1]

    def _next_boundary(self, arrivals: bool = True) -> float | None:
        """The time at which a decode run must stop to let the scheduler look again."""
        candidates = [self._next_sample]
        if self.slice_s and self.waiting:  # a slice re-evaluates only if someone waits
            candidates.append((math.floor(self.env.now / self.slice_s + 1e-9) + 1)
                              * self.slice_s)
        if self.horizon is not None:
            candidates.append(self.horizon)
        fl = self.freed_later
        if fl is not None and (fl.slots or fl.tokens) and (self.waiting or self.chunked):
            candidates.append(self.env.now)  # one step: what it holds is free after it
        if fl is not None and self._inbox:  # received now: schedulable after one step
            candidates.append(self.env.now)
        if arrivals and (not self.batch_full or self.preempt):
            nxt = self.feed.next_arrival()
            if nxt is not None:
                candidates.append(nxt)
        return min(candidates)

    def _advance(self, reqs: list[SimRequest], k: int) -> None:
        for r in reqs:
            r.generated_tokens += k
            r.private += k

    def _finish_done(self, now: float) -> None:
        done = [r for r in self.running if r.generated_tokens >= r.max_new_tokens]
        if not done:
            return
        self.running = [r for r in self.running if r.generated_tokens < r.max_new_tokens]
        self.shrunk = True
        before = self.room()
        for r in done:
            self._finish(r, now)
        if self.freed_later is not None:
            self.freed_later.add(len(done), self.room() - before)
        self._maybe_defrag(len(done))

    def _retract(self) -> None:
        """SGLang's `retract_decode`: fewest generated tokens first (ties: longest prompt),
        until the rest can decode one more step; then re-estimate `new_token_ratio`.
        (When a block allocator refused a step the token count allowed, one request is
        retracted per pass until the step fits.)"""
        order = sorted(self.running, key=lambda r: (r.generated_tokens, -r.prompt_tokens),
                       reverse=True)
        first = True
        while first or self.alloc.decode_steps([r.index for r in order], self.room()) < 1:
            first = False
            if len(order) == 1:
                victim = order.pop()
                self._close_tokens(victim)
                self._release_kv(victim)
                self._leave(victim, "aborted", "KV cache too small to decode even this "
                            "request alone")
                break
            victim = order.pop()
            self._release_to_queue(victim, preempted=False)
            if self.tree is not None:  # release_req: evict at once what the rest need
                self.tree.evict(len(order) * C.RETRACT_DECODE_STEPS)
        self.running = [r for r in self.running if r in order]
        self.shrunk = True
        if order:
            gen = sum(r.generated_tokens for r in order)
            max_new = sum(r.max_new_tokens for r in order)
            self.new_token_ratio = min(1.0, (gen + C.RETRACT_DECODE_STEPS * len(order))
                                       / (max_new + 1))  # SGLang's +1

    def _abort_prefill(self, req: SimRequest) -> None:
        if req is self.chunked:
            self.chunked = None
        self._release_kv(req)
        self._leave(req, "aborted", "prefill out of memory: the KV pool cannot hold the "
                    "next chunk even after retracting every running request")

    # ---- leaving the batch --------------------------------------------------------------
    def _close_tokens(self, r: SimRequest) -> None:
        if r.dec_start >= 0:
            r.tok_events.append((r.dec_start, self.n_dec_steps))
            r.dec_start = -1

    def _release_to_queue(self, r: SimRequest, preempted: bool) -> None:
        self._close_tokens(r)
        self._swap_out(r)
        self._release_kv(r)
        r.computed = 0
        r.round_start_s = None
        r.left_batch_s = self.env.now
        r.queue_entry_s = self.env.now
        r.arrival_work = self.counters.prefill_tokens
        if preempted:
            r.preemptions += 1
            self.counters.preemptions += 1
        else:
            r.retractions += 1
            self.counters.retractions += 1
        self.waiting.append(r)

    def _finish(self, r: SimRequest, now: float) -> None:
        self._close_tokens(r)
        out_kv = r.generated_tokens - 1  # the last token never enters the KV cache
        if self.tree is not None and r.private > 0:
            # SGLang caches the finished sequence; outputs are unique to the request
            segs = r.req.segments + (((-(r.index + 1), out_kv),) if out_kv > 0 else ())
            _, created = self.tree.insert(segs, now)
            for new in created:
                self.alloc.transfer(r.index, -new.nid, new.tokens)
            r.private = 0
        self._release_kv(r)
        r.finish_s = now
        self._leave(r, "ok", r.error)

    def _leave(self, r: SimRequest, status: str, error: str) -> None:
        r.status, r.error = status, error
        r.view_cache = None  # no decision sees it again: a day's worth of views freed
        if r.finish_s is None:
            r.finish_s = self.env.now
        self.finished.append(r)
        self.feed.left(self, r)

    def _reject_stuck(self) -> None:
        """Nothing runs and nothing can be admitted: should not happen after `_validate`;
        if it does, the head request leaves with the numbers instead of hanging."""
        r = self.waiting.pop(0)
        self._leave(r, "aborted", f"could not be admitted into an idle server: needs "
                    f"{r.fill_len - r.prefix_len} + {min(r.remaining, C.CLIP_MAX_NEW_TOKENS)} "
                    f"tokens, KV room {self.alloc.available() + self.evictable()}")

    def _end(self, now: float) -> None:
        for r in [*self.running, *([self.chunked] if self.chunked else []), *self.waiting]:
            self._close_tokens(r)
            self._leave(r, "aborted", f"simulation horizon {self.horizon}s reached")
        for sent, req in [*self._inbox, *self.feed.unsent()]:
            r = SimRequest(req, sent, self._n_seen)
            self._n_seen += 1
            self._leave(r, "aborted", f"not sent before the horizon {self.horizon}s")
        self._inbox = []
        self.running, self.waiting, self.chunked = [], [], None

    # ---- faults (hooks for a fleet, twin/cluster.py; a single server never calls them) --
    def crash(self, reason: str) -> None:
        """The server dies now (its process was interrupted): every request inside leaves
        'aborted' with `reason`, keeping only the tokens emitted by now; the KV pool and the
        radix cache empty, as a restarted server's."""
        now = self.env.now
        ends = self.step_end
        keep = int(np.searchsorted(ends, now, side="right"))
        self._end_chunks, self._end_blocks, self.n_dec_steps = [ends[:keep]], [], keep
        live = [*self.running, *([self.chunked] if self.chunked else []), *self.waiting,
                *[r for r in self.cur_batch if not r.status]]
        live = list({id(r): r for r in live}.values())
        self.running, self.waiting, self.chunked, self.cur_batch = [], [], None, []
        for r in live:
            self._close_tokens(r)
            r.tok_events = [(e[0], min(e[1], keep)) if isinstance(e, tuple) else e
                            for e in r.tok_events if (e[0] < keep if isinstance(e, tuple)
                                                      else e <= now)]
            r.swapped_tokens = 0
            self._release_kv(r)
            self._leave(r, "aborted", reason)
        inbox, self._inbox = self._inbox, []
        for sent, req in inbox:
            r = SimRequest(req, sent, self._n_seen)
            self._n_seen += 1
            self._leave(r, "aborted", reason)
        if self.tree is not None:
            self.tree.evict(self.tree.total_tokens)
        if self.hicache is not None:
            self.hicache.clear()  # host memory goes with the server (counters stay)
        self.host_used = 0.0

    def restart(self) -> None:
        """Back after a repair: a fresh scheduler over the (empty) pool; `run()` again."""
        self.batch_full = self.shrunk = False
        self._known, self._scheduled_at = 0, None
        self.new_token_ratio = self.init_ratio
        self._stall = 0.0
        self._wake = self.env.event()
        self._placed_any, self._unplaced = True, []
        if self.freed_later is not None:
            self.freed_later = FreedLater()

    # ---- observation ------------------------------------------------------------------
    def _sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        cached = self.tree.total_tokens if self.tree else 0
        stored, allocated, largest, internal, external = self.alloc.series_columns()
        self.series.append((round(now, 6), len(self.running), len(self.waiting), stored,
                            allocated, largest, cached, round(self.new_token_ratio, 4),
                            internal, external))
        self._next_sample = (math.floor(now / self._sample_every) + 1) * self._sample_every
        if self.progress is not None:
            self.progress(len(self.finished), now)

    @property
    def step_end(self) -> np.ndarray:
        """End time of every step that decoded (decode and mixed steps), in order."""
        parts = self._end_blocks + self._end_chunks
        return np.concatenate(parts) if parts else np.empty(0)

    def check_integrity(self) -> None:
        self.alloc.check_integrity()
        tree_tokens = self.tree.total_tokens if self.tree else 0
        live = [*self.running, *self.waiting, *([self.chunked] if self.chunked else [])]
        private = sum(r.private for r in live)
        assert self.alloc.stored() == tree_tokens + private, (
            self.alloc.stored(), tree_tokens, private)
        if self.tree:
            self.tree.check_integrity()
        if self.hicache is not None:
            self.hicache.check_integrity()
