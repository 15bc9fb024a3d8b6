"""Self-speculation: the target's own first L layers + its final norm and LM head.

No extra weights and no extra cache: drafting writes the first L layers' KV into the
target's own cache, then trims it back, and the verify pass recomputes those entries.
Raw layer-skip drafts are poor on small models (measured ~0 acceptance on SmolLM2);
the adaptive policy then turns them off, and output stays lossless either way.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw
from mlxspec.target import Target


class SelfSpeculation:
    needs_hidden = False

    def __init__(self, target: Target, layers: int, name: str = "self-spec", k_max: int = 8):
        decoder = target.decoder  # raises UnsupportedModel for models we cannot split
        if not 1 <= layers < len(decoder.layers):
            raise ValueError(
                f"self-spec layers must be in 1..{len(decoder.layers) - 1}, got {layers}"
            )
        if target.snapshot_layers:
            raise ValueError("self-spec needs a target whose KV cache can be trimmed")
        self.name, self.layers, self.k_max = name, layers, k_max
        self.cost_hint = layers / len(decoder.layers)

    def situation(self, ctx: ProposalContext) -> Situation | None:
        return Situation(self, "layers")

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        decoder, cache = ctx.target.decoder, ctx.target.cache[: self.layers]
        history = list(ctx.tokens)
        tokens, rows = [], []
        for _ in range(k):
            hidden = decoder.hidden(mx.array([history[-1:]]), cache, self.layers)
            token, probs = draw(ctx, decoder.head(hidden)[:, -1, :], history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
        for c in cache:
            c.trim(k)
        probs = None if ctx.scorer.settings.greedy else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)
