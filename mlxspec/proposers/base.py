"""The one interface every proposer implements.

A round goes: `situation(ctx)` (cheap: is there anything to propose, and what kind of
case is this — the policy keeps acceptance statistics per case), the policy picks k,
then `propose(ctx, k)`. Proposers keep their own state in sync with `ctx.tokens`
themselves (comparing with what they saw last), so the engine never has to tell them
about rollbacks, and a multi-turn chat simply works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np

from mlxspec.sampling import TokenScorer, sample_from

if TYPE_CHECKING:
    from mlxspec.models.target import Target


@dataclass
class ProposalContext:
    tokens: list[int]  # prompt + output so far; the last one is pending (not in the target cache)
    scorer: TokenScorer
    rng: np.random.Generator
    target: Target
    # Target hidden states (m, F) of the m tokens just before the pending one, i.e. those
    # the target cache took in since the last round; the last row predicted the pending
    # token. F: the final normed state, after the captured layers the proposer asked for
    # (`hidden_capture`). None for proposers that do not need them.
    hidden: mx.array | None = None
    history: bool = True  # may proposers read the model's history of earlier requests?
    # How many of `tokens` are the prompt (the rest is this request's answer so far); 0:
    # not known, all of it counts as answer.
    prompt_length: int = 0


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: mx.array | None = (
        None  # (len, V) distributions the drafts were drawn from; None: one-hot
    )


@dataclass(frozen=True)
class Situation:
    source: Proposer  # who will draft this round (a chain member, or the proposer itself)
    key: str  # a case label the policy keeps acceptance statistics for
    prior: float = 0.5  # expected per-token acceptance in this case, before any evidence
    # The proposer's own evidence for its line, per draft position j: (earlier
    # occurrences that went on with the line's token j, those that got that far), e.g.
    # suffix decoding's frequency counts at this match. The line ends where it ends.
    # Empty: none; the policy then prices every position at the situation's one rate.
    evidence: tuple[tuple[int, int], ...] = ()
    # Tokens the source must take in, in one pass, before it drafts (a draft model's own
    # cache, behind by what the target accepted while it was off); 0: it keeps no state
    # of its own. The policy prices that pass with the round (`Policy._catch_up_price`).
    catch_up: int = 0


class Proposer(Protocol):
    name: str
    k_max: int
    needs_hidden: bool
    cost_hint: float  # draft cost per token relative to one target step, before measuring

    # `propose` is called only in rounds that draft (k > 0): a proposer with state of its
    # own (a draft model's cache, a head's) does no work while the policy keeps it off,
    # and takes in what it missed in one pass when drafting resumes. It may also have
    # `own_cost`: its passes measured on this machine (a `DraftCost`: its step in target
    # steps, a pass of n tokens in its steps), which the policy prices it by.

    def situation(self, ctx: ProposalContext) -> Situation | None: ...

    def propose(self, ctx: ProposalContext, k: int) -> Draft: ...

    # Proposers with needs_hidden also have `observe(ctx)`: take in the hidden states of
    # a round that `situation` did not see (the last one of a request); and may have
    # `target_layers`: the layers whose incoming residual stream they read too.


def hidden_capture(proposer: Proposer | None) -> tuple[int, ...] | None:
    """What the target must hand `proposer` each round: None (nothing), () (its final
    normed hidden state) or the layers to capture before it (`Decoder.hidden`)."""
    if proposer is None or not proposer.needs_hidden:
        return None
    return tuple(getattr(proposer, "target_layers", ()))


def candidates(proposer: Proposer | None, ctx: ProposalContext) -> list[Situation]:
    """The situations this round could draft in: a chain offers each member's, and the
    policy picks the one with the best expected speed."""
    if proposer is None:
        return []
    if hasattr(proposer, "situations"):
        return proposer.situations(ctx)
    found = proposer.situation(ctx)
    return [found] if found is not None else []


def full_width(logits: mx.array, vocab: mx.array, vocab_size: int) -> mx.array:
    """Draft-vocabulary logits (1, n) spread over the target's ids (others: -inf), so that
    the sampling settings (penalties by token id, top-p...) apply unchanged."""
    full = mx.full((logits.shape[0], vocab_size), -mx.inf, dtype=logits.dtype)
    full[:, vocab] = logits
    return full


def draw(ctx: ProposalContext, logits: mx.array, history: list[int]) -> tuple[int, mx.array | None]:
    """One draft token from draft logits (1, V) under the target's sampling settings."""
    processed = ctx.scorer.process(logits, history, [])
    if ctx.scorer.settings.greedy:
        return ctx.scorer.greedy_tokens(processed)[0], None
    probs = ctx.scorer.probabilities(processed)
    return sample_from(np.asarray(probs[0]), ctx.rng), probs
