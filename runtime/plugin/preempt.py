"""The plugin's preempt questions (docs/plugin.md), a part of `PluginRuntime`
(runtime/plugin/hooks.py): SGLang 0.5.23's `PrefillAdder.preempt_to_schedule` when
request slots run out, and, for a policy that `preempts_for_kv`, `add_one_req`'s NO_TOKEN.
Both ask the policy the same way (`_ask_victims`) and commit its victims with SGLang's own
release steps (`commit_preemption`); every failure falls back to SGLang's own behaviour.
"""

from __future__ import annotations

import time

from runtime.plugin.views import preemptible_running, req_view, tokens_needed, views
from twin.policy.base import Plan, Snapshot
from twin.policy.check import validate_plan


class PreemptQuestions:
    """Mixin of `PluginRuntime`: it provides `policy`, `native`, `link`, `counters`, the pass's
    views (`pass_queue`, `pass_entries`, `pass_views`, `pass_running`) and the shared
    `_snapshot`, `_timed`, `decided`, `failed`, `_write_counters`."""

    def on_preempt(self, adder, req, own) -> bool:
        if self.native:
            return self._native_preempt(adder, req, own) if self._log else own(req)
        try:
            valid = preemptible_running(adder)
        except Exception as exc:
            self.failed("raised", "preempt", exc)
            return own(req)
        done = self._ask_victims(adder, req, valid, "preempt", None)
        return own(req) if done is None else done

    def on_kv_shortfall(self, adder, req) -> bool:
        """`add_one_req` answered NO_TOKEN: unless the request was added all the same
        (the verdict is then about the next one), ask the policy a preempt question with
        SGLang's own `min_tokens_to_remove` and commit its victims as
        `preempt_to_schedule` does. Whether victims were released (the caller then
        retries the request once); every failure means "no preemption", SGLang's own
        behaviour, and the candidate waits."""
        if adder.can_run_list and adder.can_run_list[-1] is req:
            return False
        valid = preemptible_running(adder)
        if not valid or not self._ask_victims(adder, req, valid, "kv preempt", "kv"):
            return False
        self.counters["kv_preemptions"] += 1
        self._write_counters()
        return True

    def _ask_victims(self, adder, req, valid: list, where: str, cause: str | None):
        """Ask the policy which of `valid` to preempt for `req` and commit them: True when
        victims were released, False when it named none (or SGLang's release failed half
        way), None when the policy failed (raised or answered out of contract)."""
        link = self.link
        if link is None or link.leader:
            plan = self._decide_victims(adder, req, valid, where, cause)
        else:
            plan = None
        if link is not None:  # TP > 1: rank 0's answer on every rank (ranks.py)
            shared = link.share_victims(plan, len(valid))
            if shared is not None and not link.leader:
                self.followed()
            plan = shared
        if plan is None:
            return None
        if not plan.victims:
            return False
        try:
            commit_preemption(adder, [valid[i] for i in plan.victims])
        except Exception as exc:  # SGLang's own release steps failed half-way
            self.failed("raised", f"{where} commit", exc)
            return False
        return True

    def _decide_victims(self, adder, req, valid: list, where: str, cause: str | None):
        """The policy's checked preempt answer; None when it failed (counted, logged)."""
        t0 = time.perf_counter()
        snap = plan = None
        try:
            snap = self.preempt_snapshot(adder, req, valid)
            plan = self.policy.decide(snap)
            why = validate_plan(snap, plan)
        except Exception as exc:
            self.failed("raised", where, exc, snap, None, t0, cause=cause)
            return None
        if why:
            self.failed("invalid", where, why, snap, plan, t0, cause=cause)
            return None
        self.decided(snap, plan, "applied", self._timed(t0, "preempt"), cause=cause)
        return plan

    def preempt_snapshot(self, adder, req, valid: list) -> Snapshot:
        ratio = adder.new_token_ratio
        queue = self.pass_queue or []
        idx = next((i for i, r in enumerate(queue) if r is req), None)
        fresh = req_view(req, False, ratio)
        if idx is None:  # not in this pass's queue (should not happen): a queue of one
            waiting, idx = (fresh,), 0
        else:
            known = self._queue_views(queue, ratio)
            waiting = known[:idx] + (fresh,) + known[idx + 1:]
        return self._snapshot(waiting, self._running_views(valid, ratio), ratio,
                              candidate=idx, tokens_needed=tokens_needed(adder, req))

    def _queue_views(self, queue: list, ratio: float) -> tuple:
        """The views of this pass's queue in its current order (the order question's,
        permuted as its answer was applied)."""
        if self.pass_entries is not None:
            entries, order = self.pass_entries
            self.pass_entries = None
            if len(entries) == len(queue):
                self.pass_views = (tuple(entries[i][1] for i in order), None)
        if self.pass_views is not None:
            known, order = self.pass_views
            if order is not None and len(known) == len(queue):
                self.pass_views = (tuple(map(known.__getitem__, order)), None)
            known = self.pass_views[0]
            if len(known) == len(queue):
                return known
        return views(queue, False, ratio)

    def _running_views(self, valid: list, ratio: float) -> tuple:
        known = self.pass_running
        out = []
        for r in valid:
            v = known.view_of(r) if known is not None else None
            out.append(v if v is not None else req_view(r, True, ratio))
        return tuple(out)

    def _native_preempt(self, adder, req, own) -> bool:
        t0 = time.perf_counter()
        try:
            valid = preemptible_running(adder)
            snap = self.preempt_snapshot(adder, req, valid)
            before = len(adder.preempt_list)
        except Exception as exc:
            self.failed("raised", "native preempt log", exc)
            return own(req)
        done = own(req)
        try:
            taken = {id(r) for r in adder.preempt_list[before:]}
            victims = tuple(i for i, r in enumerate(valid) if id(r) in taken)
            self.decided(snap, Plan(victims=victims), "native",
                         (time.perf_counter() - t0) * 1e6)
        except Exception as exc:
            self.failed("raised", "native preempt log", exc)
        return done


def commit_preemption(adder, victims: list) -> None:
    """SGLang 0.5.23's own commit in `PrefillAdder.preempt_to_schedule`: take each victim's
    reservation off the budget, release it, drop it from the running batch and list it for
    re-queueing after the pass."""
    chosen = {id(r) for r in victims}
    batch = adder.running_batch
    keep, released = [], 0
    for i, r in enumerate(batch.reqs):
        if id(r) in chosen:
            adder.memory_budget.total_offset -= adder._get_running_request_total_token_offset(r)
            released += 1
            batch.release_req(i, len(batch.reqs) - released)
        else:
            keep.append(i)
    batch.filter_batch(keep_indices=keep)
    adder.preempt_list.extend(victims)
