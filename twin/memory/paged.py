"""Paged KV allocation: fixed pages of `page_size` tokens (vLLM-style; SGLang with
`--page-size > 1`). Any free page serves any owner, so there is no external fragmentation;
an owner's last page is partly empty (internal fragmentation).

Pages are physical: each has a fill count and a reference count, and an owner holds a list
of (page, tokens) entries in order. When a request hands its leading tokens to a radix-cache
node (`transfer`) and the boundary falls inside a page, the page becomes shared by both
(reference count 2) and is freed when both have let go, as the same slots are referenced by
the cache and the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twin.memory import AllocatorStats, AllocResult, KVAllocator, Owner, register_allocator


class PagedAllocator(KVAllocator):
    name = "paged"

    def __init__(self, capacity: int, page_size: int = 16, **_: object) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page = page_size
        self.total_pages = capacity // page_size
        self.capacity = self.total_pages * page_size
        self.fill = [0] * self.total_pages
        self.refs = [0] * self.total_pages
        self.free_pages = list(range(self.total_pages - 1, -1, -1))  # pop() = lowest
        self.held: dict[Owner, list[list[int]]] = {}  # owner -> [[page, tokens], ...]
        self.stored_total = 0
        self._oom = 0

    # -- helpers --------------------------------------------------------------------------
    def _room(self, owner: Owner) -> int:
        entries = self.held.get(owner)
        return self.page - self.fill[entries[-1][0]] if entries else 0

    def _new_pages(self, owner: Owner, n: int) -> int:
        return -(-max(0, n - self._room(owner)) // self.page)

    def _put(self, owner: Owner, n: int) -> None:
        entries = self.held.setdefault(owner, [])
        if entries and n:
            last = entries[-1]
            take = min(n, self.page - self.fill[last[0]])
            last[1] += take
            self.fill[last[0]] += take
            n -= take
        while n > 0:
            p = self.free_pages.pop()
            take = min(n, self.page)
            self.fill[p], self.refs[p] = take, 1
            entries.append([p, take])
            n -= take

    def _drop(self, page: int, tokens: int) -> None:
        self.fill[page] -= tokens
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.fill[page] = 0
            self.free_pages.append(page)

    # -- interface ------------------------------------------------------------------------
    def available(self) -> int:
        return len(self.free_pages) * self.page

    def alloc(self, owner: Owner, n: int) -> AllocResult:
        if self._new_pages(owner, n) > len(self.free_pages):
            self._oom += 1
            return AllocResult.OOM
        self._put(owner, n)
        self.stored_total += n
        return AllocResult.OK

    def free(self, owner: Owner) -> None:
        for page, tokens in self.held.pop(owner, []):
            self.stored_total -= tokens
            self._drop(page, tokens)

    def free_tokens(self, owner: Owner, n: int) -> None:
        entries = self.held[owner]
        self.stored_total -= n
        while n > 0:
            last = entries[-1]
            take = min(n, last[1])
            last[1] -= take
            n -= take
            if last[1] == 0:
                entries.pop()
                self._drop(last[0], take)
            else:
                self.fill[last[0]] -= take

    def transfer(self, src: Owner, dst: Owner, n: int) -> None:
        """dst takes src's leading n tokens in place; a page split between them is shared."""
        entries = self.held[src]
        moved: list[list[int]] = []
        while n > 0:
            first = entries[0]
            if first[1] <= n:
                moved.append(entries.pop(0))
                n -= first[1]
            else:
                moved.append([first[0], n])
                first[1] -= n
                self.refs[first[0]] += 1
                n = 0
        self.held.setdefault(dst, []).extend(moved)

    def decode_steps(self, owners: Sequence[Owner], room: int) -> int:
        rooms = np.fromiter((self._room(o) for o in owners), np.int64, count=len(owners))
        free = len(self.free_pages)
        lo, hi = 0, room // len(owners)
        while lo < hi:  # the most steps whose new pages fit in the free pages
            mid = (lo + hi + 1) // 2
            if int((-(-np.maximum(mid - rooms, 0) // self.page)).sum()) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grow_all(self, owners: Sequence[Owner], k: int) -> int | None:
        if sum(self._new_pages(o, k) for o in owners) > len(self.free_pages):
            self._oom += 1
            return None
        for o in owners:
            self._put(o, k)
        self.stored_total += len(owners) * k
        return 0

    def stored(self) -> int:
        return self.stored_total

    def stats(self) -> AllocatorStats:
        free = len(self.free_pages) * self.page
        return AllocatorStats(self.capacity, self.stored_total, self.capacity - free, free,
                              free, self._oom)

    def check_integrity(self) -> None:
        fill = [0] * self.total_pages
        refs = [0] * self.total_pages
        for entries in self.held.values():
            for page, tokens in entries:
                assert tokens > 0, "empty page entry"
                fill[page] += tokens
                refs[page] += 1
        assert fill == self.fill and refs == self.refs
        assert all(f <= self.page for f in fill)
        assert sum(fill) == self.stored_total
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages)
        assert all((refs[p] == 0) == (p in free) for p in range(self.total_pages))


@register_allocator("paged")
def _make(capacity: int, page_size: int = 16, **options: object) -> PagedAllocator:
    return PagedAllocator(capacity, page_size=page_size)
