"""Drafting with a head that reads the target's hidden states (EAGLE/MTP style).

The head keeps a KV cache of its own with one entry per position i of the sequence,
made from the target's hidden state h_i and the token x_{i+1}. The engine hands over
the hidden states of the tokens the target cache took in each round (from the same
prefill or verify pass: no extra target forward). Drafting k tokens runs the head k times: the
first step from the target's last hidden state, later ones from the head's own output,
then cuts those draft entries off again.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask

from mlxspec.drafter.head import Head, head_cache, lm_rows
from mlxspec.models.prompt_cache import common_prefix
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree, LevelGrower
from mlxspec.models.tree_attention import rope_positions
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw, full_width

BRANCH = 3  # children offered per expanded node
BEAM = 4  # nodes expanded per level


class HeadProposer:
    needs_hidden = True

    def __init__(
        self,
        head: Head,
        target: Target,
        name: str = "head",
        k_max: int = 8,
        cost_hint: float | None = None,  # per draft token vs a target step; None: guess
    ):
        self.name, self.head, self.k_max = name, head, k_max
        # Measured on SmolLM2-135M: one layer + an 8k-row LM head ~0.06 of a target step;
        # each further layer adds about one target layer's share (1/30 there).
        layers = head.spec.layers
        self.cost_hint = 0.045 + 0.025 * layers if cost_hint is None else cost_hint
        self.target_layers = head.target_layers  # what the target hands over besides h
        self.decoder = target.decoder
        # The target's LM head rows of the draft vocabulary (n, d), unless the head has
        # its own (EAGLE-3's 32k rows of an 8B target would be 0.5 GB in fp32).
        self.rows = None if head.spec.own_lm_head else lm_rows(self.decoder, head.vocab)
        self.vocab_size = target.decoder.embed.weight.shape[0]
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # the sequence the state below was built from
        self.base = 0  # sequence position of hidden row 0 and of cache entry 0
        self.hidden: list[mx.array] = []  # chunks of target hidden rows, in order
        self.n_hidden = 0
        self.cache = head_cache(self.head)
        self.entries = 0  # cache entries, all made from the target's own hidden states
        self._g: mx.array | None = None  # head output at the last entry

    def situation(self, ctx: ProposalContext) -> Situation | None:
        """Take in the round's hidden states (cheap); draft if the head is in sync."""
        self._take_hidden(ctx)
        if self.n_hidden == 0 or self.base + self.n_hidden < len(ctx.tokens) - 1:
            return None  # hidden states missing: wait until the next round fills them
        # Rows taken in while it was off wait for the next `propose`, fed in one pass.
        return Situation(self, "head", prior=0.6, catch_up=self.n_hidden - self.entries)

    def observe(self, ctx: ProposalContext) -> None:
        self._take_hidden(ctx)

    def _take_hidden(self, ctx: ProposalContext) -> None:
        seq, new = ctx.tokens, ctx.hidden
        m = 0 if new is None else new.shape[0]
        start = len(seq) - 1 - m  # position of new's first row
        same = common_prefix(self.tokens, seq)
        # Rows we hold stay valid for positions before `same` (they depend on tokens 0..p).
        valid = min(self.base + self.n_hidden, same, start)
        if valid < start or valid < self.base:  # a gap: start over from the new rows
            self.reset()
            self.base = start
        else:
            self._cut_hidden(valid - self.base)
        if m:
            self.hidden.append(new)
            self.n_hidden += m
        # Entry p uses tokens up to p+1: keep those before `same - 1`.
        keep = max(0, min(self.entries, same - 1 - self.base))
        if keep < self.entries:
            self.cache.trim(self.entries - keep)
            self.entries, self._g = keep, None
        self.tokens = list(seq)

    def _cut_hidden(self, n: int) -> None:
        if n == self.n_hidden:
            return
        rows = mx.concatenate(self.hidden)[:n] if self.hidden else None
        self.hidden = [rows] if n else []
        self.n_hidden = n

    def _rows_from(self, i: int) -> mx.array:
        """Hidden rows i.. (relative to base), merging the chunks (they are kept merged)."""
        if len(self.hidden) > 1:
            self.hidden = [mx.concatenate(self.hidden)]
        return self.hidden[0][i:]

    def _catch_up(self) -> mx.array:
        """Feed the head every position up to the one before the pending token."""
        if self.entries == self.n_hidden and self._g is None:  # redo the last entry
            self.cache.trim(1)
            self.entries -= 1
        todo = self.n_hidden - self.entries
        if todo > 0:
            hidden = self._rows_from(self.entries)[None]
            first = self.base + self.entries + 1
            embeds = self.decoder.embed(mx.array([self.tokens[first : first + todo]]))
            mask = create_attention_mask(hidden, self.cache, return_array=self.decoder.array_masks)
            self._g = self.head(self.head.from_target(hidden), embeds, mask, self.cache)[:, -1:]
            self.entries += todo
        return self._g

    def _full_logits(self, g: mx.array) -> mx.array:
        small = self.head.logits(g, self.rows)[:, -1, :]
        return full_width(small, self.head.vocab, self.vocab_size)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        history = list(ctx.tokens)
        g = self._catch_up()
        tokens, rows = [], []
        for i in range(k):
            token, probs = draw(ctx, self._full_logits(g), history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
            if i + 1 < k:
                embed = self.decoder.embed(mx.array([[token]]))
                g = self.head(self.head.feedback(g), embed, None, self.cache)
        if k > 1:
            self.cache.trim(k - 1)  # the draft entries were made from guesses, not the target
        probs = None if ctx.scorer.settings.greedy else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """EAGLE-2's dynamic tree: level by level, the BEAM nodes of highest cumulative
        draft probability are expanded together in ONE head pass (a tree mask over the
        head's cache, all of them at their level's position), each offering its BRANCH
        likeliest children; the best `budget` nodes of the whole tree are kept. So a
        tree costs about the head passes of a line of the same depth."""
        history = list(ctx.tokens)
        outputs = {0: self._catch_up()}  # node -> head output (1, 1, d) at the node
        real = self.cache.offset  # entries made from the target's own hidden states
        grower = LevelGrower(BRANCH)
        slots: dict[int, int] = {}  # node -> its place among this round's head entries
        level = [0]
        for d in range(1, depth + 1):
            g = mx.concatenate([outputs[n] for n in level], axis=1)
            probs = self._probs(ctx, g, [history + grower.paths[n] for n in level])
            children = grower.grow(level, probs)
            if d == depth or not children:
                break
            level = grower.best(children, BEAM)
            parents, tokens = grower.parents, grower.tokens
            outputs.update(self._expand(level, parents, tokens, slots, outputs, real, d))
        self.cache.trim(self.cache.offset - real)
        return grower.tree(budget)

    def _probs(self, ctx: ProposalContext, g: mx.array, prefixes: list[list[int]]) -> mx.array:
        """Draft distributions (F, V) at F nodes, under the sampling settings."""
        full = full_width(self.head.logits(g, self.rows)[0], self.head.vocab, self.vocab_size)
        processed = ctx.scorer.process_rows(full, lambda i: prefixes[i])
        if ctx.scorer.settings.greedy:
            return mx.softmax(processed.astype(mx.float32), axis=-1)
        return ctx.scorer.probabilities(processed)

    def _expand(
        self,
        level: list[int],
        parents: list[int],
        tokens: list[int],
        slots: dict[int, int],
        outputs: dict[int, mx.array],
        real: int,
        depth: int,
    ) -> dict[int, mx.array]:
        """Head outputs of the `level` nodes (all at `depth`), in one pass that appends
        their entries; each attends the real entries, its ancestors' entries and itself."""
        appended = self.cache.offset - real
        sees = np.zeros((len(level), appended + len(level)), dtype=bool)
        for row, node in enumerate(level):
            sees[row, appended + row] = True
            ancestor = parents[node - 1]
            while ancestor:
                sees[row, slots[ancestor]] = True
                ancestor = parents[ancestor - 1]
            slots[node] = appended + row
        mask = mx.array(np.concatenate([np.ones((len(level), real), dtype=bool), sees], axis=1))
        hidden = mx.concatenate(
            [self.head.feedback(outputs[parents[n - 1]]) for n in level], axis=1
        )
        embeds = self.decoder.embed(mx.array([[tokens[n - 1] for n in level]]))
        # Every node of a level sits where a line's draft of that depth would.
        with rope_positions(self.head, [(0, len(level), 0)], base=real + depth - 1):
            g = self.head(hidden, embeds, mask, self.cache)
        return {node: g[:, row : row + 1] for row, node in enumerate(level)}
