"""Drafting a block in one pass with a block drafter (DFlash, DSpark: `drafter/block.py`).

The drafter's context cache holds one entry per committed position, made from the
target's features there (handed over by the same prefill or verify pass that made
them: no extra target forward). Each round it takes in the new positions, runs the
block [pending, mask, ...] once and reads a distribution per slot; the policy decides
how many of them to verify (k <= the block's drafts) from the verify-cost curve and the
acceptance it measured at each slot (`acceptance_by_position`); the drafter's cost hardly
depends on k, so it is priced per round (`cost_per_round`).

Trees: each slot's top candidates, expanded level by level from the likeliest nodes
(DSpark's Markov bias is recomputed for each node's own token, so its tree is as exact
as its line).
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.drafter.block import BlockDrafter
from mlxspec.models.prompt_cache import common_prefix
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree, LevelGrower
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw

BRANCH = 3  # children offered per expanded node
BEAM = 4  # nodes expanded per level


class BlockProposer:
    needs_hidden = True
    cost_per_round = True  # one drafter pass drafts the whole block, whatever k is
    acceptance_by_position = True  # its slots are not equally good: the policy tracks each

    def __init__(
        self,
        drafter: BlockDrafter,
        target: Target,
        name: str = "block",
        k_max: int | None = None,
        cost_hint: float | None = None,  # a round's draft cost vs a target step
    ):
        self.name, self.drafter = name, drafter
        spec = drafter.spec
        self.k_max = min(k_max or spec.drafts_per_block, spec.drafts_per_block)
        self.decoder = target.decoder
        # Before measuring: its layers against the target's, plus an LM head of B rows.
        self.cost_hint = (
            spec.layers / len(self.decoder.layers) + 0.05 if cost_hint is None else cost_hint
        )
        self.target_layers = drafter.capture
        self.width = len(spec.target_layer_ids) * spec.hidden_size  # feature columns used
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # the sequence the state below was built from
        self.base = 0  # sequence position of context entry 0
        self.fed = 0  # context entries in the drafter's cache
        self.waiting: list[mx.array] = []  # feature rows after those, not yet fed
        self.n_waiting = 0
        self.caches = self.drafter.make_cache()

    def situation(self, ctx: ProposalContext) -> Situation | None:
        self._take_hidden(ctx)
        if self.fed + self.n_waiting == 0:
            return None  # no features yet: the next round brings them
        return Situation(self, "block", prior=0.6)

    def observe(self, ctx: ProposalContext) -> None:
        self._take_hidden(ctx)

    def _take_hidden(self, ctx: ProposalContext) -> None:
        """Keep what is still valid (a row at position p depends on tokens 0..p) and
        append the round's rows; a gap starts the context over from them."""
        seq, new = ctx.tokens, ctx.hidden
        m = 0 if new is None else new.shape[0]
        start = len(seq) - 1 - m  # position of new's first row
        valid = min(self.base + self.fed + self.n_waiting, common_prefix(self.tokens, seq))
        valid = min(valid, start)
        if valid < start or valid < self.base:
            self.reset()
            self.base = start
        elif valid < self.base + self.fed:  # cut cached entries (and every waiting row)
            for cache in self.caches:
                cache.trim(self.base + self.fed - valid)
            self.fed, self.waiting, self.n_waiting = valid - self.base, [], 0
        elif valid < self.base + self.fed + self.n_waiting:
            keep = valid - self.base - self.fed
            self.waiting = [mx.concatenate(self.waiting)[:keep]] if keep else []
            self.n_waiting = keep
        if m:
            self.waiting.append(new[:, : self.width])
            self.n_waiting += m
        self.tokens = list(seq)

    def _block_logits(self, ctx: ProposalContext) -> mx.array:
        """The block's draft logits (drafts_per_block, V), the context caught up first."""
        if self.n_waiting:
            features = mx.concatenate(self.waiting)[None]
            self.drafter.add_context(features, self.base + self.fed, self.caches)
            self.fed += self.n_waiting
            self.waiting, self.n_waiting = [], 0
        position = len(ctx.tokens) - 1
        return self.drafter.draft_logits(ctx.tokens[-1], position, self.caches, self.decoder)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        logits = self._block_logits(ctx)
        history = list(ctx.tokens)
        tokens, rows = [], []
        for slot in range(min(k, logits.shape[0])):
            row = logits[slot : slot + 1]
            bias = self.drafter.markov_bias([history[-1]])
            token, probs = draw(ctx, row if bias is None else row + bias, history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
        probs = None if ctx.scorer.settings.greedy or not rows else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """Level by level, the BEAM likeliest nodes each offer their slot's BRANCH top
        tokens (one drafter pass for the whole tree); the best `budget` nodes are kept."""
        logits = self._block_logits(ctx)
        history = list(ctx.tokens)
        grower = LevelGrower(BRANCH)
        level = [0]
        for slot in range(min(depth, logits.shape[0])):
            prefixes = [history + grower.paths[n] for n in level]
            rows = mx.repeat(logits[slot : slot + 1], len(level), axis=0)
            bias = self.drafter.markov_bias([prefix[-1] for prefix in prefixes])
            rows = rows if bias is None else rows + bias
            children = grower.grow(level, self._probs(ctx, rows, prefixes))
            if not children:
                break
            level = grower.best(children, BEAM)
        return grower.tree(budget)

    def _probs(self, ctx: ProposalContext, rows: mx.array, prefixes: list[list[int]]) -> mx.array:
        """Draft distributions (F, V) at F nodes, under the sampling settings."""
        processed = ctx.scorer.process_rows(rows, lambda i: prefixes[i])
        if ctx.scorer.settings.greedy:
            return mx.softmax(processed.astype(mx.float32), axis=-1)
        return ctx.scorer.probabilities(processed)
