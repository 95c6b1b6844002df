"""Deterministic prompt token ids for live replay.

A `Request` describes its prompt as segments `(segment_hash, n_tokens)`; the live server
needs real token ids. `SegmentTokens` turns each segment into ids drawn by a generator
seeded from `(seed, segment_hash)` alone, so the same hash gives the same ids in every
request, every run and every process, and the live radix cache sees exactly the sharing
the twin's segment-level cache sees. A shorter segment with the same hash is a prefix of
the longer one (the generator's stream is consumed in order).

Ids come from `[first_id, min(vocab_size, MAX_ID))`: low ids are special tokens in most
tokenizers (`<s>`, `</s>`, `<pad>` are 0-2 in Llama's and in the CPU harness model), and
capping the range at 32000 keeps clear of the special and padding ids that Llama-3,
Qwen and DeepSeek tokenizers put at the top of their vocabularies.

Unrelated segments can still agree on their first token by chance (probability about one
in the range size per cached branch), which makes the live radix cache report a one- or
two-token hit that the twin does not see; at 4,093 usable ids that is rare but possible.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

FIRST_ID = 3
MAX_ID = 32_000
_HASH_MASK = (1 << 64) - 1


class SegmentTokens:
    """Token ids for segments, a pure function of `(seed, segment_hash, n_tokens)`."""

    def __init__(self, vocab_size: int, seed: int = 0, first_id: int = FIRST_ID) -> None:
        high = min(int(vocab_size), MAX_ID)
        if high - first_id < 2:
            raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids "
                             f"above {first_id}")
        self.low, self.high, self.seed = first_id, high, int(seed)
        self._segment = lru_cache(maxsize=4096)(self._draw)

    def _draw(self, segment_hash: int, n_tokens: int) -> tuple[int, ...]:
        # Non-negative 64-bit entropy words: hashes may be negative or wider than 64 bits.
        words = [self.seed & _HASH_MASK, segment_hash & _HASH_MASK,
                 (segment_hash >> 64) & _HASH_MASK]
        rng = np.random.default_rng(words)
        return tuple(rng.integers(self.low, self.high, size=n_tokens, dtype=np.int64).tolist())

    def segment(self, segment_hash: int, n_tokens: int) -> tuple[int, ...]:
        return self._segment(int(segment_hash), int(n_tokens))

    def prompt(self, segments: tuple[tuple[int, int], ...]) -> list[int]:
        """The request's `input_ids`: its segments' ids, concatenated in order."""
        out: list[int] = []
        for segment_hash, n_tokens in segments:
            out.extend(self.segment(segment_hash, n_tokens))
        return out
