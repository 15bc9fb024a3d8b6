"""Block drafters as published: z-lab's DFlash and DeepSeek's DSpark (DeepSpec).

Both draft a whole block in ONE pass. The target's residual stream after a few of its
layers (`target_layer_ids`), side by side, goes through `fc` and `hidden_norm` once per
position into a context; every drafter layer projects that context with its own k/v
projections into a KV cache (of committed positions only). The block is the pending
token followed by B-1 copies of `mask_token_id`; its queries attend over the whole
context and over each other (not causally, by default), at the positions the tokens
would take. The final norm's output goes through an LM head:
- DFlash borrows the target's embedding and LM head; slot j (j >= 1) predicts the token
  at the slot's own position, so a block of B gives B-1 drafts.
- DSpark has its own embedding and LM head; slot j predicts the token after it (the
  anchor's slot too: B drafts), and a low-rank Markov head adds to slot j's logits a
  bias read from the token before it, so its drafts are drawn left to right.

Weight names, config fields and their sources: docs/design/drafters.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from mlxspec.drafter.strict import unknown_fields, unread_tensors
from mlxspec.models.anatomy import Decoder

CONFIG = "config.json"
BLOCK_PATTERNS = ["*.json", "*.safetensors"]  # hub files of a published block drafter
DFLASH, DSPARK = "dflash", "dspark"  # the formats (models.toml's `format`)
# config.json fields read below (or checked to hold what mlxspec runs); the rest of a
# published config must be Hugging Face metadata (`strict.HF_METADATA`).
CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",  # Qwen3's default for layer_types, which the configs spell out
    "is_causal",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",  # the target's depth, checked through target_layer_ids
    "dflash_config",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "num_anchors",  # DSpark training only
    "mlxspec_training",  # our trainer's record
)
DFLASH_FIELDS = ("mask_token_id", "target_layer_ids", "block_size", "causal")
# vLLM's qwen3_dflash options mlxspec does not run: each is refused in one line when on.
UNSUPPORTED_OPTIONS = {
    "use_swa": "sliding-window block decoding",
    "attention_sink_bias": "attention sinks",
}


class BlockDrafterError(ValueError):
    """A block drafter that cannot be loaded or does not fit the target: one line."""


@dataclass(frozen=True)
class BlockSpec:
    format: str  # DFLASH or DSPARK
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # layer i's OUTPUT (-1: the embedding output)
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    windows: tuple[int | None, ...]  # per layer: a sliding window over the context, or None
    causal: tuple[bool, ...]  # per layer: block queries see only earlier block slots
    bias: bool = False  # attention projections with biases
    markov_rank: int = 0  # DSpark's Markov head (0: none)
    confidence_input: int = 0  # DSpark's confidence head's input width (0: none)

    @property
    def first_slot(self) -> int:
        """The first block slot whose output is a draft (DFlash's anchor slot is not)."""
        return 1 if self.format == DFLASH else 0

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_slot


class Attention(nn.Module):
    def __init__(self, spec: BlockSpec, window: int | None, causal: bool, rope: nn.Module):
        super().__init__()
        d, hd = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.window, self.causal = (
            spec.heads,
            spec.kv_heads,
            window,
            causal,
        )
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, spec.heads * hd, bias=spec.bias)
        self.k_proj = nn.Linear(d, spec.kv_heads * hd, bias=spec.bias)
        self.v_proj = nn.Linear(d, spec.kv_heads * hd, bias=spec.bias)
        self.o_proj = nn.Linear(spec.heads * hd, d, bias=spec.bias)
        self.q_norm = nn.RMSNorm(hd, eps=spec.norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=spec.norm_eps)
        self._rope = rope  # shared, without weights

    def _keys_values(self, x: mx.array, position: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self._rope(keys, offset=position), values

    def add_context(self, context: mx.array, position: int, cache: KVCache) -> None:
        """Cache the keys and values of context rows that start at `position`."""
        cache.update_and_fetch(*self._keys_values(context, position))

    def __call__(self, x: mx.array, position, cache: KVCache, mask=None) -> mx.array:
        """The block x (B, L, d) at `position` (an int, or one per row for training, which
        passes its own `mask`) over the cached context and itself."""
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self._rope(queries, offset=position)
        block_keys, block_values = self._keys_values(x, position)
        context_keys, context_values = cache.keys_and_values()
        keys = mx.concatenate([context_keys, block_keys], axis=2)
        values = mx.concatenate([context_values, block_values], axis=2)
        if mask is None:
            mask = self._mask(position, cache.offset, L)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _mask(self, position: int, n_context: int, L: int) -> mx.array | None:
        """Which keys each block query sees: those less than the window before it (if
        the layer slides), and no later block slot (if causal); None: all of them. As
        SpecForge trains DFlash drafters (`create_dflash_sdpa_mask` in
        specforge/algorithms/common/dflash_family_model.py: a sliding layer's query at
        slot j sees context from `anchor + j - (window - 1)` and block slots <= j);
        z-lab/dflash's model.py attends without a mask (`is_causal=False`) and hands the
        window to the attention kernel."""
        if not self.causal and (self.window is None or n_context + L <= self.window):
            return None
        query = position + mx.arange(L)[:, None]
        key = mx.arange(position - n_context, position + L)[None]
        seen = key <= query if self.causal else mx.ones((L, n_context + L), mx.bool_)
        return seen & (query - key < self.window) if self.window else seen


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, spec: BlockSpec, window: int | None, causal: bool, rope: nn.Module):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.self_attn = Attention(spec, window, causal, rope)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)

    def __call__(self, x: mx.array, position, cache: KVCache, mask=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), position, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Markov(nn.Module):
    """DSpark's Markov head: logits of a slot += w2(w1[the token before it])."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(tokens))


class Confidence(nn.Module):
    """DSpark's acceptance predictor; loaded (it is part of the layout), not used: the
    engine's policy measures acceptance itself."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class BlockDrafter(nn.Module):
    def __init__(self, spec: BlockSpec, vocab_size: int, rope: nn.Module):
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.fc = nn.Linear(len(spec.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=spec.norm_eps)
        self.layers = [Layer(spec, w, c, rope) for w, c in zip(spec.windows, spec.causal)]
        self.norm = nn.RMSNorm(d, eps=spec.norm_eps)
        if spec.format == DSPARK:
            self.embed_tokens = nn.Embedding(vocab_size, d)
            self.lm_head = nn.Linear(d, vocab_size, bias=False)
        if spec.markov_rank:
            self.markov_head = Markov(vocab_size, spec.markov_rank)
        if spec.confidence_input:
            self.confidence_head = Confidence(spec.confidence_input)

    @property
    def capture(self) -> tuple[int, ...]:
        """`Decoder.hidden`'s capture indices: layer i's output enters layer i + 1."""
        return tuple(i + 1 for i in self.spec.target_layer_ids)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def add_context(self, features: mx.array, position: int, caches: list[KVCache]) -> None:
        """Take in target features (1, n, len(ids) * d) of positions `position`.. ."""
        context = self.hidden_norm(self.fc(features))
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.add_context(context, position, cache)

    def draft_logits(
        self, pending: int, position: int, caches: list[KVCache], decoder: Decoder
    ) -> mx.array:
        """Logits (drafts_per_block, V) of the block after `pending` (at `position`),
        before DSpark's Markov bias (which depends on the drafts drawn)."""
        spec = self.spec
        block = mx.array([[pending] + [spec.mask_token_id] * (spec.block_size - 1)])
        h = self.block_hidden(block, position, caches, decoder)
        logits = self.lm_head(h) if spec.format == DSPARK else decoder.head(h)
        return logits[0].astype(mx.float32)

    def block_hidden(self, blocks: mx.array, position, caches, decoder: Decoder, mask=None):
        """The final norm's output (B, drafts_per_block, d) at the drafting slots of
        `blocks` (B, block_size) token ids (see `Attention.__call__` for the rest)."""
        spec = self.spec
        h = self.embed_tokens(blocks) if spec.format == DSPARK else decoder.embed(blocks)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, position, cache, mask)
        return self.norm(h[:, spec.first_slot :])

    def markov_bias(self, previous: list[int]) -> mx.array | None:
        """(len(previous), V) logit biases of slots that follow `previous` tokens."""
        if not self.spec.markov_rank:
            return None
        return self.markov_head(mx.array(previous)).astype(mx.float32)


