"""Shared bookkeeping of allocators that place each request's KV in one region of the
address space (`buddy` blocks, `contiguous` runs).

A request (the region's *home* owner) allocates into its region; `transfer` hands stored
tokens to radix-cache nodes without a copy, so a region is reference-counted by every owner
holding tokens in it (`Region.holders`) and returns to the free space only when the last
of them frees. When the home owner leaves while cached nodes still hold part of its region,
the region is trimmed to the tokens still held (subclasses decide how: a buddy block gives
back upper halves, a run its tail); this assumes the cached tokens are the first ones
written, which holds for the prompt and the output the replica caches in order.

Subclasses provide the placement: `_place`, `_release`, `_trim`, `free_space`,
`largest_free`, `_regions_ok`, `compact`; and growth past a region (`_regrow`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from twin.memory import AllocatorStats, AllocResult, KVAllocator, Owner


@dataclass(eq=False)
class Region:
    addr: int  # tokens
    size: int  # tokens
    used: int = 0  # tokens held by all holders
    holders: dict[Owner, int] = field(default_factory=dict)  # owner -> tokens held here
    home: Owner | None = None  # the owner that allocates into it; None once it left


class RegionAllocator(KVAllocator):
    reserved = 0  # tokens never allocated (the contiguous reserve)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.home: dict[Owner, Region] = {}
        self.parts: dict[Owner, list[Region]] = {}
        self.stored_total = 0
        self.failures = {AllocResult.OOM: 0, AllocResult.FRAGMENTED: 0}
        self.compactions = 0
        self.moved = 0  # tokens copied by compaction and re-allocation
        self.reallocations = 0
        self.slack = 0  # unused tokens of regions only the cache holds (see cache_slack)

    # ---- placement (subclasses) ------------------------------------------------------
    def _place(self, n: int) -> Region | None:
        """A new region holding at least n tokens, or None."""
        raise NotImplementedError

    def _release(self, r: Region) -> None:
        raise NotImplementedError

    def _trim(self, r: Region) -> None:
        """Shrink a home-less region toward its used tokens."""

    def _regrow(self, owner: Owner, r: Region, n: int) -> bool:
        """Make room for n more tokens of `owner` beyond its region; False: cannot."""
        return False

    def free_space(self) -> int:
        raise NotImplementedError

    def largest_free(self) -> int:
        raise NotImplementedError

    # ---- the interface ----------------------------------------------------------------
    def available(self) -> int:
        return self.free_space()

    def _fail(self, n: int) -> AllocResult:
        res = AllocResult.OOM if n > self.free_space() else AllocResult.FRAGMENTED
        self.failures[res] += 1
        return res

    def _new_home(self, owner: Owner, n: int) -> AllocResult:
        r = self._place(n)
        if r is None:
            return self._fail(n)
        r.home = owner
        r.holders[owner] = 0
        self.home[owner] = r
        self.parts.setdefault(owner, []).append(r)
        return AllocResult.OK

    def _take(self, owner: Owner, r: Region, n: int) -> None:
        r.holders[owner] += n
        r.used += n
        self.stored_total += n

    def alloc(self, owner: Owner, n: int) -> AllocResult:
        if n <= 0:
            return AllocResult.OK
        r = self.home.get(owner)
        if r is None:
            res = self._new_home(owner, n)
            if res is not AllocResult.OK:
                return res
            r = self.home[owner]
        elif r.size - r.used < n:
            if not self._regrow(owner, r, n):
                return self._fail(n)
            r = self.home[owner]
        self._take(owner, r, n)
        return AllocResult.OK

    def free(self, owner: Owner) -> None:
        for r in self.parts.pop(owner, []):
            self.slack -= _slack(r)
            n = r.holders.pop(owner)
            r.used -= n
            self.stored_total -= n
            if r.home == owner:
                r.home = None
                del self.home[owner]
            if not r.holders:
                self._release(r)
            elif r.home is None:
                self._trim(r)
                self.slack += _slack(r)

    def free_tokens(self, owner: Owner, n: int) -> None:
        for r in reversed(self.parts[owner]):
            k = min(n, r.holders[owner])
            r.holders[owner] -= k
            r.used -= k
            if r.home is None:
                self.slack += k
            self.stored_total -= k
            n -= k
            if not n:
                return
        raise ValueError(f"owner {owner} frees {n} tokens more than it holds")

    def transfer(self, src: Owner, dst: Owner, n: int) -> None:
        dst_parts = self.parts.setdefault(dst, [])
        for r in reversed(self.parts[src]):
            k = min(n, r.holders[src])
            if not k:
                continue
            r.holders[src] -= k
            r.holders[dst] = r.holders.get(dst, 0) + k
            if r not in dst_parts:
                dst_parts.append(r)
            n -= k
            if not n:
                return
        raise ValueError(f"owner {src} transfers {n} tokens more than it holds")

    def cache_slack(self) -> int:
        """Allocated but unused tokens in regions held only by radix-cache nodes: they come
        back, beyond the nodes' own tokens, once those nodes are evicted. A room estimate
        `available() + evictable` misses them (a node of 40 tokens can pin a 2,048-token
        block)."""
        return self.slack

    def _rooms(self, owners: Sequence[Owner]) -> np.ndarray:
        home = self.home
        return np.fromiter(
            ((r.size - r.used) if (r := home.get(o)) else 0 for o in owners),
            np.int64,
            count=len(owners),
        )

    def decode_steps(self, owners: Sequence[Owner], room: int) -> int:
        """Steps before any owner fills its region (at most room // len(owners))."""
        if not owners:
            return 0
        return int(min(self._rooms(owners).min(), room // len(owners)))

    def grow_all(self, owners: Sequence[Owner], k: int) -> int | None:
        short = [
            o for o, room in zip(owners, self._rooms(owners).tolist(), strict=True) if room < k
        ]
        moved = self._grow_short(short, k) if short else 0
        if moved is None:
            return None
        home = self.home
        for o in owners:
            self._take(o, home[o], k)
        return moved

    def _grow_short(self, short: list[Owner], k: int) -> int | None:
        """Give every owner of `short` room for k more tokens; the tokens copied, or None
        (nothing changed). By default regions do not grow: only owners without one get a
        region of k tokens."""
        if any(o in self.home for o in short):
            self._fail(len(short) * k)
            return None
        placed = []
        for o in short:
            if self._new_home(o, k) is not AllocResult.OK:
                for p in reversed(placed):
                    self.free(p)
                return None
            placed.append(o)
        return 0

    def stored(self) -> int:
        return self.stored_total

    def regions(self) -> Iterator[Region]:
        """Every live region once, in the order their owners appeared."""
        seen: set[int] = set()
        for rs in self.parts.values():
            for r in rs:
                if id(r) not in seen:
                    seen.add(id(r))
                    yield r

    def fragmentation(self) -> float:
        """External fragmentation, 1 - largest free / free: O(free-list heads)."""
        free = self.free_space()
        return 1.0 - self.largest_free() / free if free else 0.0

    def stats(self) -> AllocatorStats:
        free = self.free_space()
        allocated = self.capacity - self.reserved - free
        return AllocatorStats(
            self.capacity,
            self.stored_total,
            allocated,
            free,
            self.largest_free(),
            self.failures[AllocResult.OOM],
            self.failures[AllocResult.FRAGMENTED],
            self.compactions,
            self.moved,
            reserved=self.reserved,
            reallocations=self.reallocations,
        )

    def _check_regions(self) -> list[Region]:
        live = sorted(self.regions(), key=lambda r: r.addr)
        for r in live:
            assert r.holders, r
            assert r.used == sum(r.holders.values()) <= r.size, r
            assert all(v >= 0 for v in r.holders.values()), r
            assert r.home is None or self.home[r.home] is r, r
        for a, b in pairwise(live):
            assert a.addr + a.size <= b.addr, ("overlap", a, b)
        assert sum(r.used for r in live) == self.stored_total
        assert sum(_slack(r) for r in live) == self.slack, ("slack", self.slack)
        assert sum(r.size for r in live) + self.free_space() + self.reserved == self.capacity
        for o, rs in self.parts.items():
            assert all(o in r.holders for r in rs), o
        return live


def _slack(r: Region) -> int:
    return r.size - r.used if r.home is None else 0
