"""EAGLE-3 heads as published (SafeAILab's layout, which vLLM and SGLang read too).

Three things set them apart from the EAGLE-1/MTP heads in `head.py`:
- they read the target's residual stream entering layers 2, N//2 and N-3 (side by
  side, in layer order) through `fc` (3d -> d, no bias), not its final hidden state;
- their one layer attends over [input_layernorm(embedding), hidden_norm(h)], 2d wide,
  with the un-normed h as the residual; later draft steps read its pre-norm output;
- their own LM head covers a draft vocabulary: draft id i is target id i + d2t[i].

The layer is mlx-lm's llama attention and MLP (its KV cache and RoPE are ordinary ones,
so draft trees work unchanged), the attention widened to read 2d.

vLLM's `speculators` layout (RedHatAI's heads, e.g. RedHatAI/Qwen3-8B-speculator.eagle3)
is the same head under other names: `layers.0.*` for `midlayer.*`, `fc` possibly with a
bias, and a config.json whose `transformer_layer_config` holds the layer's fields, with
`draft_vocab_size`, `norm_before_residual` (the residual is hidden_norm(h), not h),
`target_hidden_size` and `eagle_aux_hidden_state_layer_ids` (the captured layers; default
2, N/2, N-3) beside it. Its `embed_tokens` copy of the target's embedding is not used.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from mlxspec.anatomy import Decoder
from mlxspec.drafter.head import HeadError, HeadSpec

FORMAT = "eagle-3"
CONFIG = "config.json"
SPECULATORS_LAYER = "layers.0."  # vLLM speculators' name for SafeAILab's `midlayer.`


def capture_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers whose incoming residual stream an EAGLE-3 head reads."""
    return (2, n_layers // 2, n_layers - 3)


class Eagle3Layer(nn.Module):
    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        d = args.hidden_size
        head_dim = args.head_dim or d // args.num_attention_heads
        self.hidden_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        # mlx-lm's attention reading [embedding, hidden] (2d), writing d.
        self.self_attn = llama.Attention(replace(args, hidden_size=2 * d, head_dim=head_dim))
        self.self_attn.o_proj = nn.Linear(args.num_attention_heads * head_dim, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.mlp = llama.MLP(args)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask: Any, cache=None) -> mx.array:
        normed = self.hidden_norm(hidden)
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The `DraftHead` interface (see `head.py`) over an EAGLE-3 checkpoint."""

    def __init__(
        self,
        spec: HeadSpec,
        args: llama.ModelArgs,
        vocab: mx.array,
        target_layers,
        fc_bias: bool = False,
        norm_before_residual: bool = False,
    ):
        super().__init__()
        d = args.hidden_size
        self.spec = spec
        self.target_layers = tuple(target_layers)
        self.fc = nn.Linear(len(self.target_layers) * d, d, bias=fc_bias)
        self.midlayer = Eagle3Layer(args, norm_before_residual)
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(d, int(vocab.size), bias=False)
        self._vocab = vocab  # target ids of the draft vocabulary (d2t applied)

    @property
    def vocab(self) -> mx.array:
        return self._vocab

    def from_target(self, rows: mx.array) -> mx.array:
        """The captured layers (the columns before the final state) through `fc`."""
        width = self.fc.weight.shape[1]
        return self.fc(rows[..., :width])

    def __call__(self, hidden: mx.array, embeds: mx.array, mask: Any = None, cache=None):
        return self.midlayer(embeds, hidden, mask, cache)

    def features(self, g: mx.array) -> mx.array:
        return self.norm(g)

    def feedback(self, g: mx.array) -> mx.array:
        return g  # EAGLE-3 feeds its pre-norm output back

    def logits(self, g: mx.array, rows: mx.array | None) -> mx.array:
        return self.lm_head(self.norm(g))


def _speculators_name(key: str) -> str:
    """SafeAILab's name of a speculators weight (`layers.0.x` -> `midlayer.x`)."""
    return "midlayer." + key[len(SPECULATORS_LAYER) :] if key.startswith(SPECULATORS_LAYER) else key


def load_eagle3(
    directory: Path, weights: dict[str, mx.array], model: nn.Module, decoder: Decoder
) -> Eagle3Head:
    """An `Eagle3Head` from a checkpoint folder (its config.json and `weights`), in
    SafeAILab's layout or vLLM's `speculators` one."""
    try:
        outer = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise HeadError(
            f"{directory} is an EAGLE-3 head but its {CONFIG} is unreadable: {err}"
        ) from None
    config = outer.get("transformer_layer_config") or outer
    if "transformer_layer_config" in outer:  # speculators: the same layer under `layers.0.`
        weights = {_speculators_name(k): v for k, v in weights.items()}
        if any(k.startswith("layers.1.") for k in weights):
            raise HeadError(
                f"the EAGLE-3 head in {directory} has more than one layer; mlxspec loads "
                "one-layer EAGLE-3 heads"
            )
    d, vocab_size, n = decoder.width, decoder.embed.weight.shape[0], len(decoder.layers)
    width = config.get("hidden_size")
    target_width = outer.get("target_hidden_size") or width
    if width != d or target_width != d:
        raise HeadError(
            f"the EAGLE-3 head in {directory} has width {width} (target width "
            f"{target_width}); this target has {d}, and mlxspec "
            "loads EAGLE-3 heads only as wide as their target"
        )
    layers = tuple(outer.get("eagle_aux_hidden_state_layer_ids") or capture_layers(n))
    if len(set(layers)) < len(layers) or not all(0 <= i < n for i in layers):
        raise HeadError(
            f"an EAGLE-3 head reads the target's layers {', '.join(map(str, layers))}, which "
            f"are not {len(layers)} different layers of this {n}-layer target"
        )
    try:
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=d,
            num_hidden_layers=1,
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab_size,
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings"),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise HeadError(f"{directory / CONFIG} lacks what an EAGLE-3 layer needs: {err}") from None
    draft_size = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else 0
    if "d2t" in weights:
        vocab = mx.arange(draft_size, dtype=mx.int32) + weights["d2t"].astype(mx.int32)
    else:
        vocab = mx.arange(vocab_size, dtype=mx.int32)
    if vocab.size != draft_size or int(vocab.max()) >= vocab_size or int(vocab.min()) < 0:
        raise HeadError(
            f"the EAGLE-3 head in {directory} drafts {draft_size} tokens that do not map into "
            f"this target's {vocab_size}-token vocabulary"
        )
    spec = HeadSpec(
        hidden_size=d,
        vocab_size=vocab_size,
        own_lm_head=True,
        final_norm=True,
        norm_eps=args.rms_norm_eps,
        source_format=FORMAT,
    )
    head = Eagle3Head(
        spec,
        args,
        vocab,
        layers,
        fc_bias="fc.bias" in weights,
        norm_before_residual=bool(outer.get("norm_before_residual", False)),
    )
    ours = ("fc.", "midlayer.", "norm.", "lm_head.")
    pairs = [(k, v.astype(mx.float32)) for k, v in weights.items() if k.startswith(ours)]
    try:
        head.load_weights(pairs, strict=True)
    except ValueError as err:
        raise HeadError(f"{directory} looks like an EAGLE-3 head but does not fit: {err}") from None
    return head
