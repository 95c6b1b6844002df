"""Radix prefix cache over prompt segments, as SGLang's RadixCache works over tokens.

A node holds one segment `(hash, n_tokens)`; a path from the root is a prefix. Requests
lock the path they use (`lock`/`unlock` count references up to the root); unlocked leaves
are evicted least-recently-used first, ties broken by creation order, so eviction is
deterministic. Segments are atomic: sharing happens at segment boundaries, which is exact
for the twin's requests because two requests share a segment only when they share its
tokens. The cache counts tokens; the KV allocator is charged by the replica.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

Segment = tuple[int, int]


class Node:
    __slots__ = ("key", "tokens", "parent", "children", "lock", "last_access", "nid")

    def __init__(self, key: Segment | None, parent: Node | None, nid: int, now: float) -> None:
        self.key = key
        self.tokens = key[1] if key else 0
        self.parent = parent
        self.children: dict[Segment, Node] = {}
        self.lock = 0
        self.last_access = now
        self.nid = nid


class RadixCache:
    def __init__(self, on_evict: Callable[[Node], None] | None = None,
                 on_insert: Callable[[Sequence[Segment], Node, list[Node], float], None]
                 | None = None) -> None:
        # told of every evicted node, its parent chain still set (the allocator frees it;
        # SGLang's hierarchical cache keeps a host copy, twin/hicache.py)
        self.on_evict = on_evict
        self.on_insert = on_insert  # told of every insert: (segments, deepest, created, now)
        self.root = Node(None, None, 0, 0.0)
        self.root.lock = 1  # never evicted
        self._next_id = 1
        self.n_nodes = 0
        self.total_tokens = 0
        self.evictable_tokens = 0
        # candidate leaves for eviction, (last_access, nid, node); entries go stale when a
        # node gains children, is locked, is touched again or is removed, and are skipped
        self._lru: list[tuple[float, int, Node]] = []

    # -- lookups ------------------------------------------------------------------------
    def match(self, segments: Sequence[Segment], now: float) -> tuple[int, Node]:
        """Longest cached leading run of `segments`: (tokens matched, deepest node)."""
        node, matched = self.root, 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                break
            node, matched = child, matched + child.tokens
            node.last_access = now
        if node is not self.root and not node.children and node.lock == 0:
            heapq.heappush(self._lru, (now, node.nid, node))
        return matched, node

    def peek(self, segments: Sequence[Segment]) -> int:
        """Tokens of the longest cached leading run of `segments`, read-only: no access
        time, no LRU entry changes (for observers such as a router that looks)."""
        node, matched = self.root, 0
        for seg in segments:
            node = node.children.get(seg)
            if node is None:
                break
            matched += node.tokens
        return matched

    def insert(self, segments: Sequence[Segment], now: float) -> tuple[Node, list[Node]]:
        """Add the path for `segments`; returns (deepest node, nodes created). Segments
        already present are shared: the caller frees its duplicate KV for them."""
        node, added, created = self.root, 0, []
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                child = Node(seg, node, self._next_id, now)
                self._next_id += 1
                self.n_nodes += 1
                node.children[seg] = child
                added += child.tokens
                created.append(child)
                self.evictable_tokens += child.tokens  # new nodes start unlocked
            child.last_access = now
            node = child
        self.total_tokens += added
        if node is not self.root and not node.children and node.lock == 0:
            heapq.heappush(self._lru, (now, node.nid, node))
        if self.on_insert is not None:
            self.on_insert(segments, node, created, now)
        return node, created

    # -- references ---------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.evictable_tokens -= node.tokens
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        if not node.children and node is not self.root and node.lock == 1:
            heapq.heappush(self._lru, (node.last_access, node.nid, node))
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_tokens += node.tokens
            node = node.parent  # type: ignore[assignment]

    # -- eviction -----------------------------------------------------------------------
    def evict(self, n_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until `n_tokens` are freed or
        nothing is evictable. Returns the tokens freed."""
        heap = self._lru
        if len(heap) > 4 * self.n_nodes + 64:  # rare: drop stale entries
            heap[:] = [(n.last_access, n.nid, n) for n in self._leaves() if n.lock == 0]
            heapq.heapify(heap)
        freed = 0
        while freed < n_tokens and heap:
            t, _, node = heapq.heappop(heap)
            if (node.parent is None or node.lock or node.children or t != node.last_access
                    or node.parent.children.get(node.key) is not node):
                continue  # stale entry
            parent = node.parent
            del parent.children[node.key]  # type: ignore[index]
            self.n_nodes -= 1
            freed += node.tokens
            if self.on_evict is not None:
                self.on_evict(node)
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, parent.nid, parent))
        self.total_tokens -= freed
        self.evictable_tokens -= freed
        return freed

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def check_integrity(self) -> None:
        """Token totals match the tree; lock counts equal the locks of the subtrees."""
        total = evictable = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            assert node.lock >= 0, f"negative lock on node {node.nid}"
            assert node.lock >= max((c.lock for c in node.children.values()), default=0), \
                f"node {node.nid} locked less than a child"
            total += node.tokens
            evictable += node.tokens if node.lock == 0 else 0
        assert total == self.total_tokens, (total, self.total_tokens)
        assert evictable == self.evictable_tokens, (evictable, self.evictable_tokens)
