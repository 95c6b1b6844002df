"""KV-cache allocators behind one interface (`KVAllocator`), chosen by name (`--kv-allocator`).

Every KV token the replica stores is charged to an owner: a request (owner id = its index,
>= 0) or a radix-cache node (owner id = -node id, < 0). When a finished prefill is inserted
into the radix cache, `transfer` hands the request's tokens to the node without a copy (the
cache references the same slots, as SGLang's radix cache does); block allocators keep the
block alive until every owner holding part of it has freed it.

`token` is SGLang's `TokenToKVPoolAllocator` (page size 1): any free slot serves any token,
so only counts matter and there is no fragmentation. Other allocators register themselves in
`ALLOCATORS` from their modules (`paged`, `buddy`, `contiguous`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from twin.registry import Registry

Owner = int


class AllocResult(enum.Enum):
    OK = "ok"
    OOM = "out of memory"  # not enough free tokens in total
    FRAGMENTED = "fragmented"  # enough free tokens, but not in a usable place


@dataclass(frozen=True)
class AllocatorStats:
    capacity: int  # tokens
    stored: int  # tokens holding KV
    allocated: int  # tokens reserved by owners (stored + internal waste)
    free: int  # capacity - allocated
    largest_free_run: int
    failures_oom: int = 0
    failures_fragmented: int = 0
    compactions: int = 0
    tokens_moved: int = 0  # by compaction and re-allocation
    reserved: int = 0  # never allocated (the contiguous safety reserve)
    reallocations: int = 0  # owners moved to a bigger block (buddy growth)

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated tokens that hold no KV."""
        return (self.allocated - self.stored) / self.allocated if self.allocated else 0.0

    @property
    def external_fragmentation(self) -> float:
        """1 - largest free run / free: how scattered the free space is."""
        return 1.0 - self.largest_free_run / self.free if self.free else 0.0

    @property
    def effective_utilization(self) -> float:
        """Tokens holding KV over capacity."""
        return self.stored / self.capacity if self.capacity else 0.0


class KVAllocator(ABC):
    """Contract (free + allocated + reserved == capacity):
    - `alloc(owner, n)` gives `owner` room for n more tokens or says why not (nothing changes
      on failure); `free(owner)` returns everything it holds; `transfer(src, dst, n)` moves
      n stored tokens from src to dst without a copy.
    - `available()` is the free token count SGLang's budgets see (`available_size()`).
    - `decode_steps(owners, room)`: how many decode steps, each adding one token to every
      owner, run before one of them needs an allocation decision other than taking free
      tokens (re-allocation, a new block) — at most `room // len(owners)`; `grow_all` then
      applies them and returns the tokens it copied.
    - `check_integrity()` proves free + allocated == capacity and that no two owners'
      space overlaps.
    """

    name = "abstract"
    capacity: int
    #: reserve() should cover the outputs too (pre-allocation of the maximum length)
    reserves_outputs = False

    def fragmentation(self) -> float:
        """External fragmentation now (cheap: the replica may call it after every finish)."""
        return 0.0

    @abstractmethod
    def available(self) -> int: ...

    @abstractmethod
    def alloc(self, owner: Owner, n: int) -> AllocResult: ...

    @abstractmethod
    def free(self, owner: Owner) -> None: ...

    @abstractmethod
    def free_tokens(self, owner: Owner, n: int) -> None:
        """Give back the last n stored tokens of `owner` (duplicates of cached segments)."""

    @abstractmethod
    def transfer(self, src: Owner, dst: Owner, n: int) -> None: ...

    def reserve(self, owner: Owner, max_tokens: int) -> AllocResult:
        """Pre-allocate for an owner that will grow to `max_tokens` (a no-op unless the
        allocator pre-allocates)."""
        return AllocResult.OK

    def decode_steps(self, owners: Sequence[Owner], room: int) -> int:
        return room // len(owners)

    @abstractmethod
    def grow_all(self, owners: Sequence[Owner], k: int) -> int | None:
        """Add k tokens to every owner; the tokens copied by re-allocations, or None when
        it cannot (nothing changes then)."""

    @abstractmethod
    def stored(self) -> int: ...

    @abstractmethod
    def stats(self) -> AllocatorStats: ...

    def series_columns(self) -> tuple[int, int, int, float, float]:
        """A time-series sample of `stats()`: stored, allocated, largest free run, and the
        internal and external fragmentation rounded to 6 places (twin.metrics'
        SERIES_FIELDS)."""
        st = self.stats()
        return (st.stored, st.allocated, st.largest_free_run,
                round(st.internal_fragmentation, 6), round(st.external_fragmentation, 6))

    def footprint(self, n: int) -> int:
        """Free tokens a new owner of n tokens takes (a block allocator rounds up to its
        block): what an admission budget should subtract."""
        return n

    def cache_slack(self) -> int:
        """Allocated tokens, beyond the cached tokens themselves, that evicting every
        radix-cache node would free (block allocators: the unused part of blocks only the
        cache holds). 0 for pools that allocate token by token."""
        return 0

    def compact(self) -> int:
        """Move live allocations together; returns tokens moved (the replica charges the
        copy time at HBM bandwidth). A pool with no placement moves nothing."""
        return 0

    @abstractmethod
    def check_integrity(self) -> None: ...


