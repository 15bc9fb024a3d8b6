"""Prompt caches kept for the next request that starts the same way, bounded in bytes.

A chat's next turn, an agent's next call under the same system prompt, an editor's next
completion in the same file: each prompt begins with what an earlier request already
fed. One pool serves a model's requests alone (`Target.fill`) and its batch's rows
(`BatchCaches.start`), whatever their dialect, so an agent's side request (a title, a
summary) no longer evicts the main conversation: each is an entry, and the least
recently used goes first once the pool passes its bytes.

What an entry can give depends on its layers (mlx-lm's cache classes):
- Plain KV histories (`KVCache`, and any cache `is_trimmable()`) can be cut to any
  prefix: an entry serves every prompt sharing at least MIN_REUSE tokens with it.
- Recurrent state (`ArraysCache`: Gated DeltaNet, conv, Mamba) and a sliding window that
  has wrapped (`RotatingKVCache`) hold their whole sequence folded in; no prefix can be
  cut out. Such an entry is a *checkpoint*: it serves a prompt that extends it exactly.
  `Target.fill` and the batch's prefill save one at the end of each prompt (where the
  next turn's re-rendered history most likely diverges from what was generated), every
  CHECKPOINT_EVERY tokens of a long one, and at the end of each request.

Modelled on mlx-lm's server (`LRUPromptCache`: a prefix trie, least recently used out
first, prefixes of a trimmable entry dropped as it supersedes them), with what it lacks
here: a length query that copies nothing, copies of the prefix only, entries kept apart
by their layers' form (a batch holds window layers as full histories, a request alone
as rings), and an optional disk tier (`prompt_disk.DiskCache`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxspec.models.kv_form import start_of

MIN_REUSE = 8  # a shorter common prefix is not worth a copy of every layer's cache
# A checkpoint every this many prompt tokens of a long prefill, for caches that cannot be
# cut back (a conversation that diverges inside a long prompt restarts from the last one).
CHECKPOINT_EVERY = 2048
CAPACITY = 64  # entries at most, whatever their bytes (a trie walk per entry per request)


@dataclass
class Kept:
    tokens: list[int]  # what the cache holds, in order
    cache: list[Any]  # one mlx-lm cache per layer, a single row, holding exactly `tokens`
    nbytes: int = 0
    form: tuple[str, ...] = field(default=())  # its layers' cache classes

    @property
    def cuttable(self) -> bool:
        """Whether every layer can be cut back to a prefix (else: only the whole serves)."""
        return all(layer.is_trimmable() for layer in self.cache)

    def reusable(self, tokens: list[int], least: int = MIN_REUSE) -> int:
        """How many of `tokens` this entry can hand over (0: fewer than `least`). A
        quantized KV layer is not cut below its form's start: a fresh prefill of that
        prefix would hold float KV there (`kv_form`)."""
        n = reusable_length(self.tokens, self.cuttable, tokens, least)
        if n < len(self.tokens) and n < start_of(self.form) and self.quantized:
            return 0
        return n

    @property
    def quantized(self) -> bool:
        return any(isinstance(layer, QuantizedKVCache) for layer in self.cache)

    @property
    def key(self) -> tuple:
        return self.tokens, self.form, self.cuttable


class DiskTier(Protocol):
    """Where entries go when the pool lets them go (`prompt_disk.DiskCache`)."""

    def write(self, kept: Kept) -> None: ...

    def read(self, tokens: list[int], form: tuple[str, ...]) -> Kept | None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
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


def reusable_length(held: list[int], cuttable: bool, tokens: list[int], least: int) -> int:
    """How many of `tokens` an entry holding `held` can hand over: any common prefix
    where it can be cut back, else only the whole (0: fewer than `least`)."""
    n = common_prefix(held, tokens)
    if n < len(held) and not cuttable:
        return 0
    return n if n >= least else 0


def supersedes(new: tuple, old: tuple) -> bool:
    """Whether an entry (tokens, form, cuttable) `new` makes `old` needless: the same
    tokens, or a cuttable one whose tokens begin with `old`'s."""
    (tokens, form, cuttable), (old_tokens, old_form, _) = new, old
    if old_form != form:
        return False
    if old_tokens == tokens:
        return True
    short = len(old_tokens) < len(tokens)
    return cuttable and short and tokens[: len(old_tokens)] == old_tokens


def form_of(cache: list[Any], kv_key: str | None = None) -> tuple[str, ...]:
    """What entries a cache can stand in for: its layers' classes (a quantized KV layer
    named as the float one it was converted from) and, for a quantized KV form, its key
    (`KVForm.key`): a float and a quantized cache never stand in for each other."""
    names = tuple(
        "KVCache" if isinstance(layer, QuantizedKVCache) else type(layer).__name__
        for layer in cache
    )
    return names + ((kv_key,) if kv_key else ())


def cache_bytes(cache: list[Any]) -> int:
    return sum(layer.nbytes for layer in cache)


