"""What the round loop holds of each request (`Slot`) and of its draft this round
(`Round`): plain records the scheduler fills in, kept apart from the loop itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlxspec.decoding.request import RequestRun
from mlxspec.events import Event
from mlxspec.models.tree import DraftTree
from mlxspec.proposers.base import Draft, Proposer, Situation


@dataclass
class Slot:
    """One request in the scheduler: queued, prefilling, or a row of the batch."""

    request_id: int
    run: RequestRun
    proposer: Proposer | None
    admitted_at: float = 0.0  # when its prefill began (time to first token counts from submit)
    cancelled: bool = False
    trees: bool = False  # draft a tree each round (asked for, and the caches can verify it)
    tree_nodes: int = 32  # most nodes a drafted tree may have
    error: Exception | None = None  # what ended it, if its own drafting or accepting failed
    events: list[Event] = field(default_factory=list)


@dataclass
class Round:
    """What one active request drafted this round."""

    situation: Situation | None
    draft: Draft | None
    tree: DraftTree
    draft_seconds: float
    unverified_first: int | None = None  # the first draft token, when the width cut all
    forced: int = 0  # the line's first tokens, forced by the request's grammar
    masks: np.ndarray | None = None  # per verify row, the tokens the grammar allows
    refused: int | None = None  # the draft token the grammar cut the line before


def grammar_ready(slot: Slot) -> bool:
    """Whether a queued request's grammar (if it has one) is compiled, or has failed."""
    return slot.run.constraint is None or slot.run.constraint.ready
