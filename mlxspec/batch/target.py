"""Rows of several sequences in one set of mlx-lm batch caches: join, verify, trim, leave.

Built on mlx-lm's `BatchKVCache` (left padding; `merge`, `extend`, `filter`) rather than
a cache of our own. What it lacks is a per-row trim after ragged acceptance: every row
verifies the same width (drafts padded to the longest), then keeps its own number of
entries. The part all rows refuse is trimmed; each row's further unkept tail must then
become left padding, so that the kept entries of every row end at the shared cache
index. mlx-lm's own right-padding `finalize` rolls the whole row for that, a copy of
every layer's cache: at 8 rows of 150-600 tokens it cost 172 ms, as much as the verify
itself, and made every ragged round dear. Instead the row's first entries are copied
over its unkept tail and the left padding grows past them (`_move_tails`): attention
does not care where in the cache a key sits (its position is rotated into it), so only
`extract`, which hands a row's entries on in token order, has to undo the shuffle.

Sliding-window layers (gemma3's local layers) are held as plain histories in the same
batch caches, the window being their mask (`batch_prompt_cache`), and cut to the
window as the rows grow (`_cut_windows`). That mask counts cache positions, so for
such models a ragged keep rolls each row (mlx-lm's `finalize`) and the rows stay in
token order.

Recurrent layers (conv or gated-delta state in mlx-lm's `ArraysCache`, as in LFM2 and
Qwen3-Next) cannot be trimmed at all. As the single-sequence target does, the batch
copies their state before a verify wider than one token; afterwards each row that
refused part of its drafts gets its copied state back and replays the tokens it kept,
all such rows in one pass, right-padded, with `ArraysCache.prepare(lengths=...)`
masking each row's padding out of its state (mlx-lm's own ragged-batch mechanism).

Invariant between rounds, as in `mlxspec.models.target`: each row's cache holds every token
of its sequence but the last (pending) one.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import _extend_cache, _merge_caches
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxspec.models import tree_attention
from mlxspec.models.anatomy import Decoder, is_recurrent, split_decoder
from mlxspec.models.target import feed_cache
from mlxspec.models.tree import DraftTree, batch_attention_mask, node_depths

# Left padding a batch may carry before it is cut (a copy of every layer's cache).
COMPACT_AT = 64
# Columns a sliding-window layer keeps beyond its window: once it holds twice as many,
# the oldest are cut (a copy of these layers' caches, one in WINDOW_SLACK rounds).
WINDOW_SLACK = 256


def cache_columns(tokens: int) -> int:
    """The most columns a batch cache holds per row while its longest row holds `tokens`:
    besides them, left padding short of COMPACT_AT, a verify's width (at most 64), and
    the step mlx-lm grows its buffer by (256), which a trim does not give back."""
    return tokens + COMPACT_AT + 64 + BatchKVCache.step


def has_recurrent_layers(model: nn.Module) -> bool:
    """Whether any layer keeps recurrent state (`ArraysCache`) rather than a KV history."""
    return any(isinstance(c, ArraysCache) for c in make_prompt_cache(model))


def is_window(cache) -> bool:
    """A sliding-window layer's cache (gemma3's local layers): a ring of the last
    `max_size` tokens, with no tokens kept from the start (`keep`)."""
    return type(cache) is RotatingKVCache and cache.keep == 0


def batch_prompt_cache(model: nn.Module) -> list:
    """The caches a batch row is prefilled in: the model's own, but a plain `KVCache`
    for each sliding-window layer. A ring cannot drop a row's refused drafts once it
    has wrapped; a full history can, and the window is then the layer's mask (mlx-lm's
    `window_size`, by cache index, which holds while each row stays in token order:
    see `BatchTarget._trim_rows`). Once joined, the columns older than the window are
    cut (`BatchTarget._cut_windows`); a prefill holds its whole prompt."""
    return [KVCache() if is_window(c) else c for c in make_prompt_cache(model)]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot be batched here yet (None: it can)."""
    caches = batch_prompt_cache(model)
    attention = any(type(c) is KVCache for c in caches)  # where the rows' lengths are kept
    if attention and all(type(c) is KVCache or isinstance(c, ArraysCache) for c in caches):
        if any(isinstance(c, ArraysCache) for c in caches) and not _honours_lengths(model):
            return (
                f"its recurrent layers ({type(model).__module__.rsplit('.', 1)[-1]}) ignore "
                "the per-row lengths a ragged replay needs, so rows would absorb padding"
            )
        return None
    kinds = {type(c).__name__ for c in caches}
    return (
        f"batching needs attention KV caches (sliding windows included), beside any "
        f"recurrent ones; this model uses {', '.join(sorted(kinds))}"
    )


