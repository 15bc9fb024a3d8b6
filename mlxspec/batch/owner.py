"""What the scheduler's round asks of the engine that owns the target.

The engine builds a one-row `Scheduler` for `Engine.stream` and hands itself over; the
scheduler calls back for the request helpers (check, new run, policies, draft trees,
finish). Typing that hand-over by this protocol, not by importing `Engine`, keeps the
imports one way: engine → batch.scheduler → batch.owner, and the engine stays the owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mlxspec.decoding.policy import Policy
from mlxspec.decoding.request import RequestRun
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Done
from mlxspec.markup.conversation import Conversation
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree
from mlxspec.proposers.base import ProposalContext, Proposer
from mlxspec.settings import GenerationSettings


class RoundOwner(Protocol):
    """The engine, as a round sees it (mlxspec.decoding.engine.Engine implements it)."""

    name: str
    target: Target
    proposers: dict[str, Proposer]
    vocab_size: int
    # False where costs were handed in (tests, a sharded rank): then nothing is measured.
    measures_costs: bool
    notify: Callable

    @property
    def verify_cost(self) -> VerifyCost: ...

    def check_request(
        self,
        prompt: str | list[int] | list[dict] | Conversation,
        settings: GenerationSettings,
        proposer: str | None,
    ) -> tuple[list[int], int]: ...

    def kept_policy(self, proposer: Proposer | None, fixed_k: int | None) -> Policy: ...

    def new_policy(self, proposer: Proposer | None, fixed_k: int | None) -> Policy: ...

    def new_run(
        self,
        prompt_tokens: list[int],
        settings: GenerationSettings,
        proposer: Proposer | None,
        max_tokens: int,
        policy: Policy,
    ) -> RequestRun: ...

    def draft_tree(
        self, source: Proposer, ctx: ProposalContext, depth: int, budget: int, policy: Policy
    ) -> DraftTree: ...

    def round_cost(self, policy: Policy, m: int) -> float: ...

    def finish(self, run: RequestRun) -> Done: ...
