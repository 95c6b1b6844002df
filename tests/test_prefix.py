"""Radix cache over segments: match, insert, locks, LRU eviction, integrity."""

from hypothesis import given, settings
from hypothesis import strategies as st

from twin.prefix import RadixCache


def test_match_insert_and_shared_prefixes():
    t = RadixCache()
    node, created = t.insert([(1, 100), (2, 50)], now=0.0)
    assert [n.tokens for n in created] == [100, 50] and t.total_tokens == 150 and t.evictable_tokens == 150
    assert t.match([(1, 100), (3, 10)], now=1.0)[0] == 100
    assert t.match([(1, 100), (2, 50), (4, 1)], now=1.0)[0] == 150
    assert t.match([(9, 100)], now=1.0)[0] == 0
    _, created = t.insert([(1, 100), (3, 10)], now=2.0)
    assert [n.key for n in created] == [(3, 10)] and t.total_tokens == 160
    t.check_integrity()


def test_locked_path_is_not_evicted_and_lru_goes_first():
    t = RadixCache()
    a, _ = t.insert([(1, 10), (2, 20)], now=0.0)
    b, _ = t.insert([(1, 10), (3, 30)], now=1.0)
    c, _ = t.insert([(4, 40)], now=2.0)
    t.lock(b)
    assert t.evictable_tokens == 20 + 40
    assert t.evict(1) == 20  # (2,20) is the least recently used unlocked leaf
    assert t.match([(1, 10), (2, 20)], now=3.0)[0] == 10
    assert t.evict(1000) == 40  # b's path is locked
    assert t.total_tokens == 40 and t.evictable_tokens == 0
    t.unlock(b)
    assert t.evictable_tokens == 40
    assert t.evict(1000) == 40 and t.total_tokens == 0
    t.check_integrity()


def test_a_touched_leaf_is_evicted_after_an_untouched_one():
    t = RadixCache()
    t.insert([(1, 10)], now=0.0)
    t.insert([(2, 10)], now=1.0)
    t.match([(1, 10)], now=5.0)
    assert t.evict(5) == 10
    assert t.match([(1, 10)], now=6.0)[0] == 10 and t.match([(2, 10)], now=6.0)[0] == 0


OPS = st.lists(st.tuples(st.sampled_from(["insert", "lock", "unlock", "evict", "match"]),
                         st.lists(st.integers(1, 4), min_size=1, max_size=4),
                         st.integers(1, 200)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_operations_keep_the_invariants(ops):
    t = RadixCache()
    locked = []
    now = 0.0
    for op, path, n in ops:
        now += 1
        segs = [(h, 10 * h) for h in path]
        if op == "insert":
            t.insert(segs, now)
        elif op == "match":
            t.match(segs, now)
        elif op == "lock":
            node, _ = t.insert(segs, now)
            t.lock(node)
            locked.append((node, segs))
        elif op == "unlock" and locked:
            t.unlock(locked.pop(0)[0])
        elif op == "evict":
            before = t.total_tokens
            freed = t.evict(n)
            assert t.total_tokens == before - freed
        for node, path_segs in locked:  # a locked path is never evicted
            assert node.parent is not None or node is t.root
            assert t.match(path_segs, now)[0] == sum(k for _, k in path_segs)
        t.check_integrity()
