"""Buddy allocation of the KV pool (the users' design): power-of-two blocks with a minimum
block given in bytes, split and coalesced as in a textbook buddy system (free lists per
order, buddy address = address XOR size).

- The minimum block (`min_block_bytes`, default 256 MiB) becomes the smallest power of two
  of tokens whose bytes reach it: `2 ** ceil(log2(min_block_bytes / bytes_per_token))`
  (`min_block_tokens` overrides it). Llama-3.1-8B (128 KiB per token) gives 2,048 tokens.
- A capacity that is not a multiple of the minimum block loses its tail (like pages); the
  rest, `units` minimum blocks, is covered by the largest power-of-two blocks in address
  order (the binary digits of `units`, largest first). These roots have no buddy.
- A request owns one block and grows inside it. Growing past it first tries to double in
  place (absorbing free buddies while the block is the lower half), else re-allocates the
  smallest block holding its own tokens plus the growth and copies them (counted in
  `tokens_moved`, returned by `grow_all`); cached nodes keep the old block.
- `largest_free_run` is the largest free *block*: adjacent free blocks that are not buddies
  cannot serve one allocation.
"""

from __future__ import annotations

import bisect
import math
from itertools import pairwise

from twin.memory import AllocResult, Owner, register_allocator
from twin.memory.regions import Region, RegionAllocator

DEFAULT_MIN_BLOCK_BYTES = 256 * 2**20


def block_tokens(min_block_bytes: float, bytes_per_token: float) -> int:
    """The smallest power of two of tokens holding at least `min_block_bytes`."""
    return 1 << max(0, math.ceil(math.log2(min_block_bytes / bytes_per_token) - 1e-12))


class BuddySpace:
    """Free lists per order over an address space of `units` minimum blocks."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.roots: list[tuple[int, int]] = []  # (address, order), addresses increasing
        self.free: list[list[int]] = [[] for _ in range(max(units.bit_length(), 1))]
        self.free_units = 0
        addr = 0
        for o in reversed(range(units.bit_length())):
            if units >> o & 1:
                self.roots.append((addr, o))
                self.free[o].append(addr)
                addr += 1 << o
                self.free_units += 1 << o
        self._root_addrs = [a for a, _ in self.roots]

    def copy(self) -> BuddySpace:
        new = object.__new__(BuddySpace)
        new.units, new.roots, new._root_addrs = self.units, self.roots, self._root_addrs
        new.free = [list(f) for f in self.free]
        new.free_units = self.free_units
        return new

    def root_order(self, addr: int) -> int:
        return self.roots[bisect.bisect_right(self._root_addrs, addr) - 1][1]

    def _remove(self, order: int, addr: int) -> bool:
        f = self.free[order]
        i = bisect.bisect_left(f, addr)
        if i < len(f) and f[i] == addr:
            del f[i]
            return True
        return False

    def take(self, order: int) -> int | None:
        """The lowest-addressed free block of `order`, splitting a larger one if needed."""
        for o in range(order, len(self.free)):
            if self.free[o]:
                addr = self.free[o].pop(0)
                while o > order:
                    o -= 1
                    bisect.insort(self.free[o], addr + (1 << o))
                self.free_units -= 1 << order
                return addr
        return None

    def give(self, addr: int, order: int) -> None:
        """Free a block, coalescing with free buddies inside its root."""
        self.free_units += 1 << order
        top = self.root_order(addr)
        while order < top and self._remove(order, addr ^ (1 << order)):
            addr &= ~(1 << order)
            order += 1
        bisect.insort(self.free[order], addr)

    def extend(self, addr: int, order: int, target: int) -> bool:
        """Grow a block in place to `target` by absorbing its free upper buddies."""
        top = self.root_order(addr)
        for o in range(order, target):
            if o >= top or addr & (1 << o) or not self._has(o, addr + (1 << o)):
                return False
        for o in range(order, target):
            self._remove(o, addr + (1 << o))
        self.free_units -= (1 << target) - (1 << order)
        return True

    def _has(self, order: int, addr: int) -> bool:
        f = self.free[order]
        i = bisect.bisect_left(f, addr)
        return i < len(f) and f[i] == addr

    def trim(self, addr: int, order: int, used_units: int) -> int:
        """Give back upper halves not needed for `used_units`; the block's new order."""
        while order > 0 and used_units <= 1 << (order - 1):
            order -= 1
            self.give(addr + (1 << order), order)
        return order

    def carve(self, addr: int, order: int) -> None:
        """Mark the block (addr, order) used, splitting the free block that contains it."""
        for o in range(order, len(self.free)):
            a = addr & ~((1 << o) - 1)
            if self._remove(o, a):
                while o > order:
                    o -= 1
                    half = a + (1 << o)
                    if addr >= half:
                        bisect.insort(self.free[o], a)
                        a = half
                    else:
                        bisect.insort(self.free[o], half)
                self.free_units -= 1 << order
                return
        raise AssertionError(f"block {addr}/{order} is not free")

    def largest_order(self) -> int | None:
        for o in reversed(range(len(self.free))):
            if self.free[o]:
                return o
        return None

    def check(self) -> list[tuple[int, int]]:
        """The free blocks (addr, order), checked aligned, inside a root, not overlapping,
        with no two free buddies left uncoalesced."""
        blocks = sorted((a, o) for o, f in enumerate(self.free) for a in f)
        assert sum(1 << o for _, o in blocks) == self.free_units
        for a, o in blocks:
            assert a % (1 << o) == 0 and o <= self.root_order(a), (a, o)
            if o < self.root_order(a):
                assert not self._has(o, a ^ (1 << o)), ("uncoalesced buddies", a, o)
        for (a, o), (b, _) in pairwise(blocks):
            assert a + (1 << o) <= b, ("free overlap", a, b)
        return blocks


