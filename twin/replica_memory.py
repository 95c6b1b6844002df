"""The replica's KV memory: allocator, radix cache, swap to host, compaction, and the copy
time they cost (`KVMemory`, mixed into `twin.replica.Replica`, whose state it uses), plus the
replica's counters and its swap and defragmentation settings."""

from __future__ import annotations

from dataclasses import dataclass

from twin.hicache import LOAD_BACK_THRESHOLD, HostTier, build_host_tier, layerwise_step, path_nodes
from twin.memory import AllocResult
from twin.request_state import SimRequest


@dataclass
class Counters:
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0  # tokens computed by prefill (recomputation included)
    retractions: int = 0
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_bytes: float = 0.0
    compactions: int = 0
    compaction_s: float = 0.0
    stall_s: float = 0.0  # time the replica spent copying KV (swap, compaction)
    busy_s: float = 0.0


@dataclass(frozen=True)
class DefragConfig:
    """Compact the KV allocator every `every` finished requests and/or whenever its external
    fragmentation exceeds `threshold` (the users: 100 and 0.25)."""

    every: int | None = None
    threshold: float | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.every) or self.threshold is not None


@dataclass(frozen=True)
class SwapConfig:
    """Swap instead of recompute for preempted or retracted requests holding at least
    `min_tokens` KV tokens, while host memory (`host_bytes`) has room. Copies run over the
    GPU's host link (`GpuSpec.host_link_bw`) and stall the replica."""

    min_tokens: int | None = None  # None: always recompute (SGLang's behaviour)
    host_bytes: float = 0.0


