"""Rows of several sequences in one set of mlx-lm batch caches: join, verify, trim, leave.

Built on mlx-lm's `BatchKVCache` (left padding; `merge`, `extend`, `filter`) rather than
a cache of our own. What it lacks is a per-row trim after ragged acceptance: every row
verifies the same width (drafts padded to the longest), then keeps its own number of
entries. The part all rows refuse is trimmed; each row's further unkept tail is turned
into left padding by rolling the row right (mlx-lm's own right-padding `finalize`), so
the kept entries of every row end at the shared cache index and the tail is masked.

Invariant between rounds, as in `mlxspec.target`: each row's cache holds every token
of its sequence but the last (pending) one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import _extend_cache, _merge_caches
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

# Left padding a batch may carry before it is cut (a copy of every layer's cache).
COMPACT_AT = 64


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot be batched here yet (None: it can)."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds == {"KVCache"}:
        return None
    return (
        f"batching needs plain KV caches; this model uses {', '.join(sorted(kinds))} "
        "(rotating windows and recurrent state cannot be trimmed per row yet)"
    )


class Prefill:
    """A joining sequence's own single-row cache, filled one chunk per call."""

    def __init__(self, model: nn.Module, tokens: list[int], start: tuple | None = None):
        """`start`: (a cache already holding tokens[:n], n), e.g. from `PrefixPool`."""
        cache, reused = start if start and start[0] is not None else (None, 0)
        self.model, self.todo, self.reused = model, list(tokens[reused:]), reused
        self.cache = cache if cache is not None else make_prompt_cache(model)

    @property
    def done(self) -> bool:
        return not self.todo

    def advance(self, chunk: int) -> None:
        """Feed the next chunk, so that the batch's rounds go on between chunks."""
        piece, self.todo = self.todo[:chunk], self.todo[chunk:]
        if piece:
            self.model(mx.array([piece]), cache=self.cache)
            mx.eval([c.state for c in self.cache])


class BatchTarget:
    def __init__(self, model: nn.Module):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        self.cache: list[BatchKVCache] = []  # one per layer; empty while no rows

    @property
    def rows(self) -> int:
        return self.cache[0].offset.shape[0] if self.cache else 0

    def lengths(self) -> list[int]:
        """Tokens each row's cache holds."""
        return self.cache[0].offset.tolist() if self.cache else []

    def join(self, prefill: Prefill) -> None:
        """Append a prefilled sequence as the last row."""
        row: list[KVCache] = prefill.cache
        self.cache = _extend_cache(self.cache, _merge_caches([row]))

    def extract(self, row: int) -> list[KVCache]:
        """Row `row`'s entries as a single-row cache per layer (a copy)."""
        return [c.extract(row) for c in self.cache]

    def leave(self, keep_rows: list[int]) -> None:
        """Keep only `keep_rows` (in that order)."""
        if not keep_rows:
            self.cache = []
            return
        indices = mx.array(keep_rows)
        for c in self.cache:
            c.filter(indices)

    def verify(self, rows: list[list[int]]) -> mx.array:
        """One forward over every row's [pending] + drafts, right-padded to the widest:
        logits (B, width, V). A pad position only follows its row's real tokens, so it
        changes none of their logits, and `keep` drops its cache entry."""
        width = max(len(r) for r in rows)
        padded = [r + [r[0]] * (width - len(r)) for r in rows]
        return self.model(mx.array(padded), cache=self.cache)

    def keep(self, n_keep: list[int], width: int) -> None:
        """After a verify of `width` tokens, keep the first n_keep[i] entries of row i."""
        unkept = [width - n for n in n_keep]
        common = min(unkept)
        extra = [n - common for n in unkept]
        for c in self.cache:
            if common:
                c.trim(common)
            if any(extra):
                c.prepare(right_padding=extra)  # roll each row right by its extra tail
                c.finalize()
        if min(self.cache[0].left_padding.tolist()) >= COMPACT_AT:
            self.leave(list(range(self.rows)))  # `filter` cuts the shared left padding
