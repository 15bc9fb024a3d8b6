"""The tokens a request's grammar forces, drafted for free in front of its proposer.

Where only one continuation is legal (`{"name": "get_weather", "arguments": {"` and the
like), the grammar engine knows the next tokens before the target does: they go into
the round's line as drafts that cost nothing to make, and the proposer drafts on from
where they end. They are verified like any draft: the target may spell the forced text
in other tokens, and its choice stands (the reference is constrained plain decoding,
not the grammar's spelling).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from mlxspec.decoding.request import RequestRun
from mlxspec.proposers.base import (
    Draft,
    ProposalContext,
    Proposer,
    Situation,
    candidates,
    hidden_capture,
)


def forced_tokens(run: RequestRun, proposer: Proposer | None) -> list[int]:
    """The tokens the request's grammar forces next, where the request speculates at
    all (plain decoding, constrained, is the reference and drafts nothing)."""
    if run.constraint is None or proposer is None or run.policy.fixed_k == 0:
        return []
    return run.constraint.forced(run.left)


def draft_after(
    run: RequestRun,
    proposer: Proposer,
    ctx: ProposalContext,
    chosen: Situation | None,
    forced: list[int],
    k: int,
) -> tuple[Situation | None, Draft]:
    """A line of the forced tokens, then up to k of the proposer's drafts after them
    (k: the policy's choice for `chosen`, whose source drafts again from where the forced
    tokens end), and the situation they were drafted in (None: the forced tokens alone).
    Only a proposer that drafts from tokens alone goes on: one that reads the target's
    hidden states has none for tokens the target has not taken in yet."""
    tokens, probs, situation = list(forced), None, None
    room = min(k, run.left - len(forced))
    if chosen is not None and room > 0 and hidden_capture(proposer) is None:
        after = dataclasses.replace(ctx, tokens=[*ctx.tokens, *forced])
        found = candidates(proposer, after)
        same = [s for s in found if s.source is chosen.source]
        situation = (same or found or [None])[0]
        draft = situation.source.propose(after, room) if situation else None
        if draft is not None and draft.tokens:
            tokens += draft.tokens[:room]
            if draft.probs is not None:  # the forced tokens' q: one-hot
                ids = mx.arange(draft.probs.shape[-1])[None]
                one_hot = (ids == mx.array(forced)[:, None]).astype(draft.probs.dtype)
                probs = mx.concatenate([one_hot, draft.probs[:room]])
        else:
            situation = None
    return situation, Draft(tokens, probs)