# `Decoder.hidden` gives a recurrent layer the SSM mask (each row's left padding) only
# where it carries GatedDeltaNet's marker (`is_recurrent`); LFM2's conv layers would get
# the attention mask.
RECURRENT_CAPTURE = (
    "a batch does not capture hidden states of a model whose recurrent layers it cannot "
    "mask per row (e.g. LFM2's conv layers) yet"
)


# `Decoder.hidden` gives every attention layer the same mask, without a window.
WINDOW_CAPTURE = "a batch does not capture hidden states of a model with sliding-window layers yet"


def capture_unsupported(model: nn.Module) -> str | None:
    """Why a batch of `model` cannot hand rows their hidden states (None: it can)."""
    layers = getattr(model, "layers", [])
    caches = make_prompt_cache(model)
    if any(is_window(c) for c in caches):
        return WINDOW_CAPTURE
    unmasked = any(
        isinstance(c, ArraysCache) and not is_recurrent(layer) for c, layer in zip(caches, layers)
    )
    return RECURRENT_CAPTURE if unmasked else None


# The probe's answer per live model (by id; dropped when the model is): the server asks
# when a model opens, the batch again when it is built, and for a model it refuses, on
# every request; each asking would cost two forward passes.
_HONOURS_LENGTHS: dict[int, bool] = {}


def _honours_lengths(model: nn.Module) -> bool:
    """Whether the recurrent layers stop each row at `ArraysCache.prepare(lengths=...)`
    (lfm2, qwen3_next do; jamba's Mamba layers do not), probed once per model."""
    key = id(model)
    if key not in _HONOURS_LENGTHS:
        _HONOURS_LENGTHS[key] = _probe_lengths(model)
        weakref.finalize(model, _HONOURS_LENGTHS.pop, key, None)
    return _HONOURS_LENGTHS[key]


def _probe_lengths(model: nn.Module) -> bool:
    """A token fed past a row's length must leave its state as feeding only the tokens
    within it does."""
    padded, alone = make_prompt_cache(model), make_prompt_cache(model)
    recurrent = [i for i, c in enumerate(padded) if isinstance(c, ArraysCache)]
    for i in recurrent:
        padded[i].prepare(lengths=[1])
    model(mx.array([[1, 2]]), cache=padded)
    model(mx.array([[1]]), cache=alone)
    return all(  # relative: bfloat16 states of a real model differ in their last bits
        (mx.abs(a - b).max() <= 0.01 * mx.abs(b).max()).item()
        for i in recurrent
        for a, b in zip(padded[i].cache, alone[i].cache)
        if a is not None and b is not None
    )


