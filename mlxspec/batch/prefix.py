"""Finished rows' caches, kept for the next request that starts the same way.

A chat's next turn, an agent's next call under the same system prompt, an editor's next
completion in the same file: each prompt begins with what an earlier request already
fed. The single-sequence engine reuses its one cache across requests; the batch keeps
the caches of its last few finished rows (mlx-lm's `BatchKVCache.extract`) and starts a
joining request's prefill from the one sharing the longest prefix with its prompt.
Only the prefix is copied, so the kept cache stays intact for the next match.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

MIN_REUSE = 8  # a shorter common prefix is not worth a copy of every layer's cache


@dataclass
class Kept:
    tokens: list[int]  # what the cache holds, in order
    cache: list[KVCache]  # one per layer, a single row


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixPool:
    """The caches of the last `capacity` finished rows, most recently used last."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.kept: list[Kept] = []

    def add(self, tokens: list[int], cache: list[KVCache]) -> None:
        if self.capacity <= 0:
            return
        # `BatchKVCache.extract` is lazy: unevaluated, each entry would keep the whole
        # batch's cache of that moment alive (every row, full size), not its own row.
        mx.eval([layer.keys for layer in cache] + [layer.values for layer in cache])
        self.kept.append(Kept(list(tokens), cache))
        del self.kept[: -self.capacity]

    @property
    def tokens(self) -> int:
        """Tokens the kept caches hold, all together."""
        return sum(len(kept.tokens) for kept in self.kept)

    def evict_to(self, tokens: int) -> None:
        """Let the least recently used kept caches go until at most `tokens` remain."""
        while self.kept and self.tokens > tokens:
            del self.kept[0]

    def take(self, tokens: list[int]) -> tuple[list[KVCache] | None, int]:
        """A fresh cache holding the longest kept prefix of `tokens`, and its length
        (None, 0 when no kept cache shares at least MIN_REUSE tokens)."""
        best, length = None, 0
        for kept in self.kept:
            n = common_prefix(kept.tokens, tokens)
            if n > length:
                best, length = kept, n
        if best is None or length < MIN_REUSE:
            return None, 0
        self.kept.remove(best)
        self.kept.append(best)
        return [_prefix_copy(layer, length) for layer in best.cache], length


def _prefix_copy(layer: KVCache, length: int) -> KVCache:
    copy = KVCache()
    copy.keys = mx.contiguous(layer.keys[..., :length, :])  # new arrays: the kept cache
    copy.values = mx.contiguous(layer.values[..., :length, :])  # must not see later writes
    copy.offset = length
    return copy
