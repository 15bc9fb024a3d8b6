"""The target model and its KV cache: prefill with prefix reuse, verify, roll back.

Invariant between rounds: the cache holds the KV of every token of the sequence but
the last one (the "pending" token), which is fed at the head of the next verify.

Rolling back rejected drafts: attention caches are trimmed. Layers whose cache cannot
be trimmed (recurrent/hybrid state, a rotating window that has wrapped) are copied
before the verify and restored after it, and the accepted tokens are replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from mlxspec.models import tree_attention
from mlxspec.models.anatomy import Decoder, split_decoder
from mlxspec.models.kv_form import FLOAT, KVForm
from mlxspec.models.prompt_cache import (
    CHECKPOINT_EVERY,
    MIN_REUSE,
    PromptCache,
    common_prefix,
    copy_cache,
    form_of,
    reusable_length,
)
from mlxspec.models.tree import DraftTree

ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)
PREFILL_CHUNK = 512


def trim_cache(holder, n: int) -> bool:
    """Cut the last n tokens from `holder.cache` (and `holder.cached_tokens`) if it can be."""
    if not all(c.is_trimmable() for c in holder.cache):  # a rotating window may have wrapped
        return False
    kv: KVForm = getattr(holder, "kv", FLOAT)
    if not kv.can_cut(holder.cache, len(holder.cached_tokens) - n):
        return False  # quantized past its start: a fresh prefill would hold float KV here
    for c in holder.cache:
        c.trim(n)
    del holder.cached_tokens[len(holder.cached_tokens) - n :]
    return True


def feed_cache(holder, chunk: list[int], capture: tuple[int, ...] | None) -> mx.array | None:
    """Run `chunk` into `holder.cache` (`holder`: the target or a joining row's
    `Prefill`, anything with `model`, `cache` and `decoder`). Without `capture` only the
    cache is computed: no logits, so mlx never runs the LM head over every position nor
    the last layer's MLP (9 % of a 500-token SmolLM2 prefill). With it, the hidden
    states (1, m, F) that `capture` asks for (`Decoder.hidden`)."""
    if capture is None:
        holder.model(mx.array([chunk]), cache=holder.cache)
        return None
    return holder.decoder.hidden(mx.array([chunk]), holder.cache, capture=capture)


def catch_up(
    holder,
    tokens: list[int],
    *,
    reusable: int | None = None,
    allow_trim: bool = True,
    progress=None,
    feed: Callable[[list[int]], mx.array | None] | None = None,
) -> tuple[int, mx.array | None]:
    """Make `holder.cache` hold `tokens`: keep its common prefix with `holder.cached_tokens`
    (at most `tokens[:reusable]`), cut the rest or start over where it cannot be cut, and
    feed what is missing in chunks. Returns (tokens reused, logits of the last chunk fed).

    `holder` is the target or a draft model: anything with `model`, `cache`,
    `cached_tokens` and `reset()`. `feed(chunk)` runs the model over a chunk (default:
    `holder.model` with its cache) and returns its logits, or None where the caller needs
    only the cache: mlx then never runs what the cache does not hold (the LM head over
    every position, the last layer's MLP), 9 % of a 500-token SmolLM2 prefill.
    """
    reused = common_prefix(holder.cached_tokens, tokens[:reusable])
    surplus = len(holder.cached_tokens) - reused
    if surplus and not (allow_trim and trim_cache(holder, surplus)):
        holder.reset()
        reused = 0
    todo, logits = tokens[reused:], None
    if progress and todo:
        progress(0, len(todo))  # a long prefill says so before its first chunk
    kv: KVForm = getattr(holder, "kv", FLOAT)
    done = 0
    for start in range(0, len(todo), PREFILL_CHUNK):
        block = todo[start : start + PREFILL_CHUNK]
        for begin, end in kv.pieces(len(holder.cached_tokens), len(block)):
            chunk = block[begin:end]
            kv.convert(holder.cache)
            if feed is None:
                logits = holder.model(mx.array([chunk]), cache=holder.cache)
            else:
                logits = feed(chunk)
            states = [c.state for c in holder.cache]
            mx.eval(states if logits is None else (logits, states))
            holder.cached_tokens.extend(chunk)
            done += len(chunk)
        if progress:
            progress(done, len(todo))
    return reused, logits


def _copy_state(state: Any) -> Any:
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(item) for item in state)
    return state


def host_last(arrays: list[mx.array]) -> list[int]:
    """The last column of each array, rows in order, read to the host: the tokens a round
    chose, from its own reads ((B, W) for a batch's rows at once, (m,) for one row)."""
    return [int(t) for a in arrays for t in np.atleast_2d(np.asarray(a))[:, -1]]


class LaunchedPass:
    """A one-token-a-row pass started before its tokens reached the host (mlx-lm's
    `generate_step` pipelines every step so): what the round chose, read in place of the
    pass's own lazy input (`host_last`), and the pass's logits. While it is pending every
    layer's cache holds its column; the next verify of exactly those tokens takes it, and
    anything else takes it back first by a one-column trim, so a launch changes no
    result. One for `Target` (a request alone) and one for a batch (`BatchCaches`)."""

    def __init__(self) -> None:
        self._launched: tuple[list[mx.array], mx.array] | None = None

    @property
    def pending(self) -> bool:
        return self._launched is not None

    def start(self, model: nn.Module, cache: list, tokens: mx.array, chosen: list[mx.array]):
        """Run `model` over one token a row, `tokens` (B,), scheduled now, read later.
        `chosen`: arrays evaluated apart from the pass whose last columns are `tokens`,
        which `take` reads instead: `tokens`, scheduled with the pass, wait for all of it,
        and the next pass's graph would then be built only once this one is done."""
        logits = model(tokens[:, None], cache=cache)
        mx.async_eval(logits)
        self._launched = chosen, logits

    def take(self, cache: list, tokens: list[int]) -> mx.array | None:
        """The launched logits (B, 1, V) if the pass ran over exactly `tokens` (one a
        row); None (the pass taken back) otherwise, or if none was launched."""
        if self._launched is None:
            return None
        chosen, logits = self._launched
        if tokens != host_last(chosen):
            self.drop(cache)
            return None
        self._launched = None
        return logits

    def drop(self, cache: list) -> None:
        """Take the launched pass back: its column leaves every layer's cache."""
        if self._launched is not None:
            self._launched = None
            for c in cache:
                c.trim(1)

    def forget(self) -> None:
        """The cache it ran in is gone (a reset): nothing to take back."""
        self._launched = None


class Target:
    def __init__(self, model: nn.Module, pool: PromptCache | None = None, kv: KVForm = FLOAT):
        """`pool`: where caches of earlier prompts are kept (the engine's, which its batch
        shares); None: the one cache this target holds is all it reuses. `kv`: the form
        its KV is held in (`kv_form`)."""
        self.model, self.pool, self.kv = model, pool, kv
        self.cache = make_prompt_cache(model)
        self.cached_tokens: list[int] = []
        # The pool's entries this target can take: its layers', in its KV form.
        self.form = form_of(self.cache, kv.key if kv.quantized else None)
        # The float layers of a verify that crossed the KV form's start, until `keep`.
        self._float_before: list[Any] | None = None
        self.snapshot_layers = [
            i for i, c in enumerate(self.cache) if not isinstance(c, ALWAYS_TRIMMABLE)
        ]
        self._decoder: Decoder | None = None
        self._snapshot: list[Any] | None = None
        self.launched = LaunchedPass()  # the next verify's pass, started early (`launch`)
        self._tree_reason: str | None | bool = False  # False: not checked yet

    @property
    def tree_unsupported(self) -> str | None:
        """Why this target cannot verify draft trees (None: it can)."""
        if self._tree_reason is False and self.kv.quantized:
            self._tree_reason = "draft trees read a float KV cache; this target's is quantized"
        if self._tree_reason is False:
            self._tree_reason = tree_attention.unsupported_reason(self.model, self.cache)
        return self._tree_reason

    def refuse_trees(self, reason: str) -> None:
        """Verify lines only (e.g. a sharded target, whose ranks must agree on every shape)."""
        self._tree_reason = reason

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
        self._float_before = None
        self.launched.forget()

    @property
    def can_launch(self) -> bool:
        """Whether a launched pass can be taken back (`drop_launched`): a trim, so every
        layer's cache must be trimmable."""
        return not self.snapshot_layers

    def launch(self, token: mx.array, chosen: list[mx.array] | None = None) -> None:
        """Start the next one-token verify over `token` (shape (1,), lazy: e.g. the argmax
        of the pass still computing), so that MLX computes it while the host handles the
        current round (as mlx-lm's `generate_step` does with `mx.async_eval`). The next
        `verify` of exactly that token takes it (`take_launched`); anything else first
        drops it, so a launch changes no result, only when the work is done. `chosen`:
        arrays evaluated apart from the pass whose last column is `token` (`host_last`),
        read in its place: reading `token`, scheduled with the pass, waits for all of it."""
        self.kv.convert(self.cache)  # a one-token pass never crosses the start
        self.launched.start(self.model, self.cache, token, [token] if chosen is None else chosen)

    def take_launched(self, tokens: list[int]) -> mx.array | None:
        """The launched pass's logits (1, V) if it ran over exactly `tokens`; None (and
        the pass dropped) otherwise, or if none was launched."""
        logits = self.launched.take(self.cache, tokens)
        if logits is None:
            return None
        self.cached_tokens.extend(tokens)
        return logits[0]

    def drop_launched(self) -> None:
        """Take a launched pass back: its token's KV leaves the cache (the request ended,
        or the next round is not that one-token pass)."""
        self.launched.drop(self.cache)

    def forward(
        self,
        tokens: list[int],
        capture: tuple[int, ...] | None = None,
        cache: list[Any] | None = None,
    ) -> tuple[mx.array, Any]:
        """Run the target over `tokens` (appending to the cache): logits (m, V) and, unless
        `capture` is None, hidden states (m, F) (`Decoder.hidden` with that capture).
        A quantized KV form runs it in two passes where it crosses its start (`kv_form`)."""
        if cache is not None or not self.kv.quantized:
            return self._forward(tokens, capture, self.cache if cache is None else cache)
        outputs = []
        for begin, end in self.kv.pieces(len(self.cached_tokens), len(tokens)):
            if begin:  # kept, so that `keep` can go back below the start
                self._float_before = list(self.cache)
            self.kv.convert(self.cache)
            outputs.append(self._forward(tokens[begin:end], capture, self.cache))
        if len(outputs) == 1:
            return outputs[0]
        (logits_a, hidden_a), (logits_b, hidden_b) = outputs
        hidden = None if hidden_a is None else mx.concatenate([hidden_a, hidden_b])
        return mx.concatenate([logits_a, logits_b]), hidden

    def _forward(
        self, tokens: list[int], capture: tuple[int, ...] | None, cache: list[Any]
    ) -> tuple[mx.array, Any]:
        inputs = mx.array([tokens])
        if capture is not None:
            hidden = self.decoder.hidden(inputs, cache, capture=capture)
            logits = self.decoder.logits(hidden)
            self.cached_tokens.extend(tokens)
            return logits[0], hidden[0]
        logits = self.model(inputs, cache=cache)
        self.cached_tokens.extend(tokens)
        return logits[0], None

    def prepare(
        self, sequence: list[int], progress=None, capture: tuple[int, ...] | None = None
    ) -> tuple[int, mx.array | None]:
        """Fill the cache with all of `sequence` but its last (pending) token; see `fill`."""
        return self.fill(sequence[:-1], progress, capture)

    def fill(
        self, tokens: list[int], progress=None, capture: tuple[int, ...] | None = None
    ) -> tuple[int, mx.array | None]:
        """Make the cache hold `tokens`, reusing the longest prefix kept: this target's
        own cache (the previous request's) or one of the pool's (`take_kept`).

        Returns how many tokens were reused and, unless `capture` is None, the hidden
        states (m, F) of the m tokens fed now (drafter heads read them: the last row
        predicted the pending token).
        """
        self.take_kept(tokens)
        rows: list[mx.array] = []
        checkpoints = self.pool is not None and bool(self.snapshot_layers)

        def feed(chunk: list[int]) -> mx.array | None:
            hidden = feed_cache(self, chunk, capture)
            if hidden is None:
                return None
            rows.append(hidden[0])
            return hidden[:, -1:]  # evaluated with the cache; nobody reads logits here

        marked = len(self.cached_tokens) // CHECKPOINT_EVERY  # the last checkpoint's

        def fed(done: int, total: int) -> None:
            # A cache that cannot be cut back serves a later prompt only from where a
            # copy was taken: every CHECKPOINT_EVERY tokens and at the prompt's end.
            nonlocal marked
            held = len(self.cached_tokens)
            if checkpoints and (done == total or held // CHECKPOINT_EVERY > marked):
                marked = held // CHECKPOINT_EVERY
                self.pool.add(self.cached_tokens, copy_cache(self.cache), self.form)
            if progress:
                progress(done, total)

        # Snapshot layers cannot be rewound past the last request: start over instead.
        reused, _ = catch_up(
            self,
            tokens,
            allow_trim=not self.snapshot_layers,
            progress=fed,
            feed=feed,
        )
        hidden = mx.concatenate(rows) if rows else None
        return reused, hidden

    def put_away(self) -> None:
        """The own cache to the pool (the process ends, or the pool's disk is written):
        this target then holds nothing."""
        if self.pool is not None and len(self.cached_tokens) >= MIN_REUSE:
            self.launched.drop(self.cache)
            self.pool.add(self.cached_tokens, self.cache, self.form)
            self.reset()

    def take_kept(self, tokens: list[int]) -> None:
        """Before a prefill of `tokens`: where this target's own cache does not extend to
        them (it would be cut back, or start over) or the pool holds a longer prefix, the
        own cache goes to the pool (moved, not copied: the main conversation survives a
        side request) and the pool's best prefix comes back as a copy."""
        if self.pool is None:
            return
        held = self.cached_tokens
        # A recurrent state cannot be cut back to the common prefix: the pool's own rule.
        own = reusable_length(held, not self.snapshot_layers, tokens, least=0)
        extends = own == len(held)
        if extends and self.pool.reusable(tokens, self.form, least=1) <= own:
            return
        self.launched.drop(self.cache)
        if len(held) >= MIN_REUSE and not (extends and not self.snapshot_layers):
            self.pool.add(held, self.cache, self.form)  # (a prefix of a longer kept KV: no need)
        # Any common prefix: the copy is of that much (a chat's edited turn, as before).
        cache, reused = self.pool.take(tokens, self.form, least=1)
        self.cache = cache if cache is not None else make_prompt_cache(self.model)
        self.cached_tokens = list(tokens[:reused])

    def verify(
        self, tokens: list[int], capture: tuple[int, ...] | None = None
    ) -> tuple[mx.array, Any]:
        """Forward over [pending] + drafts, remembering how to undo it."""
        if self.snapshot_layers and len(tokens) > 1:
            self._snapshot = [_copy_state(self.cache[i].state) for i in self.snapshot_layers]
        return self.forward(tokens, capture)

    def verify_tree(
        self, pending: int, tree: DraftTree, capture: tuple[int, ...] | None = None
    ) -> tuple[mx.array, Any]:
        """One forward over the pending token and every node of `tree`: logits (n+1, V)
        where row i predicts the token after node i's path."""
        reason = self.tree_unsupported
        if reason:
            raise ValueError(f"this model cannot verify draft trees: {reason}")
        cache = tree_attention.tree_caches(self.cache, tree)
        with tree_attention.tree_positions(self.model, tree):
            return self.forward([pending, *tree.tokens], capture, cache)

    def keep_nodes(self, pending: int, tree: DraftTree, path: list[int]) -> None:
        """After `verify_tree`, keep the root's and the accepted path's entries only."""
        verified = len(tree) + 1
        tree_attention.keep_nodes(self.cache, verified, [0, *path])
        del self.cached_tokens[len(self.cached_tokens) - verified :]
        self.cached_tokens.extend([pending, *(tree.tokens[i - 1] for i in path)])

    def keep(self, verified: list[int], n_keep: int) -> None:
        """After verifying `verified`, keep the cache entries of its first `n_keep` tokens."""
        surplus = len(verified) - n_keep
        snapshot, self._snapshot = self._snapshot, None
        float_before, self._float_before = self._float_before, None
        if surplus == 0:
            return
        begin = len(self.cached_tokens) - len(verified)
        restored: set[int] = set()
        if float_before is not None and begin + n_keep < self.kv.start:
            # The verify crossed the KV form's start, and what is kept ends below it:
            # the float layers as they were (holding up to the start) come back.
            held = begin if self.snapshot_layers else begin + n_keep
            for i, layer in enumerate(float_before):
                if layer is not self.cache[i]:
                    layer.trim(layer.offset - held)
                    self.cache[i] = layer
                    restored.add(i)
        if not self.snapshot_layers:
            for i, c in enumerate(self.cache):
                if i not in restored:
                    c.trim(surplus)
            del self.cached_tokens[len(self.cached_tokens) - surplus :]
            return
        # Restore the copied layers, rewind the rest, and replay the kept tokens.
        for i, c in enumerate(self.cache):
            if c.is_trimmable() and i not in restored:
                c.trim(len(verified))
        for i, state in zip(self.snapshot_layers, snapshot):
            self.cache[i].state = state
        del self.cached_tokens[len(self.cached_tokens) - len(verified) :]
        if n_keep:
            self.forward(verified[:n_keep])
            mx.eval([c.state for c in self.cache])
