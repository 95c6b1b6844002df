"""SGLang 0.5.23's own scheduling policies (`--schedule-policy`), read from
`sglang/srt/managers/schedule_policy.py`, as pure functions of a `Snapshot`.

Cache-aware policies (`lpm`, `dfs-weight`, `hrrn`, `shortest-prefill-first`) ask for fresh
prefix matches and defer duplicate prefixes within the queue (`in_batch_deferred`): a
request whose cached prefix is at most 32 tokens and whose first 32 tokens another, earlier
such request shares is moved behind the others, so only one of them computes the shared
tokens and the rest hit the cache in a later pass. `lpm` and `hrrn` fall back to fcfs above
128 waiting requests. In the live engine these run natively (`sglang_name`); the plugin
leaves SGLang's order in place and only logs it.
"""

from __future__ import annotations

import random

from twin.policy.base import (
    IN_BATCH_CHECK_THRESHOLD,
    PREFIX_MATCH_MAX_QUEUE,
    Policy,
    RequestView,
    Snapshot,
    keyed_order,
)
from twin.policy.registry import register


def in_batch_deferred(waiting: tuple[RequestView, ...]) -> set[int]:
    """SGLang's `_compute_prefix_matches`: indices of waiting requests deprioritized because
    an earlier waiting request with a short cache match shares their first 32 tokens."""
    seen: set[int] = set()
    deferred: set[int] = set()
    for i, r in enumerate(waiting):
        if r.prefix_len > IN_BATCH_CHECK_THRESHOLD:
            continue
        if r.head is not None and r.head in seen:
            deferred.add(i)
        elif r.head is not None:
            seen.add(r.head)
    return deferred


class CacheAware(Policy):
    falls_back_above: int | None = None

    def wants_prefix_match(self, n_waiting: int) -> bool:
        return self.falls_back_above is None or n_waiting <= self.falls_back_above

    def order(self, snap: Snapshot) -> list[int]:
        if not self.wants_prefix_match(len(snap.waiting)):
            return list(range(len(snap.waiting)))
        return self.sort(snap, in_batch_deferred(snap.waiting))

    def sort(self, snap: Snapshot, deferred: set[int]) -> list[int]:
        raise NotImplementedError


@register
class FCFS(Policy):
    """First come, first served (SGLang's default): the queue order is arrival order."""

    name = sglang_name = "fcfs"


@register
class LOF(Policy):
    """Longest output first: most `max_new_tokens` first."""

    name = sglang_name = "lof"

    def sort_key(self):
        return self._key() if type(self).order is LOF.order else None

    def _key(self):
        if self.priority_scheduling:
            sign = self.sign
            return lambda r: (sign * r.priority, -r.max_new_tokens)
        return lambda r: -r.max_new_tokens

    def order(self, snap: Snapshot) -> list[int]:
        return keyed_order(snap.waiting, self._key())


@register
class LPM(CacheAware):
    """Longest prefix match first, duplicate prefixes deferred; fcfs above 128 waiting."""

    name = sglang_name = "lpm"
    falls_back_above = PREFIX_MATCH_MAX_QUEUE

    def sort(self, snap: Snapshot, deferred: set[int]) -> list[int]:
        w = snap.waiting
        return sorted(range(len(w)),
                      key=lambda i: float("inf") if i in deferred else -w[i].prefix_len)


@register
class HRRN(CacheAware):
    """Highest response ratio next with token-based aging (`_sort_by_hrrn`): the ratio's
    growth is the prefill tokens processed since the request queued over its uncached
    tokens; no uncached work first, deferred last, ties by rid; fcfs above 128 waiting."""

    name = sglang_name = "hrrn"
    falls_back_above = PREFIX_MATCH_MAX_QUEUE

    def sort(self, snap: Snapshot, deferred: set[int]) -> list[int]:
        w = snap.waiting

        def key(i: int) -> tuple[float, str]:
            r = w[i]
            if i in deferred:
                return (float("inf"), r.rid)
            if r.uncached <= 0:
                return (-float("inf"), r.rid)
            waited = max(0, snap.processed_tokens - r.arrival_work)
            return (-waited / r.uncached, r.rid)

        return sorted(range(len(w)), key=key)