# --- Loading ------------------------------------------------------------------------------


def _config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise BlockDrafterError(f"no readable {CONFIG} in {directory}: {err}") from None
    if not isinstance(config, dict):
        raise BlockDrafterError(f"{directory / CONFIG} is not a JSON object")
    return config


def detect_format(config: dict[str, Any], names: set[str]) -> str:
    """DFLASH or DSPARK from the config (architectures, fields) and the tensor names."""
    architecture = (config.get("architectures") or [""])[0]
    if architecture == "DFlash2DraftModel" or "conv_kernel_size" in config.get("dflash_config", {}):
        raise BlockDrafterError(
            "DFlash2 drafters (convolutions and a candidate selector) are not supported yet; "
            "use a DFlash (DFlashDraftModel) or DSpark drafter"
        )
    if architecture.endswith("DSparkModel") or "markov_rank" in config:
        return DSPARK
    if architecture == "DFlashDraftModel" or "dflash_config" in config:
        return DFLASH
    if "embed_tokens.weight" in names and "fc.weight" in names:
        return DSPARK
    raise BlockDrafterError(
        "it is not a block drafter: expected a DFlash config (architectures DFlashDraftModel, "
        "dflash_config) or a DSpark one (architectures Qwen3DSparkModel, markov_rank)"
    )


