"""Tensor parallelism: one decision for every rank (docs/plugin.md, "TP > 1").

With `--tp-size` > 1 every TP rank runs its own scheduler over the same requests and must
build the same batches. The ranks' `time_stats` stamps and `perf_counter` clocks differ,
so a policy that reads time (`slices`, `deadline`, `learned`) could answer differently on
each rank, and the ranks would then schedule different batches. So TP rank 0 decides and
broadcasts its answer over the TP group's CPU (gloo) group, and the other ranks apply it.
What crosses is int64 tensors (no pickle): for an order question `[k, admit, order...]`,
for a preempt question `[k, victims...]`, for a chunk question `[k, limit, park]` (limit 0:
None), with `k` = -1 for "no decision: SGLang's own behaviour for this pass" (rank 0's
policy failed; for a chunk, SGLang's own chunk and no parking), which every rank then
falls back to.

Every rank reaches each question in the same pass (the scheduler's state is replicated:
that is what TP relies on), so each call here is one collective that all ranks make; a
rank must never skip one, or the others would wait: the callers make the broadcast
unconditionally once they are past the questions' replicated early exits.
"""

from __future__ import annotations

from twin.policy.base import ChunkPlan, Plan


class RankLink:
    """Rank 0's answers to the other TP ranks of this scheduler."""

    def __init__(self, group, tp_rank: int, src: int) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group, self.tp_rank, self.src = group, tp_rank, src

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @classmethod
    def of(cls, scheduler) -> RankLink | None:
        """The link of a scheduler with TP > 1 (SGLang 0.5.23's `get_parallel()` context);
        None with one rank. Raises where the ranks do not all schedule the same requests
        (attention data parallelism, pipeline stages): not supported."""
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        if int(par.tp_size) <= 1:
            return None
        if getattr(par, "attn_dp_enabled", False) or int(getattr(par, "pp_size", 1)) > 1:
            raise NotImplementedError("attention DP or pipeline parallelism: each rank "
                                      "schedules its own requests")
        import torch.distributed as dist

        group = scheduler.tp_cpu_group
        return cls(group, int(par.tp_rank), dist.get_global_rank(group, 0))

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (an all-reduce of the minimum): the plugin runs on all
        ranks or on none, so that no rank waits in a broadcast the others never make."""
        t = self._torch.tensor([1 if ok else 0], dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _share(self, values: list[int] | None, size: int) -> list[int] | None:
        torch = self._torch
        t = torch.full((size + 1,), -1, dtype=torch.int64)
        if self.leader and values is not None and len(values) <= size:
            t[0] = len(values)
            if values:
                t[1:len(values) + 1] = torch.tensor(values, dtype=torch.int64)
        self._dist.broadcast(t, src=self.src, group=self.group)
        k = int(t[0])
        return None if k < 0 else t[1:k + 1].tolist()

    def share_order(self, plan: Plan | None, n: int) -> Plan | None:
        """Rank 0's order answer for a queue of `n` (None: fall back), on every rank."""
        values = None
        if self.leader and plan is not None:
            values = [-1 if plan.admit is None else plan.admit, *plan.order]
        got = self._share(values, n + 1)
        if got is None or len(got) != n + 1:
            return None
        return Plan(order=tuple(got[1:]), admit=None if got[0] < 0 else got[0])

    def share_victims(self, plan: Plan | None, n_running: int) -> Plan | None:
        """Rank 0's preempt answer among `n_running` candidates (None: fall back)."""
        got = self._share(None if plan is None else list(plan.victims), n_running)
        return None if got is None else Plan(victims=tuple(got))

    def share_chunk(self, plan: ChunkPlan | None) -> ChunkPlan | None:
        """Rank 0's chunk answer (None: SGLang's own chunk), on every rank. Asked when a
        chunk is due, which every rank sees in the same pass (the chunked request's
        `prefix_len` is replicated)."""
        values = None
        if self.leader and plan is not None:
            values = [plan.limit or 0, plan.park]
        got = self._share(values, 2)
        if got is None or len(got) != 2:
            return None
        return ChunkPlan(limit=got[0] or None, park=got[1])
