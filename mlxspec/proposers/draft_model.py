"""A small same-family model drafts autoregressively with its own KV cache."""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.models.anatomy import text_settings
from mlxspec.models.kv_form import FLOAT, KVForm
from mlxspec.models.prompt_cache import common_prefix
from mlxspec.models.target import catch_up
from mlxspec.models.tree import DraftTree
from mlxspec.proposers.base import Draft, ProposalContext, Situation, draw
from mlxspec.proposers.growth import grow


class VocabularyMismatch(ValueError):
    pass


def check_same_vocabulary(target_name: str, target_tok, draft_name: str, draft_tok) -> None:
    """Refuse a pair whose tokenizers differ: the same id must mean the same text."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda x: x[1])
    example = (
        f"; first difference: {differing[0][0]!r} -> id {differing[0][1]}" if differing else ""
    )
    raise VocabularyMismatch(
        f"draft model '{draft_name}' cannot draft for '{target_name}': their tokenizers differ "
        f"({len(draft_vocab)} vs {len(target_vocab)} tokens{example}); pick a draft of the "
        "same model family"
    )


def truncated_model(model: nn.Module, n_layers: int) -> nn.Module:
    """A standalone mlx-lm model made of `model`'s first n layers, sharing its modules.

    It is an ordinary mlx-lm model (own cache, `make_cache`, saveable), so mlx-lm's
    own speculative decoding can use it as a draft as well. The source's leaf modules
    themselves are shared, not only their parameters: a fresh model has float layers,
    with no place for the scales of quantized ones (what Metal keeps).
    """
    args = model.args
    text = text_settings(args)  # a multimodal wrapper's (Qwen3.5): its text model's
    total = text["num_hidden_layers"]
    if not 1 <= n_layers <= total:
        raise ValueError(f"draft_layers must be in 1..{total}, got {n_layers}")
    if text.get("hidden_size_per_layer_input") and n_layers < total:
        raise ValueError(  # Gemma 4 E2B/E4B: one embedding table feeds every layer
            f"cannot cut {model.model_type} to {n_layers} layers: its per-layer input "
            f"embeddings are made for all {total}"
        )
    changes = {"num_hidden_layers": n_layers}
    if text.get("layer_types"):
        changes["layer_types"] = list(text["layer_types"][:n_layers])
    if text.get("num_kv_shared_layers"):  # Gemma 4: the last layers reuse earlier KV
        changes["num_kv_shared_layers"] = max(0, n_layers - total + text["num_kv_shared_layers"])
    if hasattr(args, "text_config"):
        changes = {"text_config": {**args.text_config, **changes}}
    small = type(model)(dataclasses.replace(args, **changes))
    layer_name = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")

    def first_layers(items: list) -> list:
        return [
            (name, value)
            for name, value in items
            if not (found := layer_name.search(name)) or int(found.group(1)) < n_layers
        ]

    leaves = tree_flatten(model.leaf_modules(), is_leaf=lambda value: isinstance(value, nn.Module))
    small.update_modules(tree_unflatten(first_layers(leaves)))
    # Arrays held beside child modules (a Mamba mixer's A_log) are not in any leaf.
    small.update(tree_unflatten(first_layers(tree_flatten(model.parameters()))))
    try:
        small(mx.array([[0]]), cache=small.make_cache() if hasattr(small, "make_cache") else None)
    except (IndexError, ValueError) as err:
        raise ValueError(
            f"cannot cut {getattr(model, 'model_type', 'this model')} to {n_layers} layers "
            f"(its layer pattern needs more): {err}"
        ) from None
    return small


class DraftModel:
    """Drafts only when asked (k > 0): while the policy keeps it off its cache falls
    behind, and the next `propose` feeds everything the target accepted meanwhile in one
    pass, as a prefill does (`catch_up`), whose width each round's situation tells."""

    needs_hidden = False

    def __init__(
        self,
        model: nn.Module,
        name: str = "draft-model",
        k_max: int = 16,
        cost_hint: float = 0.2,
        own_cost=None,
        kv: KVForm = FLOAT,
    ):
        """`own_cost`: the model's passes measured here beside the target's (a
        `DraftCost`), or None: the policy prices a draft token at `cost_hint` target
        steps (a guess) until it timed one. `kv`: the form its own KV cache is held in
        (the target's, `--kv-bits`)."""
        self.name, self.model, self.k_max, self.cost_hint = name, model, k_max, cost_hint
        self.own_cost = own_cost
        self.kv = kv
        self.reset()

    def reset(self) -> None:
        self.cache, self.cached_tokens = make_prompt_cache(self.model), []

    def situation(self, ctx: ProposalContext) -> Situation | None:
        behind = len(ctx.tokens) - common_prefix(self.cached_tokens, ctx.tokens[:-1])
        return Situation(self, "model", catch_up=behind)

    def _catch_up(self, tokens: list[int]) -> mx.array:
        """Bring the cache to `tokens` (always feeding the last one); logits after it."""
        _, logits = catch_up(self, tokens, reusable=len(tokens) - 1)
        return logits[:, -1, :]

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        history = list(ctx.tokens)
        logits = self._catch_up(history)
        tokens, rows = [], []
        for i in range(k):
            token, probs = draw(ctx, logits, history)
            tokens.append(token)
            rows.append(probs)
            history.append(token)
            if i + 1 < k:
                logits = self.model(mx.array([[token]]), cache=self.cache)[:, -1, :]
                self.cached_tokens.append(token)
        probs = None if ctx.scorer.settings.greedy else mx.concatenate(rows, axis=0)
        return Draft(tokens, probs)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """A tree grown best first; moving between branches trims the draft cache back
        to the branch point and feeds the new path in one pass."""
        history = list(ctx.tokens)
        return grow(ctx, lambda path: self._catch_up(history + path), depth, budget)
