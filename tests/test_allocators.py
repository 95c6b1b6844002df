"""KV allocators: invariants under random operation sequences, statistics by hand on small
layouts, compaction, and the simulator end to end with each allocator."""

import pytest
from helpers import GPU, MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.config import ServerArgs
from twin.memory import AllocResult, make_allocator
from twin.memory.buddy import BuddyAllocator, block_tokens
from twin.memory.contiguous import ContiguousAllocator
from twin.memory.regions import RegionAllocator
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload

NAMES = ["token", "paged", "buddy", "contiguous"]


def make(name: str, capacity: int = 200):
    return make_allocator(name, capacity, page_size=8, min_block_tokens=8, reserve_fraction=0.1)


# ---- random operation sequences --------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(1, 60)),
    st.tuples(st.just("reserve"), st.integers(0, 5), st.integers(1, 90)),
    st.tuples(st.just("grow"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("steps"), st.just(0), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("transfer"), st.integers(0, 5), st.integers(1, 100)),
    st.tuples(st.just("free_tokens"), st.integers(0, 5), st.integers(1, 100)),
    st.tuples(st.just("evict"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("compact"), st.just(0), st.just(0)),
), max_size=80)


class Model:
    """What the allocator must hold: tokens per owner."""

    def __init__(self, a):
        self.a, self.held, self.next_node = a, {}, -1

    def live(self):
        return sorted(o for o in self.held if o >= 0)

    def apply(self, op, x, y):
        a, held = self.a, self.held
        if op == "alloc":
            free = a.available()
            res = a.alloc(x, y)
            if res is AllocResult.OK:
                held[x] = held.get(x, 0) + y
            else:
                assert (res is AllocResult.OOM) == (y > free), (res, y, free)
        elif op == "reserve":
            if a.reserve(x, y) is AllocResult.OK:
                held.setdefault(x, 0)
        elif op == "grow" and self.live():
            owners = self.live()
            if a.grow_all(owners, x) is not None:
                for o in owners:
                    held[o] += x
        elif op == "steps" and self.live():
            owners = self.live()
            k = a.decode_steps(owners, a.available() + 10**6)
            if k and isinstance(a, RegionAllocator):  # within the blocks: no copy, no failure
                assert a.grow_all(owners, k) == 0
                for o in owners:
                    held[o] += k
        elif op == "free":
            a.free(x)
            held.pop(x, None)
        elif op == "transfer" and held.get(x):
            n = min(y, held[x])
            a.transfer(x, self.next_node, n)
            held[x] -= n
            held[self.next_node] = n
            self.next_node -= 1
        elif op == "free_tokens" and held.get(x):
            n = min(y, held[x])
            a.free_tokens(x, n)
            held[x] -= n
        elif op == "evict":
            nodes = sorted(o for o in held if o < 0)
            if nodes:
                node = nodes[x % len(nodes)]
                a.free(node)
                del held[node]
        elif op == "compact":
            check_compaction(a)

    def check(self):
        a = self.a
        a.check_integrity()
        s = a.stats()
        assert s.free + s.allocated + s.reserved == s.capacity
        assert s.stored == a.stored() == sum(self.held.values())
        assert s.allocated >= s.stored
        assert 0 <= s.largest_free_run <= s.free == a.available()
        assert 0 <= s.external_fragmentation <= 1 and 0 <= s.internal_fragmentation <= 1
        if isinstance(a, RegionAllocator):
            assert a.fragmentation() == s.external_fragmentation


def check_compaction(a):
    """Compaction moves exactly the stored tokens of the regions whose address changed and
    leaves one free run."""
    if not isinstance(a, RegionAllocator):
        assert a.compact() == 0
        return
    before = {id(r): (r.addr, r.used) for r in a.regions()}
    moved = a.compact()
    after = {id(r): r.addr for r in a.regions()}
    assert moved == sum(used for i, (addr, used) in before.items() if after[i] != addr)
    live_end = sum(r.size for r in a.regions())
    assert max((r.addr + r.size for r in a.regions()), default=0) == live_end
    assert a.largest_free() == a.free_space() or isinstance(a, BuddyAllocator)
    if isinstance(a, BuddyAllocator):  # free blocks tile [live_end, capacity) in one run
        spans = sorted((b * a.mb, a.mb << o) for b, o in a.space.check())
        at = live_end
        for addr, size in spans:
            assert addr == at
            at += size


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.integers(8, 300))
def test_random_sequences_keep_the_invariants(name, ops, capacity):
    a = make(name, capacity)
    m = Model(a)
    for op in ops:
        m.apply(*op)
        m.check()
    for o in sorted(m.held):
        a.free(o)
    a.check_integrity()
    s = a.stats()
    assert s.stored == s.allocated == 0 and s.free + s.reserved == s.capacity
    if isinstance(a, BuddyAllocator):  # coalescing complete: the free blocks are the roots
        assert [(b, o) for b, o in a.space.check()] == a.space.roots
    if isinstance(a, ContiguousAllocator):
        assert a.space.check() == [(0, a.space.limit)]


