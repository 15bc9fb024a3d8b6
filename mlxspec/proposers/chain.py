"""A fallback chain: each round, the first member with something to propose drafts."""

from __future__ import annotations

from collections.abc import Sequence

from mlxspec.proposers.base import (
    Draft,
    ProposalContext,
    Proposer,
    Situation,
    hidden_capture,
)


class Chain:
    cost_hint = 0.0

    def __init__(self, members: Sequence[Proposer], name: str = "auto"):
        if not members:
            raise ValueError("a proposer chain needs at least one member")
        self.name, self.members = name, list(members)
        self.k_max = max(m.k_max for m in self.members)
        self.needs_hidden = any(m.needs_hidden for m in self.members)
        captures = {hidden_capture(m) for m in self.members} - {None}
        if len(captures) > 1:  # one verify pass hands every member the same rows
            raise ValueError(
                f"proposers {', '.join(m.name for m in self.members)} read different target "
                "layers; a chain can hold only one kind of head"
            )
        self.target_layers = next(iter(captures), ())
        self._current: Proposer | None = None

    def reset(self) -> None:
        for member in self.members:
            getattr(member, "reset", lambda: None)()

    def situation(self, ctx: ProposalContext) -> Situation | None:
        """The first member's case, where one has one (every member is asked: those that
        read the target's hidden states must see every round's states to stay in sync)."""
        found = self.situations(ctx)
        self._current = found[0].source if found else None
        return found[0] if found else None

    def situations(self, ctx: ProposalContext) -> list[Situation]:
        """Every member's situation this round (the engine's policy picks among them by
        expected speed, so a weak lookup match does not shut out a good head)."""
        found = [member.situation(ctx) for member in self.members]
        return [s for s in found if s is not None]

    def observe(self, ctx: ProposalContext) -> None:
        for member in self.members:
            if member.needs_hidden:
                member.observe(ctx)

    def annotate(self, record) -> None:
        """Members that report on their drafts (suffix's origins) do so for the chain."""
        for member in self.members:
            if hasattr(member, "annotate"):
                member.annotate(record)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        return self._current.propose(ctx, k) if self._current else Draft([])