class Prefill:
    """A joining sequence's own single-row cache, filled one chunk per call."""

    def __init__(
        self,
        model: nn.Module,
        tokens: list[int],
        start: tuple | None = None,
        capture: tuple[int, ...] | None = None,
        decoder: Decoder | None = None,
    ):
        """`start`: (a cache already holding tokens[:n], n), e.g. from `PrefixPool`.
        `capture`: the hidden states its proposer reads (`hidden_capture`), computed
        through `decoder` as `Target.fill` does; None: the cache alone."""
        cache, reused = start if start and start[0] is not None else (None, 0)
        self.model, self.todo, self.reused = model, list(tokens[reused:]), reused
        self.tokens = list(tokens)
        self.fed = 0  # prompt tokens fed so far (beside the `reused` ones)
        self.cache = cache if cache is not None else batch_prompt_cache(model)
        self.capture, self.decoder = capture, decoder
        self._hidden: list[mx.array] = []  # (m, F) per chunk fed, with `capture`

    @property
    def done(self) -> bool:
        return not self.todo

    @property
    def held(self) -> list[int]:
        """The prompt tokens its cache holds so far."""
        return self.tokens[: len(self.tokens) - len(self.todo)]

    @property
    def fresh(self) -> bool:
        """Nothing in its cache yet and no hidden states to capture: it may be fed beside
        other fresh prompts in one pass (`feed_together`)."""
        return not (self.fed or self.reused) and self.capture is None

    @property
    def hidden(self) -> mx.array | None:
        """Hidden states (m, F) of the tokens fed (None without `capture`, or if none
        was fed): the first round's, as `SingleCaches.start` hands them over."""
        return mx.concatenate(self._hidden) if self._hidden else None

    def advance(self, chunk: int) -> None:
        """Feed the next chunk, so that the batch's rounds go on between chunks."""
        piece, self.todo = self.todo[:chunk], self.todo[chunk:]
        if not piece:
            return
        self.fed += len(piece)
        hidden = feed_cache(self, piece, self.capture)
        if hidden is not None:
            self._hidden.append(hidden[0])
        mx.eval(hidden, [c.state for c in self.cache])  # hidden: None without capture


def feed_together(model: nn.Module, prefills: list[Prefill], chunk: int) -> None:
    """Feed the next `chunk` tokens of several fresh prefills in one pass, left-padded in
    a `BatchKVCache` as mlx-lm's `batch_generate` prefills its prompts: one pass where each
    prompt alone runs its own (whether that pays is `width.prefill_group`'s call). Each
    row's entries then go to its own cache (`extract`), which joins as before. Only for
    attention-only models (`BatchTarget.feeds_together`)."""
    if not all(prefill.fresh and prefill.todo for prefill in prefills):
        raise ValueError("only prompts with nothing in their caches can be fed together")
    pieces = [prefill.todo[:chunk] for prefill in prefills]
    width = max(len(piece) for piece in pieces)
    padding = [width - len(piece) for piece in pieces]
    cache = [BatchKVCache(padding) for _ in prefills[0].cache]
    model(mx.array([[0] * pad + piece for pad, piece in zip(padding, pieces)]), cache=cache)
    mx.eval([c.state for c in cache])
    for row, (prefill, piece) in enumerate(zip(prefills, pieces)):
        prefill.cache = [c.extract(row) for c in cache]
        prefill.todo = prefill.todo[len(piece) :]
        prefill.fed += len(piece)


