"""EAGLE-3 heads as published (SafeAILab's layout, which vLLM and SGLang read too).

Three things set them apart from the EAGLE-1/MTP heads in `head.py`:
- they read the target's residual stream entering layers 2, N//2 and N-3 (side by
  side, in layer order) through `fc` (3d -> d, no bias), not its final hidden state;
- their one layer attends over [input_layernorm(embedding), hidden_norm(h)], 2d wide,
  with the un-normed h as the residual; later draft steps read its pre-norm output;
- their own LM head covers a draft vocabulary: draft id i is target id i + d2t[i].

The layer is mlx-lm's llama attention (or qwen3's, with per-head q/k norms, where the
layer config's `model_type` is qwen3) and MLP, the attention widened to read 2d; its KV
cache and RoPE are ordinary ones, so draft trees work unchanged.

Three config layouts, as their references read them:
- SafeAILab (EAGLE `eagle/traineagle3/cnets.py`): a flat llama config, `draft_vocab_size`.
- SpecForge/SGLang: the same, with `eagle_config.eagle_aux_hidden_state_layer_ids`, the
  captured layers' OUTPUTS (SpecForge `model_providers.resolve_eagle_capture_layers`:
  default [1, N//2 - 1, N - 4], the layers entering 2, N//2, N-3).
- vLLM's `speculators` (RedHatAI's heads): `layers.0.*` for `midlayer.*`, `fc` possibly
  with a bias, the layer's fields in `transformer_layer_config` (transformers 5 writes
  `rope_parameters` there, not `rope_theta`), and beside it `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (the residual stream ENTERING
  those layers, as vLLM captures it), `norm_before_residual` (the residual is
  hidden_norm(h); vLLM's speculators config adapter defaults it to true),
  `norm_before_fc` (`input_norm`, one RMSNorm over the 3d features before `fc`),
  `fc_norm` (`fc_norm.{i}`, one per captured layer) and `norm_output` (feed the final
  norm's output back); speculators' `models/eagle3/core.py` and vLLM's
  `llama_eagle3.py` (`combine_hidden_states`, `LlamaModel.forward`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3

from mlxspec.drafter.head import HeadError, HeadSpec
from mlxspec.drafter.strict import unknown_fields, unread_tensors
from mlxspec.models.anatomy import Decoder

FORMAT = "eagle-3"
CONFIG = "config.json"
SPECULATORS_LAYER = "layers.0."  # vLLM speculators' name for SafeAILab's `midlayer.`
LAYER_TYPES = ("llama", "qwen3")  # draft layer families (speculators' model_definitions)
# Parts of the published layouts the head has no use for: the target's embedding copy
# and t2d (d2t's inverse); vLLM skips both.
UNUSED_PARTS = ("embed_tokens.weight", "t2d")
# Tensors the references skip that the layouts do not promise: training-only verifier
# copies, RoPE tables (a warning names them).
HARMLESS = ("verifier_norm.weight", "verifier_lm_head.weight", "*rotary_emb.inv_freq")
# The layer's config fields mlxspec reads (or checks hold their neutral value).
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "num_hidden_layers",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
)
SPECULATORS_FIELDS = (
    "transformer_layer_config",
    "speculators_model_type",
    "speculators_version",
    "speculators_config",  # the proposal method and verifier: advice, not the forward
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",  # training only
    "has_no_defaults_at_init",
)
EAGLE_CONFIG_FIELDS = ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc")


def capture_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers whose incoming residual stream an EAGLE-3 head reads."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass(frozen=True)
class Eagle3Options:
    """The layout's switches (see the module docstring)."""

    layer_type: str = "llama"
    fc_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False


def _attention(args: llama.ModelArgs, layer_type: str) -> nn.Module:
    """mlx-lm's attention of `layer_type` reading [embedding, hidden] (2d), writing d."""
    d, head_dim = args.hidden_size, args.head_dim
    wide = replace(args, hidden_size=2 * d)
    if layer_type == "qwen3":
        attention = qwen3.Attention(
            qwen3.ModelArgs(
                model_type="qwen3",
                hidden_size=2 * d,
                num_hidden_layers=1,
                intermediate_size=args.intermediate_size,
                num_attention_heads=args.num_attention_heads,
                rms_norm_eps=args.rms_norm_eps,
                vocab_size=args.vocab_size,
                num_key_value_heads=args.num_key_value_heads,
                max_position_embeddings=args.max_position_embeddings,
                head_dim=head_dim,
                tie_word_embeddings=False,
                rope_theta=args.rope_theta,
                rope_scaling=args.rope_scaling,
            )
        )
    else:
        attention = llama.Attention(wide)
    bias = args.attention_bias
    attention.o_proj = nn.Linear(args.num_attention_heads * head_dim, d, bias=bias)
    return attention


