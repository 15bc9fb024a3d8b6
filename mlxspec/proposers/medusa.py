"""Drafting with Medusa heads: every head reads the same hidden row, so a whole tree of
guesses costs K small matmuls and no draft loop at all.

The engine hands over the target's hidden states each round; the last row is the one
that predicted the pending token, and head k guesses the token k places after it. The
heads do not see each other's guesses, so a tree is the Cartesian product of each
head's likeliest tokens, kept where the product of their probabilities is highest
(Medusa's sparse tree, chosen per round instead of fixed).
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.drafter.head import lm_rows
from mlxspec.drafter.medusa import MedusaHeads
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree, from_paths, keep_best
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw, full_width

BRANCH = 3  # candidates per head


class MedusaProposer:
    needs_hidden = True

    def __init__(
        self,
        heads: MedusaHeads,
        target: Target,
        name: str = "medusa",
        k_max: int | None = None,
        cost_hint: float = 0.02,
    ):
        self.name, self.heads, self.cost_hint = name, heads, cost_hint
        self.k_max = min(k_max or heads.count, heads.count)
        # The target's LM-head rows, unless the heads bring their own (a published
        # checkpoint: a copy of the full LM head would be wasted memory).
        self.rows = None if heads.own_lm_heads else lm_rows(target.decoder, heads.vocab)
        self.vocab_size = target.decoder.embed.weight.shape[0]
        self.reset()

    def reset(self) -> None:
        """Forget the last request's state. A batch row's private copy (`private_copy`)
        is reset, not deep-copied: it shares the heads' weights."""
        self._last: mx.array | None = None  # the hidden row that predicted the pending token
        self._length = 0  # len(tokens) when that row was taken

    def situation(self, ctx: ProposalContext) -> Situation | None:
        self.observe(ctx)
        if self._last is None or self._length != len(ctx.tokens):
            return None  # no fresh hidden state for this position (e.g. a new request)
        return Situation(self, "medusa", prior=0.4)

    def observe(self, ctx: ProposalContext) -> None:
        if ctx.hidden is not None and ctx.hidden.shape[0]:
            self._last, self._length = ctx.hidden[-1:], len(ctx.tokens)

    def _logits(self, depth: int) -> list[mx.array]:
        """Full-vocabulary logits (1, V) of heads 1..depth (others: -inf)."""
        return [
            full_width(small, self.heads.vocab, self.vocab_size)
            for small in self.heads.logits(self._last, self.rows)[:depth]
        ]

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        history = list(ctx.tokens)
        tokens, rows = [], []
        for logits in self._logits(k):
            token, probs = draw(ctx, logits, history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
        probs = None if ctx.scorer.settings.greedy else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        level = [([], 1.0)]  # (path, score): the best `budget` paths of each depth
        paths, scores = [], []
        for logits in self._logits(depth):
            probs = mx.softmax(ctx.scorer.process(logits, ctx.tokens, []).astype(mx.float32))
            top = mx.argpartition(-probs[0], BRANCH - 1)[:BRANCH]
            options = list(zip(top.tolist(), probs[0, top].tolist()))
            level = sorted(
                ((path + [t], score * p) for path, score in level for t, p in options if p > 0),
                key=lambda item: -item[1],
            )[:budget]
            for path, score in level:
                paths.append(path)
                scores.append([score] * len(path))  # a prefix keeps its own (higher) score
        return keep_best(from_paths(paths, scores), budget)