class TokenPool(KVAllocator):
    """SGLang's token pool: any free slot serves any token, so only counts matter."""

    name = "token"

    def __init__(self, capacity: int, **_: object) -> None:
        self.capacity = capacity
        self.used = 0
        self.held: dict[Owner, int] = {}
        self._oom = 0

    def available(self) -> int:
        return self.capacity - self.used

    def alloc(self, owner: Owner, n: int) -> AllocResult:
        if n > self.capacity - self.used:
            self._oom += 1
            return AllocResult.OOM
        self.used += n
        self.held[owner] = self.held.get(owner, 0) + n
        return AllocResult.OK

    def free(self, owner: Owner) -> None:
        self.used -= self.held.pop(owner, 0)

    def free_tokens(self, owner: Owner, n: int) -> None:
        self.held[owner] -= n
        self.used -= n

    def transfer(self, src: Owner, dst: Owner, n: int) -> None:
        self.held[src] -= n
        self.held[dst] = self.held.get(dst, 0) + n

    def grow_all(self, owners: Sequence[Owner], k: int) -> int | None:
        if len(owners) * k > self.capacity - self.used:
            self._oom += 1
            return None
        held = self.held
        for o in owners:
            held[o] = held.get(o, 0) + k
        self.used += len(owners) * k
        return 0

    def stored(self) -> int:
        return self.used

    def stats(self) -> AllocatorStats:
        free = self.capacity - self.used
        return AllocatorStats(self.capacity, self.used, self.used, free, free, self._oom)

    def series_columns(self) -> tuple[int, int, int, float, float]:
        # stats()' numbers without the object: allocated is stored, the free space one
        # run, so both fragmentations are 0.0 (a sample a simulated second, issue 14)
        return self.used, self.used, self.capacity - self.used, 0.0, 0.0

    def check_integrity(self) -> None:
        assert 0 <= self.used <= self.capacity, (self.used, self.capacity)
        assert sum(self.held.values()) == self.used, (sum(self.held.values()), self.used)
        assert all(v >= 0 for v in self.held.values())


AllocatorFactory = Callable[..., KVAllocator]
ALLOCATORS: Registry[AllocatorFactory] = Registry(
    "KV allocator", "--kv-allocator",
    ("twin.memory.paged", "twin.memory.buddy", "twin.memory.contiguous"))
ALLOCATORS.register("token")(TokenPool)
register_allocator = ALLOCATORS.register


def allocator_names() -> list[str]:
    return ALLOCATORS.names()


def make_allocator(name: str, capacity: int, **options: object) -> KVAllocator:
    """`options`: page_size, bytes_per_token, min_block_bytes, reserve_fraction, ..."""
    return ALLOCATORS.get(name)(capacity, **options)