class KVMemory:
    """KV bookkeeping of the simulated server. Every KV token is charged to an owner in the
    allocator (a request, or a radix node); copies (swap, re-allocation, compaction) add to
    `self._stall`, which the scheduler loop charges before the next step."""

    # (time, cause, tokens moved) of each compaction when a list (servetwin simulate
    # --alerts sets one: the defragmentation alert's record); None: not kept
    compaction_log: list | None = None
    # SGLang's hierarchical cache (twin/hicache.py) when --enable-hierarchical-cache
    hicache: HostTier | None = None
    _pending_load: dict[int, tuple[int, int, int]]  # req index -> (host, GPU tokens, segs)
    _load_s = 0.0  # host-to-GPU loads of the prefill batch being built

    def room(self) -> int:
        return self.rep.room()

    def ceil_page(self, n: int) -> int:
        return -(-n // self.page) * self.page if self.page > 1 else n

    def evictable(self) -> int:
        return self.tree.evictable_tokens if self.tree else 0

    def _take_kv(self, owner: int, n: int) -> bool:
        """Give `owner` n more KV tokens, evicting cached prefixes (LRU) when short."""
        if n <= 0:
            return True
        short = n - self.alloc.available()
        if short > 0 and self.tree:
            self.tree.evict(short)
        res = self.alloc.alloc(owner, n)
        while res is AllocResult.FRAGMENTED and self.tree and self.tree.evictable_tokens:
            self.tree.evict(n)  # freed blocks may coalesce into a usable run
            res = self.alloc.alloc(owner, n)
        if res is AllocResult.FRAGMENTED and self.defrag.enabled:
            self._compact()
            res = self.alloc.alloc(owner, n)
        self._charge_moves()
        return res is AllocResult.OK

    def _reserve(self, req: SimRequest) -> bool:
        """Pre-allocate at admission: contiguous reserves prompt + max new tokens, a buddy
        block is sized for the round's own tokens; token pools do nothing. With the
        hierarchical cache, a host hit is loaded back here (SGLang: at admission)."""
        if self.hicache is not None and req.index in self._pending_load:
            return self._reserve_kv(req) and self._load_back(req)
        return self._reserve_kv(req)

    def _reserve_kv(self, req: SimRequest) -> bool:
        own = req.fill_len - req.prefix_len
        n = own + req.remaining if self.alloc.reserves_outputs else own
        res = self.alloc.reserve(req.index, n)
        if res is AllocResult.OK:
            return True
        if self.tree and self.tree.evictable_tokens:
            self.tree.evict(self.tree.evictable_tokens)
            res = self.alloc.reserve(req.index, n)
        if res is not AllocResult.OK and self.defrag.enabled:
            self._compact()
            res = self.alloc.reserve(req.index, n)
        return res is AllocResult.OK

    def _charge_moves(self) -> None:
        """Re-allocations copy KV over HBM: stall the replica for read + write."""
        if not self._tracks_moves:
            return
        moved = self.alloc.stats().tokens_moved
        if moved > self._moved_seen:
            self._copy_stall(moved - self._moved_seen)
            self._moved_seen = moved

    def _copy_stall(self, tokens: int) -> None:
        self._stall += 2 * tokens * self.cap.kv_bytes_per_token / self.cap.gpu.hbm_bw

    def _compact(self, cause: str = "allocation") -> None:
        """Mark-compact the allocator (`--defrag-every`, `--defrag-threshold`, or an
        allocation that failed on fragmentation); the copy stalls the replica."""
        moved = self.alloc.compact()
        if self.compaction_log is not None:
            self.compaction_log.append((round(self.env.now, 6), cause, moved))
        self.counters.compactions += 1
        stall = 2 * moved * self.cap.kv_bytes_per_token / self.cap.gpu.hbm_bw
        self.counters.compaction_s += stall
        self._stall += stall
        if self._tracks_moves:
            self._moved_seen = self.alloc.stats().tokens_moved
        self._since_defrag = 0

    def _maybe_defrag(self, finished: int) -> None:
        d = self.defrag
        if not d.enabled:
            return
        self._since_defrag += finished
        if d.every and self._since_defrag >= d.every:
            self._compact("every")
        elif d.threshold is not None and self.alloc.fragmentation() > d.threshold:
            self._compact("threshold")

    def lock(self, req: SimRequest, node) -> None:
        if self.tree and node is not None:
            self.tree.lock(node)
            req.node = node

    def unlock(self, req: SimRequest) -> None:
        if self.tree and req.node is not None:
            self.tree.unlock(req.node)
        req.node = None

    def _match(self, req: SimRequest) -> None:
        if self.tree is None or req.swapped_tokens:
            req.prefix_len, req.matched_node = 0, None
            return
        n, node = self.tree.match(req.req.segments, self.env.now)
        if self.hicache is not None:
            n = self._match_host(req, n)
        # SGLang keeps at least one token to compute (the logits of the last one)
        req.prefix_len, req.matched_node = min(n, req.fill_len - 1), node

    # ---- SGLang's hierarchical cache: the host tier's load-back (twin/hicache.py) --------
    def _init_hicache(self) -> None:
        """--enable-hierarchical-cache: a host tier behind the radix cache."""
        from twin.prefix import RadixCache

        self.hicache = build_host_tier(self.args, self.cap, self.alloc.name)
        self.tree = RadixCache(on_evict=self._evicted_hicache,
                               on_insert=self.hicache.on_insert)
        self._pending_load = {}
        self.counters.hicache = self.hicache.stats  # the summary's engine.hicache

    def _match_host(self, req: SimRequest, n: int) -> int:
        """The prefix as SGLang's admission counts it: GPU prefix plus `host_hit_length`
        (when at least `load_back_threshold` tokens; smaller hits are recomputed)."""
        h, k = self.hicache.match(req.req.segments, self.env.now)
        if h - n >= LOAD_BACK_THRESHOLD:
            self._pending_load[req.index] = (h, n, k)
            return h
        self._pending_load.pop(req.index, None)
        return n

    def host_hit(self, req: SimRequest) -> int:
        """KV tokens a waiting request's load-back needs (`PrefillAdder` reserves them)."""
        if self.hicache is None:
            return 0
        p = self._pending_load.get(req.index)
        return p[0] - p[1] if p else 0

    def _load_back(self, req: SimRequest) -> bool:
        """`init_load_back`: room on the GPU for the host hit (evicting GPU nodes), the nodes
        back in the GPU tree, the request's lock moved onto them; the copy is charged in the
        step (`_with_load_back`). False: the host copies went meanwhile (matched again)."""
        h, n, k = self._pending_load.pop(req.index)
        hc, segs, now = self.hicache, req.req.segments[:k], self.env.now
        if hc.match(segs, now)[1] < k:
            return False
        need = h - self.tree.peek(segs)
        if need > 0 and not self._take_kv(req.index, need):
            return False
        hc.loading = True
        node, created = self.tree.insert(segs, now)
        hc.loading = False
        got = 0
        for c in created:
            self.alloc.transfer(req.index, -c.nid, c.tokens)
            got += c.tokens
        if need > got:
            self.alloc.free_tokens(req.index, need - got)
        old = req.node
        self.tree.lock(node)
        req.node = node
        if old is not None:
            self.tree.unlock(old)
        if got:
            self._load_s += hc.loaded(segs, path_nodes(node), got, h - n)
        return True

    def _with_load_back(self, compute_s: float) -> float:
        """The step's time with its loads: layer i's attention waits for layer i's copy."""
        load, self._load_s = self._load_s, 0.0
        dur = layerwise_step(compute_s, load, self.cap.model.num_layers)
        self.hicache.stats["load_back_wait_s"] += dur - compute_s
        return dur

    def _evicted_hicache(self, node) -> None:
        """A GPU radix node evicted with the hierarchical cache on: freed, and its host copy
        kept (under write_back, written first: the replica waits for it)."""
        self.alloc.free(-node.nid)
        self._stall += self.hicache.on_device_evict(node, self.env.now)

    def _swap_in(self, req: SimRequest, restored: list[SimRequest]) -> float:
        """Bring a swapped-out request's KV back over the host link; it decodes next."""
        n = req.swapped_tokens
        if not self._take_kv(req.index, n) and not self._make_room(req.index, n):
            self.waiting.append(req)  # stays swapped out; tried again in a later pass
            self._unplaced.append(req)
            return 0.0
        nbytes = n * self.cap.kv_bytes_per_token
        req.private, req.swapped_tokens = n, 0
        req.moved_bytes += nbytes
        self.host_used -= nbytes
        self.counters.swap_ins += 1
        self.counters.swapped_bytes += nbytes
        restored.append(req)
        return nbytes / self.cap.gpu.host_link_bw

    def _grow_decoders(self, reqs: list[SimRequest], k: int) -> bool:
        """Charge k decode tokens to each of `reqs`; when the allocator cannot (a block
        allocator out of usable space), retract as SGLang does when decode runs out of KV.
        False when the step cannot run as planned."""
        need = len(reqs) * k - self.alloc.available()
        if need > 0 and self.tree:
            self.tree.evict(need)
        owners = [r.index for r in reqs]
        moved = self.alloc.grow_all(owners, k)
        if moved is None and self.tree and self.tree.evictable_tokens:
            self.tree.evict(self.tree.evictable_tokens)
            moved = self.alloc.grow_all(owners, k)
        if moved is None and self.defrag.enabled:
            self._compact()
            moved = self.alloc.grow_all(owners, k)
        if moved is None:
            self._retract()
            return False
        if moved:
            self._copy_stall(moved)
            if self._tracks_moves:
                self._moved_seen = self.alloc.stats().tokens_moved
        return True

    def _make_room(self, owner: int, n: int) -> bool:
        """A prefill chunk found no KV (possible for a chunked request's later chunks, which
        SGLang's budget does not reserve, or a block allocator's fragmentation): retract
        running requests for it, fewest generated tokens first, until it fits. False when
        even that is not enough."""
        while self.running:
            victim = min(self.running, key=lambda r: (r.generated_tokens, -r.prompt_tokens))
            self.running.remove(victim)
            self._release_to_queue(victim, preempted=False)
            self.shrunk = True
            if self._take_kv(owner, n):
                return True
        return self._take_kv(owner, n)

    def _requeue_unplaced(self, req: SimRequest) -> None:
        """The budget admitted it but the allocator could not place it (fragmentation): it
        waits for the next pass, or is aborted when nothing else holds memory to wait for."""
        self.alloc.free(req.index)
        self.unlock(req)
        if req is self.chunked:
            self.chunked = None
        self.waiting.insert(0, req)
        self.batch_full = True
        self._unplaced.append(req)

    def _abort_unplaceable(self) -> None:
        """A pass placed nothing while nothing else holds KV: the requests it could not
        place never will be (the cache was evicted for them); they leave with the numbers."""
        for req in self._unplaced:
            self.waiting.remove(req)
            if req.swapped_tokens:
                self.host_used -= req.swapped_tokens * self.cap.kv_bytes_per_token
            need = req.swapped_tokens or req.fill_len - req.prefix_len
            self._leave(req, "aborted", f"the {self.alloc.name} KV allocator cannot place "
                        f"its {need} tokens even in an otherwise empty pool "
                        f"({self.alloc.stats().free} of {self.alloc.capacity} tokens free)")
        self._unplaced = []

    def _release_kv(self, r: SimRequest) -> None:
        self.alloc.free(r.index)
        r.private = 0
        self.unlock(r)

    def _swap_out(self, r: SimRequest) -> None:
        """Copy the request's whole KV to host memory when swapping is on, it holds enough
        tokens and the host has room; otherwise it will be recomputed."""
        kv = r.prompt_tokens + r.generated_tokens - 1
        nbytes = kv * self.cap.kv_bytes_per_token
        if (self.swap.min_tokens is None or kv < self.swap.min_tokens
                or self.host_used + nbytes > self.swap.host_bytes):
            return
        r.swapped_tokens = kv
        r.moved_bytes += nbytes
        self.host_used += nbytes
        self._stall += nbytes / self.cap.gpu.host_link_bw
        self.counters.swap_outs += 1
        self.counters.swapped_bytes += nbytes