# ---- statistics by hand -----------------------------------------------------------------
def test_buddy_three_owners_by_hand():
    b = BuddyAllocator(128, min_block_tokens=16)  # 8 minimum blocks
    assert b.alloc(0, 20) is AllocResult.OK  # 2 units -> 32 tokens at 0
    assert b.alloc(1, 16) is AllocResult.OK  # 16 at 32
    assert b.alloc(2, 40) is AllocResult.OK  # 3 units -> 64 at 64
    assert [(r.addr, r.size) for r in b.regions()] == [(0, 32), (32, 16), (64, 64)]
    assert [b.footprint(n) for n in (1, 16, 17, 40, 65)] == [16, 16, 32, 64, 128]
    s = b.stats()
    assert (s.stored, s.allocated, s.free, s.largest_free_run) == (76, 112, 16, 16)
    assert s.internal_fragmentation == pytest.approx(36 / 112)
    assert s.external_fragmentation == 0 and s.effective_utilization == pytest.approx(76 / 128)
    b.free(1)  # 32 and 48 coalesce
    assert b.stats().largest_free_run == 32
    b.free(0)
    assert b.stats().largest_free_run == 64
    b.check_integrity()


def test_buddy_fragmented_vs_oom_and_compaction():
    b = BuddyAllocator(128, min_block_tokens=16)
    for o in range(8):
        assert b.alloc(o, 16) is AllocResult.OK
    for o in (0, 2, 4, 6):
        b.free(o)
    s = b.stats()
    assert (s.free, s.largest_free_run) == (64, 16)
    assert s.external_fragmentation == 0.75
    assert b.alloc(9, 32) is AllocResult.FRAGMENTED
    assert b.alloc(9, 80) is AllocResult.OOM
    assert (b.stats().failures_fragmented, b.stats().failures_oom) == (1, 1)
    assert b.compact() == 64  # all four live blocks move: 16->0, 48->16, 80->32, 112->48
    assert [r.addr for r in b.regions()] == [0, 16, 32, 48]
    assert b.stats().largest_free_run == 64 and b.fragmentation() == 0
    assert b.alloc(9, 32) is AllocResult.OK
    assert (b.stats().compactions, b.stats().tokens_moved) == (1, 64)
    b.check_integrity()


def test_buddy_grows_in_place_then_reallocates():
    b = BuddyAllocator(128, min_block_tokens=16)
    b.alloc(0, 16)
    assert b.decode_steps([0], 100) == 0
    assert b.grow_all([0], 1) == 0  # its buddy is free: doubled in place
    assert [(r.addr, r.size) for r in b.regions()] == [(0, 32)]
    b.alloc(1, 16)  # at 32: the next doubling of owner 0 is blocked
    assert b.decode_steps([0, 1], 100) == 0 and b.decode_steps([0], 100) == 15
    assert b.decode_steps([0], 10) == 10  # at most room // owners
    assert b.grow_all([0], 16) == 17  # 33 tokens: re-allocated to 64 at 64, 17 copied
    assert b.home[0].addr == 64 and b.home[0].size == 64
    assert (b.stats().reallocations, b.stats().tokens_moved) == (1, 17)
    b.check_integrity()


def test_buddy_reserve_takes_the_block_up_front():
    b = BuddyAllocator(128, min_block_tokens=16)
    assert b.reserve(0, 40) is AllocResult.OK  # 64 tokens at 0, nothing stored
    assert (b.stats().allocated, b.stats().stored) == (64, 0)
    for _ in range(5):  # chunks of 8: no re-allocation
        assert b.alloc(0, 8) is AllocResult.OK
    assert b.stats().reallocations == 0 and b.home[0].size == 64
    assert b.reserve(1, 128) is AllocResult.OOM
    b.check_integrity()


