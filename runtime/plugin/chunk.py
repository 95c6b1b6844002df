"""The plugin's chunk question (docs/plugin.md, "The chunk question live"), a part of
`PluginRuntime` (runtime/plugin/hooks.py): a policy with `chunks = True` answers
`Policy.chunk(snap, chunked, budget, page_size) -> ChunkPlan(limit, park)` once per chunk
of a prompt SGLang 0.5.23 prefills in chunks, as the twin's replica asks it
(`_chunk_parked`, `_ask_chunk`, `_chunk_limit` in twin/replica.py).

A prompt's first chunk is asked too (`first_chunk_limit`): when SGLang's adder would cut
a new request (`add_one_req`), the plan's limit becomes that pass's `rem_chunk_tokens`,
so SGLang's own cut takes that many tokens and its pass ends there.

Where SGLang asks: each pass with a chunked request calls
`SchedulePolicy.shortest_prefill_chunk_limit(chunked_req, waiting_queue, budget, page)`
(after `calc_priority`, after `chunked_req.init_next_round_input()`, so `prefix_len` is
the tokens computed so far) and then `PrefillAdder.add_chunked_req`. The plugin's AROUND
hook on the first asks the policy when a new chunk is due (keyed by the `Req` itself and
its `prefix_len`) and either caps SGLang's own limit with `ChunkPlan.limit` (the chunk
runs) or, while `park` passes are left and the running batch is decoding, marks this pass
parked: the adder (hooks.py) then returns the chunked request untouched (SGLang's own
early return: no KV computed, nothing to stash) and admits nobody, so SGLang builds no
prefill batch and runs a decode step. Every failure means SGLang's own chunk for that
pass and no parking.
"""

from __future__ import annotations

import time

from twin.policy.base import ChunkPlan
from twin.policy.check import validate_chunk_plan


class ChunkDue:
    """The policy's answer for one chunk: the `Req`, its `prefix_len` when asked, the
    plan (None: the policy failed, SGLang's own chunk), and the parked passes left."""

    __slots__ = ("req", "prefix_len", "plan", "park_left")

    def __init__(self, req, prefix_len: int, plan: ChunkPlan | None) -> None:
        self.req, self.prefix_len, self.plan = req, prefix_len, plan
        self.park_left = plan.park if plan is not None else 0

    def is_for(self, req) -> bool:
        return self.req is req and self.prefix_len == req.prefix_len