def copy_cache(cache: list[Any]) -> list[Any]:
    """A copy whose arrays later writes into `cache` cannot reach (a KV layer's buffer is
    written in place as tokens come)."""
    return [copy.deepcopy(layer) for layer in cache]


class PromptCache:
    """Kept caches, most recently used last, within `max_bytes` (None: no byte bound)
    and `capacity` entries."""

    def __init__(
        self,
        capacity: int = CAPACITY,
        max_bytes: int | None = None,
        disk: DiskTier | None = None,
    ):
        self.capacity, self.max_bytes, self.disk = capacity, max_bytes, disk
        self.kept: list[Kept] = []

    @property
    def tokens(self) -> int:
        """Tokens the kept caches hold, all together."""
        return sum(len(kept.tokens) for kept in self.kept)

    @property
    def nbytes(self) -> int:
        """Bytes the kept caches hold, all together."""
        return sum(kept.nbytes for kept in self.kept)

    def clear(self) -> None:
        self.kept.clear()

    def add(self, tokens: list[int], cache: list[Any], form: tuple[str, ...] | None = None) -> None:
        """Keep `cache` (holding exactly `tokens`; from now on the pool's: the caller
        writes into it no more) under `form` (default: `form_of(cache)`, a float KV form).
        An entry it supersedes goes (a cuttable one whose tokens begin it, or one of the
        same tokens)."""
        if self.capacity <= 0 or len(tokens) < MIN_REUSE:
            return
        # `BatchKVCache.extract` is lazy: unevaluated, each entry would keep the whole
        # batch's cache of that moment alive (every row, full size), not its own row.
        mx.eval([layer.state for layer in cache])
        form = form_of(cache) if form is None else form
        kept = Kept(list(tokens), cache, cache_bytes(cache), form)
        self.kept = [old for old in self.kept if not supersedes(kept.key, old.key)]
        self.kept.append(kept)
        self._bound()

    def reusable(self, tokens: list[int], form: tuple[str, ...], least: int = MIN_REUSE) -> int:
        """The most of `tokens` an entry of `form` can hand over (nothing is copied)."""
        best = self._best(tokens, form, least)
        return best[1] if best else 0

    def take(
        self, tokens: list[int], form: tuple[str, ...], least: int = MIN_REUSE
    ) -> tuple[list[Any] | None, int]:
        """A fresh cache holding the longest kept prefix of `tokens`, and its length (None,
        0 when no entry of `form` shares at least `least` tokens: a batch's joining row
        copies every layer for it). The entry stays whole for the next match, and
        becomes the most recently used."""
        best = self._best(tokens, form, least)
        if best is None:
            return None, 0
        kept, length = best
        self.kept.remove(kept)
        self.kept.append(kept)
        return prefix_copy(kept, length), length

    def evict_to(self, nbytes: int) -> None:
        """Let the least recently used kept caches go until they hold at most `nbytes`
        (to the disk, where there is one)."""
        while self.kept and self.nbytes > nbytes:
            self._spill(self.kept.pop(0))

    def flush(self) -> None:
        """Write every kept cache to the disk (the process ends: the next starts warm)."""
        for kept in self.kept:
            self._spill(kept)

    def _spill(self, kept: Kept) -> None:
        if self.disk is not None:
            self.disk.write(kept)

    def _best(
        self, tokens: list[int], form: tuple[str, ...], least: int
    ) -> tuple[Kept, int] | None:
        best, length = None, 0
        for kept in self.kept:
            if kept.form == form and (n := kept.reusable(tokens, least)) > length:
                best, length = kept, n
        if best is None and self.disk is not None:
            loaded = self.disk.read(tokens, form)  # a restart's, or another process's
            if loaded is not None and (n := loaded.reusable(tokens, least)):
                self.kept.append(loaded)
                self._bound()
                best, length = (loaded, n) if loaded in self.kept else (None, 0)
        return (best, length) if best is not None else None

    def _bound(self) -> None:
        while len(self.kept) > self.capacity:
            self._spill(self.kept.pop(0))
        if self.max_bytes is not None:
            self.evict_to(self.max_bytes)


def prefix_copy(kept: Kept, length: int) -> list[Any]:
    """A copy of `kept`'s cache holding its first `length` tokens: a KV layer copies that
    much of its buffer only; another layer is copied whole, then cut back (a checkpoint
    hands over its whole sequence: nothing to cut)."""
    surplus = len(kept.tokens) - length
    layers = []
    for layer in kept.cache:
        if type(layer) is KVCache:
            layers.append(_kv_prefix(layer, length))
            continue
        layer = copy.deepcopy(layer)
        if surplus:
            layer.trim(surplus)
        layers.append(layer)
    return layers


def _kv_prefix(layer: KVCache, length: int) -> KVCache:
    copy_ = KVCache()
    if layer.keys is not None:
        copy_.keys = mx.contiguous(layer.keys[..., :length, :])  # new arrays: the kept cache
        copy_.values = mx.contiguous(layer.values[..., :length, :])  # must not see later writes
    copy_.offset = length
    return copy_