class BuddyAllocator(RegionAllocator):
    name = "buddy"

    def __init__(
        self,
        capacity: int,
        *,
        bytes_per_token: float | None = None,
        min_block_bytes: float = DEFAULT_MIN_BLOCK_BYTES,
        min_block_tokens: int | None = None,
    ) -> None:
        if min_block_tokens is None:
            if not bytes_per_token:
                raise ValueError("buddy allocator: give bytes_per_token or min_block_tokens")
            min_block_tokens = block_tokens(min_block_bytes, bytes_per_token)
        if min_block_tokens < 1 or min_block_tokens & (min_block_tokens - 1):
            raise ValueError(f"min block must be a power of two of tokens: {min_block_tokens}")
        units = capacity // min_block_tokens
        if units < 1:
            raise ValueError(
                f"buddy minimum block ({min_block_tokens} tokens) is larger than "
                f"the KV pool ({capacity} tokens)"
            )
        super().__init__(units * min_block_tokens)
        self.mb = min_block_tokens
        self.space = BuddySpace(units)

    def _order(self, n: int) -> int:
        return (-(-n // self.mb) - 1).bit_length() if n > 0 else 0

    def footprint(self, n: int) -> int:
        return self.mb << self._order(n)

    def _block(self, addr: int, order: int) -> Region:
        return Region(addr * self.mb, self.mb << order)

    def _place(self, n: int) -> Region | None:
        order = self._order(n)
        addr = self.space.take(order)
        return None if addr is None else self._block(addr, order)

    def _ord(self, r: Region) -> int:
        return (r.size // self.mb).bit_length() - 1

    def _release(self, r: Region) -> None:
        self.space.give(r.addr // self.mb, self._ord(r))

    def _trim(self, r: Region) -> None:
        r.size = self.mb << self.space.trim(r.addr // self.mb, self._ord(r), -(-r.used // self.mb))

    def free_space(self) -> int:
        return self.space.free_units * self.mb

    def largest_free(self) -> int:
        o = self.space.largest_order()
        return 0 if o is None else self.mb << o

    # ---- growth past a block ----------------------------------------------------------
    def _plan(self, space: BuddySpace, owner: Owner, r: Region | None, k: int) -> tuple | None:
        """On `space`, make room for k more tokens of `owner`: ("extend", order) in place,
        or ("move", addr, order, old order or None when the old block is freed); an owner
        with no block (`r` None) gets ("move", addr, order, None)."""
        if r is None:
            addr = space.take(self._order(k))
            return None if addr is None else ("move", addr, self._order(k), None)
        a, o = r.addr // self.mb, self._ord(r)
        target = self._order(r.used + k)
        if space.extend(a, o, target):
            return ("extend", target)
        own = r.holders[owner]
        new_order = self._order(own + k)
        addr = space.take(new_order)
        if addr is None:
            return None
        if len(r.holders) == 1:
            space.give(a, o)
            return ("move", addr, new_order, None)
        return ("move", addr, new_order, space.trim(a, o, -(-(r.used - own) // self.mb)))

    def _apply(self, owner: Owner, r: Region | None, plan: tuple) -> int:
        if plan[0] == "extend":
            r.size = self.mb << plan[1]
            return 0
        _, addr, order, old_order = plan
        if r is None:
            new = self._block(addr, order)
            new.holders[owner], new.home = 0, owner
            self.home[owner] = new
            self.parts.setdefault(owner, []).append(new)
            return 0
        own = r.holders.pop(owner)
        r.used -= own
        r.home = None
        if old_order is not None:
            r.size = self.mb << old_order
            self.slack += r.size - r.used
        new = self._block(addr, order)
        new.holders[owner], new.used, new.home = own, own, owner
        self.home[owner] = new
        self.parts[owner] = [x for x in self.parts[owner] if x is not r] + [new]
        self.reallocations += 1
        self.moved += own
        return own

    def _grow_short(self, short: list[Owner], k: int) -> int | None:
        space = self.space.copy()
        plans = []
        for o in short:
            plan = self._plan(space, o, self.home.get(o), k)
            if plan is None:
                self._fail(len(short) * k)
                return None
            plans.append(plan)
        self.space = space
        return sum(self._apply(o, self.home.get(o), p) for o, p in zip(short, plans, strict=True))

    def reserve(self, owner: Owner, max_tokens: int) -> AllocResult:
        """A block for `max_tokens` up front (e.g. the whole prompt, so chunked prefill does
        not re-allocate at every chunk); an existing block grows as `alloc` would."""
        r = self.home.get(owner)
        if max_tokens <= 0 or (r is not None and r.size >= max_tokens):
            return AllocResult.OK
        if r is None:
            return self._new_home(owner, max_tokens)
        if self._grow_short([owner], max_tokens - r.used) is None:
            return self._fail(max_tokens - r.used)
        return AllocResult.OK

    def _regrow(self, owner: Owner, r: Region, n: int) -> bool:
        return self._grow_short([owner], n) is not None

    # ---- compaction -------------------------------------------------------------------
    def compact(self) -> int:
        """Re-pack the live blocks from address 0, largest first (ties: address order), so
        every block stays aligned and the free space is one run at the top. Returns the
        stored tokens of the blocks that moved (the copy; a block's empty part is not)."""
        live = sorted(self.regions(), key=lambda r: (-r.size, r.addr))
        space = BuddySpace(self.space.units)
        moved, at = 0, 0
        for r in live:
            if r.addr != at:
                moved += r.used
                r.addr = at
            space.carve(at // self.mb, self._ord(r))
            at += r.size
        self.space = space
        self.compactions += 1
        self.moved += moved
        return moved

    def check_integrity(self) -> None:
        live = self._check_regions()
        free = self.space.check()
        for r in live:
            o = self._ord(r)
            assert r.size == self.mb << o and r.addr % r.size == 0, r
        spans = sorted(
            [(r.addr, r.size) for r in live] + [(a * self.mb, self.mb << o) for a, o in free]
        )
        at = 0
        for a, s in spans:  # blocks and free blocks tile the address space exactly
            assert a == at, ("gap or overlap at", at, a)
            at += s
        assert at == self.capacity, (at, self.capacity)


@register_allocator("buddy")
def _make(
    capacity: int,
    bytes_per_token: float | None = None,
    min_block_bytes: float = DEFAULT_MIN_BLOCK_BYTES,
    min_block_tokens: int | None = None,
    **_: object,
) -> BuddyAllocator:
    return BuddyAllocator(
        capacity,
        bytes_per_token=bytes_per_token,
        min_block_bytes=min_block_bytes,
        min_block_tokens=min_block_tokens,
    )