class Eagle3Layer(nn.Module):
    def __init__(self, args: llama.ModelArgs, options: Eagle3Options):
        super().__init__()
        self.norm_before_residual = options.norm_before_residual
        d = args.hidden_size
        self.hidden_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.self_attn = _attention(args, options.layer_type)
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
        options: Eagle3Options = Eagle3Options(),
    ):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.spec = spec
        self.options = options
        self.target_layers = tuple(target_layers)
        width = len(self.target_layers) * d
        if options.norm_before_fc:
            self.input_norm = nn.RMSNorm(width, eps=eps)
        if options.fc_norm:
            self.fc_norm = [nn.RMSNorm(d, eps=eps) for _ in self.target_layers]
        self.fc = nn.Linear(width, d, bias=options.fc_bias)
        self.midlayer = Eagle3Layer(args, options)
        self.norm = nn.RMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, int(vocab.size), bias=False)
        self._vocab = vocab  # target ids of the draft vocabulary (d2t applied)

    @property
    def vocab(self) -> mx.array:
        return self._vocab

    def from_target(self, rows: mx.array) -> mx.array:
        """The captured layers (the columns before the final state) through `fc`, after
        `input_norm` / `fc_norm` where the head has them (vLLM's combine_hidden_states)."""
        features = rows[..., : self.fc.weight.shape[1]]
        if self.options.norm_before_fc:
            features = self.input_norm(features)
        if self.options.fc_norm:
            chunks = mx.split(features, len(self.fc_norm), axis=-1)
            features = mx.concatenate([n(c) for n, c in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(features)

    def __call__(self, hidden: mx.array, embeds: mx.array, mask: Any = None, cache=None):
        return self.midlayer(embeds, hidden, mask, cache)

    def features(self, g: mx.array) -> mx.array:
        return self.norm(g)

    def feedback(self, g: mx.array) -> mx.array:
        """The pre-norm output, or the normed one with `norm_output` (Eagle 3.1)."""
        return self.norm(g) if self.options.norm_output else g

    def logits(self, g: mx.array, rows: mx.array | None) -> mx.array:
        return self.lm_head(self.norm(g))


def _speculators_name(key: str) -> str:
    """SafeAILab's name of a speculators weight (`layers.0.x` -> `midlayer.x`)."""
    return "midlayer." + key[len(SPECULATORS_LAYER) :] if key.startswith(SPECULATORS_LAYER) else key


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise HeadError(
            f"{directory} is an EAGLE-3 head but its {CONFIG} is unreadable: {err}"
        ) from None
    if not isinstance(config, dict):
        raise HeadError(f"{directory / CONFIG} is not a JSON object")
    return config


def _layout(outer: dict[str, Any], n_layers: int) -> tuple[dict, tuple[int, ...], Eagle3Options]:
    """(the layer's fields, the capture indices, the switches) of a config in any of the
    three layouts, or the one-line reason it cannot be read."""
    speculators = "transformer_layer_config" in outer
    layer = outer["transformer_layer_config"] if speculators else outer
    eagle = outer.get("eagle_config") or {}
    problem = unknown_fields(layer, LAYER_FIELDS + SPECULATORS_FIELDS, "its config.json")
    if speculators and problem is None:
        problem = unknown_fields(outer, SPECULATORS_FIELDS, "its config.json")
        problem = problem or unknown_fields(layer, LAYER_FIELDS, "its transformer_layer_config")
    problem = problem or unknown_fields(eagle, EAGLE_CONFIG_FIELDS, "its eagle_config")
    layer_type = layer.get("model_type", "llama") if speculators else "llama"
    kinds = set(layer.get("layer_types") or ["full_attention"])
    checks = [
        (layer_type not in LAYER_TYPES, f"its layer is a {layer_type!r} layer (llama, qwen3 are)"),
        (layer.get("hidden_act", "silu") != "silu", f"hidden_act {layer.get('hidden_act')!r}"),
        (bool(layer.get("mlp_bias")), "an MLP with biases (mlp_bias)"),
        (int(layer.get("num_hidden_layers", 1)) != 1, "more than one layer"),
        (kinds != {"full_attention"} or bool(layer.get("use_sliding_window")), "sliding layers"),
        (not eagle.get("use_aux_hidden_state", True), "use_aux_hidden_state false"),
        (
            speculators and outer.get("speculators_model_type", "eagle3") != "eagle3",
            f"speculators_model_type {outer.get('speculators_model_type')!r}",
        ),
    ]
    problem = problem or next(
        (f"it has {why}, which mlxspec does not load" for bad, why in checks if bad), None
    )
    if problem is not None:
        raise ValueError(problem)
    if speculators:  # the residual stream entering these layers (vLLM's capture)
        ids = outer.get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(ids) if ids else capture_layers(n_layers)
    elif eagle.get("eagle_aux_hidden_state_layer_ids"):  # SpecForge: layer outputs
        layers = tuple(i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"])
    else:
        layers = capture_layers(n_layers)
    options = Eagle3Options(
        layer_type=layer_type,
        # vLLM's speculators config adapter defaults it to true; llama_eagle3 to false.
        norm_before_residual=bool(outer.get("norm_before_residual", speculators)),
        norm_before_fc=bool(outer.get("norm_before_fc", eagle.get("norm_before_fc", False))),
        fc_norm=bool(outer.get("fc_norm", False)),
        norm_output=bool(outer.get("norm_output", False)),
    )
    return layer, layers, options


def _rope(layer: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_theta` / `rope_scaling` or transformers 5's
    `rope_parameters` (which holds both; speculators' `flatten_rope_parameters` takes
    the `sliding_attention` entry where it is split by layer type)."""
    parameters = layer.get("rope_parameters") or {}
    if "sliding_attention" in parameters:
        parameters = parameters["sliding_attention"]
    theta = layer.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    scaling = layer.get("rope_scaling") or parameters or None
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def load_eagle3(
    directory: Path, weights: dict[str, mx.array], model: nn.Module, decoder: Decoder
) -> Eagle3Head:
    """An `Eagle3Head` from a checkpoint folder (its config.json and `weights`), in
    SafeAILab's, SpecForge's or vLLM's `speculators` layout."""
    outer = _read_config(directory)
    d, vocab_size, n = decoder.width, decoder.embed.weight.shape[0], len(decoder.layers)
    try:
        config, layers, options = _layout(outer, n)
    except (ValueError, TypeError) as err:
        raise HeadError(f"the EAGLE-3 head in {directory}: {err}") from None
    if "transformer_layer_config" in outer:  # speculators: the same layer under `layers.0.`
        weights = {_speculators_name(k): v for k, v in weights.items()}
        if any(k.startswith("layers.1.") for k in weights):
            raise HeadError(
                f"the EAGLE-3 head in {directory} has more than one layer; mlxspec loads "
                "one-layer EAGLE-3 heads"
            )
    width = config.get("hidden_size")
    target_width = outer.get("target_hidden_size") or width
    if width != d or target_width != d:
        raise HeadError(
            f"the EAGLE-3 head in {directory} has width {width} (target width "
            f"{target_width}); this target has {d}, and mlxspec "
            "loads EAGLE-3 heads only as wide as their target"
        )
    if len(set(layers)) < len(layers) or not all(0 <= i < n for i in layers):
        raise HeadError(
            f"an EAGLE-3 head reads the target's layers {', '.join(map(str, layers))}, which "
            f"are not {len(layers)} different layers of this {n}-layer target"
        )
    try:
        theta, scaling = _rope(config)
        heads = int(config["num_attention_heads"])
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=d,
            num_hidden_layers=1,
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or d // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab_size,
            attention_bias=bool(config.get("attention_bias", False)),
            rope_theta=theta,
            rope_scaling=scaling,
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
    options = replace(options, fc_bias="fc.bias" in weights)
    head = Eagle3Head(spec, args, vocab, layers, options)
    expected = {k for k, _ in tree_flatten(head.parameters())}
    # The references skip input_norm where norm_before_fc is off (vLLM's skip_substrs).
    harmless = HARMLESS + (() if options.norm_before_fc else ("input_norm.weight",))
    problem = unread_tensors(
        weights, expected | {"d2t", *UNUSED_PARTS}, harmless, f"the EAGLE-3 head in {directory}"
    )
    if problem is not None:
        raise HeadError(problem)
    pairs = [(k, v.astype(mx.float32)) for k, v in weights.items() if k in expected]
    try:
        head.load_weights(pairs, strict=True)
    except ValueError as err:
        raise HeadError(f"{directory} looks like an EAGLE-3 head but does not fit: {err}") from None
    return head
