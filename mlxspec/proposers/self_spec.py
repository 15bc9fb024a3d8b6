"""Self-speculation: the target's own first L layers, then an exit to draft tokens.

No extra cache: drafting writes the first L layers' KV into the target's own cache,
then trims it back, and the verify pass recomputes those entries. The exit is either
the target's final norm and LM head (raw layer-skip: no extra weights, but poor drafts
on small models, ~0 acceptance measured on SmolLM2) or a trained exit head
(`mlxspec train-drafter --kind exit`, see drafter/exit.py) over a draft vocabulary.
The adaptive policy turns poor drafts off, and output stays lossless either way.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.drafter.exit import ExitHead, raw_states
from mlxspec.drafter.head import lm_rows
from mlxspec.models.target import Target
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw, full_width


class SelfSpeculation:
    needs_hidden = False

    def __init__(
        self,
        target: Target,
        layers: int,
        name: str = "self-spec",
        k_max: int = 8,
        exit_head: ExitHead | None = None,
    ):
        decoder = target.decoder  # raises UnsupportedModel for models we cannot split
        if not 1 <= layers < len(decoder.layers):
            raise ValueError(
                f"self-spec layers must be in 1..{len(decoder.layers) - 1}, got {layers}"
            )
        if target.snapshot_layers:
            raise ValueError("self-spec needs a target whose KV cache can be trimmed")
        if exit_head is not None and exit_head.spec.layers != layers:
            raise ValueError(
                f"its exit head was trained after {exit_head.spec.layers} layers, not "
                f"{layers}; set layers = {exit_head.spec.layers}"
            )
        self.name, self.layers, self.k_max, self.exit = name, layers, k_max, exit_head
        self.cost_hint = layers / len(decoder.layers)
        if exit_head is not None:
            self.raw = raw_states(decoder)  # the exit head reads the un-normed state
            self.rows = lm_rows(decoder, exit_head.vocab)
            self.vocab_size = decoder.embed.weight.shape[0]

    def situation(self, ctx: ProposalContext) -> Situation | None:
        return Situation(self, "layers")

    def _logits(self, ctx: ProposalContext, token: int, cache: list) -> mx.array:
        """Next-token logits (1, V) after feeding `token` through the first L layers."""
        inputs = mx.array([[token]])
        if self.exit is None:
            decoder = ctx.target.decoder
            return decoder.head(decoder.hidden(inputs, cache, self.layers))[:, -1, :]
        state = self.raw.hidden(inputs, cache, self.layers)[:, -1, :]
        return full_width(self.exit.logits(state, self.rows), self.exit.vocab, self.vocab_size)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        cache = ctx.target.cache[: self.layers]
        history = list(ctx.tokens)
        tokens, rows = [], []
        for _ in range(k):
            token, probs = draw(ctx, self._logits(ctx, history[-1], cache), history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
        for c in cache:
            c.trim(k)
        probs = None if ctx.scorer.settings.greedy else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)
