"""Paged KV allocation: fixed pages of `page_size` tokens (vLLM-style; SGLang with
`--page-size > 1`). Any free page serves any owner, so there is no external fragmentation;
each owner's last page is partly empty (internal fragmentation). Pages are counted per
owner; when a request hands tokens to a radix-cache node and the boundary falls inside a
page, that page stays charged to whichever of the two still needs it, so the total never
counts a page twice."""

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
        self.stored_by: dict[Owner, int] = {}
        self.pages_by: dict[Owner, int] = {}
        self.used_pages = 0
        self.stored_total = 0
        self._oom = 0

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def available(self) -> int:
        return (self.total_pages - self.used_pages) * self.page

    def _extra(self, owner: Owner, n: int) -> int:
        return max(0, self._pages(self.stored_by.get(owner, 0) + n)
                   - self.pages_by.get(owner, 0))

    def alloc(self, owner: Owner, n: int) -> AllocResult:
        extra = self._extra(owner, n)
        if extra > self.total_pages - self.used_pages:
            self._oom += 1
            return AllocResult.OOM
        self.stored_by[owner] = self.stored_by.get(owner, 0) + n
        self.pages_by[owner] = self.pages_by.get(owner, 0) + extra
        self.used_pages += extra
        self.stored_total += n
        return AllocResult.OK

    def free(self, owner: Owner) -> None:
        self.stored_total -= self.stored_by.pop(owner, 0)
        self.used_pages -= self.pages_by.pop(owner, 0)

    def free_tokens(self, owner: Owner, n: int) -> None:
        have = self.stored_by[owner] - n
        self.stored_by[owner] = have
        self.stored_total -= n
        release = max(0, self.pages_by[owner] - self._pages(have))
        self.pages_by[owner] -= release
        self.used_pages -= release

    def transfer(self, src: Owner, dst: Owner, n: int) -> None:
        """The tokens stay where they are: the pages src no longer needs for its remaining
        tokens go to dst; a page holding both sides' tokens stays charged to src."""
        src_left = self.stored_by[src] - n
        moved = max(0, self.pages_by[src] - self._pages(src_left))
        self.stored_by[src] = src_left
        self.pages_by[src] -= moved
        self.stored_by[dst] = self.stored_by.get(dst, 0) + n
        self.pages_by[dst] = self.pages_by.get(dst, 0) + moved

    def _extra_pages(self, owners: Sequence[Owner], k: int) -> int:
        stored, pages = self._arrays(owners)
        return int(np.maximum(-(-(stored + k) // self.page) - pages, 0).sum())

    def _arrays(self, owners: Sequence[Owner]) -> tuple[np.ndarray, np.ndarray]:
        n = len(owners)
        stored = np.fromiter((self.stored_by.get(o, 0) for o in owners), np.int64, count=n)
        pages = np.fromiter((self.pages_by.get(o, 0) for o in owners), np.int64, count=n)
        return stored, pages

    def decode_steps(self, owners: Sequence[Owner], room: int) -> int:
        free = self.total_pages - self.used_pages
        lo, hi = 0, room // len(owners)
        stored, pages = self._arrays(owners)
        while lo < hi:  # the most steps whose new pages fit in the free pages
            mid = (lo + hi + 1) // 2
            if int(np.maximum(-(-(stored + mid) // self.page) - pages, 0).sum()) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def grow_all(self, owners: Sequence[Owner], k: int) -> int | None:
        if self._extra_pages(owners, k) > self.total_pages - self.used_pages:
            self._oom += 1
            return None
        for o in owners:
            extra = self._extra(o, k)
            self.stored_by[o] = self.stored_by.get(o, 0) + k
            self.pages_by[o] = self.pages_by.get(o, 0) + extra
            self.used_pages += extra
        self.stored_total += len(owners) * k
        return 0

    def stored(self) -> int:
        return self.stored_total

    def stats(self) -> AllocatorStats:
        free = (self.total_pages - self.used_pages) * self.page
        return AllocatorStats(self.capacity, self.stored_total, self.used_pages * self.page,
                              free, free, self._oom)

    def check_integrity(self) -> None:
        assert sum(self.stored_by.values()) == self.stored_total
        assert sum(self.pages_by.values()) == self.used_pages
        assert 0 <= self.used_pages <= self.total_pages
        assert all(p >= 0 for p in self.pages_by.values())


@register_allocator("paged")
def _make(capacity: int, page_size: int = 16, **options: object) -> PagedAllocator:
    return PagedAllocator(capacity, page_size=page_size)
