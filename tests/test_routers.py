"""Routers, hand-worked: which replica each request goes to, in order.

Two (or three) SGLang replicas with round step times (prefill 2 s, decode 1 s), so a
request's time in flight — what the router's own load counts see — is exact."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from helpers import GPU, MODEL, req
from hypothesis import given, settings
from hypothesis import strategies as st
from stepmodels import FixedStepTime

from twin.cluster import Deployment
from twin.config import ServerArgs
from twin.errors import ConfigError
from twin.fleet import run_deployment
from twin.routers import ApproxTree, WorkerView, make_router, router_names
from twin.sim import SimConfig, make_replica
from twin.source import Source
from twin.workload import Request, Workload

ST = FixedStepTime(prefill_s=2.0, decode_s=1.0)


def fleet(requests, router, n=2, pools=None, **failover):
    env = simpy.Environment()
    from twin.faults import Failover

    dep = Deployment(env, Source(Workload("t", tuple(requests))), router,
                     failover=Failover(**failover))
    for i in range(n):
        cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=100_000), gpu=GPU,
                        sample_every_s=1e9, debug_checks=True, step_time_backend="roofline")
        rep, _ = make_replica(env, cfg, ST)
        dep.add(rep, pools[i] if pools else "default", f"r{i}")
    dep.send_log = []
    res = run_deployment(dep)
    return [rec["replica"] for rec in res.records], res


def test_registry_lists_every_router_and_refuses_unknown_names_and_params():
    assert router_names() == ["cache_aware", "least_load", "length", "power_of_two",
                              "prefix_hash", "random", "round_robin"]
    with pytest.raises(ConfigError, match="allowed values: cache_aware"):
        make_router("nope")
    with pytest.raises(ConfigError, match="cache_treshold"):
        make_router("cache_aware", {"cache_treshold": 0.5})


def test_round_robin_alternates_over_healthy_workers():
    reqs = [req(f"q{i}", float(i), 100, 3) for i in range(5)]
    order, _ = fleet(reqs, make_router("round_robin"))
    assert order == ["r0", "r1", "r0", "r1", "r0"]


def test_random_is_the_seeded_generator_over_healthy_workers():
    reqs = [req(f"q{i}", float(i), 100, 3) for i in range(8)]
    order, _ = fleet(reqs, make_router("random", seed=7))
    rng = np.random.default_rng(7)
    assert order == [f"r{int(rng.integers(2))}" for _ in range(8)]
    assert fleet(reqs, make_router("random", seed=7))[0] == order


def test_power_of_two_picks_the_less_loaded_of_the_pair():
    # A (t=0) is in flight until t=2+9=11; B at t=1 must go to the other worker whatever
    # the pair's order; C at t=1.5 sees one request on each: the first of the drawn pair
    reqs = [req("A", 0.0, 100, 10), req("B", 1.0, 100, 10), req("C", 1.5, 100, 10)]
    order, _ = fleet(reqs, make_router("power_of_two", seed=3))
    rng = np.random.default_rng(3)
    first = [f"r{int(i)}" for i in (rng.choice(2, size=2, replace=False) for _ in range(3))
             for i in i[:1]]
    assert order[0] == first[0]
    assert order[1] != order[0]
    assert order[2] == first[2]


def test_least_load_counts_the_routers_own_in_flight_requests():
    # A and B occupy r0 and r1 until t=11 and t=11.1; C (t=0.2) ties -> lowest index r0;
    # D at t=20, after all finished: both idle -> r0
    reqs = [req("A", 0.0, 100, 10), req("B", 0.1, 100, 10), req("C", 0.2, 100, 2),
            req("D", 20.0, 100, 2)]
    order, _ = fleet(reqs, make_router("least_load"))
    assert order == ["r0", "r1", "r0", "r0"]


def test_cache_aware_sends_a_miss_to_the_least_loaded_worker_and_a_hit_to_its_tree():
    # A misses (loads 0, 0): the first worker, r0, its prompt inserted for r0; B (a new
    # prefix, A in flight: loads 1, 0) misses -> r1; C matches X in r0's tree
    # (1000/1100 > 0.3) -> r0; D matches Y -> r1; E (new; loads 2, 2) misses -> r0, the
    # first on a tie (sgl-model-gateway 0.3.2, as measured live: cache_aware_probe.py)
    X, Y = (11, 1000), (12, 1000)
    reqs = [req("A", 0.0, [X, (101, 100)], 2), req("B", 0.1, [Y, (102, 100)], 2),
            req("C", 0.2, [X, (103, 100)], 2), req("D", 0.3, [Y, (104, 100)], 2),
            req("E", 0.4, [(105, 500)], 2)]
    router = make_router("cache_aware")
    order, res = fleet(reqs, router)
    assert order == ["r0", "r1", "r0", "r1", "r0"]
    assert router.decisions == {"balance": 0, "cache_hit": 2, "cache_miss": 3,
                                "fallback_first": 0}
    assert res.summary["router_decisions"]["cache_hit"] == 2


def test_cache_aware_sequential_misses_all_go_to_the_first_worker():
    # each request ends before the next arrives: every miss sees loads (0, 0) -> r0
    reqs = [req(f"R{i}", 20.0 * i, [(200 + i, 500)], 2) for i in range(4)]
    order, _ = fleet(reqs, make_router("cache_aware"))
    assert order == ["r0"] * 4


def test_cache_aware_balance_rule_then_the_most_recent_holder_of_a_match():
    # thresholds abs 1, rel 1.0: A misses -> r0; B matches X in r0's tree -> r0; C sees
    # loads (2, 0): imbalanced -> least loaded r1, its prompt inserted for r1; D (loads
    # 2, 1: balanced) matches X, held by r0 and r1: the most recent, r1; E (a new prefix;
    # loads 2, 2) misses -> r0, the first on a tie
    X, Y = (11, 1000), (12, 1000)
    reqs = [req("A", 0.0, [X, (1, 10)], 20), req("B", 0.1, [X, (2, 10)], 20),
            req("C", 0.2, [X, (3, 10)], 20), req("D", 0.3, [X, (4, 10)], 20),
            req("E", 0.4, [Y, (5, 10)], 20)]
    router = make_router("cache_aware", {"balance_abs_threshold": 1,
                                         "balance_rel_threshold": 1.0})
    order, _ = fleet(reqs, router)
    assert order == ["r0", "r0", "r1", "r1", "r0"]
    assert router.decisions == {"balance": 1, "cache_hit": 2, "cache_miss": 2,
                                "fallback_first": 0}


def test_cache_aware_follows_its_tree_once_both_workers_have_text():
    t = ApproxTree()
    t.insert([(11, 1000), (1, 100)], 0, now=1.0)
    t.insert([(12, 1000), (2, 100)], 1, now=2.0)
    t.insert([(13, 50)], 1, now=3.0)
    assert t.prefix_match([(11, 1000), (9, 100)], 4.0) == (1000, 0)
    assert t.smallest_tenant() == 0  # 1100 < 1150


def test_approx_tree_eviction_keeps_each_worker_under_its_size_lru_first():
    t = ApproxTree()
    t.insert([(1, 10), (2, 10)], 0, now=1.0)
    t.insert([(1, 10), (3, 10)], 0, now=2.0)
    t.insert([(1, 10)], 1, now=3.0)
    assert t.size == {0: 30, 1: 10}
    t.evict(20, now=4.0)  # worker 0: drop its oldest leaf (2, 10)
    assert t.size == {0: 20, 1: 10}
    assert t.prefix_match([(1, 10), (2, 10)], 5.0)[0] == 10
    assert t.prefix_match([(1, 10), (3, 10)], 5.0) == (20, 0)


def test_prefix_hash_keeps_a_prefix_on_one_worker():
    P, Q = (21, 300), (22, 300)
    reqs = [req(f"p{i}", i * 0.5, [P, (100 + i, 50)], 2) for i in range(4)]
    reqs += [req(f"q{i}", 0.25 + i * 0.5, [Q, (200 + i, 50)], 2) for i in range(4)]
    reqs.sort(key=lambda r: r.arrival_s)
    order, res = fleet(reqs, make_router("prefix_hash", {"load_factor": 100.0}), n=3)
    by = {rec["rid"]: rec["replica"] for rec in res.records}
    assert len({by[f"p{i}"] for i in range(4)}) == 1
    assert len({by[f"q{i}"] for i in range(4)}) == 1


def test_length_router_sends_each_prompt_to_its_pool():
    pools = ["sglang", "medium", "high"]
    inner = {p: make_router("round_robin") for p in pools}
    router = make_router("length", {"thresholds": [32000, 64000], "pools": pools,
                                    "inner": inner})
    sizes = [100, 32000, 32001, 64000, 64001, 120000]
    views = [WorkerView(i, f"w{i}", p, True, 0) for i, p in enumerate(pools)]
    got = [views[router.pick(Request.make(f"x{n}", 0, [(n, n)], 1), views, 0.0)].pool
           for n in sizes]
    assert got == ["sglang", "sglang", "medium", "medium", "high", "high"]


def test_length_router_inner_round_robin_per_pool_and_503_for_an_empty_pool():
    pools = ["short", "long"]
    router = make_router("length", {"thresholds": [1000], "pools": pools,
                                    "inner": {p: make_router("round_robin") for p in pools}})
    reqs = [req("s0", 0.0, 100, 2), req("L0", 0.1, 2000, 2), req("s1", 0.2, 100, 2),
            req("s2", 0.3, 100, 2)]
    order, res = fleet(reqs, router, n=3, pools=["short", "short", "long"])
    assert order == ["r0", "r2", "r1", "r0"]
    assert [r["pool"] for r in res.records] == ["short", "long", "short", "short"]
    views = [WorkerView(0, "w0", "short", False, 0), WorkerView(1, "w1", "long", True, 0)]
    assert router.pick(Request.make("s", 0, [(1, 10)], 1), views, 0.0) is None


def test_least_load_on_polled_load_acts_on_the_last_poll_not_the_present():
    # polls at 0, 10, 20: at 0 nothing has reached a queue yet, so B and C (t=1, 2) see
    # (0, 0) and follow A to r0 (the in-flight count would have sent B to r1); D at 11
    # sees the poll at 10 (r0 holds three) and goes to r1
    env = simpy.Environment()
    reqs = [req("A", 0.0, 100, 20), req("B", 1.0, 100, 20), req("C", 2.0, 100, 20),
            req("D", 11.0, 100, 2)]
    router = make_router("least_load", {"load": "polled", "poll_interval_s": 10.0})
    dep = Deployment(env, Source(Workload("t", tuple(reqs))), router, poll_interval_s=10.0)
    for i in range(2):
        cfg = SimConfig(args=ServerArgs(model_path=MODEL, max_total_tokens=100_000), gpu=GPU,
                        sample_every_s=1e9, step_time_backend="roofline")
        dep.add(make_replica(env, cfg, ST)[0], "default", f"r{i}")
    res = run_deployment(dep)
    assert [r["replica"] for r in res.records] == ["r0", "r0", "r0", "r1"]


def test_length_router_falls_back_to_another_pool_when_its_own_has_no_healthy_worker():
    pools = ["sglang", "vllm"]
    router = make_router("length", {"thresholds": [1000], "pools": pools,
                                    "inner": {p: make_router("round_robin") for p in pools},
                                    "fallback": {"sglang": ["vllm"]}})
    views = [WorkerView(0, "s0", "sglang", False, 0), WorkerView(1, "v0", "vllm", True, 0)]
    short, long_ = Request.make("s", 0, [(1, 10)], 1), Request.make("l", 0, [(2, 5000)], 1)
    assert router.pick(short, views, 0.0) == 1 and router.fallbacks == 1
    views[1] = WorkerView(1, "v0", "vllm", False, 0)
    assert router.pick(long_, views, 0.0) is None  # no fallback given for vllm
    with pytest.raises(ConfigError, match="fallback names pool 'tpu'"):
        make_router("length", {"pools": pools, "thresholds": [1], "inner": {},
                               "fallback": {"sglang": ["tpu"]}})


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50)),
                                          min_size=1, max_size=4), st.integers(0, 3)),
    st.tuples(st.just("evict"), st.integers(0, 150), st.just(0))), max_size=120))
def test_cache_aware_tree_keeps_each_tenants_leaves(ops) -> None:
    """The approximate tree's per-tenant leaves (what an eviction starts from) and its
    eviction heaps, kept as inserts, matches and evictions go, give what tree.rs's
    eviction gives (a heap built from a walk's leaves at each eviction): the leaves a walk
    finds, and the same tree after every operation."""
    import heapq

    def id_of(n) -> tuple:  # the path of segment keys from the root, walked up
        path = []
        while n.parent is not None:
            path.append(n.key)
            n = n.parent
        return tuple(reversed(path))

    def walk_leaves_of(t: ApproxTree, tenant: int) -> list:
        out, stack = [], [t.root]
        while stack:
            n = stack.pop()
            kids = list(n.children.values())
            stack.extend(kids)
            if n is not t.root and tenant in n.tenants and not any(
                    tenant in c.tenants for c in kids):
                out.append(n)
        return out

    def evict_by_walk(t: ApproxTree, max_tokens: int) -> None:
        for tenant in sorted(x for x, s in t.size.items() if s > max_tokens):
            heap = [(n.tenants[tenant], id_of(n), n) for n in walk_leaves_of(t, tenant)]
            heapq.heapify(heap)
            while heap and t.size[tenant] > max_tokens:
                _, _, n = heapq.heappop(heap)
                if tenant not in n.tenants:
                    continue
                del n.tenants[tenant]
                t.size[tenant] -= n.tokens
                parent = n.parent
                if not n.children and not n.tenants and parent is not None:
                    del parent.children[n.key]
                if parent is not t.root and parent is not None and tenant in parent.tenants \
                        and not any(tenant in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[tenant], id_of(parent), parent))

    def state(t: ApproxTree) -> list:
        out, stack = [], [t.root]
        while stack:
            n = stack.pop()
            out.append((n.path, sorted(n.tenants.items())))
            stack.extend(n.children.values())
        return sorted(out) + [sorted(t.size.items())]

    kept, walked = ApproxTree(), ApproxTree()
    for step, (op, arg, tenant) in enumerate(ops):
        now = float(step // 3)  # (equal access times: the path breaks the tie)
        if op == "insert":
            kept.insert(arg, tenant, now)
            walked.insert(arg, tenant, now)
            kept.prefix_match(arg[:1], now + 0.5)
            walked.prefix_match(arg[:1], now + 0.5)
        else:
            kept.evict(arg, now)
            evict_by_walk(walked, arg)
        assert state(kept) == state(walked)
        for ten in range(4):
            assert set(map(id, kept.leaves.get(ten, ()))) == set(map(id, walk_leaves_of(kept, ten)))
