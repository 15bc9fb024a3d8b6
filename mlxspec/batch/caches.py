"""Every KV cache of a batch behind one short list of calls: its rows (`BatchTarget`),
the prompts still prefilling, and the finished rows kept for reuse (`PrefixPool`).

The scheduler decides; this object does all the cache work those decisions cause, and
nothing else touches a cache. So each call is a plain instruction with JSON-able
arguments, and a copy of the batch that replays the same calls in the same order holds
the same caches: that is how the other ranks of a sharded target follow rank 0's
batch (`mlxspec.distributed.batch`) without running a scheduler of their own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxspec.batch.prefix import PrefixPool
from mlxspec.batch.target import BatchTarget, Prefill

# The calls that run the model: on a sharded target each is a collective pass.
FORWARDS = ("advance", "verify")


class BatchCaches:
    # Rows of several requests share each pass (see `SingleCaches` for a request alone).
    solo = False
    tree_unsupported = "draft trees are not supported in batched mode yet"

    def __init__(self, model: nn.Module, prefix_capacity: int):
        self.target = BatchTarget(model)
        # A recurrent state holds its whole sequence: no prefix of it can be reused.
        self.prefixes = PrefixPool(prefix_capacity if self.target.reuses_prefixes else 0)
        self.prefills: dict[int, Prefill] = {}  # joining requests' own caches, by request id

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
        return self.target.lengths()

    def start(self, request_id: int, tokens: list[int]) -> int:
        """Begin a joining request's prefill from the longest kept prefix of `tokens`;
        returns how many of them that prefix already holds."""
        prefill = Prefill(self.target.model, tokens, self.prefixes.take(tokens))
        self.prefills[request_id] = prefill
        return prefill.reused

    def advance(self, request_id: int, chunk: int) -> bool:
        """Feed the next `chunk` prompt tokens of a joining request; True once all are in."""
        prefill = self.prefills[request_id]
        prefill.advance(chunk)
        return prefill.done

    def join(self, request_id: int) -> None:
        """A fully prefilled request becomes the last row. The merge is evaluated here:
        left lazy it ran inside the next verify, whose time then read as a slow plain
        pass (0.40 s against 0.18 s over 8 rows), and every wider pass as cheaper."""
        self.target.join(self.prefills.pop(request_id))
        self.target.settle()

    def drop(self, request_id: int) -> None:
        """A request cancelled while it prefilled: its cache goes."""
        self.prefills.pop(request_id, None)

    def leave(self, keep_rows: list[int], kept: list[tuple[int, list[int]]]) -> None:
        """Keep only `keep_rows`; first, each (row, tokens) of `kept` (leaving rows whose
        cache holds exactly `tokens`) goes to the prefix pool."""
        for row, tokens in kept:
            self.prefixes.add(tokens, self.target.extract(row))
        self.target.leave(keep_rows)
        self.target.settle()  # the filter too, out of the next verify's time (as `join`)

    def verify(self, rows: list[list[int]]) -> mx.array:
        """One pass over every row's [pending] + drafts: logits (B, width, V)."""
        return self.target.verify(rows)

    def keep(self, n_keep: list[int], width: int) -> None:
        """After a verify of `width` columns, row i keeps its first n_keep[i] entries.
        The trims and rolls are evaluated here, so that the round that caused them is
        the one whose time they count in."""
        self.target.keep(n_keep, width)
        self.target.settle()
