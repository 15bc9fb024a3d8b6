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
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxspec.drafter.head import DraftHead, lm_rows
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw, full_width
from mlxspec.target import Target, common_prefix_len


class HeadProposer:
    needs_hidden = True

    def __init__(
        self,
        head: DraftHead,
        target: Target,
        name: str = "head",
        k_max: int = 8,
        cost_hint: float = 0.07,  # one layer + an 8k-row LM head vs a target step
    ):
        self.name, self.head, self.k_max, self.cost_hint = name, head, k_max, cost_hint
        self.decoder = target.decoder
        self.rows = lm_rows(self.decoder, head.vocab)  # (n, d): the target's LM head rows
        self.vocab_size = target.decoder.embed.weight.shape[0]
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # the sequence the state below was built from
        self.base = 0  # sequence position of hidden row 0 and of cache entry 0
        self.hidden: list[mx.array] = []  # chunks of target hidden rows, in order
        self.n_hidden = 0
        self.cache = KVCache()
        self.entries = 0  # cache entries, all made from the target's own hidden states
        self._g: mx.array | None = None  # head output at the last entry

    def situation(self, ctx: ProposalContext) -> Situation | None:
        """Take in the round's hidden states (cheap); draft if the head is in sync."""
        self._take_hidden(ctx)
        if self.n_hidden == 0 or self.base + self.n_hidden < len(ctx.tokens) - 1:
            return None  # hidden states missing: wait until the next round fills them
        return Situation(self, "head", prior=0.6)

    def observe(self, ctx: ProposalContext) -> None:
        self._take_hidden(ctx)

    def _take_hidden(self, ctx: ProposalContext) -> None:
        seq, new = ctx.tokens, ctx.hidden
        m = 0 if new is None else new.shape[0]
        start = len(seq) - 1 - m  # position of new's first row
        same = common_prefix_len(self.tokens, seq)
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
            mask = create_attention_mask(hidden, self.cache)
            self._g = self.head(hidden, embeds, mask, self.cache)[:, -1:]
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
