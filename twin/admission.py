"""SGLang's `PrefillAdder` for one scheduling pass: the token budgets a prefill batch is
built under (max prefill tokens, chunk size, KV room minus `new_token_ratio` x the running
requests' future tokens). The replica (`twin/replica.py`) owns the state it reads."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from twin import config as C
from twin.policy import reservation
from twin.request_state import SimRequest

if TYPE_CHECKING:
    from twin.replica import Replica

CONTINUE, NO_TOKEN, OTHER = "continue", "no_token", "other"


class Adder:
    """SGLang's `PrefillAdder` for one scheduling pass: the token budgets."""

    def __init__(self, rep: Replica, mixed_bs: int) -> None:
        self.rep = rep
        cap = rep.cap
        self.ratio = rep.new_token_ratio
        self.total_offset = mixed_bs + self._reserved_sum(rep.running)
        self.cur_offset = mixed_bs
        self.rem_input = cap.max_prefill_tokens - mixed_bs
        chunk = cap.chunked_prefill_size
        self.rem_chunk = None if chunk is None else chunk - mixed_bs
        self.can_run: list[tuple[SimRequest, int]] = []  # (request, tokens to extend)
        self.new_chunked: SimRequest | None = None
        #: the chunked request continues past this pass (its chunk was truncated)
        self.continuing = False

    def _reserved_sum(self, running: list[SimRequest]) -> float:
        """sum(reserved(r) for r in running). With every request `ignore_eos` each term
        is a whole number times 1.0, so the float sum is exact in any order: summed as
        integers (the same value, without a call per request)."""
        loop_c = sys.modules["twin.replica"]._LOOP_C  # the replica's switch (imported)
        if loop_c is not None:  # compiled, where every request is of this kind
            got = loop_c.reserved_sum(running, C.CLIP_MAX_NEW_TOKENS)
            if got is not None:
                return got
        if not running or not all(r.ignore_eos for r in running):
            return sum(self.reserved(r) for r in running)
        left = [r.max_new_tokens - r.generated_tokens for r in running]
        clip = C.CLIP_MAX_NEW_TOKENS
        if max(left) <= clip:  # none clipped: the sum as it is
            return float(sum(left))
        return float(sum([min(n, clip) for n in left]))

    def reserved(self, r: SimRequest) -> float:
        """A running request's future tokens (SGLang's rule, shared with the plugin)."""
        return reservation(r.max_new_tokens, r.generated_tokens, r.ignore_eos, self.ratio)

    def room(self) -> int:
        return self.rep.room()

    def rem_total(self) -> float:
        return self.room() - self.total_offset

    def state(self) -> str:
        if self.rem_total() <= 0 or self.room() - self.cur_offset <= 0:
            return NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return OTHER
        return CONTINUE

    def _take(self, extend: int, future: int) -> None:
        extend = self.rep.ceil_page(extend)
        self.total_offset += self.rep.alloc.footprint(extend + future)
        self.cur_offset += extend
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend

    def add_chunked(self, req: SimRequest, limit: int | None = None) -> SimRequest | None:
        """The chunked request's next chunk; `limit` caps it (shortest-prefill-first)."""
        left = req.fill_len - req.computed
        rem = self.rem_chunk
        if limit is not None:
            rem = limit if rem is None else min(rem, limit)
        truncated = rem is not None and left > rem
        ext = min(left, rem) if rem is not None else left
        self.can_run.append((req, ext))
        self._take(ext, 0 if truncated else min(req.remaining, C.CLIP_MAX_NEW_TOKENS))
        self.continuing = truncated
        return req if truncated else None

    def add_one(self, req: SimRequest) -> str:
        future = min(max(req.remaining, 0), C.CLIP_MAX_NEW_TOKENS)
        if req.swapped_tokens:  # comes back from host memory: KV room, no compute
            total = self.rep.alloc.footprint(req.swapped_tokens + future)
            if total >= self.rem_total():
                return NO_TOKEN
            self.can_run.append((req, 0))
            self.total_offset += total
            self.cur_offset += req.swapped_tokens
            return self.state()
        extend = req.fill_len - req.prefix_len
        input_tokens = self.rep.ceil_page(extend)
        future += self.rep.host_hit(req)  # HiCache: room for the load-back, not compute
        total = self.rep.alloc.footprint(extend + future)
        if total >= self.rem_total():
            return NO_TOKEN
        if input_tokens >= self.rem_input and self.can_run:
            return OTHER
        self.rep.lock(req, req.matched_node)
        if total >= self.rem_total():
            self.rep.unlock(req)
            return NO_TOKEN
        if self.rem_chunk is None or input_tokens <= self.rem_chunk:
            self.can_run.append((req, extend))
            self._take(extend, future)
        else:
            trunc = self.rem_chunk // self.rep.page * self.rep.page
            if trunc <= 0 or self.continuing:  # SGLang tracks one unfinished chunked
                # request: under a cap (spf's, or a chunk answer's) budget is left after a
                # truncated chunk, and SGLang refuses a second one (`OTHER`)
                self.rep.unlock(req)
                return OTHER
            limit = self.rep.first_chunk_limit(req)
            if limit is not None and limit < self.rem_chunk:
                # the pass's chunk budget becomes the cap: the chunk spends it, the pass
                # ends (the plugin lowers SGLang's `rem_chunk_tokens` the same way)
                self.rem_chunk = limit
                trunc = limit
            self.can_run.append((req, trunc))
            self.new_chunked = req
            self._take(trunc, self.rep.host_hit(req))
        return self.state()