def test_buddy_block_lives_until_its_last_holder_frees():
    b = BuddyAllocator(32, min_block_tokens=4)
    b.alloc(0, 30)  # the whole pool
    b.transfer(0, -1, 6)  # a radix node caches the first 6 tokens, no copy
    b.free(0)  # the node keeps the block, trimmed to 8 tokens
    assert [(r.addr, r.size, r.used) for r in b.regions()] == [(0, 8, 6)]
    assert b.stats().largest_free_run == 16 and b.stats().free == 24
    b.free(-1)
    assert b.stats().largest_free_run == 32
    b.check_integrity()


def test_buddy_min_block_in_tokens():
    assert block_tokens(256 * 2**20, 131072) == 2048  # Llama-3.1-8B, 128 KiB per token
    assert block_tokens(256 * 2**20, 100_000) == 4096  # rounded up to a power of two
    b = make_allocator("buddy", 10_000, bytes_per_token=131072)
    assert (b.mb, b.capacity, b.space.roots) == (2048, 8192, [(0, 2)])
    odd = BuddyAllocator(10 * 16 + 5, min_block_tokens=16)  # 10 units: roots 8 + 2
    assert odd.capacity == 160 and odd.space.roots == [(0, 3), (8, 1)]


def test_contiguous_by_hand():
    c = ContiguousAllocator(100, reserve_fraction=0.15)  # 15 reserved, 85 usable
    assert c.reserve(0, 30) is AllocResult.OK and c.reserve(1, 40) is AllocResult.OK
    c.alloc(0, 10)
    c.alloc(1, 25)
    s = c.stats()
    assert (s.stored, s.allocated, s.free, s.reserved) == (35, 70, 15, 15)
    assert s.internal_fragmentation == 0.5 and s.effective_utilization == 0.35
    assert c.grow_all([0, 1], 16) is None  # owner 1 would pass its run: nothing changes
    assert c.grow_all([0, 1], 15) == 0 and c.stored() == 65
    c.free(0)
    s = c.stats()
    assert (s.free, s.largest_free_run) == (45, 30)
    assert s.external_fragmentation == pytest.approx(1 / 3)
    assert c.reserve(2, 40) is AllocResult.FRAGMENTED
    assert c.reserve(2, 50) is AllocResult.OOM
    assert c.compact() == 40  # owner 1's 40 stored tokens slide from 30 to 0
    assert c.stats().largest_free_run == 45 and c.fragmentation() == 0
    assert c.reserve(2, 40) is AllocResult.OK
    c.check_integrity()


def test_contiguous_run_referenced_by_the_cache():
    c = ContiguousAllocator(100, reserve_fraction=0.0)
    c.reserve(0, 60)
    c.alloc(0, 20)
    c.transfer(0, -1, 20)
    c.free(0)  # trimmed to the node's 20 tokens
    assert [(r.addr, r.size) for r in c.regions()] == [(0, 20)]
    assert c.stats().free == 80
    c.free(-1)
    assert c.stats().free == 100 == c.stats().largest_free_run


# ---- end to end -----------------------------------------------------------------------
def small_workload(n=24):
    reqs = []
    for i in range(n):
        shared = [(7, 40)] if i % 2 else []  # half share a 40-token prefix
        segs = shared + [(1000 + i, 30 + 37 * (i % 7))]
        reqs.append(Request.make(f"q{i}", 0.05 * i, segs, 10 + 13 * (i % 5)))
    return Workload("alloc-e2e", tuple(reqs), None)


def run_small(name: str, min_block_tokens: int = 64, n: int = 24):
    w = small_workload(n)
    args = ServerArgs(model_path=MODEL, max_total_tokens=4096, page_size=1)
    cfg = SimConfig(args=args, gpu=GPU, step_time_backend="roofline", kv_allocator=name,
                    debug_checks=True, horizon_s=600.0,  # bounded even if requests loop
                    buddy_min_block_bytes=min_block_tokens * 131072,  # Llama-3.1-8B
                    kv_reserve_fraction=0.15)
    res = simulate(w, cfg)
    assert sorted(r["rid"] for r in res.records) == sorted(r.rid for r in w.requests)
    return [(r["rid"], r["status"], r["error"]) for r in res.records if r["status"] != "ok"]


@pytest.mark.parametrize("name", ["token", "paged", "buddy", "contiguous"])
def test_simulator_end_to_end(name):
    assert not run_small(name)


@pytest.mark.parametrize("min_block", [256, 512, 1024, 2048])
def test_simulator_end_to_end_with_coarse_buddy_blocks(min_block):
    assert not run_small("buddy", min_block)
