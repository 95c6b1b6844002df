"""Routers in front of a fleet of replicas, by name from a registry.

A router decides from what it has itself: its own count of requests in flight to each
worker (incremented when it sends one, decremented when the response ends, as
sglang-router's `Worker::load`), its health-check and circuit-breaker view (`healthy`),
an optional polled engine load with the poll's age, and state it keeps (a counter, a
seeded generator, an approximate prefix tree). It never reads an engine's queues or radix
cache. `pick(req, workers, now)` returns the fleet index of the chosen worker or None
(no healthy worker: the router answers 503). Routers are pure: no SimPy, no clock of
their own.

Sources read (sgl-project/sglang, `sgl-router/src/policies/`, PyPI sglang-router 0.3.2
`router_args.py` for defaults): `round_robin.rs`, `random.rs`, `power_of_two.rs`,
`cache_aware.rs`, `tree.rs`. `least_load` and `prefix_hash` are the successor gateway's
(lightseekorg/smg `docs/configuration/routing.md`). `length` is the users' design.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from twin.errors import ConfigError
from twin.registry import Registry
from twin.workload import Request


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as its router sees it."""

    index: int  # position in the fleet
    name: str
    pool: str
    healthy: bool  # health checks passed and the circuit breaker lets requests through
    load: int  # the router's own count of requests in flight to it
    polled_load: int | None = None  # running + waiting at the last poll (None: not polled)


class Router(Protocol):
    """`pick` chooses among `workers` (all of the router's workers, unhealthy included:
    sglang-router's balance check reads every worker's load); `done` is told when a
    request the router sent ends (ok or not)."""

    name: str

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None: ...
    def done(self, worker: int, req: Request, now: float, ok: bool) -> None: ...


RouterFactory = Callable[..., Router]
ROUTERS: Registry[RouterFactory] = Registry("router", "router")
register_router = ROUTERS.register


def router_names() -> list[str]:
    return ROUTERS.names()


def make_router(name: str, params: dict | None = None, *, seed: int = 0,
                where: str = "router") -> Router:
    """A router by name; unknown parameters are refused, naming `where`."""
    factory = ROUTERS.get(name) if name in ROUTERS else None
    if factory is None:
        raise ConfigError(f"{where}: router {name!r}: allowed values: {', '.join(router_names())}")
    import inspect

    allowed = [p for p in inspect.signature(factory).parameters if p != "seed"]
    unknown = sorted(set(params or {}) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: router {name!r}: unknown parameter {unknown[0]!r}; "
                          f"allowed: {', '.join(allowed) or 'none'}")
    try:
        return factory(seed=seed, **(params or {}))
    except TypeError as exc:
        raise ConfigError(f"{where}: router {name!r}: {exc}") from None


def _healthy(workers: Sequence[WorkerView]) -> list[WorkerView]:
    return [w for w in workers if w.healthy]


class _Base:
    name = "base"

    def done(self, worker: int, req: Request, now: float, ok: bool) -> None:
        return None


@register_router("round_robin")
class RoundRobin(_Base):
    """sglang-router `round_robin`: one counter; the n-th request goes to healthy worker
    n mod (number healthy)."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        self.counter = 0

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        ok = _healthy(workers)
        if not ok:
            return None
        w = ok[self.counter % len(ok)]
        self.counter += 1
        return w.index


@register_router("random")
class Random(_Base):
    """sglang-router `random`: uniform over healthy workers (seeded generator)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        ok = _healthy(workers)
        if not ok:
            return None
        return ok[int(self.rng.integers(len(ok)))].index


def _load(w: WorkerView, source: str) -> int:
    if source == "polled" and w.polled_load is not None:
        return w.polled_load
    return w.load


