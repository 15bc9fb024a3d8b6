"""The target model and its KV cache: prefill with prefix reuse, verify, roll back.

Invariant between rounds: the cache holds the KV of every token of the sequence but
the last one (the "pending" token), which is fed at the head of the next verify.

Rolling back rejected drafts: attention caches are trimmed. Layers whose cache cannot
be trimmed (recurrent/hybrid state, a rotating window that has wrapped) are copied
before the verify and restored after it, and the accepted tokens are replayed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from mlxspec.anatomy import Decoder, split_decoder

ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)
PREFILL_CHUNK = 512


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference: long chats stay cheap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _copy_state(state: Any) -> Any:
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(item) for item in state)
    return state


class Target:
    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.cached_tokens: list[int] = []
        self.snapshot_layers = [
            i for i, c in enumerate(self.cache) if not isinstance(c, ALWAYS_TRIMMABLE)
        ]
        self._decoder: Decoder | None = None
        self._snapshot: list[Any] | None = None

    @property
    def strategy(self) -> str:
        """'trim' when every layer's cache can be cut back, else 'snapshot'."""
        return "snapshot" if self.snapshot_layers else "trim"

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = split_decoder(self.model)
        return self._decoder

    def reset(self) -> None:
        self.cache = make_prompt_cache(self.model)
        self.cached_tokens = []

    def forward(self, tokens: list[int], with_hidden: bool = False) -> tuple[mx.array, Any]:
        """Run the target over `tokens` (appending to the cache): logits (m, V), hidden."""
        inputs = mx.array([tokens])
        if with_hidden:
            hidden = self.decoder.hidden(inputs, self.cache)
            logits = self.decoder.head(hidden)
            self.cached_tokens.extend(tokens)
            return logits[0], hidden[0]
        logits = self.model(inputs, cache=self.cache)
        self.cached_tokens.extend(tokens)
        return logits[0], None

    def prepare(self, sequence: list[int], progress=None) -> int:
        """Fill the cache with all of `sequence` but its last token; reuse what matches.

        Returns how many tokens were reused from the previous request.
        """
        wanted = sequence[:-1]
        reused = common_prefix_len(self.cached_tokens, wanted)
        surplus = len(self.cached_tokens) - reused
        if surplus and (self.snapshot_layers or not self._trim(surplus)):
            self.reset()
            reused = 0
        todo = wanted[reused:]
        for start in range(0, len(todo), PREFILL_CHUNK):
            chunk = todo[start : start + PREFILL_CHUNK]
            self.model(mx.array([chunk]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.cached_tokens.extend(chunk)
            if progress:
                progress(start + len(chunk), len(todo))
        return reused

    def _trim(self, n: int) -> bool:
        if not all(c.is_trimmable() for c in self.cache):
            return False
        for c in self.cache:
            c.trim(n)
        del self.cached_tokens[len(self.cached_tokens) - n :]
        return True

    def verify(self, tokens: list[int], with_hidden: bool = False) -> tuple[mx.array, Any]:
        """Forward over [pending] + drafts, remembering how to undo it."""
        if self.snapshot_layers and len(tokens) > 1:
            self._snapshot = [_copy_state(self.cache[i].state) for i in self.snapshot_layers]
        return self.forward(tokens, with_hidden)

    def keep(self, verified: list[int], n_keep: int) -> None:
        """After verifying `verified`, keep the cache entries of its first `n_keep` tokens."""
        surplus = len(verified) - n_keep
        snapshot, self._snapshot = self._snapshot, None
        if surplus == 0:
            return
        if not self.snapshot_layers:
            self._trim(surplus)
            return
        # Restore the copied layers, rewind the rest, and replay the kept tokens.
        for c in self.cache:
            if c.is_trimmable():
                c.trim(len(verified))
        for i, state in zip(self.snapshot_layers, snapshot):
            self.cache[i].state = state
        del self.cached_tokens[len(self.cached_tokens) - len(verified) :]
        if n_keep:
            self.forward(verified[:n_keep])
            mx.eval([c.state for c in self.cache])