class ChunkQuestions:
    """Mixin of `PluginRuntime`: it provides `policy`, `scheduler`, `counters`, `link`, the pass's
    views (`waiting_views`, `pass_running`, `_pass_running`) and `_snapshot`, `_ratio`,
    `_timed`, `failed`, `_write_counters`. State: `chunks` (the question is asked),
    `chunk_due` (a `ChunkDue` or None), `pass_batch` (this pass's running batch, from
    `calc_priority`) and `pass_park` (this pass parks; consumed by the adder)."""

    def begin_pass(self, running_batch) -> None:
        """A scheduling pass that can prefill starts (`calc_priority`): no stale park."""
        self.pass_batch, self.pass_park = running_batch, None

    def on_chunk_limit(self, req, queue: list, budget: int, page_size: int, own):
        """SGLang's `shortest_prefill_chunk_limit` answered `own` for `req`'s next chunk:
        the limit to use, and `pass_park` set when this pass is a parked one."""
        self.pass_park = None
        due = self.chunk_due
        if due is None or not due.is_for(req):
            due = self.chunk_due = ChunkDue(req, req.prefix_len,
                                            self._chunk_answer(req, queue, budget, page_size))
        plan = due.plan
        if plan is None:
            return own
        if due.park_left > 0 and self._decoding():
            self.pass_park = due  # the adder parks and counts it (`take_park`)
            return own
        if plan.limit is None:
            return own
        page = max(int(page_size or 1), 1)
        limit = max(page, plan.limit // page * page)  # SGLang asserts > 0; pages align
        return limit if own is None else min(own, limit)

    def first_chunk_limit(self, req, budget: int, page_size: int) -> int | None:
        """The cap on `req`'s first chunk (SGLang's adder would cut it; the twin's
        `Replica.first_chunk_limit`): the plan's limit, page-aligned, or None (no cap, or
        the policy failed: SGLang's own cut). `park` does not apply to a first chunk.
        With TP > 1 every rank reaches this at the same candidate of the same pass, so
        the broadcast in `_chunk_answer` pairs up."""
        queue = self.pass_queue
        if queue is None:
            queue = getattr(self.scheduler, "waiting_queue", None) or []
        plan = self._chunk_answer(req, queue, budget, page_size, first=True)
        if plan is None or plan.limit is None:
            return None
        page = max(int(page_size or 1), 1)
        return max(page, plan.limit // page * page)

    def take_park(self) -> bool:
        """Whether the adder parks the chunk in this pass (then one parked pass is used)."""
        due, self.pass_park = self.pass_park, None
        if due is None or due is not self.chunk_due or due.park_left <= 0:
            return False
        due.park_left -= 1
        self.counters["parked_passes"] += 1
        self._write_counters()
        return True

    def _decoding(self) -> bool:
        """Whether SGLang decodes when this pass builds no prefill batch: its running
        batch holds requests and is not prefill-only (the twin: `self.running`)."""
        batch = self.pass_batch
        return (batch is not None and len(batch.reqs) > 0
                and not getattr(batch, "is_prefill_only", False))

    def _chunk_answer(self, req, queue: list, budget: int, page_size: int,
                      first: bool = False):
        """The plan for the chunk due: the policy's; with TP > 1 rank 0's, shared with
        every rank (ranks.py) by a broadcast all ranks make here, unconditionally."""
        link = self.link
        if link is None:
            return self._ask_chunk(req, queue, budget, page_size, first)
        plan = self._ask_chunk(req, queue, budget, page_size, first) if link.leader \
            else None
        plan = link.share_chunk(plan)
        if plan is not None and not link.leader:
            self.counters["chunk_plans"] += 1  # rank 0's answer, applied here
            self._write_counters()
        return plan

    def _ask_chunk(self, req, queue: list, budget: int, page_size: int,
                   first: bool = False) -> ChunkPlan | None:
        """The policy's checked chunk answer; None when it failed (counted, logged). With
        a decision log, the question and the answer are a line (decisions.chunk_line)."""
        t0 = time.perf_counter()
        plan = snap = seen = None
        size = 0
        try:
            from runtime.plugin.views import req_view

            ratio = self._ratio()
            running = self.pass_running
            if running is None:
                running = self._pass_running(self.pass_batch, ratio)
            snap = self._snapshot(self.waiting_views.of(queue, True), running, ratio)
            size = int(getattr(self.scheduler, "chunked_prefill_size", 0) or budget or 0)
            seen = req_view(req, False, ratio)
            plan = self.policy.chunk(snap, seen, size, page_size)
            why = validate_chunk_plan(plan, page_size)
        except Exception as exc:
            self.failed("raised", "chunk", exc)
            self._log_chunk(snap, seen, size, page_size, None, "raised", t0, first)
            return None
        if why:
            self.failed("invalid", "chunk", why)
            self._log_chunk(snap, seen, size, page_size, plan, "invalid", t0, first)
            return None
        self.counters["chunk_plans"] += 1
        self._timed(t0, "chunk")
        self._log_chunk(snap, seen, size, page_size, plan, "applied", t0, first)
        self._write_counters()
        return plan

    def _log_chunk(self, snap, seen, budget: int, page_size: int, plan, outcome: str,
                   t0: float, first: bool) -> None:
        """The chunk question's line in the decision log (never raises)."""
        if self._log is None or snap is None or seen is None:
            return
        try:
            from runtime.plugin import decisions

            us = (time.perf_counter() - t0) * 1e6
            self._write(decisions.chunk_line(snap, seen, int(budget), int(page_size), plan,
                                             outcome, us, us > self.budget_s * 1e6, first))
        except Exception:  # the log is bookkeeping: never the scheduler's problem
            pass