def _check_fields(config: dict[str, Any]) -> None:
    """Every config field understood, and no option on that mlxspec does not run."""
    nested = config.get("dflash_config") or {}
    allowed = DFLASH_FIELDS + tuple(UNSUPPORTED_OPTIONS) + ("swa_window_size",)
    problem = unknown_fields(config, CONFIG_FIELDS, f"its {CONFIG}") or unknown_fields(
        nested, allowed, "its dflash_config"
    )
    if problem:
        raise BlockDrafterError(problem)
    for option, what in UNSUPPORTED_OPTIONS.items():
        if nested.get(option):
            raise BlockDrafterError(f"dflash_config.{option} ({what}) is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise BlockDrafterError(f"hidden_act {config['hidden_act']!r} is not supported")
    sliding = "sliding_attention" in (config.get("layer_types") or [])
    if sliding and config.get("use_sliding_window") is False:
        raise BlockDrafterError("it has sliding_attention layers but use_sliding_window false")


def _spec(config: dict[str, Any], fmt: str) -> BlockSpec:
    nested = config.get("dflash_config") or {}

    def field(name: str, default: Any = None) -> Any:
        value = nested.get(name, config.get(name, default))
        if value is None:
            raise BlockDrafterError(f"its {CONFIG} lacks {name}")
        return value

    try:
        layers = int(field("num_hidden_layers"))
        kinds = config.get("layer_types") or ["full_attention"] * layers
        if len(kinds) != layers or set(kinds) - {"full_attention", "sliding_attention"}:
            raise BlockDrafterError(f"layer_types {kinds} do not fit {layers} layers")
        window = config.get("sliding_window")
        if "sliding_attention" in kinds and not window:
            raise BlockDrafterError("sliding_attention layers need a sliding_window")
        causal = nested.get("causal", config.get("is_causal"))
        heads = int(field("num_attention_heads"))
        markov = int(config.get("markov_rank", 0)) if fmt == DSPARK else 0
        if markov and config.get("markov_head_type", "vanilla") != "vanilla":
            raise BlockDrafterError(
                f"markov_head_type {config['markov_head_type']!r} is not supported (vanilla is)"
            )
        d = int(field("hidden_size"))
        confidence = 0
        if fmt == DSPARK and config.get("enable_confidence_head"):
            confidence = d + (markov if config.get("confidence_head_with_markov") else 0)
        return BlockSpec(
            format=fmt,
            block_size=int(field("block_size", 16)),
            mask_token_id=int(field("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in field("target_layer_ids")),
            hidden_size=d,
            layers=layers,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or d // heads),
            intermediate_size=int(field("intermediate_size")),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
            # Causal where the config says so, else where it slides (SpecForge's mask).
            causal=tuple(
                bool(causal) if causal is not None else kind == "sliding_attention"
                for kind in kinds
            ),
            bias=bool(config.get("attention_bias", False)),
            markov_rank=markov,
            confidence_input=confidence,
        )
    except (TypeError, ValueError) as err:
        if isinstance(err, BlockDrafterError):
            raise
        raise BlockDrafterError(f"its {CONFIG} has a malformed field: {err}") from None


def _check_fits(spec: BlockSpec, decoder: Decoder, vocab_size: int | None) -> None:
    d, n = decoder.width, len(decoder.layers)
    if spec.hidden_size != d:
        raise BlockDrafterError(
            f"it is {spec.hidden_size} wide and reads a target of that width; this target "
            f"is {d} wide"
        )
    ids = spec.target_layer_ids
    if not ids or any(a >= b for a, b in zip(ids, ids[1:])) or ids[0] < -1 or ids[-1] >= n:
        raise BlockDrafterError(
            f"its target_layer_ids {list(ids)} are not increasing layers of this {n}-layer target"
        )
    target_vocab = decoder.embed.weight.shape[0]
    if vocab_size is not None and vocab_size != target_vocab:
        raise BlockDrafterError(
            f"it drafts over {vocab_size} tokens; this target's vocabulary has {target_vocab}"
        )
    if not 0 <= spec.mask_token_id < target_vocab or spec.block_size < 2:
        raise BlockDrafterError(
            f"mask_token_id {spec.mask_token_id} / block_size {spec.block_size} do not fit"
        )


def load_block_drafter(directory: Path, decoder: Decoder, fmt: str | None = None) -> BlockDrafter:
    """A `BlockDrafter` from a checkpoint folder (config.json and *.safetensors) in its
    published layout; `fmt` forces DFLASH or DSPARK (default: detected)."""
    if not directory.is_dir():
        raise BlockDrafterError(f"no block drafter at {directory}: not a folder")
    config = _config(directory)
    weights: dict[str, mx.array] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    if not weights:
        raise BlockDrafterError(f"no *.safetensors weights in {directory}")
    try:
        fmt = fmt or detect_format(config, set(weights))
        if "gemma" in str(config.get("model_type", "")):
            raise BlockDrafterError(
                f"it is a Gemma-style {fmt} drafter (k=v attention, sandwich norms); "
                "mlxspec loads Qwen3-style drafter layers only"
            )
        _check_fields(config)
        spec = _spec(config, fmt)
        head = weights.get("lm_head.weight")
        _check_fits(spec, decoder, None if head is None else head.shape[0])
    except BlockDrafterError as err:
        raise BlockDrafterError(f"the block drafter in {directory}: {err}") from None
    rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
    theta = config.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
    rope = initialize_rope(
        spec.head_dim,
        base=float(theta),
        traditional=False,
        scaling_config=rope_scaling if (rope_scaling or {}).get("rope_type") != "default" else None,
        max_position_embeddings=config.get("max_position_embeddings"),
    )
    drafter = BlockDrafter(spec, decoder.embed.weight.shape[0], rope)
    expected = {name: value.shape for name, value in tree_flatten(drafter.parameters())}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise BlockDrafterError(
            f"the {fmt} drafter in {directory} lacks {len(missing)} tensor(s): "
            + ", ".join(missing[:4])
            + (" ..." if len(missing) > 4 else "")
        )
    wrong = [n for n, shape in expected.items() if tuple(weights[n].shape) != tuple(shape)]
    if wrong:
        name = wrong[0]
        raise BlockDrafterError(
            f"the {fmt} drafter in {directory} does not fit this target: {name} is "
            f"{tuple(weights[name].shape)}, expected {tuple(expected[name])}"
        )
    problem = unread_tensors(
        weights, expected, ("*rotary_emb.inv_freq",), f"the {fmt} drafter in {directory}"
    )
    if problem is not None:
        raise BlockDrafterError(problem)
    drafter.load_weights([(n, weights[n]) for n in expected], strict=True)
    drafter.eval()
    mx.eval(drafter.parameters())
    return drafter
