"""Every KV cache of a batch behind one short list of calls: its rows (`BatchTarget`),
the prompts still prefilling, and the finished rows kept for reuse (`PromptCache`).

The scheduler decides; this object does all the cache work those decisions cause, and
nothing else touches a cache. So each call is a plain instruction with JSON-able
arguments, and a copy of the batch that replays the same calls in the same order holds
the same caches: that is how the other ranks of a sharded target follow rank 0's
batch (`mlxspec.distributed.batch`) without running a scheduler of their own.

Rows whose proposer reads the target's hidden states (drafter heads) get, each round,
exactly what `SingleCaches` hands a request alone: the hidden states of the tokens its
cache took in since the last round, in the request's own capture. One pass captures
the union of the rows' layers; each row keeps its own columns.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxspec.batch.target import BatchTarget, Prefill, feed_together
from mlxspec.models.prompt_cache import CHECKPOINT_EVERY, PromptCache, copy_cache, form_of
from mlxspec.models.target import LaunchedPass
from mlxspec.models.tree import DraftTree

# The calls that run the model: on a sharded target each is a collective pass.
FORWARDS = ("advance", "verify", "verify_tree")


class BatchCaches:
    # Rows of several requests share each pass (see `SingleCaches` for a request alone).
    solo = False

    def __init__(self, model: nn.Module, prefix_capacity: int, pool: PromptCache | None = None):
        """`pool`: where finished rows' caches and prompts' checkpoints are kept (the
        engine's, shared with its requests alone); None: a pool of this batch's own, of
        `prefix_capacity` entries (a sharded batch's ranks each keep the same one)."""
        self.target = BatchTarget(model)
        self.prefixes = pool if pool is not None else PromptCache(prefix_capacity)
        self.form = form_of(self.target.prompt_cache())  # the entries its rows can take
        self.prefills: dict[int, Prefill] = {}  # joining requests' own caches, by request id
        self.row_ids: list[int] = []  # the request of each row, in the target's order
        # Per row, in the target's order: the layers its proposer reads (None: nothing)
        # and the hidden states (m, F) of the tokens its cache took in since the last round.
        self.captures: list[tuple[int, ...] | None] = []
        self.hidden: list[mx.array | None] = []
        self._verified_hidden: tuple[mx.array, tuple[int, ...]] | None = None  # and its union
        self.launched = LaunchedPass()  # the next round's pass, started early (`launch`)

    @property
    def tree_unsupported(self) -> str | None:
        """Why rows cannot verify draft trees here (None: they can)."""
        return self.target.tree_unsupported

    @property
    def capture_unsupported(self) -> str | None:
        """Why rows cannot be handed hidden states here (None: they can)."""
        return self.target.capture_unsupported

    def row_hidden(self, row: int) -> mx.array | None:
        """Row `row`'s hidden states of the tokens its cache took in since the last round."""
        return self.hidden[row]

    def runs_model(self, call: list) -> bool:
        """Whether `call` ([name, *args]) runs a forward pass, which on a sharded target
        every rank must enter together: a prefill chunk, a verify, and a `keep` of a
        model with recurrent layers (rows that refused a draft are replayed)."""
        return call[0] in FORWARDS or (call[0] == "keep" and bool(self.target.recurrent))

    @property
    def empty(self) -> bool:
        """No row and no prefill: nothing to compute until a request comes."""
        return not self.target.rows and not self.prefills

    def lengths(self) -> list[int]:
        """Tokens each row's cache holds (a launched pass taken back first: a leave or a
        layout reads them)."""
        self.launched.drop(self.target.cache)
        return self.target.lengths()

    def layout(self) -> dict[str, list]:
        """What these caches hold, in JSON-able lists, for a copy that replays the same
        calls to compare with (a sharded batch's followers): each row's request and
        length, each prefill's request, reused and unfed prompt tokens, each kept
        prefix's length."""
        return {
            "rows": [[i, n] for i, n in zip(self.row_ids, self.lengths())],
            "prefills": [[i, p.reused, len(p.todo)] for i, p in self.prefills.items()],
            "kept": [len(kept.tokens) for kept in self.prefixes.kept],
        }

    def kv_layout(self) -> list[tuple[float, int | None]]:
        return self.target.kv_layout()

    def start(
        self, request_id: int, tokens: list[int], capture: tuple[int, ...] | None = None
    ) -> int:
        """Begin a joining request's prefill from the longest kept prefix of `tokens`;
        returns how many of them that prefix already holds. With `capture` (its
        proposer's `hidden_capture`) the prefill captures the hidden states of every
        prompt token, so no kept prefix is reused: the pool keeps no hidden states."""
        if capture is not None:
            capture = tuple(capture)  # a replayed plan hands a JSON list
            if reason := self.capture_unsupported:
                raise ValueError(reason)
            prefill = Prefill(self.target.model, tokens, None, capture, self.target.decoder)
        else:
            start = self.prefixes.take(tokens, self.form)
            prefill = Prefill(self.target.model, tokens, start)
        self.prefills[request_id] = prefill
        return prefill.reused

    def advance(
        self, request_ids: list[int], chunk: int, together: list[int] | tuple = ()
    ) -> list[int]:
        """Feed the next `chunk` prompt tokens of each joining request, those of
        `together` (fresh ones, `width.prefill_group`) in one pass (`feed_together`);
        returns the requests whose prompts are now all in."""
        together = together if len(together) > 1 else ()
        if together:
            feed_together(self.target.model, [self.prefills[i] for i in together], chunk)
        for request_id in request_ids:
            if request_id not in together:
                self.prefills[request_id].advance(chunk)
        if self.target.recurrent or self.target.windows:
            for request_id in request_ids:
                self._checkpoint(self.prefills[request_id], chunk)
        return [i for i in request_ids if self.prefills[i].done]

    def _checkpoint(self, prefill: Prefill, chunk: int) -> None:
        """Where a row cannot hand its whole sequence on when it leaves, its prompt is kept
        as it joins: a recurrent state serves a later prompt only from where it was kept
        (the prompt's end, and every CHECKPOINT_EVERY tokens of a long one: a copy, it is
        fed on), and a window layer's history is cut once its row runs past the window
        (`BatchTarget._cut_windows`), while its prefill still holds all of it. At the
        prompt's end the cache itself is kept: the merge at `join` copies it."""
        held = prefill.held
        if prefill.done:
            self.prefixes.add(held, prefill.cache)
        elif self.target.recurrent and (
            len(held) // CHECKPOINT_EVERY > (len(held) - chunk) // CHECKPOINT_EVERY
        ):
            self.prefixes.add(held, copy_cache(prefill.cache))

    def unfed(self, request_id: int) -> int:
        """Prompt tokens a joining request has yet to feed."""
        return len(self.prefills[request_id].todo)

    def join(self, request_ids: list[int]) -> None:
        """Fully prefilled requests become the last rows, in one merge. The merge is
        evaluated here: left lazy it ran inside the next verify, whose time then read as a
        slow plain pass (0.40 s against 0.18 s over 8 rows), and every wider pass as cheaper."""
        self.launched.drop(self.target.cache)
        prefills = [self.prefills.pop(i) for i in request_ids]
        self.target.join(prefills)
        self.row_ids += request_ids
        self.captures += [p.capture for p in prefills]
        self.hidden += [p.hidden for p in prefills]
        self.target.settle()

    def drop(self, request_id: int) -> None:
        """A request cancelled while it prefilled: its cache goes."""
        self.prefills.pop(request_id, None)

    def leave(self, keep_rows: list[int], kept: list[tuple[int, list[int]]]) -> None:
        """Keep only `keep_rows`; first, each (row, tokens) of `kept` (leaving rows whose
        cache holds exactly `tokens`) goes to the prompt cache, unless its window layers
        no longer hold its oldest tokens."""
        self.launched.drop(self.target.cache)
        for row, tokens in kept:
            if self.target.whole[row]:
                self.prefixes.add(tokens, self.target.extract(row))
        self.target.leave(keep_rows)
        self.row_ids = [self.row_ids[i] for i in keep_rows]
        self.captures = [self.captures[i] for i in keep_rows]
        self.hidden = [self.hidden[i] for i in keep_rows]
        self.target.settle()  # the filter too, out of the next verify's time (as `join`)

    def evict(self, nbytes: int) -> None:
        """Let the least recently kept prefixes go until they hold at most `nbytes`."""
        self.prefixes.evict_to(nbytes)

    @property
    def can_launch(self) -> bool:
        """Whether the next round's pass may start early (`launch`): every layer can
        take it back by a trim (no recurrent state), and no row reads hidden states."""
        return not self.target.recurrent and all(c is None for c in self.captures)

    def launch(self, tokens: mx.array, chosen: list[mx.array]) -> None:
        """Start the next round's one-token pass over `tokens` (B,), still lazy
        (`LaunchedPass.start`)."""
        self.launched.start(self.target.model, self.target.cache, tokens, chosen)

    def take_launched(self, rows: list[list[int]]) -> mx.array | None:
        """`verify`'s logits (B, 1, V) from the launched pass if it ran over exactly
        `rows`; None (the launched pass taken back) otherwise."""
        if any(len(row) != 1 for row in rows):
            self.launched.drop(self.target.cache)
            return None
        return self.launched.take(self.target.cache, [row[0] for row in rows])

    def verify(self, rows: list[list[int]]) -> mx.array:
        """One pass over every row's [pending] + drafts: logits (B, width, V); the
        hidden states of the union of the rows' captures too, where any row has one."""
        self.launched.drop(self.target.cache)
        union = self._capture_union()
        if union is None:
            return self.target.verify(rows)
        logits, hidden = self.target.verify_capturing(rows, union)
        self._verified_hidden = hidden, union
        return logits

    def verify_tree(self, rows: list[list[int]], trees: list[DraftTree | list]) -> mx.array:
        """`verify` where a row's drafts form a tree (`BatchTarget.verify_tree`):
        logits (B, width, V), row i's column j predicting what follows node j's path.
        A tree may come as [tokens, parents] (a replayed plan hands JSON lists)."""
        self.launched.drop(self.target.cache)
        trees = [t if isinstance(t, DraftTree) else DraftTree(*t) for t in trees]
        union = self._capture_union()
        logits, hidden = self.target.verify_tree(rows, trees, union)
        if union is not None:
            self._verified_hidden = hidden, union
        return logits

    def _capture_union(self) -> tuple[int, ...] | None:
        """Every layer some row's proposer reads (None: no row reads any)."""
        self._verified_hidden = None
        wanted = [set(c) for c in self.captures if c is not None]
        return tuple(sorted(set().union(*wanted))) if wanted else None

    def keep(self, n_keep: list[int], width: int) -> None:
        """After a verify of `width` columns, row i keeps its first n_keep[i] entries
        (and, capturing, the hidden states of those tokens: rows are right-padded, so
        they are its first n_keep[i]). The trims and rolls are evaluated here, so that
        the round that caused them is the one whose time they count in; not after a
        launch (a plain round, nothing trimmed), which that would wait for."""
        self.target.keep(n_keep, width)
        self._keep_hidden([slice(0, n) for n in n_keep])
        if not self.launched.pending:
            self.target.settle()

    def keep_tree(self, paths: list[list[int]], width: int) -> None:
        """After `verify_tree` of `width` columns, row i keeps its pending token's and
        its accepted path's entries (path: node numbers, root excluded), and, capturing,
        those nodes' hidden states."""
        kept = [[0, *path] for path in paths]
        self.target.keep_tree(kept, width)
        self._keep_hidden([mx.array(nodes) for nodes in kept])
        self.target.settle()

    def _keep_hidden(self, kept: list[slice | mx.array]) -> None:
        """Each capturing row's hidden states of the verify's columns kept[i] (a line's
        first n, a slice; a tree's root and path, gathered)."""
        if self._verified_hidden is None:
            return
        hidden, union = self._verified_hidden
        self._verified_hidden = None
        self.hidden = [
            None if capture is None else own_columns(hidden[i, columns], union, capture)
            for i, (columns, capture) in enumerate(zip(kept, self.captures))
        ]
        mx.eval([h for h in self.hidden if h is not None])


def own_columns(hidden: mx.array, union: tuple[int, ...], capture: tuple[int, ...]) -> mx.array:
    """A row's columns of hidden states captured with `union`: the blocks of its own
    `capture` layers and the final normed state, in layer order, as `Decoder.hidden`
    with `capture` alone lays them out."""
    if set(capture) == set(union):
        return hidden
    width = hidden.shape[-1] // (len(union) + 1)
    blocks = [union.index(layer) for layer in sorted(set(capture))] + [len(union)]
    return mx.concatenate([hidden[..., b * width : (b + 1) * width] for b in blocks], axis=-1)
