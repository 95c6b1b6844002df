"""The plugin's hooks inside SGLang 0.5.23's scheduler process (docs/plugin.md).

Four hooks, registered with SGLang's `HookRegistry` (AROUND):
- `Scheduler.__init__`: after SGLang's own, build the policy with the server's settings,
  check that the other hooks are in place (`__wrapped__`), say which policy runs, open the
  decision log;
- `SchedulePolicy.calc_priority`: SGLang's original (its sort switched off when the
  policy's order replaces it), then the policy's order (validated) applied to the
  waiting queue in place;
- `Scheduler.get_prefill_adder_class`: a `PrefillAdder` subclass whose
  `preempt_to_schedule` asks the policy for victims and commits them with SGLang's own
  release steps, and whose `add_one_req` does the same on NO_TOKEN for a policy that
  `preempts_for_kv` (then retries the request once); its `add_chunked_req`,
  `budget_state`, `add_one_req` and `preempt_to_schedule` keep a parked pass empty;
- `SchedulePolicy.shortest_prefill_chunk_limit`: for a policy that `chunks`, the chunk
  question (runtime/plugin/chunk.py): SGLang's own limit capped by the policy's, or this
  pass parked (decode-only) before the chunk.

The engine is sacred: every hook catches every exception, logs once per kind of failure,
counts it in `COUNTERS` and falls back to SGLang's own behaviour for that pass. SGLang's
hook wrappers catch nothing, and an exception in the scheduler kills the server.

State: one `PluginRuntime` per scheduler process (`_RUNTIME`). Module-level because
SGLang's hooks are module-level functions patched into its classes; with TP 1 there is one
scheduler per process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from operator import itemgetter
from pathlib import Path

from runtime.plugin import decisions
from runtime.plugin.chunk import ChunkQuestions
from runtime.plugin.preempt import PreemptQuestions
from runtime.plugin.ranks import RankLink
from runtime.plugin.views import (
    LazyViews,
    WaitingViews,
    entry_views,
    sort_keys,
)
from twin.policy.base import Plan, Snapshot
from twin.policy.check import validate_plan

log = logging.getLogger("servetwin.plugin")

POLICY_ENV = "SERVETWIN_POLICY"
BUDGET_ENV = "SERVETWIN_POLICY_BUDGET_MS"
LOG_ENV = "SERVETWIN_DECISION_LOG"
DEFAULT_BUDGET_MS = 5.0

T_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
T_ORDER = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
T_ADDER = "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class"
T_CHUNK = "sglang.srt.managers.schedule_policy.SchedulePolicy.shortest_prefill_chunk_limit"
TARGETS = (T_INIT, T_ORDER, T_ADDER, T_CHUNK)

#: fallbacks by kind ("raised", "invalid"), decisions slower than the budget ("slow",
#: applied nonetheless), every decision by outcome, and the preemptions committed for KV
#: room (the users' design; SGLang preempts only for request slots), the chunk questions
#: answered validly, the decode-only passes parked for them and the first chunks capped
COUNTERS: dict[str, int] = {"raised": 0, "invalid": 0, "slow": 0, "decisions": 0,
                            "applied": 0, "native": 0, "kv_preemptions": 0, "followed": 0,
                            "chunk_plans": 0, "parked_passes": 0, "first_chunks_capped": 0}
_RUNTIME: PluginRuntime | None = None
_SPEC = None  # the PolicySpec `install` was given


def _setup_logger() -> None:
    if not log.handlers:  # our own handler: SGLang's logging config may drop INFO
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[servetwin.plugin %(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def install(spec) -> None:
    """Register the hooks (SGLang applies them after every plugin's `load` has run)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _SPEC
    _setup_logger()
    _SPEC = spec
    HookRegistry.register(T_INIT, _scheduler_init_hook, HookType.AROUND)
    HookRegistry.register(T_ORDER, _calc_priority_hook, HookType.AROUND)
    HookRegistry.register(T_ADDER, _adder_class_hook, HookType.AROUND)
    HookRegistry.register(T_CHUNK, _chunk_limit_hook, HookType.AROUND)


def _chunk_hooks_missing() -> bool:
    """Whether the chunk question cannot be applied: its hook or the adder's is absent
    (outside a server, offline, both are: tests switch `chunks` on themselves)."""
    try:
        return bool({T_CHUNK, T_ADDER} & set(hooks_missing()))
    except Exception:
        return True


def hooks_missing() -> list[str]:
    """The targets that do not carry a wrapper (`__wrapped__`): hooks not in place."""
    import importlib

    missing = []
    for target in TARGETS:
        module, cls, attr = target.rsplit(".", 2)
        obj = getattr(getattr(importlib.import_module(module), cls, None), attr, None)
        if not hasattr(obj, "__wrapped__"):
            missing.append(target)
    return missing


# --- the hooks (each one catches everything) ---------------------------------------------

def _scheduler_init_hook(original, scheduler, *args, **kwargs):
    original(scheduler, *args, **kwargs)
    global _RUNTIME
    rt = None
    try:
        rt = PluginRuntime.start(_SPEC, scheduler)
    except Exception:
        log.exception("servetwin plugin could not start; SGLang's own scheduling runs")
    _RUNTIME = _on_every_rank(rt, scheduler)


def _on_every_rank(rt: PluginRuntime | None, scheduler) -> PluginRuntime | None:
    """With TP > 1 the plugin runs on every rank or on none (ranks.py): rank 0 decides,
    the others follow, so all must be in place. The same code on every rank: a failure
    to build the link happens on all of them."""
    try:
        link = RankLink.of(scheduler)
    except Exception:
        log.exception("servetwin plugin: no link between the TP ranks; SGLang's own "
                      "scheduling runs")
        return None
    if link is None:
        return rt
    if not link.agree(rt is not None and not hooks_missing()):
        log.error("servetwin plugin: not in place on every TP rank; SGLang's own "
                  "scheduling runs on all of them")
        return None
    rt.link = link
    log.info("servetwin plugin: TP rank %d of a linked group: %s", link.tp_rank,
             "decides for every rank" if link.leader else "applies rank 0's decisions")
    return rt


def _calc_priority_hook(original, policy_obj, waiting_queue, running_batch=None,
                        processed_tokens=0):
    rt = _RUNTIME
    if rt is not None:
        rt.begin_pass(running_batch)  # two assignments: cannot fail
    if rt is None or rt.native or len(waiting_queue) < 2:
        before = list(waiting_queue) if rt is not None and rt.logs_native else None
        original(policy_obj, waiting_queue, running_batch, processed_tokens=processed_tokens)
        if rt is not None:
            rt.guarded_order(waiting_queue, running_batch, processed_tokens, before)
        return
    # the policy's sort replaces SGLang's: SGLang's original runs for its prefix matching
    # (and prefix touches) only, then the policy orders the queue
    skipped = rt.run_without_sort(original, policy_obj, waiting_queue, running_batch,
                                  processed_tokens)
    # a skipped sort means a cache-agnostic SGLang policy ran: no prefix matched
    if not rt.guarded_order(waiting_queue, running_batch, processed_tokens, None,
                            matched=not skipped) and skipped:  # the policy failed: SGLang's own sort for this pass after all
        original(policy_obj, waiting_queue, running_batch, processed_tokens=processed_tokens)


def _chunk_limit_hook(original, policy_obj, chunked_req, waiting_queue, budget, page_size):
    own = original(policy_obj, chunked_req, waiting_queue, budget, page_size)
    rt = _RUNTIME
    if rt is None or not rt.chunks:
        return own
    try:
        return rt.on_chunk_limit(chunked_req, waiting_queue, budget, page_size, own)
    except Exception as exc:  # on_chunk_limit's policy call catches its own; the last guard
        rt.pass_park = None
        rt.failed("raised", "chunk hook", exc)
        return own


_ADDER_CLASSES: dict[type, type] = {}


def _adder_class_hook(original, scheduler):
    base = original(scheduler)
    if _RUNTIME is None:
        return base
    try:
        if base not in _ADDER_CLASSES:
            _ADDER_CLASSES[base] = _make_adder_class(base)
        return _ADDER_CLASSES[base]
    except Exception as exc:
        _RUNTIME.stop_tracking()  # SGLang's own adder forgets no examined request
        _RUNTIME.failed("raised", "prefill adder class", exc)
        return base


def _make_adder_class(base: type, results=None) -> type:
    """`results`: SGLang's `AddReqResult` (tests hand in a stand-in with the same names)."""
    if results is None:
        from sglang.srt.managers.schedule_policy import AddReqResult as results

    no_token, other = results.NO_TOKEN, results.OTHER

    class ServetwinPrefillAdder(base):
        """SGLang's PrefillAdder; `preempt_to_schedule` asks the servetwin policy, and so
        does `add_one_req` when a request finds no KV room and the policy
        `preempts_for_kv` (then it retries the request once). In a parked pass
        (`ChunkPlan.park`) `add_chunked_req` leaves the chunked request untouched and the
        pass admits nobody: SGLang builds no prefill batch and decodes."""

        _servetwin_parked = False  # this adder's pass is a parked one (one adder a pass)
        _servetwin_continuing = False  # the chunked request's chunk was cut this pass

        def add_chunked_req(self, req):
            rt = _RUNTIME
            try:
                parked = rt is not None and rt.take_park()
            except Exception as exc:
                rt.failed("raised", "chunk park", exc)
                parked = False
            if parked:  # SGLang's own early return: no KV computed, nothing to stash
                self._servetwin_parked = True
                return req
            res = super().add_chunked_req(req)
            if res is not None:
                self._servetwin_continuing = True
            return res

        def _servetwin_would_cut(self, req) -> bool:
            """Whether SGLang would cut `req` into a second unfinished chunked request:
            after a chunk cut under a cap (the chunk answer's), budget is left, and
            `get_new_batch_prefill` asserts there is one chunked request. SGLang guards
            its own cap (shortest-prefill-first) the same way (`OTHER`)."""
            rem = self.rem_chunk_tokens
            if rem is None:
                return False
            page = max(int(self.page_size), 1)
            ext = len(req.full_untruncated_fill_ids) - req.prefix_len
            return -(-ext // page) * page > rem

        def _servetwin_first_chunk(self, rt, req) -> None:
            """The chunk question for `req`'s first chunk when SGLang would cut it (the
            twin: `Adder.add_one`): the cap becomes this pass's `rem_chunk_tokens`, so
            SGLang's own cut takes that many tokens and the pass ends there. Any failure:
            SGLang's own cut."""
            try:
                if not self._servetwin_would_cut(req):
                    return
                limit = rt.first_chunk_limit(req, int(self.rem_chunk_tokens),
                                             int(self.page_size))
                if limit is not None and limit < self.rem_chunk_tokens:
                    self.rem_chunk_tokens = limit
                    rt.counters["first_chunks_capped"] += 1
            except Exception as exc:
                rt.failed("raised", "first chunk", exc)

        def budget_state(self):
            if self._servetwin_parked:  # the admission loop breaks before any candidate
                return other
            return super().budget_state()

        def add_one_req(self, req, *args, **kwargs):
            rt = _RUNTIME
            if rt is not None:
                rt.waiting_views.forget(req)  # examined: its prefix match was just redone
                if self._servetwin_parked or rt.withholds(req):  # SGLang's admission loop
                    return other  # stops here, as on a spent budget (also `Plan.admit`)
            if self._servetwin_continuing:  # one unfinished chunked request per pass
                try:
                    if self._servetwin_would_cut(req):
                        return other
                except Exception as exc:  # not sure it fits whole: do not admit it
                    if rt is not None:
                        rt.failed("raised", "second chunk guard", exc)
                    return other
            elif rt is not None and rt.chunks:
                self._servetwin_first_chunk(rt, req)
            res = super().add_one_req(req, *args, **kwargs)
            if res != no_token or rt is None or not rt.kv_preempts:
                return res
            try:
                freed = rt.on_kv_shortfall(self, req)
            except Exception as exc:  # on_kv_shortfall catches its own; the last guard
                rt.failed("raised", "kv preempt hook", exc)
                return res
            return super().add_one_req(req, *args, **kwargs) if freed else res

        def preempt_to_schedule(self, req) -> bool:
            own = super().preempt_to_schedule
            rt = _RUNTIME
            if self._servetwin_parked:  # a parked pass makes no room for anyone
                return False
            if rt is None:
                return own(req)
            if rt.withholds(req):  # withheld this pass: no room is made for it
                return False
            try:
                return rt.on_preempt(self, req, own)
            except Exception as exc:  # on_preempt catches its own; the last guard
                rt.failed("raised", "preempt hook", exc)
                return False

    ServetwinPrefillAdder.__qualname__ = f"Servetwin{base.__name__}"
    return ServetwinPrefillAdder


# --- the runtime ----------------------------------------------------------------------------

class PluginRuntime(PreemptQuestions, ChunkQuestions):
    """The policy, its log and its counters inside one scheduler process."""

    def __init__(self, spec, policy, policy_args: dict, server_policy: str, native: bool,
                 budget_ms: float, log_path: str | None, scheduler=None) -> None:
        self.spec, self.policy, self.native = spec, policy, native
        self.budget_s = budget_ms / 1000
        self.scheduler = scheduler
        self.counters = COUNTERS
        self._warned: set[str] = set()
        self.log_path = log_path
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None
        self.logs_native = native and self._log is not None
        #: the users' design: preempt for KV room too, not only for request slots
        self.kv_preempts = not native and bool(getattr(policy, "preempts_for_kv", False))
        self.pass_queue: list | None = None  # this pass's waiting queue (the scheduler's list)
        self.pass_views: tuple | None = None  # its views: (views, order applied to them)
        self.pass_running: LazyViews | None = None  # views of this pass's running batch
        self._enums = None  # SGLang's policy enums, imported at the first skipped sort
        self.processed_tokens = 0
        #: the policy's order as a per-request key (`Policy.sort_key`), kept across passes
        self.sort_key = None if native else policy.sort_key()
        self.waiting_views = WaitingViews(self.sort_key)
        #: whether a waiting request's fields change only where `WaitingViews` is told
        #: (see there); otherwise every pass checks them
        self.tracks_changes = _changes_are_tracked(scheduler)
        self.pass_entries: tuple | None = None  # this pass's (entries, order): sort key path
        self.pass_held: set | None = None  # ids of the requests `Plan.admit` holds back
        #: TP > 1: rank 0 decides and the other ranks apply its answers (ranks.py)
        self.link: RankLink | None = None
        #: the chunk question (chunk.py): asked only with its hook and the adder's in place
        self.chunks = bool(getattr(policy, "chunks", False)) and not _chunk_hooks_missing()
        self.chunk_due = self.pass_park = self.pass_batch = None
        if self._log is not None:
            server = {"schedule_policy": server_policy, "tp_rank": _tp_rank()}
            self._write(decisions.header_line(spec.to_json(), policy_args, server, native,
                                              budget_ms))
            self._write_counters()

    @classmethod
    def start(cls, spec, scheduler) -> PluginRuntime:
        from twin.policy.registry import build_policy

        args = {"priority_scheduling": bool(scheduler.enable_priority_scheduling),
                "low_values_first": bool(scheduler.schedule_low_priority_values_first),
                "preemption_threshold": int(scheduler.priority_scheduling_preemption_threshold)}
        policy = build_policy(spec, **args)
        server_policy = scheduler.policy.policy.value  # after SGLang's own adjustment
        native = (policy.sglang_name == server_policy
                  and bool(getattr(policy, "priority_scheduling", False))
                  == args["priority_scheduling"])
        budget = float(os.environ.get(BUDGET_ENV) or DEFAULT_BUDGET_MS)
        log_path = os.environ.get(LOG_ENV) or None
        rank = _tp_rank()
        if log_path and rank:  # TP > 1: rank 0's log has the decisions, the others' own
            log_path = f"{log_path}.rank{rank}"
        rt = cls(spec, policy, args, server_policy, native, budget, log_path, scheduler)
        rt.announce(server_policy, args)
        return rt

    def announce(self, server_policy: str, args: dict) -> None:
        how = ("natively: SGLang's own sort, decisions only logged" if self.native else
               f"through the plugin, on top of SGLang's --schedule-policy {server_policy}")
        slice_s = getattr(self.policy, "time_slice_s", None)
        log.info("servetwin policy %r %s (params %s, server %s, budget %.1f ms%s%s%s)",
                 self.spec.name, how, self.spec.params, args, self.budget_s * 1000,
                 f", time slice {slice_s * 1000:.0f} ms" if slice_s else "",
                 ", chunk questions" if self.chunks else "",
                 f", decision log {self.log_path}" if self.log_path else "")
        missing = hooks_missing()
        if missing:
            log.error("servetwin plugin: hooks NOT in place on %s; the policy does not run "
                      "there (SGLang's own behaviour)", ", ".join(missing))
        else:
            log.info("servetwin plugin: hooks in place on %s", ", ".join(TARGETS))

    # order ------------------------------------------------------------------------------
    def run_without_sort(self, original, policy_obj, queue, running_batch,
                         processed_tokens) -> bool:
        """SGLang's `calc_priority` with its sort switched off (as if it ran fcfs without
        priority scheduling): its prefix matching, when a cache that matches fast asks
        for it, and its prefix touches still run. Only for a cache-agnostic active policy:
        a cache-aware one's matching is entwined with its sort (in-batch deferral), so it
        runs whole. Returns whether the sort was skipped."""
        try:
            fcfs = self._fcfs_unless_cache_aware(policy_obj, queue)
        except Exception as exc:
            self.failed("raised", "sort skip", exc)
            fcfs = None
        if fcfs is None:
            original(policy_obj, queue, running_batch, processed_tokens=processed_tokens)
            return False
        saved = policy_obj.policy, policy_obj.enable_priority_scheduling
        policy_obj.policy, policy_obj.enable_priority_scheduling = fcfs, False
        try:
            original(policy_obj, queue, running_batch, processed_tokens=processed_tokens)
        finally:
            policy_obj.policy, policy_obj.enable_priority_scheduling = saved
        return True

    def _fcfs_unless_cache_aware(self, policy_obj, queue):
        if self._enums is None:
            from sglang.srt.managers import schedule_policy as sp

            self._enums = (sp.CacheAwarePolicy, sp.CacheAgnosticPolicy.FCFS)
        cache_aware, fcfs = self._enums
        active = policy_obj._determine_active_policy(queue)
        return None if isinstance(active, cache_aware) else fcfs

    def followed(self) -> None:
        """A follower rank applied rank 0's answer (TP > 1)."""
        self.counters["followed"] += 1
        if self._log is not None:
            self._write_counters()

    def withholds(self, req) -> bool:
        """Whether this pass's order answer holds `req` back (`Plan.admit`)."""
        held = self.pass_held
        return held is not None and id(req) in held

    def stop_tracking(self) -> None:
        self.tracks_changes = False
        self.waiting_views.clear()

    def guarded_order(self, queue: list, running_batch, processed_tokens: int,
                      before, matched: bool = True) -> bool:
        """`on_order`, and the last guard around it; whether the policy's order applied.
        `matched`: SGLang's `calc_priority` may have redone prefix matches this pass."""
        try:
            return self.on_order(queue, running_batch, processed_tokens, before, matched)
        except Exception as exc:  # on_order catches its own
            self.failed("raised", "order hook", exc)
            return False

    def on_order(self, queue: list, running_batch, processed_tokens: int, before,
                 matched: bool = True) -> bool:
        self.pass_queue, self.pass_views, self.pass_running = queue, None, None
        self.pass_entries = self.pass_held = None
        self.processed_tokens = processed_tokens
        if self.native:
            if before is not None:
                self._log_native_order(queue, running_batch, before)
            return False
        if len(queue) < 2:  # no choice to make; the twin does not ask either
            return False
        t0 = time.perf_counter()
        if self.link is None:
            got = self._decide_order(queue, running_batch, matched, t0)
        else:  # TP > 1: rank 0 decides for every rank (runtime/plugin/ranks.py)
            got = self._decide_order(queue, running_batch, matched, t0) \
                if self.link.leader else None
            plan = self.link.share_order(got[0] if got else None, len(queue))
            if plan is None or not _is_permutation(plan, len(queue)):
                return False  # rank 0 fell back (or the queues differ): SGLang's own
            if got is None:  # a follower applies rank 0's answer
                self._apply_order(queue, plan)
                self.followed()
                return True
        if got is None:
            return False
        plan, snap, entries = got
        self._apply_order(queue, plan)
        self.pass_entries = (entries, plan.order)  # permuted if a preempt question asks
        self.decided(snap, plan, "applied", self._timed(t0, "order"))
        return True

    def _decide_order(self, queue: list, running_batch, matched: bool, t0: float):
        """The policy's checked order answer `(plan, snapshot, entries)`; None when it
        failed (counted and logged: SGLang's own sort for this pass)."""
        snap = plan = None
        try:
            checked = matched or not self.tracks_changes or self._storage_on()
            entries = self.waiting_views.entries(queue, checked)
            if self.sort_key is not None:  # the policy's `keyed_order`, keys kept
                keys = sort_keys(entries)
                plan = Plan(order=tuple(sorted(range(len(keys)), key=keys.__getitem__)))
                why = None  # a permutation by construction
                if self._log is not None:
                    snap = self.order_snapshot(entry_views(entries), running_batch)
                else:
                    self._pass_running(running_batch, self._ratio())
            else:
                snap = self.order_snapshot(entry_views(entries), running_batch)
                plan = self.policy.decide(snap)
                why = None if _is_permutation(plan, len(queue)) and plan.admit is None \
                    else validate_plan(snap, plan)
        except Exception as exc:
            self.failed("raised", "order", exc, snap, None, t0)
            return None
        if why:
            self.failed("invalid", "order", why, snap, plan, t0)
            return None
        return plan, snap, entries

    def _apply_order(self, queue: list, plan: Plan) -> None:
        queue[:] = itemgetter(*plan.order)(queue)  # a tuple: the queue has 2 or more
        if plan.admit is not None:  # the admission loop stops at the first one held back
            self.pass_held = set(map(id, queue[plan.admit:]))

    def order_snapshot(self, waiting: tuple, running_batch) -> Snapshot:
        ratio = self._ratio()
        return self._snapshot(waiting, self._pass_running(running_batch, ratio), ratio)

    def _pass_running(self, running_batch, ratio: float) -> LazyViews:
        """This pass's running views, built when first read; nothing a running view reads
        changes before this pass's preempt questions, which reuse them."""
        self.pass_running = LazyViews(running_batch.reqs if running_batch is not None
                                      else (), True, ratio)
        return self.pass_running

    def _log_native_order(self, queue: list, running_batch, before: list) -> None:
        t0 = time.perf_counter()
        try:
            pos = {id(r): i for i, r in enumerate(before)}
            order = tuple(pos[id(r)] for r in queue)
            snap = self.order_snapshot(self.waiting_views.of(before), running_batch)
            self.pass_views = (snap.waiting, order)
        except Exception as exc:
            self.failed("raised", "native order log", exc)
            return
        self.decided(snap, Plan(order=order), "native", (time.perf_counter() - t0) * 1e6)

    # shared -------------------------------------------------------------------------------
    def _storage_on(self) -> bool:
        s = self.scheduler
        return bool(getattr(s, "enable_hicache_storage", False)
                    or getattr(s, "enable_lmcache", False))

    def _ratio(self) -> float:
        tracker = getattr(self.scheduler, "new_token_ratio_tracker", None)
        return float(tracker.current) if tracker is not None else 0.7

    def _snapshot(self, waiting, running, ratio, **question) -> Snapshot:
        s = self.scheduler
        return Snapshot(now=time.perf_counter(), waiting=waiting, running=running,
                        kv_free=_int_of(lambda: s.token_to_kv_pool_allocator.available_size()),
                        kv_evictable=_int_of(lambda: s.tree_cache.evictable_size()),
                        kv_capacity=_int_of(lambda: s.max_total_num_tokens),
                        new_token_ratio=ratio,
                        max_running_requests=_int_of(lambda: s.max_running_requests),
                        processed_tokens=self.processed_tokens, **question)

    def _timed(self, t0: float, what: str) -> float:
        elapsed = time.perf_counter() - t0
        if elapsed > self.budget_s:
            self.counters["slow"] += 1
            self._warn_once("slow", f"{'an' if what == 'order' else 'a'} {what} decision took {elapsed * 1000:.1f} ms, over the "
                                    f"{self.budget_s * 1000:.1f} ms budget (applied; counted "
                                    f"as 'slow')")
            self._write_counters()
        return elapsed * 1e6

    def decided(self, snap: Snapshot, plan: Plan, outcome: str, us: float,
                cause: str | None = None) -> None:
        self.counters["decisions"] += 1
        self.counters[outcome] += 1
        if self._log is not None:
            self._write(decisions.decision_line(snap, plan, outcome, us,
                                                us > self.budget_s * 1e6, cause))
            self._write_counters()

    def failed(self, kind: str, where: str, why, snap: Snapshot | None = None,
               plan=None, t0: float | None = None, cause: str | None = None) -> None:
        """Count and log (once per kind and place) a fallback to SGLang's own behaviour."""
        try:
            self.counters[kind] += 1
            detail = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
            self._warn_once(f"{kind}:{where}", f"policy {self.spec.name!r} {kind} at {where} "
                            f"({detail}); SGLang's own behaviour for this pass (counted as "
                            f"{kind!r}; further ones are only counted)")
            if snap is not None and self._log is not None:
                us = (time.perf_counter() - t0) * 1e6 if t0 else 0.0
                plan = plan if isinstance(plan, Plan) and _jsonable(plan) else None
                self.counters["decisions"] += 1
                self._write(decisions.decision_line(snap, plan, kind, us, False, cause))
            self._write_counters()
        except Exception:  # never let the bookkeeping of a failure fail the scheduler
            pass

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _write(self, line: str) -> None:
        try:
            self._log.write(line + "\n")
            self._log.flush()
        except Exception as exc:
            self._log = None
            self._warn_once("log", f"decision log {self.log_path} switched off: {exc}")

    def _write_counters(self) -> None:
        if not self.log_path:
            return
        path = Path(self.log_path + ".counters.json")
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.counters))
            os.replace(tmp, path)
        except OSError:
            pass


