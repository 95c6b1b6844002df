"""SGLang's hierarchical cache (HiCache, `--enable-hierarchical-cache`): the host-memory tier.

What SGLang 0.5.23 does (mem_cache/unified_radix_cache.py, unified_cache/unified_tree_core.py,
managers/cache_controller.py, managers/schedule_policy.py, arg_groups/hicache_hook.py):
- A host KV pool of `--hicache-ratio` (default 2.0) times the device pool's tokens, or
  `--hicache-size` GB per rank (overrides the ratio), rounded up to whole pages.
- Write policy: `write_through` backs a radix node up to host the first time an insert walks
  it (`write_through_threshold` 1), `write_through_selective` the second time (threshold 2),
  both asynchronously on the device-to-host stream; `write_back` writes a node only when it
  is evicted from the GPU, and waits for the copy (`writing_check(write_back=True)`).
- A node evicted from the GPU keeps its host copy; the host pool evicts, least recently used
  first, only copies whose node is no longer on the GPU (`evict_host`).
- A prefix match reports the device prefix and, beyond it, `host_hit_length`. The admission
  (`PrefillAdder.add_one`) counts the host hit as prefix for the extend length and chunk budget
  but reserves KV room for it too; `init_load_back` allocates that room (evicting GPU nodes),
  re-inserts the nodes on the GPU, and loads of fewer than `load_back_threshold` (10) tokens
  are skipped (recomputed instead).
- `ready_to_load_host_cache()` starts the batch's loads on the host-to-device stream when the
  batch is built; they run layer by layer and the forward's layer i waits for layer i's load,
  so a step of compute C with loads L over n layers lasts max(C + L/n, L + C/n).

Modelled here: the host tier only. Left out: storage backends (L3, `--hicache-storage-*`,
refused), `buffer_only` host mode (needs storage), the auto-sizing from the machine's RAM
(`--hicache-host-memory-fraction`: the twin does not know the host's RAM), io backend and memory
layout speed differences (accepted and resolved as SGLang resolves them, same bandwidth), a
write-through copy still in flight when its node leaves the GPU (SGLang drops it; here it
lands), contention of load-back with the twin's own swap on the same link.

The host copies live in a second `RadixCache` over the same segments: a host node is locked
once for every node of its subtree that is also on the GPU, so only GPU-evicted copies are
evictable, exactly SGLang's rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twin.errors import ConfigError
from twin.prefix import Node, RadixCache, Segment

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
IO_BACKENDS = ("direct", "kernel", "kernel_ascend")
MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split",
               "page_head")
HOST_MEMORY_MODES = ("cache", "buffer_only")
DEFAULT_RATIO = 2.0  # handle_hicache_ratio_default, cache mode
LOAD_BACK_THRESHOLD = 10  # UnifiedRadixCache.load_back_threshold


def check_hicache_args(a: Any) -> None:
    """SGLang's refusals of the hierarchical-cache flags, in SGLang's words where it has
    them (kv_cache_hook.py, hicache_hook.py, the fields' choices)."""
    for flag, value, allowed in (
            ("hicache_write_policy", a.hicache_write_policy, WRITE_POLICIES),
            ("hicache_io_backend", a.hicache_io_backend, IO_BACKENDS),
            ("hicache_mem_layout", a.hicache_mem_layout, MEM_LAYOUTS)):
        if value not in allowed:
            raise ConfigError(f"--{flag.replace('_', '-')} {value!r}: allowed values: "
                              f"{', '.join(allowed)}")
    if a.hicache_host_memory_mode not in HOST_MEMORY_MODES:
        raise ConfigError("hicache_host_memory_mode must be 'cache' or 'buffer_only', "
                          f"got {a.hicache_host_memory_mode!r}")
    if not a.enable_hierarchical_cache:
        return
    if a.disable_radix_cache:
        raise ConfigError(
            "The arguments enable-hierarchical-cache and disable-radix-cache are mutually "
            "exclusive and cannot be used at the same time. Please use only one of them.")
    if a.hicache_storage_backend is not None:
        raise ConfigError(f"--hicache-storage-backend {a.hicache_storage_backend!r}: the twin "
                          "models HiCache's host-memory tier only (no storage tier); leave it "
                          "unset")
    if a.hicache_host_memory_mode == "buffer_only":
        raise ConfigError(
            "--hicache-host-memory-mode buffer_only requires a storage backend "
            "(--hicache-storage-backend): host memory is only a staging buffer and all "
            "cached data lives in storage.")


def resolved_layout_io(mem_layout: str, io_backend: str) -> tuple[str, str]:
    """`resolve_layout_io_compatibility`: SGLang's rewrites of conflicting choices."""
    if mem_layout == "page_first_direct" and io_backend == "kernel":
        return mem_layout, "direct"
    if mem_layout == "page_first" and io_backend == "direct":
        return "page_first_direct", io_backend
    return mem_layout, io_backend


def host_link(gpu: Any, systems_dir: Path | None = None) -> tuple[float, str]:
    """Bytes/s per direction between a GPU and host memory, and where the number comes from:
    aiconfigurator-core's system file (`node.pcie_bw`) when it has one for the GPU, else the
    twin's GPU table (`GpuSpec.host_link_bw`, PCIe 4.0/5.0 x16 theoretical)."""
    name = gpu.aiconfigurator_system or gpu.name.rsplit("-", 1)[0].replace("-", "_")
    if systems_dir is None:
        try:
            import aiconfigurator_core
        except ImportError:
            return gpu.host_link_bw, "twin/hardware.py GpuSpec.host_link_bw"
        systems_dir = Path(aiconfigurator_core.__file__).parent / "systems"
    path = systems_dir / f"{name}.yaml"
    if path.is_file():
        import yaml

        bw = ((yaml.safe_load(path.read_text()) or {}).get("node") or {}).get("pcie_bw")
        if isinstance(bw, (int, float)) and bw > 0:
            return float(bw), f"aiconfigurator-core systems/{name}.yaml node.pcie_bw"
    return gpu.host_link_bw, "twin/hardware.py GpuSpec.host_link_bw"


def host_capacity_tokens(ratio: float | None, size_gb: int, device_tokens: int,
                         kv_bytes_per_token: float, page: int) -> int:
    """The host pool's tokens as `HostKVCache.__init__` sizes it (per rank)."""
    if size_gb > 0:
        size = int(size_gb * 1e9 // kv_bytes_per_token)
        return size // page * page
    size = int(device_tokens * (DEFAULT_RATIO if ratio is None else ratio))
    return (size // page + 1) * page


def build_host_tier(args: Any, cap: Any, allocator: str) -> HostTier:
    """The host tier of one replica from its server arguments and capacity."""
    if allocator not in ("token", "paged"):
        raise ConfigError(f"--enable-hierarchical-cache with --kv-allocator {allocator}: the "
                          "hierarchical cache works on SGLang's own pools (token, paged)")
    tokens = host_capacity_tokens(args.hicache_ratio, args.hicache_size,
                                  cap.max_total_num_tokens, cap.kv_bytes_per_token,
                                  cap.page_size)
    bw, source = host_link(cap.gpu)
    tier = HostTier(tokens, cap.kv_bytes_per_token, bw, cap.model.num_layers,
                    args.hicache_write_policy)
    layout, io = resolved_layout_io(args.hicache_mem_layout, args.hicache_io_backend)
    tier.stats.update(host_link_source=source, mem_layout=layout, io_backend=io)
    return tier


def layerwise_step(compute_s: float, load_s: float, n_layers: int) -> float:
    """A step whose layer i waits for layer i's load: both streams pipelined over n layers."""
    n = max(n_layers, 1)
    return max(compute_s + load_s / n, load_s + compute_s / n)


STAT_KEYS = (
    "host_hits",  # admitted rounds that loaded a host hit back
    "host_hit_tokens",  # tokens of those hits found on host beyond the GPU prefix
    "loaded_back_tokens",  # tokens copied host -> GPU
    "load_back_s",  # transfer time of the loads
    "load_back_wait_s",  # step time the loads added beyond the compute (layer-wise overlap)
    "written_tokens",  # tokens copied GPU -> host (backups)
    "write_back_stall_s",  # write_back: the wait for the backups of evicted nodes
    "host_evictions",  # host copies evicted (nodes), least recently used first
    "host_evicted_tokens",
    "dropped_tokens",  # backups skipped: the host pool had no room
)


class HostTier:
    """The host copies of radix nodes and the GPU-to-host link (pure: no clock of its own,
    times passed in). Driven by the replica's radix cache through `on_insert` and
    `on_device_evict`, and by the scheduler through `match` and `loaded`."""

    def __init__(self, capacity_tokens: int, kv_bytes_per_token: float, link_bw: float,
                 n_layers: int, write_policy: str) -> None:
        self.capacity = capacity_tokens
        self.kv_bytes = kv_bytes_per_token
        self.bw = link_bw
        self.n_layers = n_layers
        self.policy = write_policy
        self.threshold = 1 if write_policy == "write_through" else 2
        self.tree = RadixCache(on_evict=self._host_evicted)
        # the summary's `engine.hicache` (a live dict: the replica's counters hold it)
        self.stats: dict = {k: 0 for k in STAT_KEYS}
        self.stats.update(host_capacity_tokens=capacity_tokens, write_policy=write_policy,
                          host_link_bytes_per_s=link_bw)
        self.loading = False  # a load-back's own insert is no insert walk (no hit count)
        self._ready: dict[int, float] = {}  # host nid -> time its copy is complete
        self._on_gpu: dict[int, Node] = {}  # GPU nid -> its host copy (locked once)
        self._hits: dict[int, int] = {}  # GPU nid -> insert walks (write_through_selective)
        self._walker: dict[int, tuple] = {}  # GPU nid -> the prompt of its last counted walk
        self._d2h_free = 0.0  # when the device-to-host stream is next idle

    # -- the GPU tree's hooks --------------------------------------------------------------
    def on_insert(self, segments: Sequence[Segment], node: Node, created: list[Node],
                  now: float) -> None:
        """An insert walked `segments` down to GPU node `node` (`created` are new)."""
        if self.loading:
            return
        path = path_nodes(node)  # GPU nodes, root's child first
        if self.policy == "write_back":
            self._map_existing(segments, path)
            return
        upto = len(path)
        if self.threshold > 1:
            upto = self._count_hits(segments, path)
        self._backup(segments[:upto], path[:upto], now)
        self._map_existing(segments, path)

    def on_device_evict(self, gpu_node: Node, now: float) -> float:
        """A GPU node was evicted (its parent chain still set): release its host copy's
        lock; under write_back, back it up first. Returns the copy time to wait for."""
        self._hits.pop(gpu_node.nid, None)
        self._walker.pop(gpu_node.nid, None)
        host = self._on_gpu.pop(gpu_node.nid, None)
        stall = 0.0
        if host is None and self.policy == "write_back":
            path = path_nodes(gpu_node)
            segs = [g.key for g in path]
            written = self._backup(segs, path, now, pin=False)
            stall = written * self.kv_bytes / self.bw
            self.stats["write_back_stall_s"] += stall
            host = self._on_gpu.pop(gpu_node.nid, None)
        if host is not None:
            self.tree.unlock(host)
        return stall

    # -- the scheduler's side ------------------------------------------------------------
    def match(self, segments: Sequence[Segment], now: float) -> tuple[int, int]:
        """Tokens and segments of the longest leading run of `segments` whose host copies
        are complete at `now`; touches them (host LRU)."""
        node, tokens, n = self.tree.root, 0, 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None or self._ready.get(child.nid, 0.0) > now:
                break
            node, tokens, n = child, tokens + child.tokens, n + 1
        if n:
            self.tree.match(segments[:n], now)
        return tokens, n

    def loaded(self, segments: Sequence[Segment], path: list[Node], tokens: int,
               hit_tokens: int) -> float:
        """`tokens` were loaded back for the GPU nodes `path` (of `segments`); their host
        copies are pinned again. Returns the transfer time."""
        self._map_existing(segments, path)
        s = self.stats
        s["host_hits"] += 1
        s["host_hit_tokens"] += hit_tokens
        s["loaded_back_tokens"] += tokens
        t = tokens * self.kv_bytes / self.bw
        s["load_back_s"] += t
        return t

    def clear(self) -> None:
        """A crash: host memory is the server's and goes with it."""
        self._on_gpu.clear()
        self._hits.clear()
        self._walker.clear()
        self.tree = RadixCache(on_evict=self._host_evicted)
        self._ready.clear()

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        assert self.tree.total_tokens <= self.capacity, (self.tree.total_tokens, self.capacity)

    # -- internals ----------------------------------------------------------------------
    def _backup(self, segments: Sequence[Segment], path: list[Node], now: float,
                pin: bool = True) -> int:
        """Copy the nodes of `segments` missing on host (as far as room allows, evicting
        host-only copies LRU); returns the tokens written."""
        if not segments:
            return 0
        _, n_have = self._host_prefix(segments)
        new = sum(s[1] for s in segments[n_have:])
        if new == 0:
            return 0
        short = self.tree.total_tokens + new - self.capacity
        if short > 0:
            anchor = self._host_node(segments[:n_have])
            if anchor is not None:
                self.tree.lock(anchor)
            self.tree.evict(short)
            if anchor is not None:
                self.tree.unlock(anchor)
        room = self.capacity - self.tree.total_tokens
        k, fit = n_have, 0
        while k < len(segments) and fit + segments[k][1] <= room:
            fit += segments[k][1]
            k += 1
        self.stats["dropped_tokens"] += new - fit
        if k == n_have:
            return 0
        _, created = self.tree.insert(segments[:k], now)
        start = max(now, self._d2h_free)
        done = start + fit * self.kv_bytes / self.bw
        if pin:  # write-through runs on its own stream: the copy lands later
            self._d2h_free = done
            for c in created:
                self._ready[c.nid] = done
        self.stats["written_tokens"] += fit
        return fit

    def _count_hits(self, segments: Sequence[Segment], path: list[Node]) -> int:
        """`_inc_hit_count_and_check` over an insert walk; returns how many leading nodes
        have reached the threshold. A request's own later inserts (its chunks, its finish)
        do not count again (SGLang: `node_end > inserted_len`): the walker is known by its
        prompt (output segments, negative hashes, stripped), and a walk that extends or
        repeats the node's last walker's prompt is that walker's."""
        key = tuple(s for s in segments if s[0] >= 0)
        hits, last = self._hits, self._walker
        upto = len(path)
        for i, g in enumerate(path):
            prev = last.get(g.nid)
            n = len(prev) if prev is not None else 0
            if prev is None or (key[:n] != prev and prev[:len(key)] != key):
                hits[g.nid] = hits.get(g.nid, 0) + 1
            last[g.nid] = key if prev is None or len(key) >= n else prev
            if hits.get(g.nid, 0) < self.threshold and upto == len(path):
                upto = i
        return upto

    def _map_existing(self, segments: Sequence[Segment], path: list[Node]) -> None:
        """Pin the host copy of every GPU node on `path` that has one and is not pinned."""
        node = self.tree.root
        for seg, g in zip(segments, path, strict=False):
            node = node.children.get(seg)
            if node is None:
                return
            if g.nid not in self._on_gpu:
                self._on_gpu[g.nid] = node
                self.tree.lock(node)

    def _host_prefix(self, segments: Sequence[Segment]) -> tuple[Node, int]:
        node, n = self.tree.root, 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                break
            node, n = child, n + 1
        return node, n

    def _host_node(self, segments: Sequence[Segment]) -> Node | None:
        node, n = self._host_prefix(segments)
        return node if n and n == len(segments) else None

    def _host_evicted(self, node: Node) -> None:
        self._ready.pop(node.nid, None)
        self.stats["host_evictions"] += 1
        self.stats["host_evicted_tokens"] += node.tokens


def path_nodes(node: Node) -> list[Node]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    out.reverse()
    return out