@register
class ShortestPrefillFirst(CacheAware):
    """Fewest uncached fill tokens first (deferred duplicates last, then queue entry);
    SGLang also caps the active chunk to leave budget for shorter waiting requests
    (`chunk_limit`)."""

    name = sglang_name = "shortest-prefill-first"

    def sort(self, snap: Snapshot, deferred: set[int]) -> list[int]:
        w = snap.waiting
        return sorted(range(len(w)), key=lambda i: (i in deferred, prefill_work(w[i]),
                                                    w[i].queue_entry_s))

    @staticmethod
    def chunk_limit(chunked: RequestView, waiting: tuple[RequestView, ...], budget: int,
                    page_size: int) -> int | None:
        """`SchedulePolicy.shortest_prefill_chunk_limit`: the chunk size left to the
        chunked request after reserving page-rounded room for the shorter waiting
        requests at the queue's head; None for no cap."""
        if budget < 2 * page_size:
            return None
        remaining = chunked.fill_tokens - chunked.prefix_len
        reserved = 0
        for r in waiting:
            work = prefill_work(r)
            charge = -(-work // page_size) * page_size
            if work >= remaining or reserved + charge > budget - page_size:
                break
            reserved += charge
        if not reserved:
            return None
        return (budget - reserved) // page_size * page_size


def prefill_work(r: RequestView) -> int:
    return max(1, r.fill_tokens - r.prefix_len)


@register
class DFSWeight(CacheAware):
    """Depth-first over the radix tree, heavier subtrees (more waiting requests) first,
    a node's own requests after its subtree (`_dfs_weight_order`). Children of equal weight
    go in node-id order (creation order; SGLang's child dict keeps insertion order)."""

    name = sglang_name = "dfs-weight"

    def sort(self, snap: Snapshot, deferred: set[int]) -> list[int]:
        w = snap.waiting
        at: dict[int, list[int]] = {}
        children: dict[int, set[int]] = {}
        root = -1
        for i, r in enumerate(w):
            path = (root, *r.prefix_path)
            for parent, child in zip(path, path[1:], strict=False):
                children.setdefault(parent, set()).add(child)
            at.setdefault(path[-1], []).append(i)
        weight: dict[int, int] = {}

        def total(node: int) -> int:
            if node not in weight:
                weight[node] = len(at.get(node, ())) + sum(
                    total(c) for c in children.get(node, ()))
            return weight[node]

        order: list[int] = []
        seen: set[int] = set()  # a malformed path (a node under two parents) visits once
        stack: list[tuple[int, bool]] = [(root, False)]
        while stack:
            node, visited = stack.pop()
            if visited:
                order.extend(at.get(node, ()))
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            kids = sorted(children.get(node, ()), key=lambda c: (-total(c), c))
            stack.extend((c, False) for c in reversed(kids))
        return order


@register
class Random(Policy):
    """A seeded shuffle of the queue (SGLang shuffles with Python's global `random`; here
    the generator is the policy's own, seeded, so runs repeat)."""

    name = sglang_name = "random"

    def __init__(self, *, seed: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.seed = seed

    def order(self, snap: Snapshot) -> list[int]:
        idx = list(range(len(snap.waiting)))
        # one generator per decision, from the seed and the snapshot, so the answer is a
        # function of the snapshot (deterministic, replayable from a decision log)
        rng = random.Random(f"{self.seed}:{snap.now!r}:{snap.processed_tokens}:"
                            f"{','.join(r.rid for r in snap.waiting)}")
        rng.shuffle(idx)
        return idx


@register
class Priority(FCFS):
    """fcfs with SGLang's `--enable-priority-scheduling` always on."""

    name = "priority"

    def __init__(self, **kw) -> None:
        kw["priority_scheduling"] = True
        super().__init__(**kw)
