"""Log-probabilities of the emitted tokens, from the target's own verify logits.

A verify pass already holds the row of logits that predicted each token a round emits
(accepted drafts, the correction, the bonus): row 0 predicts the first, and the row of
each kept node predicts the next. The log-softmax of that row, after the logits
processors (repetition penalty) and before temperature, top-p and top-k, is what plain
decoding reports (mlx-lm's `generate_step` and its server; OpenAI's API): the model's
own distribution, not the one sampled from. It is computed on the device for the
requests that ask, and only the chosen tokens' values and each row's top N come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on `top_logprobs`


@dataclass(frozen=True)
class Alternative:
    """One of the likeliest tokens at a position (whether emitted or not)."""

    token: int
    text: str  # the token decoded alone
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability, and the likeliest tokens at its position."""

    token: int
    text: str  # the token decoded alone (a piece of a multi-byte character shows as U+FFFD)
    logprob: float
    top: tuple[Alternative, ...] = ()  # most likely first
    offset: int = 0  # where the token's text starts in the output, in characters


@dataclass(frozen=True)
class PendingLogprobs:
    """One request's round of logprobs, still lazy on the device: evaluate `arrays`, then
    read `entries`."""

    tokens: list[int]
    chosen: mx.array  # (m,) the log-probability of each token
    top_ids: mx.array  # (m, N) the N likeliest tokens of each row, in no order
    top_values: mx.array  # (m, N)

    @property
    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]

    def entries(self, decode: Callable[[list[int]], str]) -> list[TokenLogprob]:
        """The evaluated values on the host, one entry per token (offsets not yet known);
        `decode`: the tokenizer's, token ids to text."""
        chosen, ids, values = (a.tolist() for a in self.arrays)
        out = []
        for token, logprob, row_ids, row_values in zip(self.tokens, chosen, ids, values):
            ranked = sorted(zip(row_values, row_ids), key=lambda pair: -pair[0])
            top = tuple(Alternative(i, decode([i]), v) for v, i in ranked)
            out.append(TokenLogprob(token, decode([token]), logprob, top))
        return out


def pending_logprobs(
    processed: mx.array, rows: list[int], tokens: list[int], top_n: int
) -> PendingLogprobs:
    """Token `tokens[j]`'s log-probability under row `rows[j]` of a verify's processed
    logits (m, V), and that row's `top_n` likeliest tokens; lazy, float32."""
    picked = processed[mx.array(rows)].astype(mx.float32)
    logprobs = picked - mx.logsumexp(picked, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top_n = min(top_n, logprobs.shape[-1])
    if top_n:
        top_ids = mx.argpartition(-logprobs, kth=top_n - 1, axis=-1)[:, :top_n]
    else:
        top_ids = mx.zeros((len(rows), 0), mx.int32)
    return PendingLogprobs(tokens, chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1))