class BatchTarget:
    def __init__(self, model: nn.Module):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        self.cache: list[BatchKVCache | ArraysCache] = []  # one per layer; empty: no rows
        layers = make_prompt_cache(model)
        self.attention = [i for i, c in enumerate(layers) if type(c) is KVCache or is_window(c)]
        # Sliding-window layers (by index, their window) mask by cache index: rows must
        # stay in token order; the columns older than every row's window are cut.
        self.windows = {i: c.max_size for i, c in enumerate(layers) if is_window(c)}
        # The layer whose cache the rows' lengths and padding are read from: one that
        # keeps every token, where the model has one.
        self._kv_at = next((i for i in self.attention if i not in self.windows), self.attention[0])
        # Per row: whether its window layers still hold its whole history (a row whose
        # oldest columns were cut cannot hand a prefix on).
        self.whole: list[bool] = []
        self.recurrent = [i for i, c in enumerate(layers) if isinstance(c, ArraysCache)]
        # Whether joining prompts may be fed in one left-padded pass (`feed_together`):
        # every layer a plain KV history, masked by its left padding alone.
        self.feeds_together = all(type(c) is KVCache for c in layers)
        # Per row, the token index held at each of its cache positions from its left
        # padding on, where `_move_tails` shuffled them (None: in order); positions past
        # the list hold the following tokens in order.
        self.stored: list[list[int] | None] = []
        self._copied: list[list] | None = None  # recurrent state before the last verify
        self._verified: list[list[int]] = []  # and that verify's rows
        self._decoder: Decoder | None = None
        self.capture_unsupported = capture_unsupported(model)  # why rows get no hidden states
        # Why rows cannot verify draft trees (None: they can): as for a request alone.
        self.tree_unsupported = tree_attention.unsupported_reason(model, layers)

    @property
    def decoder(self) -> Decoder:
        """The model split into layers and head, for passes that capture hidden states."""
        if self._decoder is None:
            self._decoder = split_decoder(self.model)
        return self._decoder

    def prompt_cache(self) -> list:
        """The caches a row is prefilled in (`batch_prompt_cache`)."""
        return batch_prompt_cache(self.model)

    @property
    def _kv(self) -> BatchKVCache:
        return self.cache[self._kv_at]

    @property
    def rows(self) -> int:
        return self._kv.offset.shape[0] if self.cache else 0

    def lengths(self) -> list[int]:
        """Tokens each row's cache holds."""
        return self._kv.offset.tolist() if self.cache else []

    def kv_layout(self) -> list[tuple[float, int | None]]:
        """Per attention layer: the bytes one token of one row takes, read off the cache
        as allocated (its dtype and heads as loaded), and the most columns the layer
        may hold per row (a window layer: `cache_columns` of its window and twice the
        slack, `_cut_windows`; None: as the context). Empty before any row joined."""
        layout = []
        for i in self.attention if self.cache else ():
            c = self.cache[i]
            if c.keys is not None:
                per_token = (c.keys.nbytes + c.values.nbytes) / (c.keys.shape[0] * c.keys.shape[2])
                window = self.windows.get(i)
                cap = None if window is None else cache_columns(window + 2 * WINDOW_SLACK)
                layout.append((per_token, cap))
        return layout

    def join(self, prefills: list[Prefill]) -> None:
        """Append prefilled sequences as the last rows, in one merge."""
        self.cache = _extend_cache(self.cache, _merge_caches([p.cache for p in prefills]))
        self.stored += [None] * len(prefills)
        self.whole += [True] * len(prefills)

    def extract(self, row: int) -> list[KVCache]:
        """Row `row`'s entries as a single-row cache per layer (a copy), in token order."""
        caches = [c.extract(row) for c in self.cache]
        stored = self.stored[row]
        if stored is None:
            return caches
        length = caches[self.attention[0]].offset
        positions = mx.array(np.argsort(stored + list(range(len(stored), length))))
        for i in self.attention:
            c = caches[i]
            c.keys = mx.contiguous(mx.take(c.keys, positions, axis=2))
            c.values = mx.contiguous(mx.take(c.values, positions, axis=2))
        return caches

    def leave(self, keep_rows: list[int]) -> None:
        """Keep only `keep_rows` (in that order)."""
        self.stored = [self.stored[i] for i in keep_rows]
        self.whole = [self.whole[i] for i in keep_rows]
        if not keep_rows:
            self.cache = []
            return
        indices = mx.array(keep_rows)
        for c in self.cache:
            c.filter(indices)

    def settle(self) -> None:
        """Evaluate the cache now (the trims and rolls of `keep` are lazy), so that the
        time they take is counted in the round that caused them."""
        mx.eval([c.state for c in self.cache])

    def verify(self, rows: list[list[int]]) -> mx.array:
        """One forward over every row's [pending] + drafts, right-padded to the widest:
        logits (B, width, V). A pad position only follows its row's real tokens, so it
        changes none of their logits (nor hidden states), and `keep` drops its entry."""
        return self.model(self._padded(rows), cache=self.cache)

    def verify_capturing(
        self, rows: list[list[int]], capture: tuple[int, ...]
    ) -> tuple[mx.array, mx.array]:
        """`verify`, also returning the hidden states (B, width, F) (`Decoder.hidden`
        with `capture`); row i's first len(rows[i]) are its tokens' own."""
        hidden = self.decoder.hidden(self._padded(rows), self.cache, capture=capture)
        return self.decoder.logits(hidden), hidden

    def _padded(self, rows: list[list[int]]) -> mx.array:
        """The verify's input, right-padded; recurrent state is copied to undo it."""
        width = max(len(r) for r in rows)
        padded = [r + [r[0]] * (width - len(r)) for r in rows]
        if self.recurrent and width > 1:  # arrays are immutable: keeping them is a copy
            self._copied = [list(self.cache[i].cache) for i in self.recurrent]
            self._verified = padded  # what a row that refuses a draft replays from
        return mx.array(padded)

    def verify_tree(
        self,
        rows: list[list[int]],
        trees: list[DraftTree],
        capture: tuple[int, ...] | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """One forward over every row's [pending, *its tree's nodes], right-padded:
        logits (B, width, V), row i's column j predicting the token after node j's path
        (and, with `capture`, the hidden states as `verify_capturing`). Each row's tree
        gets its own mask (a node sees its row's tokens, its ancestors and itself) and
        its own RoPE positions (the row's length + the node's depth), so a row's line
        and a row's tree share the pass. A padding column sees only itself."""
        width = max(len(r) for r in rows)
        kv = self._kv
        mask = batch_attention_mask(trees, width, kv.left_padding.tolist(), kv._idx)
        positions = kv.offset[:, None] + mx.array(node_depths(trees, width))
        cache = [tree_attention.TreeCache(c, mask) for c in self.cache]
        inputs = self._padded(rows)
        with tree_attention.node_positions(self.model, positions):
            if capture is None:
                return self.model(inputs, cache=cache), None
            hidden = self.decoder.hidden(inputs, cache, capture=capture)
            return self.decoder.logits(hidden), hidden

    def keep_tree(self, kept: list[list[int]], width: int) -> None:
        """After `verify_tree` of `width` columns, row i keeps the entries of its nodes
        kept[i] (increasing, the root's 0 first), moved to the front of its columns."""
        layers = [self.cache[i] for i in self.attention]
        if any(nodes != list(range(len(nodes))) for nodes in kept):  # a branch was taken
            end = layers[0]._idx
            index = mx.array([nodes + [nodes[-1]] * (width - len(nodes)) for nodes in kept])
            index = index[:, None, :, None]
            moved = [
                mx.take_along_axis(store[..., end - width : end, :], index, axis=2)
                for c in layers
                for store in (c.keys, c.values)
            ]
            mx.eval(moved)  # read before the write, as in `_move_tails`
            for c, keys, values in zip(layers, moved[::2], moved[1::2]):
                c.keys[..., end - width : end, :] = keys
                c.values[..., end - width : end, :] = values
        self._trim_rows([len(nodes) for nodes in kept], width)
        self._compact()

    def keep(self, n_keep: list[int], width: int) -> None:
        """After a verify of `width` tokens, keep the first n_keep[i] entries of row i."""
        copied, self._copied = self._copied, None
        verified, self._verified = self._verified, []
        replay = [n < width for n in n_keep] if copied is not None else []
        if not any(replay):
            self._trim_rows(n_keep, width)
        else:
            # Rows that refused a draft drop the whole verify and are replayed from the
            # copied state; the others keep it all, their recurrent state included.
            self._trim_rows([0 if again else width for again in replay], width)
            self._restore(copied, replay)
            tokens = [row[:n] if again else [] for row, n, again in zip(verified, n_keep, replay)]
            self._replay(tokens)
        self._compact()

    def _compact(self) -> None:
        """Cut the shared left padding, and the window layers' columns no row sees."""
        if min(self._kv.left_padding.tolist()) >= COMPACT_AT:
            self.leave(list(range(self.rows)))  # `filter` cuts the shared left padding
        self._cut_windows()

    def _cut_windows(self) -> None:
        """Rows are right-aligned, so a window covers the same last columns of every
        row: the columns before the longest window (and the slack) are seen by none.
        Without this cut a window layer would attend over, and keep, the whole context
        (on a 12B Gemma 3 at 8k tokens, most of the KV it reads each round)."""
        if not self.windows or not self.cache:
            return
        first = next(iter(self.windows))
        end = self.cache[first]._idx
        cut = end - max(self.windows.values()) - WINDOW_SLACK
        if cut < WINDOW_SLACK:
            return
        padding = self.cache[first].left_padding.tolist()
        self.whole = [whole and pad >= cut for whole, pad in zip(self.whole, padding)]
        for i in self.windows:
            c = self.cache[i]
            c.keys, c.values = c.keys[..., cut:end, :], c.values[..., cut:end, :]
            c._idx = end - cut
            c.left_padding = mx.maximum(c.left_padding - cut, 0)

    def _trim_rows(self, n_keep: list[int], width: int) -> None:
        """Keep the first n_keep[i] of the last `width` attention entries of row i."""
        unkept = [width - n for n in n_keep]
        common = min(unkept)
        extra = [n - common for n in unkept]
        layers = [self.cache[i] for i in self.attention]
        if common:
            for c in layers:
                c.trim(common)
        if not any(extra):
            return
        if not self.windows:
            self._move_tails(layers, extra)
            return
        for c in layers:  # mlx-lm's own roll: each row right by its extra tail
            c.prepare(right_padding=extra)
            c.finalize()

    def _move_tails(self, layers: list[BatchKVCache], extra: list[int]) -> None:
        """Row i's last extra[i] entries become left padding: its first m = min(extra[i],
        entries it keeps) entries are copied over the last m, and its left padding grows
        by extra[i]. Copies m entries a row where a roll copies the whole cache."""
        end = layers[0]._idx
        padding = layers[0].left_padding.tolist()
        moves = [min(e, end - p - e) for e, p in zip(extra, padding)]
        span = max(moves)
        if span > 0:
            # Row i's new last `span` entries: the ones in place, then its moved ones.
            sources = [
                [end - span + j if j < span - m else p + j - (span - m) for j in range(span)]
                for m, p in zip(moves, padding)
            ]
            index = mx.array(sources)[:, None, :, None]
            moved = [
                mx.take_along_axis(store[..., :end, :], index, axis=2)
                for c in layers
                for store in (c.keys, c.values)
            ]
            mx.eval(moved)  # read before the write, which can then reuse the buffer
            for c, keys, values in zip(layers, moved[::2], moved[1::2]):
                c.keys[..., end - span : end, :] = keys
                c.values[..., end - span : end, :] = values
            for row, (m, e, p) in enumerate(zip(moves, extra, padding)):
                if m:
                    order = self.stored[row] or []
                    order = order + list(range(len(order), end - p - e))
                    self.stored[row] = order[m:] + order[:m]
        shift = mx.array(extra)
        for c in layers:
            c.left_padding = c.left_padding + shift
            c.offset = c.offset - shift

    def _restore(self, copied: list[list], rows: list[bool]) -> None:
        """Put the copied recurrent state back in the chosen rows."""
        chosen = mx.array(rows)
        for i, before in zip(self.recurrent, copied):
            layer = self.cache[i]
            for j, (now, then) in enumerate(zip(layer.cache, before)):
                if now is None:
                    continue
                if then is None:  # no token fed before the verify: mlx-lm starts from zeros
                    then = mx.zeros_like(now)
                mask = chosen.reshape(-1, *([1] * (now.ndim - 1)))
                layer.cache[j] = mx.where(mask, then, now)

    def _replay(self, tokens: list[list[int]]) -> None:
        """Feed each row its own tokens (some none) in one right-padded pass."""
        width = max(map(len, tokens))
        if width == 0:
            return
        lengths = [len(t) for t in tokens]
        for i in self.recurrent:
            self.cache[i].prepare(lengths=lengths)
        self.model(mx.array([t + [0] * (width - len(t)) for t in tokens]), cache=self.cache)
        for i in self.recurrent:
            self.cache[i].finalize()
        self._trim_rows(lengths, width)
