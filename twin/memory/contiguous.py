"""Contiguous pre-allocation (the users' current design): each request reserves one run of
its maximum length (prompt + max new tokens) when admitted (`reserve`), first fit over a
free list sorted by address. A safety reserve (`reserve_fraction` of the capacity, the
users' 15%) at the top of the address space is never allocated. Growth within the run is
free; growth beyond it fails (an owner that never reserved gets a run of exactly what it
first asks for). Radix-cache nodes reference the run they were cached from, which is
trimmed to its used tokens when the request leaves."""

from __future__ import annotations

import bisect
from itertools import pairwise

from twin.memory import AllocResult, Owner, register_allocator
from twin.memory.regions import Region, RegionAllocator


class RunSpace:
    """Free runs [start, start + length) of [0, limit), sorted by start, never adjacent."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.starts: list[int] = [0] if limit else []
        self.lengths: list[int] = [limit] if limit else []
        self.total = limit

    def take(self, n: int) -> int | None:
        """First fit: the lowest-addressed run holding n tokens gives its head."""
        for i, length in enumerate(self.lengths):
            if length >= n:
                addr = self.starts[i]
                if length == n:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += n
                    self.lengths[i] -= n
                self.total -= n
                return addr
        return None

    def give(self, addr: int, n: int) -> None:
        if n <= 0:
            return
        self.total += n
        i = bisect.bisect_left(self.starts, addr)
        if i < len(self.starts) and addr + n == self.starts[i]:  # merge with the next run
            n += self.lengths[i]
            del self.starts[i], self.lengths[i]
        if i and self.starts[i - 1] + self.lengths[i - 1] == addr:  # and the previous one
            self.lengths[i - 1] += n
        else:
            self.starts.insert(i, addr)
            self.lengths.insert(i, n)

    def extend(self, end: int, n: int) -> bool:
        """Take n tokens from the free run starting exactly at `end`."""
        i = bisect.bisect_left(self.starts, end)
        if i == len(self.starts) or self.starts[i] != end or self.lengths[i] < n:
            return False
        self.take_at(i, n)
        return True

    def take_at(self, i: int, n: int) -> None:
        self.starts[i] += n
        self.lengths[i] -= n
        self.total -= n
        if not self.lengths[i]:
            del self.starts[i], self.lengths[i]

    def largest(self) -> int:
        return max(self.lengths, default=0)

    def check(self) -> list[tuple[int, int]]:
        runs = list(zip(self.starts, self.lengths, strict=True))
        assert sum(self.lengths) == self.total and all(n > 0 for n in self.lengths)
        for (a, n), (b, _) in pairwise(runs):
            assert a + n < b, ("free runs overlap or touch", a, n, b)
        assert not runs or runs[-1][0] + runs[-1][1] <= self.limit
        return runs


class ContiguousAllocator(RegionAllocator):
    reserves_outputs = True
    name = "contiguous"

    def __init__(self, capacity: int, *, reserve_fraction: float = 0.15) -> None:
        if not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        super().__init__(capacity)
        self.reserved = int(capacity * reserve_fraction)
        self.space = RunSpace(capacity - self.reserved)

    def _place(self, n: int) -> Region | None:
        addr = self.space.take(n)
        return None if addr is None else Region(addr, n)

    def _release(self, r: Region) -> None:
        self.space.give(r.addr, r.size)

    def _trim(self, r: Region) -> None:
        self.space.give(r.addr + r.used, r.size - r.used)
        r.size = r.used

    def free_space(self) -> int:
        return self.space.total

    def largest_free(self) -> int:
        return self.space.largest()

    def reserve(self, owner: Owner, max_tokens: int) -> AllocResult:
        """One run of `max_tokens` for `owner` (an existing smaller run is extended in
        place when the space after it is free, else the reservation fails)."""
        r = self.home.get(owner)
        if max_tokens <= 0:
            return AllocResult.OK
        if r is None:
            return self._new_home(owner, max_tokens)
        if r.size >= max_tokens or self.space.extend(r.addr + r.size, max_tokens - r.size):
            r.size = max(r.size, max_tokens)
            return AllocResult.OK
        return self._fail(max_tokens - r.size)

    def compact(self) -> int:
        """Slide the live runs to address 0 in address order; the stored tokens of the runs
        that moved."""
        moved, at = 0, 0
        for r in sorted(self.regions(), key=lambda r: r.addr):
            if r.addr != at:
                moved += r.used
                r.addr = at
            at += r.size
        self.space = RunSpace(self.space.limit)
        if at:
            self.space.take(at)
        self.compactions += 1
        self.moved += moved
        return moved

    def check_integrity(self) -> None:
        live = self._check_regions()
        spans = sorted([(r.addr, r.size) for r in live if r.size] + self.space.check())
        at = 0
        for a, s in spans:
            assert a == at, ("gap or overlap at", at, a)
            at += s
        assert at == self.space.limit, (at, self.space.limit)


@register_allocator("contiguous")
def _make(capacity: int, reserve_fraction: float = 0.15, **_: object) -> ContiguousAllocator:
    return ContiguousAllocator(capacity, reserve_fraction=reserve_fraction)
