"""KV-cache allocators behind one interface (`KVAllocator`), chosen by name.

The replica charges every KV token to an allocator: a running request's own tokens and
the radix cache's tokens alike. `token` is SGLang's token pool (page size 1; with
`--page-size` a request's allocation is rounded up to whole pages by the replica).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class AllocatorStats:
    capacity: int
    used: int  # tokens allocated
    free: int
    largest_free_run: int
    internal_fragmentation: float  # allocated but unused share of allocated
    external_fragmentation: float  # 1 - largest free run / free


class KVAllocator(ABC):
    """Contract: `alloc(n)` succeeds only when `n <= available()`; `free(n)` returns tokens;
    `used + available == capacity` always (`check_integrity`)."""

    capacity: int

    @abstractmethod
    def available(self) -> int: ...

    @abstractmethod
    def alloc(self, n: int) -> bool: ...

    @abstractmethod
    def free(self, n: int) -> None: ...

    @abstractmethod
    def stats(self) -> AllocatorStats: ...

    def compact(self) -> int:
        """Move live allocations together; returns tokens moved (the replica charges the
        copy time). A pool with no placement moves nothing."""
        return 0

    @abstractmethod
    def check_integrity(self) -> None: ...


class TokenPool(KVAllocator):
    """SGLang's `TokenToKVPoolAllocator`: any free slot serves any token, so there is no
    external fragmentation; only counts matter."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def available(self) -> int:
        return self.capacity - self.used

    def alloc(self, n: int) -> bool:
        if n > self.capacity - self.used:
            return False
        self.used += n
        return True

    def free(self, n: int) -> None:
        self.used -= n

    def stats(self) -> AllocatorStats:
        free = self.capacity - self.used
        return AllocatorStats(self.capacity, self.used, free, free, 0.0, 0.0)

    def check_integrity(self) -> None:
        assert 0 <= self.used <= self.capacity, (self.used, self.capacity)


ALLOCATORS = {"token": TokenPool}