@register_router("power_of_two")
class PowerOfTwo(_Base):
    """sglang-router `power_of_two`: two distinct healthy workers at random, the less
    loaded (the first on a tie). `load`: `in_flight` (the router's own counts, default) or
    `polled` (engine load polled every `poll_interval_s`, as the gateway's load monitor)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0, load: str = "in_flight", poll_interval_s: float = 10.0) -> None:
        _check_choice("load", load, ("in_flight", "polled"))
        self.rng = np.random.default_rng(seed)
        self.load_source, self.poll_interval_s = load, poll_interval_s

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        ok = _healthy(workers)
        if len(ok) <= 1:
            return ok[0].index if ok else None
        i, j = self.rng.choice(len(ok), size=2, replace=False)
        a, b = ok[int(i)], ok[int(j)]
        return a.index if _load(a, self.load_source) <= _load(b, self.load_source) else b.index


@register_router("least_load")
class LeastLoad(_Base):
    """The gateway's `least_load`: the healthy worker with the fewest requests in flight
    (lowest fleet index on a tie); `load` as for power_of_two."""

    name = "least_load"

    def __init__(self, seed: int = 0, load: str = "in_flight", poll_interval_s: float = 10.0) -> None:
        _check_choice("load", load, ("in_flight", "polled"))
        self.load_source, self.poll_interval_s = load, poll_interval_s

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        ok = _healthy(workers)
        if not ok:
            return None
        return min(ok, key=lambda w: (_load(w, self.load_source), w.index)).index


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"router parameter {key}={value!r}: allowed values: {', '.join(allowed)}")


def _stable_hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


@register_router("prefix_hash")
class PrefixHash(_Base):
    """The gateway's `prefix_hash`: a hash of the prompt's first `prefix_tokens` tokens on
    a consistent-hash ring (`virtual_nodes` per worker); the first healthy worker clockwise
    whose load is at most `load_factor` x the mean (+1), else the least loaded."""

    name = "prefix_hash"

    def __init__(self, seed: int = 0, prefix_tokens: int = 256, virtual_nodes: int = 160,
                 load_factor: float = 1.25) -> None:
        self.prefix_tokens, self.vnodes, self.load_factor = prefix_tokens, virtual_nodes, load_factor
        self._ring: list[tuple[int, int]] | None = None
        self._ring_for: tuple[int, ...] = ()

    def _key(self, req: Request) -> int:
        need, parts = self.prefix_tokens, []
        for h, n in req.segments:
            take = min(n, need)
            parts.append((h, take))
            need -= take
            if need == 0:
                break
        return _stable_hash(*parts)

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        ok = _healthy(workers)
        if not ok:
            return None
        names = tuple(w.index for w in workers)
        if self._ring is None or self._ring_for != names:
            self._ring = sorted((_stable_hash(w.name, v), w.index) for w in workers
                                for v in range(self.vnodes))
            self._ring_for = names
        by_index = {w.index: w for w in ok}
        cap = self.load_factor * sum(w.load for w in ok) / len(ok) + 1
        start = bisect.bisect_left(self._ring, (self._key(req), -1))
        seen: set[int] = set()
        for k in range(len(self._ring)):
            idx = self._ring[(start + k) % len(self._ring)][1]
            w = by_index.get(idx)
            if w is None or idx in seen:
                continue
            seen.add(idx)
            if w.load <= cap:
                return idx
        return min(ok, key=lambda w: (w.load, w.index)).index


@register_router("cache_aware")
class CacheAwareRouter(_Base):
    """sglang-router `cache_aware` (0.3.2 defaults). If the router's in-flight counts are
    imbalanced — max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x
    min, over all workers — the least-loaded healthy worker, and the prompt is inserted
    for it; else the worker holding the longest prefix match in the router's own
    approximate tree, if the match rate (matched / prompt) exceeds `cache_threshold`, else
    the least-loaded healthy worker (the first on a tie); the prompt is inserted for the
    chosen worker. A matched worker that is unhealthy: the first healthy worker, tree not
    updated. That is sgl-model-gateway 0.3.2's `select_worker` (the installed binary has
    `select_worker_min_load` and no `get_smallest_tenant`; the code comments' "smallest
    tree" is older sgl-router's); measured live: a miss sent while another request is in
    flight on worker 0 goes to worker 1, sequential misses all go to worker 0
    (benchmarks/cache_aware_probe.py, docs/fleet-live.md). Every `eviction_interval_s`
    each worker's share of the tree is cut to `max_tree_size` characters, least recently
    used leaves first.

    The real tree holds request text; the twin's holds prompt segments and counts
    `chars_per_token` characters per token (sizes only; match rates are ratios). Where the
    real tree returns the first tenant of a DashMap at the deepest match (an arbitrary
    one), the twin takes the most recently used (then the lowest index)."""

    name = "cache_aware"

    def __init__(self, seed: int = 0, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 eviction_interval_s: float = 60.0, max_tree_size: int = 2**26,
                 chars_per_token: float = 4.0) -> None:
        self.cache_threshold = cache_threshold
        self.abs_t, self.rel_t = balance_abs_threshold, balance_rel_threshold
        self.eviction_interval_s, self.max_tree_size = eviction_interval_s, max_tree_size
        self.chars_per_token = chars_per_token
        self.tree = ApproxTree()
        self._next_evict = eviction_interval_s
        self.decisions = {"balance": 0, "cache_hit": 0, "cache_miss": 0, "fallback_first": 0}

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        while self.eviction_interval_s > 0 and now >= self._next_evict:
            self.tree.evict(int(self.max_tree_size / self.chars_per_token), self._next_evict)
            self._next_evict += self.eviction_interval_s
        ok = _healthy(workers)
        if not ok:
            return None
        loads = [w.load for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs_t and hi > lo * self.rel_t:
            self.decisions["balance"] += 1
            chosen = min(ok, key=lambda w: (w.load, w.index)).index
        else:
            matched, tenant = self.tree.prefix_match(req.segments, now)
            rate = matched / req.prompt_tokens if req.prompt_tokens else 0.0
            if rate > self.cache_threshold and tenant is not None:
                self.decisions["cache_hit"] += 1
                chosen = tenant
            else:
                self.decisions["cache_miss"] += 1
                chosen = min(ok, key=lambda w: (w.load, w.index)).index
            if chosen not in {w.index for w in ok}:
                # the matched worker is gone or unhealthy: the first healthy worker, and
                # the tree is not updated
                self.decisions["fallback_first"] += 1
                return ok[0].index
        self.tree.insert(req.segments, chosen, now)
        return chosen


class _TNode:
    __slots__ = ("key", "tokens", "parent", "children", "tenants", "path")

    def __init__(self, key, parent) -> None:
        self.key, self.parent = key, parent
        self.tokens = key[1] if key else 0
        self.children: dict = {}
        self.tenants: dict[int, float] = {}  # worker -> last access
        # the segment keys from the root down to here, fixed at creation: the eviction
        # order's tie-break between equal access times
        self.path: tuple = () if parent is None else (*parent.path, key)


class ApproxTree:
    """The router's multi-tenant prefix tree (sgl-router `tree.rs`) over segments."""

    def __init__(self) -> None:
        self.root = _TNode(None, None)
        self.size: dict[int, int] = {}  # tokens per tenant
        # per tenant, the nodes it holds where no child holds it (what eviction starts
        # from), kept as inserts and evictions go, and a heap of (last access, path, node)
        # pushed whenever one of them is touched: an entry whose node is no longer a leaf
        # or was touched again since is stale and skipped, so the valid entries pop in
        # the order of a heap built from the leaves at each eviction (tree.rs's)
        self.leaves: dict[int, set[_TNode]] = {}
        self.heaps: dict[int, list] = {}
        # each entry's push number, after (access, path): a stale entry may share both with
        # a node re-created on the same path, and nodes do not compare
        self._pushes = itertools.count()

    def insert(self, segments, tenant: int, now: float) -> None:
        node = self.root
        leaves = self.leaves.setdefault(tenant, set())
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                child = node.children[seg] = _TNode(seg, node)
            if tenant not in child.tenants:
                self.size[tenant] = self.size.get(tenant, 0) + child.tokens
            child.tenants[tenant] = now
            leaves.discard(node)  # a child holds the tenant now (the root is never one)
            node = child
        if node is not self.root and not any(tenant in c.tenants
                                             for c in node.children.values()):
            leaves.add(node)
            self._touched(tenant, node)

    def _touched(self, tenant: int, node: _TNode) -> None:
        """Leaf `node`'s access time for `tenant` was set: its entry joins the heap (which
        is rebuilt from the leaves when stale entries outnumber them)."""
        heap = self.heaps.setdefault(tenant, [])
        heapq.heappush(heap, (node.tenants[tenant], node.path, next(self._pushes), node))
        if len(heap) > 2 * len(self.leaves[tenant]) + 64:
            heap[:] = [(n.tenants[tenant], n.path, next(self._pushes), n)
                       for n in self.leaves[tenant]]
            heapq.heapify(heap)

    def prefix_match(self, segments, now: float) -> tuple[int, int | None]:
        node, matched = self.root, 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                break
            node, matched = child, matched + child.tokens
        if node is self.root or not node.tenants:
            return 0, None
        tenant = max(node.tenants.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        walk = node
        while walk is not self.root:  # tree.rs refreshes the path for the tenant
            walk.tenants[tenant] = now
            walk = walk.parent
        if node in self.leaves.get(tenant, ()):
            self._touched(tenant, node)
        return matched, tenant

    def smallest_tenant(self) -> int | None:
        """The tenant with the fewest characters among those that ever had text inserted
        (tree.rs `tenant_char_count`: a worker registered with "" has no entry); None for
        tree.rs's "empty"."""
        return min(self.size, key=lambda t: (self.size[t], t)) if self.size else None

    def evict(self, max_tokens: int, now: float) -> None:
        """Per tenant over `max_tokens`: drop its least recently used leaves (nodes where
        no child holds it) until it fits (tree.rs `evict_tenant_by_size`)."""
        for tenant in sorted(t for t, s in self.size.items() if s > max_tokens):
            heap = self.heaps.setdefault(tenant, [])
            leaves = self.leaves.setdefault(tenant, set())
            while heap and self.size[tenant] > max_tokens:
                t, _, _, n = heapq.heappop(heap)
                if n not in leaves or n.tenants.get(tenant) != t:
                    continue  # stale: no longer a leaf, or touched since
                del n.tenants[tenant]
                self.size[tenant] -= n.tokens
                leaves.discard(n)
                parent = n.parent
                if not n.children and not n.tenants and parent is not None:
                    del parent.children[n.key]
                if parent is not self.root and parent is not None and tenant in parent.tenants \
                        and not any(tenant in c.tenants for c in parent.children.values()):
                    leaves.add(parent)
                    heapq.heappush(heap, (parent.tenants[tenant], parent.path,
                                          next(self._pushes), parent))


@register_router("length")
class LengthRouter(_Base):
    """The users' router: by prompt length into pools (`thresholds` ascending, one fewer
    than the pools: a prompt of p tokens goes to the first pool i with p <= thresholds[i],
    else the last), each pool with its own inner router. The default thresholds are the
    users' 32,000 and 64,000 tokens. `fallback` ({pool: [pools...]}, the users' planned
    SGLang <-> vLLM failover) tries other pools in order when a pool has no healthy
    worker; the request goes only where it fits that pool's limits, which the spec's
    author vouches for (a vLLM pool refuses what exceeds its max_model_len)."""

    name = "length"

    def __init__(self, seed: int = 0, thresholds: Sequence[int] = (32000, 64000),
                 pools: Sequence[str] = (), inner: dict[str, Router] | None = None,
                 fallback: dict[str, Sequence[str]] | None = None) -> None:
        self.thresholds = list(thresholds)
        if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:], strict=False)):
            raise ConfigError(f"router length: thresholds {self.thresholds} must ascend")
        self.pools = list(pools)
        self.inner = dict(inner or {})
        self.fallback = {k: list(v) for k, v in (fallback or {}).items()}
        for k, v in self.fallback.items():
            bad = [p for p in [k, *v] if p not in self.pools]
            if bad:
                raise ConfigError(f"router length: fallback names pool {bad[0]!r}; pools: "
                                  f"{', '.join(self.pools)}")
        self.fallbacks = 0

    def pool_of(self, req: Request) -> str:
        i = bisect.bisect_left(self.thresholds, req.prompt_tokens)
        return self.pools[min(i, len(self.pools) - 1)]

    def pick(self, req: Request, workers: Sequence[WorkerView], now: float) -> int | None:
        home = self.pool_of(req)
        for i, pool in enumerate([home, *self.fallback.get(home, [])]):
            got = self.inner[pool].pick(req, [w for w in workers if w.pool == pool], now)
            if got is not None:
                self.fallbacks += i > 0
                return got
        return None

    def done(self, worker: int, req: Request, now: float, ok: bool) -> None:
        self.inner[self.pool_of(req)].done(worker, req, now, ok)
