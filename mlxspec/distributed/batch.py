"""The batch on a sharded target: rank 0 schedules, every rank runs the same passes.

A sharded forward is a collective (all-reduces inside the layers), so every rank must
call the model with inputs of the same shape, in the same order: each prefill chunk,
each round's verify, and between them the same joins, leaves, trims and rolls.

The other ranks run no scheduler, proposer or policy (whose choices hang on rank 0's
timings and clients). Rank 0's `PlannedCaches` records every call the scheduler makes
on its `BatchCaches` and, before each forward pass, broadcasts the calls since the last
one as a plan; the other ranks replay them on their own `BatchCaches` (`BatchFollower`)
and so hold caches of the same shape, in which the same forward runs. A plan also
carries what rank 0's caches hold (`BatchCaches.layout`: each row's request and length,
each prefill's progress, the kept prefixes), which each rank checks before the pass: a
rank that drifts anyway stops with a line naming what differs instead of computing on.

When the batch empties (last request done or cancelled), the plan goes out at once
and says so, so the other ranks let their rows go too and wait for the next request
without a deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.target import BatchTarget, has_recurrent_layers, unsupported_reason
from mlxspec.distributed.collectives import Collectives
from mlxspec.distributed.errors import DistributedError
from mlxspec.models.tree import DraftTree

PLAN = "plan"  # the key that tells a plan from a request announcement
# The parts of `BatchCaches.layout` a follower checks, and how its error line names them.
LAYOUT = {
    "rows": "rows [request, length]",
    "prefills": "prefills [request, reused, unfed]",
    "kept": "kept prefix lengths",
}


def batches(model: nn.Module, max_batch: int) -> bool:
    """Whether rank 0's server runs a batch (every rank must know: the batch's cost
    calibration and its passes are collectives). Not for a model with recurrent layers,
    yet: whether they honour per-row lengths is found by a forward pass
    (`unsupported_reason`), which on a sharded target is a collective outside the
    plans; such a model serves one request at a time, sharded."""
    if max_batch <= 1 or has_recurrent_layers(model):
        return False
    return unsupported_reason(model) is None


class PlannedCaches(BatchCaches):
    """Rank 0's batch caches: each call is also recorded for the other ranks."""

    # Splitting the model for a capturing pass probes it with a forward of its own,
    # which on a sharded target is a collective outside the plans.
    capture_unsupported = "a sharded batch does not hand hidden states to heads yet"
    # A launched pass is a collective over tokens still lazy on rank 0, which its plan
    # could name only once they are read: the other ranks could not enter it early.
    can_launch = False

    def __init__(self, model: nn.Module, prefix_capacity: int, collectives: Collectives):
        super().__init__(model, prefix_capacity)
        self.collectives = collectives
        self.pending: list[list] = []  # calls not yet sent

    def start(
        self, request_id: int, tokens: list[int], capture: tuple[int, ...] | None = None
    ) -> int:
        return self._call("start", request_id, tokens, capture)

    def advance(self, request_ids: list[int], chunk: int, together=()) -> list[int]:
        return self._call("advance", request_ids, chunk, list(together))

    def join(self, request_ids: list[int]) -> None:
        self._call("join", request_ids)

    def drop(self, request_id: int) -> None:
        self._call("drop", request_id)

    def leave(self, keep_rows: list[int], kept: list[tuple[int, list[int]]]) -> None:
        self._call("leave", keep_rows, kept)

    def evict(self, tokens: int) -> None:
        self._call("evict", tokens)  # every rank's pool must offer the same prefixes

    def verify(self, rows: list[list[int]]) -> mx.array:
        return self._call("verify", rows)

    def keep(self, n_keep: list[int], width: int) -> None:
        self._call("keep", n_keep, width)

    def verify_tree(self, rows: list[list[int]], trees: list[DraftTree]) -> mx.array:
        return self._call("verify_tree", rows, [[t.tokens, t.parents] for t in trees])

    def keep_tree(self, paths: list[list[int]], width: int) -> None:
        self._call("keep_tree", paths, width)

    def _call(self, name: str, *args):
        self.pending.append([name, *args])
        if self.runs_model(self.pending[-1]):  # the other ranks must be in this pass with us
            self._send(idle=False)
        result = getattr(BatchCaches, name)(self, *args)
        if self.empty and self.pending:
            self._send(idle=True)
        return result

    def _send(self, idle: bool) -> None:
        plan = {PLAN: self.pending, "layout": self.layout(), "idle": idle}
        self.pending = []
        self.collectives.announce(plan, "sending the batch's plan")
        if idle:  # no deadline until the next request
            self.collectives.watchdog.disarm()


class BatchFollower:
    """Another rank's copy of the batch caches, moved only by rank 0's plans."""

    def __init__(self, model: nn.Module, prefix_capacity: int, rank: int):
        self.caches = BatchCaches(model, prefix_capacity)
        self.rank = rank
        self.rounds = 0  # verify passes run (the fault hook counts them)

    def replay(self, plan: dict, on_round: Callable[[BatchTarget, int], None]) -> bool:
        """Run one plan's calls; returns whether rank 0 went idle after it.
        `on_round(rows, round)` runs before each verify (the test fault hook)."""
        calls = plan[PLAN]
        forward = calls.pop() if calls and self.caches.runs_model(calls[-1]) else None
        for name, *args in calls:
            getattr(self.caches, name)(*args)
        mine, theirs = self.caches.layout(), plan["layout"]
        for part, what in LAYOUT.items():
            if mine[part] != theirs[part]:
                raise DistributedError(
                    f"rank {self.rank} diverged from rank 0 in the batch: {what} {mine[part]} "
                    f"vs {theirs[part]}; stopping (no output past this point is trusted)"
                )
        if forward is not None:
            name, *args = forward
            verifies = name in ("verify", "verify_tree")
            if verifies:
                self.rounds += 1
                on_round(self.caches.target, self.rounds)
            result = getattr(self.caches, name)(*args)
            if verifies:
                mx.eval(result)  # the pass's own all-reduces run when it is evaluated
        return plan["idle"]
