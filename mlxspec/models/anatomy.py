"""Reach inside an mlx-lm decoder: embeddings, layers, final norm and LM head.

Self-speculation runs only the first L layers; drafter heads read the last hidden
state. Both need the model split where `model(x) == head(norm(layers(embed(x))))`.
Rather than trusting a list of architectures, `split_decoder` checks that identity
numerically on the model it is given, and refuses models where it does not hold
(e.g. ones that scale embeddings or soft-cap logits inside `__call__`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache


def text_settings(args: Any) -> dict[str, Any]:
    """A model's settings (`model.args`) as a dict; a multimodal wrapper's (Qwen3.5) are
    its text model's, nested in `text_config`."""
    return dict(args.text_config) if hasattr(args, "text_config") else dict(vars(args))


class UnsupportedModel(ValueError):
    """The model's structure is not the plain decoder these features need."""


@dataclass
class Decoder:
    embed: nn.Embedding
    layers: list[nn.Module]
    norm: nn.Module
    head: Callable[[mx.array], mx.array]
    # Attention masks as arrays, never the "causal" shortcut: MLA (DeepSeek-V3) applies
    # its mask with `mx.where` and asks mlx-lm for an array (`return_array=True`).
    array_masks: bool = False
    # Sliding-window layers (gpt-oss's): layer index -> window, each masked to it.
    windows: dict[int, int] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return self.norm.weight.shape[0]

    def hidden(
        self,
        inputs: mx.array,
        cache: list[Any],
        n_layers: int | None = None,
        capture: tuple[int, ...] = (),
    ) -> mx.array:
        """Normed hidden states after the first `n_layers` layers (all by default).

        With `capture`, the residual stream entering each of those layers comes first,
        side by side in layer order: (B, L, (len(capture) + 1) * width); index
        len(layers) is the last layer's output (block drafters may read it). EAGLE-3
        heads read three layers; `logits` takes the LM head of the last `width` columns."""
        layers = self.layers if n_layers is None else self.layers[:n_layers]
        h = self.embed(inputs)
        kinds = [self.mask_kind(i) for i in range(len(self.layers))]
        masks = _layer_masks(h, kinds, cache, self.array_masks)
        taken = []
        for index, (layer, layer_cache) in enumerate(zip(layers, cache)):
            if index in capture:
                taken.append(h)
            h = layer(h, masks[kinds[index]], cache=layer_cache)
        if len(layers) in capture:  # the last layer's own output, before the final norm
            taken.append(h)
        return mx.concatenate([*taken, self.norm(h)], axis=-1) if taken else self.norm(h)

    def mask_kind(self, index: int) -> str | int | None:
        """What layer `index` is masked by: "recurrent" (an SSM mask), its window, or None
        (full causal attention)."""
        if is_recurrent(self.layers[index]):
            return "recurrent"
        return self.windows.get(index)

    def logits(self, features: mx.array) -> mx.array:
        """Logits from `hidden`'s output: the LM head on the final normed state."""
        return self.head(features[..., -self.width :])


def is_recurrent(layer: nn.Module) -> bool:
    """A hybrid model's recurrent layer (Qwen3-Next / Qwen3.5 GatedDeltaNet): it takes
    an SSM mask, not an attention mask, and keeps no KV cache."""
    return bool(getattr(layer, "is_linear", False))


def last_attention_layer(layers: list[nn.Module]) -> int:
    """Index of the last layer that attends (keeps a KV cache): where a drafter layer of
    the target's family is modelled on, and named after when converting its weights."""
    return max(
        (i for i, layer in enumerate(layers) if not is_recurrent(layer)), default=len(layers) - 1
    )


def _layer_masks(
    h: mx.array, kinds: list[str | int | None], cache: list[Any], array: bool = False
) -> dict[str | int | None, Any]:
    """{mask kind: mask} (`Decoder.mask_kind`), each made from the cache of the first layer
    of its kind, as the hybrid and sliding-window models' own forwards do."""
    masks = {}
    for kind, layer_cache in zip(kinds, cache):
        if kind in masks:
            continue
        if kind == "recurrent":
            masks[kind] = create_ssm_mask(h, layer_cache)
        else:
            masks[kind] = create_attention_mask(h, layer_cache, kind, return_array=array)
    return masks


def split_decoder(model: nn.Module) -> Decoder:
    inner = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "norm")]
    if inner is None or any(part is None for part in parts):
        raise UnsupportedModel(
            f"model type '{getattr(model, 'model_type', type(model).__name__)}' does not expose "
            "embed_tokens/layers/norm; self-speculation and drafter heads need a plain decoder"
        )
    embed, layers, norm = parts
    # Multimodal wrappers (Qwen3.5) keep the LM head on their text model.
    lm_head = getattr(getattr(model, "language_model", model), "lm_head", None)
    head = lm_head if lm_head is not None else embed.as_linear
    probe = mx.array([[1, 2, 3]])
    expected = model(probe)
    windows = {
        i: c.max_size
        for i, c in enumerate(make_prompt_cache(model))
        if isinstance(c, RotatingKVCache) and c.keep == 0
    }
    for array_masks in (False, True):  # the "causal" shortcut where the layers take it
        decoder = Decoder(embed, list(layers), norm, head, array_masks, windows)
        if _same_logits(decoder, probe, expected):
            return decoder
    raise UnsupportedModel(
        f"model type '{getattr(model, 'model_type', '?')}' computes logits in a way mlxspec "
        "cannot split into layers + head (embedding scaling, logit soft-capping, or layers "
        "that pass more than the hidden state on, as Gemma 4's do); "
        "self-speculation and drafter heads are not available for it"
    )


def _same_logits(decoder: Decoder, probe: mx.array, expected: mx.array) -> bool:
    """Whether `decoder`'s parts give the model's own logits (`expected`) on `probe`."""
    try:
        got = decoder.head(decoder.hidden(probe, [None] * len(decoder.layers)))
    except ValueError:  # MLA handed the "causal" string where it applies an array
        return False
    except TypeError:  # Gemma 4's layers return (hidden, shared KV, offset)
        return False
    return expected.shape == got.shape and mx.allclose(expected, got, atol=1e-3, rtol=1e-3).item()
