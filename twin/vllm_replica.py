"""One vLLM V1 server as a SimPy process, fed like the SGLang replica (`submit`, a `Feed`),
writing the same records.

Modelled from vLLM's `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, read via
vllm-project/vllm at 00024d3) and its KV cache manager:
- one token budget per step, `max_num_batched_tokens`; no prefill or decode phase: each
  request gets up to (its tokens - its computed tokens) from the budget, so prefill is
  always chunked and mixed with decodes;
- RUNNING requests first, in order; a request that cannot get the blocks it needs
  preempts the last running request (`self.running.pop()`; under `--scheduling-policy
  priority` the max of (priority, arrival)), which frees its blocks, resets its computed
  tokens to 0 and goes back to the front of the waiting queue, to be recomputed (prompt
  plus outputs); if it was itself the victim it stops there;
- WAITING requests next, only if nothing was preempted this step, while budget remains and
  fewer than `max_num_seqs` run: prefix-cache hit in whole blocks (`block_size`: 16 on
  GPUs, 128 on CPUs; at most tokens - 1, so one token is computed), then `allocate_slots`
  for the rest of its chunk, admitted only if the blocks for its whole sequence so far
  fit (`scheduler_reserve_full_isl`, on by default in 0.32); a refusal stops admission
  for the step;
- prefix caching: a full block is cached by the hash of its tokens and its parent's when
  its tokens are scheduled (`allocate_slots` caches up to computed + scheduled tokens), so
  a request admitted later in the same step already hits a block being computed; a
  freed block goes to the tail of the free queue (a request's blocks in reverse order)
  keeping its hash until it is reused from the head (LRU); a hit on a free block takes it
  out of the queue; a block whose hash is already cached is not cached twice;
- the pool's first block is vLLM's null block: `num_blocks - 1` hold tokens.
- requests whose prompt plus `max_tokens` exceed `max_model_len` are refused (HTTP 400).

Step times come from the same backends as SGLang's (aiconfigurator-core's vLLM tables with
`opdb`). Between events, decode-only steps are advanced together as in the SGLang replica.
Not modelled: async scheduling, speculative decoding, CPU offload, the per-step CPU
overhead apart from the backend's constant.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import simpy

from twin.config import ServerArgs, derive_capacity
from twin.errors import InfeasibleError
from twin.inbox import Inbox
from twin.request_state import SimRequest
from twin.workload import Request

BLOCK = 16


@dataclass(frozen=True)
class VllmArgs:
    """vLLM engine arguments by vLLM's names (defaults: vLLM >= 0.9 V1 for an API server
    on a GPU of 70 GiB or more)."""

    model: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    gpu_memory_utilization: float = 0.9
    block_size: int = BLOCK
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    num_gpu_blocks_override: int | None = None
    long_prefill_token_threshold: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from twin.errors import ConfigError

        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"vllm scheduling_policy {self.scheduling_policy!r}: allowed "
                              "values: fcfs, priority")
        for key in ("tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                    "block_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"vllm {key} {v!r}: must be an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm gpu_memory_utilization {self.gpu_memory_utilization}: "
                              "must be in (0, 1]")

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size


# vLLM profiles activations at max_num_batched_tokens and reserves CUDA-graph memory; the
# twin estimates both (per GPU): about 24 bf16 values per token per hidden unit / tp, plus
# 0.5 GiB of graphs.
ACTIVATION_VALUES_PER_TOKEN_HIDDEN = 24
GRAPH_BYTES = 0.5 * 2**30


def vllm_kind(args: VllmArgs, gpu: str, backend: str | None, profile: dict | None = None,
              where: str = "calibration"):
    """(Capacity, step-time model) for a vLLM replica kind; with a vLLM calibration
    `profile` (calibration/vllm.py), its fitted step time."""
    from twin.perf import make_step_time

    sa = ServerArgs(model_path=args.model, tp_size=args.tp_size,
                    mem_fraction_static=args.gpu_memory_utilization,
                    kv_cache_dtype=args.kv_cache_dtype, context_length=args.max_model_len)
    base = derive_capacity(sa, gpu)
    m = base.model
    act = (args.max_num_batched_tokens * m.hidden * 2 * ACTIVATION_VALUES_PER_TOKEN_HIDDEN
           / args.tp_size + GRAPH_BYTES)
    kv_tokens = int(base.max_total_num_tokens - act / base.kv_bytes_per_token)
    blocks = args.num_gpu_blocks_override or kv_tokens // args.block_size
    max_len = args.max_model_len or base.context_len
    if blocks * args.block_size < max_len:
        raise InfeasibleError(f"vLLM on {args.tp_size}x {gpu} ({m.name}): {blocks} KV blocks "
                              f"of {args.block_size} tokens hold {blocks * args.block_size} "
                              f"tokens, fewer than max_model_len {max_len}; vLLM refuses to "
                              "start (raise gpu_memory_utilization or lower max_model_len)")
    cap = replace(base, max_total_num_tokens=blocks * args.block_size,
                  max_running_requests=args.max_num_seqs,
                  chunked_prefill_size=args.max_num_batched_tokens,
                  max_prefill_tokens=args.max_num_batched_tokens, context_len=max_len,
                  page_size=args.block_size, notes=(f"vLLM V1: {blocks} blocks",))
    if profile is not None:
        from twin.perf.fitted import vllm_step_time

        return cap, vllm_step_time(profile, args.tp_size, where)
    name = backend or "opdb"
    if name == "opdb":
        from twin.errors import ConfigError
        from twin.perf.opdb import OpdbStepTime

        try:
            return cap, OpdbStepTime(cap, sa, framework="vllm")
        except ConfigError:
            name = "roofline"
    return cap, make_step_time(name, cap, sa)


@dataclass
class VCounters:
    prefill_tokens: int = 0
    prefill_steps: int = 0
    mixed_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    retractions: int = 0
    busy_s: float = 0.0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    emitting_steps: int = 0  # steps that emitted a token (vLLM's iteration_tokens count)


class VllmReplica(Inbox):
    """The simulated vLLM server; `run()` is its SimPy process."""

    def __init__(self, env: simpy.Environment, args: VllmArgs, cap, step_time, feed=None, *,
                 horizon_s: float | None = None, sample_every_s: float = 1.0,
                 debug_checks: bool = False) -> None:
        self.env, self.args, self.cap, self.st, self.feed = env, args, cap, step_time, feed
        self.name = "vllm"
        self.horizon, self.debug = horizon_s, debug_checks
        self.bs = args.block_size
        self.n_blocks = cap.max_total_num_tokens // args.block_size - 1  # minus the null block
        self.max_len = cap.context_len
        self._inbox: list[tuple[float, Request]] = []
        self._wake = env.event()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        self.counters = VCounters()
        self.series: list[tuple] = []
        self._sample_every, self._next_sample = sample_every_s, 0.0
        self._n_seen = 0
        self._end_chunks: list[np.ndarray] = []
        self.n_dec_steps = 0
        self._reset_kv()

    def wait_in_events(self) -> None:
        """Every busy period already waits on an event (twin/interrupt.py)."""

    def _reset_kv(self) -> None:
        # vLLM's free queue: never-used blocks first (a count), then freed ones in order
        self.fresh = self.n_blocks
        self.free_q: OrderedDict = OrderedDict()
        self.hashed: set = set()  # membership only: never iterated
        self.refs: dict = {}
        self.blocks: dict[int, list] = {}  # request index -> block keys
        self._upto: dict[int, int] = {}  # request index -> blocks already hashed
        self._keys: dict[int, list[int]] = {}  # request index -> its prompt's block hashes
        self._tag = 0

    # ---- feeding ------------------------------------------------------------------------
    def _pull(self, now: float) -> None:
        self.feed.pump(now)
        inbox, self._inbox = self._inbox, []
        for sent, req in inbox:
            r = SimRequest(req, sent, self._n_seen)
            self._n_seen += 1
            r.entered_s = r.queue_entry_s = now
            r.cached_tokens = -1  # vLLM's num_cached_tokens: set at the first schedule
            if r.prompt_tokens + r.max_new_tokens > self.max_len:
                r.cached_tokens = 0
                self._leave(r, "rejected", f"This model's maximum context length is "
                            f"{self.max_len} tokens. However, you requested "
                            f"{r.prompt_tokens + r.max_new_tokens} tokens ({r.prompt_tokens} "
                            f"in the prompt, {r.max_new_tokens} in the completion) (vLLM 400)")
                continue
            self.blocks[r.index] = []
            self.waiting.append(r)

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> Iterator[simpy.Event]:
        while True:
            now = self.env.now
            self._pull(now)
            self._sample(now)
            if self.horizon is not None and now >= self.horizon:
                break
            if self.debug:
                self.check_integrity()
            sched, admitted_all = self._schedule()
            if sched:
                yield from self._step(sched, admitted_all)
                continue
            if self._inbox:
                continue
            if self.waiting and not self.running:
                r = self.waiting.popleft()  # cannot fit an empty pool: never after start-up
                self._free(r)
                self._leave(r, "aborted", f"needs {r.prompt_tokens + r.generated_tokens} "
                            f"tokens of KV, the pool has {self.n_blocks * self.bs}")
                continue
            if not self.waiting and not self.running and self.feed.done():
                break
            yield from self._idle(now)
        self._end()

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], bool]:
        """One `Scheduler.schedule()`: [(request, tokens)], and whether the waiting queue
        was emptied or blocked only by the request cap."""
        budget, sched, preempted = self.args.max_num_batched_tokens, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = self._chunk(r, r.computed, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not self._allocate(r, r.computed, n, []):
                victim = self._victim()
                self.running.remove(victim)
                for k, (s, m) in enumerate(sched):
                    if s is victim:
                        budget += m
                        del sched[k]
                        i -= 1
                        break
                self._preempt(victim)
                preempted = True
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            self._cache_full_blocks(r, r.computed + n)
            sched.append((r, n))
            budget -= n
            i += 1
        blocked_by_kv = False
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.args.max_num_seqs:
                r = self.waiting[0]
                hits = self._hits(r) if r.computed == 0 else []
                start = len(hits) * self.bs if r.computed == 0 else r.computed
                n = self._chunk(r, start, budget)
                if not (self._whole_fits(r, hits) and self._allocate(r, start, n, hits)):
                    blocked_by_kv = True
                    break
                self.waiting.popleft()
                self._admit(r, start, len(hits))
                self._cache_full_blocks(r, start + n)
                sched.append((r, n))
                budget -= n
        calm = not preempted and (not self.waiting or blocked_by_kv
                                  or len(self.running) >= self.args.max_num_seqs)
        return sched, calm

    def _chunk(self, r: SimRequest, computed: int, budget: int) -> int:
        n = r.prompt_tokens + r.generated_tokens - computed
        t = self.args.long_prefill_token_threshold
        if 0 < t < n:
            n = t
        return max(min(n, budget, self.max_len - 1 - computed), 0)

    def _victim(self) -> SimRequest:
        if self.args.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_s, r.index))
        return self.running[-1]

    def _admit(self, r: SimRequest, start: int, n_hit_blocks: int) -> None:
        now = self.env.now
        r.computed = start
        if r.cached_tokens < 0:
            r.cached_tokens = start
        self.counters.prefix_query_tokens += r.prompt_tokens + r.generated_tokens
        self.counters.prefix_hit_tokens += start
        if r.first_admit_s is None:
            r.first_admit_s = now
            r.queued_s = now - r.entered_s  # vLLM's queue time: the first wait only
        if r.left_batch_s is not None:
            r.lost_s += now - r.left_batch_s
            r.left_batch_s = None
        self.running.append(r)

    def _step(self, sched, calm: bool) -> Iterator[simpy.Event]:
        decode_only = all(r.computed >= r.prompt_tokens + r.generated_tokens - 1 and n == 1
                          for r, n in sched)
        if decode_only and calm:
            k = self._decode_run_length()
            if k > 1:
                yield from self._decode_run(k)
                return
        chunks, dec = [], []
        for r, n in sched:
            if r.computed >= r.prompt_tokens + r.generated_tokens - 1 and n == 1:
                dec.append(r.computed + 1)
            else:
                chunks.append((n, r.computed))
                self.counters.prefill_tokens += n
        dur = self.st.step_time(chunks, dec)
        if chunks and dec:
            self.counters.mixed_steps += 1
        elif chunks:
            self.counters.prefill_steps += 1
        else:
            self.counters.decode_steps += 1
        self.counters.busy_s += dur
        yield self.env.timeout(dur)
        end = self.env.now
        emitted = False
        for r, n in sched:
            r.computed += n
            if r.computed >= r.prompt_tokens + r.generated_tokens:
                emitted = True
                r.generated_tokens += 1
                r.tok_events.append(end)
                if r.first_token_s is None:
                    r.first_token_s = end
        self.counters.emitting_steps += emitted
        self._finish_done(end)

    # ---- batched decode -----------------------------------------------------------------
    def _decode_run_length(self) -> int:
        k = min(r.max_new_tokens - r.generated_tokens for r in self.running)
        bound = self._next_boundary()
        if bound is not None and k > 1:
            b = len(self.running)
            kv0 = sum(r.computed + 1 for r in self.running)
            first = float(self.st.decode_times(b, np.array([kv0]))[0])
            k = min(k, int((bound - self.env.now) / first) + 1)
        while k > 1 and self._blocks_needed(k) > self.n_free:
            k //= 2
        return k

    def _blocks_needed(self, k: int) -> int:
        return sum(-(-(r.computed + k) // self.bs) - len(self.blocks[r.index])
                   for r in self.running)

    def _next_boundary(self) -> float | None:
        cands = [self._next_sample]
        if self.horizon is not None:
            cands.append(self.horizon)
        nxt = self.feed.next_arrival()
        if nxt is not None:
            cands.append(nxt)
        return min(cands)

    def _decode_run(self, k: int) -> Iterator[simpy.Event]:
        b = len(self.running)
        kv0 = sum(r.computed + 1 for r in self.running)
        times = self.st.decode_times(b, kv0 + b * np.arange(k))
        ends = self.env.now + np.cumsum(times)
        bound = self._next_boundary()
        if bound is not None and ends[-1] > bound:
            k = min(int(np.searchsorted(ends, bound, side="left")) + 1, k)
        for r in self.running:
            self._allocate(r, r.computed, k, [])
        start = self.n_dec_steps
        self._end_chunks.append(ends[:k])
        self.n_dec_steps += k
        dur = float(ends[k - 1]) - self.env.now
        self.counters.decode_steps += k
        self.counters.emitting_steps += k
        self.counters.busy_s += dur
        for r in self.running:
            r.tok_events.append((start, start + k))
            r.generated_tokens += k
            r.computed += k
        yield self.env.timeout(dur)
        for r in self.running:
            self._cache_full_blocks(r, r.computed)
        self._finish_done(self.env.now)

    # ---- KV blocks and the prefix cache ------------------------------------------------
    def _prompt_keys(self, r: SimRequest) -> list[int]:
        """Chained hashes of the prompt's full blocks (a block's tokens and its parent)."""
        hit = self._keys.get(r.index)
        if hit is not None:
            return hit
        keys, prev, pieces, filled, bs = [], 0, [], 0, self.bs
        append = keys.append
        for h, n in r.req.segments:
            off = 0
            while off < n:
                if not filled:  # whole blocks of one segment (a document's): the same
                    while n - off >= bs:  # hashes without the general case's bookkeeping
                        prev = hash((prev, ((h, off, bs),)))
                        append(prev)
                        off += bs
                    if off == n:
                        break
                take = min(n - off, bs - filled)
                pieces.append((h, off, take))
                off += take
                filled += take
                if filled == bs:
                    prev = hash((prev, tuple(pieces)))
                    keys.append(prev)
                    pieces, filled = [], 0
        self._keys[r.index] = keys
        return keys

    def _hits(self, r: SimRequest) -> list:
        if not self.args.enable_prefix_caching:
            return []
        limit = (r.prompt_tokens + r.generated_tokens - 1) // self.bs
        keys = self._prompt_keys(r)
        out = []
        for b in range(limit):  # a recomputed request also finds its own output blocks
            key = keys[b] if b < len(keys) else ("o", r.index, b)
            if key not in self.hashed:
                break
            out.append(key)
        return out

    def _allocate(self, r: SimRequest, computed: int, n: int, hits: list) -> bool:
        held = self.blocks[r.index]
        new = -(-(computed + n) // self.bs) - len(held) - len(hits)
        cost = max(new, 0) + sum(1 for key in hits if key in self.free_q)
        if cost > self.n_free:
            return False
        for key in hits:
            if key in self.free_q:
                del self.free_q[key]
            self.refs[key] = self.refs.get(key, 0) + 1
            held.append(key)
        new = max(new, 0)
        fresh = min(new, self.fresh)  # never-used blocks first, then the free queue's head
        self.fresh -= fresh
        pop, discard = self.free_q.popitem, self.hashed.discard
        for _ in range(new - fresh):
            discard(pop(last=False)[0])  # a cached block reused from the head: evicted
        tag = self._tag
        held.extend([("p", t) for t in range(tag + 1, tag + new + 1)])
        self._tag = tag + new
        return True

    def _whole_fits(self, r: SimRequest, hits: list) -> bool:
        """`allocate_slots(full_sequence_must_fit=True)` for a waiting request: the blocks
        of its whole sequence so far (prompt plus outputs), hits reused, fit the free ones."""
        need = -(-(r.prompt_tokens + r.generated_tokens) // self.bs) - len(hits)
        return need + sum(1 for key in hits if key in self.free_q) <= self.n_free

    def _cache_full_blocks(self, r: SimRequest, upto: int) -> None:
        """Cache the full blocks among the first `upto` tokens (vLLM's `cache_blocks`)."""
        if not self.args.enable_prefix_caching:
            return
        held = self.blocks[r.index]
        upto = min(upto, r.prompt_tokens + r.generated_tokens)
        full = min(upto // self.bs, len(held))
        first = self._upto.get(r.index, 0)
        if full <= first:
            return
        self._upto[r.index] = full
        keys = self._prompt_keys(r)
        hashed, refs, n_keys = self.hashed, self.refs, len(keys)
        for b in range(first, full):
            block = held[b]
            if type(block) is not tuple or block[0] != "p":
                continue
            key = keys[b] if b < n_keys else ("o", r.index, b)
            if key in hashed:
                continue  # already cached by another block: this one stays unhashed
            hashed.add(key)
            refs[key] = 1
            held[b] = key

    def _free(self, r: SimRequest) -> None:
        refs, free_q = self.refs, self.free_q
        for key in reversed(self.blocks.get(r.index, [])):
            n = refs.get(key)
            if n is None:
                free_q[key] = None
            elif n == 1:
                del refs[key]
                free_q[key] = None
            else:
                refs[key] = n - 1
        self.blocks[r.index] = []
        self._upto.pop(r.index, None)

    def _preempt(self, r: SimRequest) -> None:
        self._close(r)
        self._free(r)
        r.computed = 0
        r.preemptions += 1
        self.counters.preemptions += 1
        r.left_batch_s = r.queue_entry_s = self.env.now
        self.waiting.appendleft(r)

    # ---- leaving --------------------------------------------------------------------------
    def _close(self, r: SimRequest) -> None:
        return None  # token events are recorded as they happen

    def _finish_done(self, now: float) -> None:
        done = [r for r in self.running if r.generated_tokens >= r.max_new_tokens]
        if not done:
            return
        self.running = [r for r in self.running if r.generated_tokens < r.max_new_tokens]
        for r in done:
            self._free(r)
            del self.blocks[r.index]
            self._keys.pop(r.index, None)
            r.finish_s = now
            self._leave(r, "ok", r.error)

    def _leave(self, r: SimRequest, status: str, error: str) -> None:
        r.status, r.error = status, error
        if r.cached_tokens < 0:
            r.cached_tokens = 0
        if r.finish_s is None:
            r.finish_s = self.env.now
        self.finished.append(r)
        self.feed.left(self, r)

    def _end(self) -> None:
        for r in [*self.running, *self.waiting]:
            self._leave(r, "aborted", f"simulation horizon {self.horizon}s reached")
        for sent, req in [*self._inbox, *self.feed.unsent()]:
            r = SimRequest(req, sent, self._n_seen)
            self._n_seen += 1
            r.cached_tokens = 0
            self._leave(r, "aborted", f"not sent before the horizon {self.horizon}s")
        self._inbox, self.running, self.waiting = [], [], deque()

    # ---- faults ---------------------------------------------------------------------------
    def crash(self, reason: str) -> None:
        """As `Replica.crash`: everything inside is lost; tokens after now are dropped."""
        now = self.env.now
        ends = self.step_end
        keep = int(np.searchsorted(ends, now, side="right"))
        self._end_chunks, self.n_dec_steps = [ends[:keep]], keep
        live = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        for r in live:
            r.tok_events = [(e[0], min(e[1], keep)) if isinstance(e, tuple) else e
                            for e in r.tok_events if (e[0] < keep if isinstance(e, tuple)
                                                      else e <= now)]
            self._leave(r, "aborted", reason)
        inbox, self._inbox = self._inbox, []
        for sent, req in inbox:
            r = SimRequest(req, sent, self._n_seen)
            self._n_seen += 1
            r.cached_tokens = 0
            self._leave(r, "aborted", reason)
        self._reset_kv()

    def restart(self) -> None:
        self._wake = self.env.event()

    # ---- observation ----------------------------------------------------------------------
    def _sample(self, now: float) -> None:
        if now < self._next_sample:
            return
        used, bs = (self.n_blocks - self.n_free) * self.bs, self.bs
        self.series.append((round(now, 6), len(self.running), len(self.waiting), used, used,
                            self.n_free * bs, len(self.hashed) * bs, None))
        self._next_sample = (math.floor(now / self._sample_every) + 1) * self._sample_every

    @property
    def step_end(self) -> np.ndarray:
        return np.concatenate(self._end_chunks) if self._end_chunks else np.empty(0)

    @property
    def n_free(self) -> int:
        return self.fresh + len(self.free_q)

    def check_integrity(self) -> None:
        """Every block is free or held; a shared cached block is held once per holder."""
        in_use = sum(len(b) for b in self.blocks.values())
        shared = sum(v - 1 for v in self.refs.values() if v > 1)
        assert in_use - shared + self.n_free == self.n_blocks, (
            in_use, shared, self.n_free, self.n_blocks)
