"""One request's own cache behind the batch's calls: the engine's `Target` as a batch of one.

`Engine.stream` runs the scheduler's round (the only one) over this backend with one
row, so the chat, `generate`, the bench and a sharded rank's requests decode as the
batch does. What the single `Target` can do that the batch caches cannot yet, it does
here: verify draft trees (`verify_tree`/`keep_tree`), capture the hidden states
drafter heads read (`hidden`), let self-speculation run the target's own layers and
cache (`target`), and roll back any cache the `Target` can (snapshot families, rotating
windows). Prompt reuse is the `Target`'s own: it keeps its cache when a request ends,
and the next request's `start` keeps the common prefix (a chat's next turn) or takes a
longer one from the engine's pool (`Target.take_kept`), so the scheduler has nothing to
keep at a leave.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxspec.events import ProgressNote
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree

# New prompt tokens from which a prefill reports its progress (about a second on a Mac).
LONG_PREFILL = 2048


class SingleCaches:
    # The pass is one request's alone: the scheduler keeps the engine's own proposer and
    # policy for it, cuts no width and prices each round for the run record.
    solo = True

    capture_unsupported = None  # the single target captures for any model it serves

    def __init__(self, target: Target, notify: Callable[[str], None] = lambda _: None):
        """`notify`: where a long prefill says how far it is (the engine's: the chat's
        status line, `generate`'s stderr)."""
        self.target, self.notify = target, notify
        # The hidden states the request's proposer reads (`hidden_capture`), from `start`.
        self.capture: tuple[int, ...] | None = None
        # Nothing for the scheduler to keep at a leave: the Target's cache stays as it is,
        # and goes to the engine's pool when a later prompt does not extend it.
        self.prefixes = PromptCache(0)
        # Hidden states (m, F) of the tokens the cache took in since the last round.
        self.hidden: mx.array | None = None
        self._rows = 0  # 1 once the request joined, 0 when it left
        self._verified: list[int] = []  # the last verify's row: [pending, *drafts]
        self._tree: DraftTree | None = None  # the last verify's tree, for `keep_tree`
        self._verified_hidden: mx.array | None = None

    @property
    def tree_unsupported(self) -> str | None:
        """Why this target cannot verify draft trees (None: it can)."""
        return self.target.tree_unsupported

    @property
    def empty(self) -> bool:
        return not self._rows

    def lengths(self) -> list[int]:
        return [len(self.target.cached_tokens)] * self._rows

    def row_hidden(self, row: int) -> mx.array | None:
        return self.hidden

    def start(
        self, request_id: int, tokens: list[int], capture: tuple[int, ...] | None = None
    ) -> int:
        """Fill the cache with `tokens` at once (no other row waits on this prefill);
        returns how many the previous request had left in it."""
        self.capture = capture

        def progress(done: int, total: int) -> None:
            if total >= LONG_PREFILL:
                note = f"reading the prompt: {done}/{total} new tokens"
                self.notify(ProgressNote(note, done, total))

        reused, self.hidden = self.target.fill(tokens, progress, capture=capture)
        return reused

    def advance(self, request_ids: list[int], chunk: int, together=()) -> list[int]:
        return request_ids  # `start` fed it all

    def join(self, request_ids: list[int]) -> None:
        self._rows = 1

    def drop(self, request_id: int) -> None:
        """Nothing to free: the cache holds a prefix of the prompt, reusable as such."""

    def leave(self, keep_rows: list[int], kept: list[tuple[int, list[int]]]) -> None:
        """The request left: a pass launched for a round it will not run is taken back,
        so the cache holds its tokens but the pending one, for the next request."""
        self.target.drop_launched()
        # Evaluated now: a replay after the last keep is still lazy, and the next request
        # may take this cache (or the pool its copy) on another thread, where mlx cannot
        # evaluate what this one's stream scheduled.
        mx.eval([c.state for c in self.target.cache])
        self._rows = len(keep_rows)

    @property
    def can_launch(self) -> bool:
        """Whether the next round's one-token pass may start early (`launch`): a cache
        that can take it back, and no hidden states to hand over (the round's own)."""
        return self.target.can_launch and self.capture is None

    def launch(self, token: mx.array, chosen: list[mx.array]) -> None:
        """Start the next round's pass over `token` (1,), still lazy (`Target.launch`)."""
        self.target.launch(token, chosen)

    def take_launched(self, rows: list[list[int]]) -> mx.array | None:
        """`verify`'s logits (1, 1, V) from the launched pass if it ran over exactly
        `rows`; None (the launched pass dropped) otherwise."""
        logits = self.target.take_launched(rows[0])
        if logits is None:
            return None
        (self._verified,) = rows
        return logits[None]

    def verify(self, rows: list[list[int]]) -> mx.array:
        """One pass over the row's [pending] + drafts: logits (1, width, V)."""
        (self._verified,) = rows
        logits, self._verified_hidden = self.target.verify(self._verified, self.capture)
        return logits[None]

    def keep(self, n_keep: list[int], width: int) -> None:
        """After `verify`, keep the entries of the row's first n_keep[0] tokens."""
        (kept,) = n_keep
        self.target.keep(self._verified, kept)
        if self.capture is not None:
            self.hidden = self._verified_hidden[:kept]

    def verify_tree(self, rows: list[list[int]], trees: list[DraftTree]) -> mx.array:
        """One pass over the row's pending token and every node of its tree: logits
        (1, nodes + 1, V), row i predicting the token after node i's path."""
        (self._verified,), (self._tree,) = rows, trees
        pending = self._verified[0]
        logits, self._verified_hidden = self.target.verify_tree(pending, self._tree, self.capture)
        return logits[None]

    def keep_tree(self, paths: list[list[int]], width: int) -> None:
        """After `verify_tree`, keep the pending token's and the accepted path's entries."""
        (path,) = paths
        self.target.keep_nodes(self._verified[0], self._tree, path)
        if self.capture is not None:
            self.hidden = self._verified_hidden[mx.array([0, *path])]