def _is_permutation(plan, n: int) -> bool:
    """The common case of `validate_plan` for an order question, in C-level passes: a
    tuple of `n` ints (not bools) from 0 to n - 1 without repeats. False sends the answer
    to `validate_plan`, which has the last word (and the message)."""
    if not isinstance(plan, Plan):
        return False
    order = plan.order
    return (type(order) is tuple and len(order) == n > 0 and set(map(type, order)) == _INT
            and min(order) == 0 and max(order) == n - 1 and len(set(order)) == n)


_INT = {int}


def _tp_rank() -> int:
    """This scheduler's TP rank (0 outside a server)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        return 0


def _changes_are_tracked(scheduler) -> bool:
    """Whether SGLang 0.5.23, as this scheduler runs it, changes a waiting request's view
    fields only where the plugin hears of it (`WaitingViews`): not with a cache that
    matches every waiting request in `calc_priority`, nor with disaggregation; and only
    when the adder hook is in place. (Hierarchical-cache storage and LMCache, which
    rematch requests the prefill loop then skips, can be switched on at run time:
    `_storage_on` is asked at every pass.)"""
    try:
        if scheduler is None or hooks_missing():
            return False
        if scheduler.tree_cache.supports_fast_match_prefix():
            return False
        mode = getattr(scheduler, "disaggregation_mode", None)
        return str(getattr(mode, "value", mode) or "null") == "null"
    except Exception:
        return False


def _int_of(get) -> int:
    try:
        return int(get())
    except Exception:
        return 0


def _jsonable(plan: Plan) -> bool:
    try:
        json.dumps(decisions.plan_to_json(plan))
        return True
    except (TypeError, ValueError):
        return False
