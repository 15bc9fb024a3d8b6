"""A drafter head: a transformer layer (or a few) that reads the target's hidden state.

EAGLE/MTP style. Input at position i: the target's hidden state h_i (final-normed; MiMo's
MTP reads the last layer's output before the final norm, as vLLM's `MiMoModel.forward`
returns it) and the embedding of the next token x_{i+1}; output g_i, a guess of h_{i+1},
from which the target's own LM head rows give the draft distribution of x_{i+2}. Drafting
further feeds g back in place of h. The block is a layer of the target's own family (built by
mlx-lm's class), so its KV cache is an ordinary mlx-lm cache (one per layer where a head
has more than one: `head_cache`).

One module covers our trained heads and the published layouts (see `formats.py`):
EAGLE-1 (fc with bias over [embedding, hidden], block without input norm), MTP
(RMSNorm on each input, fc without bias, a final norm, its own LM head; MiMo puts the
hidden state first) — switches in `HeadSpec`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlxspec.models.anatomy import Decoder, last_attention_layer

HEAD_FILE, WEIGHTS_FILE = "head.json", "head.safetensors"
# Hub files of our heads and of published ones (EAGLE ships PyTorch .bin files).
HEAD_PATTERNS = ["*.json", "*.safetensors", "*.bin"]
FORMAT = "mlxspec-head-1"


class HeadError(ValueError):
    """A head that cannot be loaded or does not fit the target: one line for the user."""


@dataclass
class HeadSpec:
    hidden_size: int
    vocab_size: int  # the target's
    target: str = ""  # the models.toml name or reference it was made for
    fc_bias: bool = True
    input_norms: bool = False  # MTP: RMSNorm on the embedding and on the hidden state
    block_input_norm: bool = True  # EAGLE-1 drops the block's input_layernorm
    final_norm: bool = False  # MTP: a norm before the LM head
    own_lm_head: bool = False  # EAGLE-3/MTP checkpoints may ship their own LM head rows
    embedding_first: bool = True  # fc input order: [embedding, hidden] (MiMo: reversed)
    feed_normed: bool = False  # later draft steps read norm(g) instead of g (our heads)
    # h is the last layer's output before the target's final norm (MiMo), not after it.
    prenorm_input: bool = False
    # The embedding at sequence position 0 reads as zeros (vLLM's deepseek_mtp and
    # mimo_mtp: "masking inputs at position 0, as not needed by MTP").
    zero_first_embedding: bool = False
    layers: int = 1  # decoder layers after the fusion (published heads have one)
    # The target layer index the block is built as (None: its last attention layer).
    # DeepSeek-V3 / GLM-4.5 MTP layers are layer N of an N-layer target, and their
    # family picks dense or MoE by that index (first_k_dense_replace, moe_layer_freq).
    block_layer: int | None = None
    norm_eps: float = 1e-5
    source_format: str = FORMAT
    record: dict[str, Any] = field(default_factory=dict)  # how it was trained

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}


class Head(Protocol):
    """What drafting needs of a head: ours and the published ones (`DraftHead`, and
    `eagle3.Eagle3Head`, whose insides differ)."""

    spec: HeadSpec
    target_layers: tuple[int, ...]  # layers whose incoming residual stream it reads

    @property
    def vocab(self) -> mx.array: ...

    def from_target(self, rows: mx.array) -> mx.array: ...

    def __call__(self, hidden: mx.array, embeds: mx.array, mask: Any = None, cache=None): ...

    def features(self, g: mx.array) -> mx.array: ...

    def feedback(self, g: mx.array) -> mx.array: ...

    def logits(self, g: mx.array, rows: mx.array | None) -> mx.array: ...


def family_block(model: nn.Module, index: int | None = None) -> nn.Module:
    """A fresh layer of the target's family, built by mlx-lm's own class as layer
    `index`; by default like its last attention layer (a head keeps a KV cache, so never
    a hybrid model's recurrent one)."""
    attention_index = last_attention_layer(model.layers)
    last = model.layers[attention_index]
    index = attention_index if index is None else index
    # Multimodal wrappers (Qwen3.5) keep the text model's args on their language model.
    args = getattr(getattr(model, "language_model", model), "args", None)
    if args is None:
        raise HeadError(
            f"model type '{getattr(model, 'model_type', '?')}' has no args to build a layer"
        )
    try:
        return type(last)(args)
    except TypeError:  # families whose layers take their index (gemma3, lfm2, qwen3_next)
        return type(last)(args, index)


def lm_rows(decoder: Decoder, vocab: mx.array) -> mx.array:
    """The target LM head's rows for `vocab` ids, as a float matrix (n, d).

    Gathering rows of a quantized matrix and dequantizing just those keeps a
    reduced-vocabulary head cheap on Metal, where the target stays quantized.
    """
    head = decoder.head
    module = getattr(head, "__self__", head)  # embed.as_linear (tied) or lm_head
    weight = module.weight
    if "scales" in module:
        return mx.dequantize(
            weight[vocab],
            module.scales[vocab],
            module.get("biases")[vocab] if "biases" in module else None,
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        ).astype(mx.float32)
    return weight[vocab].astype(mx.float32)


class LayerCaches:
    """The KV caches of a head with several layers, one per layer, kept in step: the
    proposer trims and positions them as it would one cache."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    @property
    def offset(self) -> int:
        return self.parts[0].offset

    @offset.setter
    def offset(self, value: int) -> None:
        for part in self.parts:
            part.offset = value

    def trim(self, n: int) -> int:
        """Trim every layer's cache by `n`; how many entries were trimmed (as mlx-lm's)."""
        trimmed = [part.trim(n) for part in self.parts]
        return trimmed[0]

    def make_mask(self, *args, **kwargs):
        return self.parts[0].make_mask(*args, **kwargs)


def head_cache(head: Head, factory=KVCache):
    """A fresh KV cache for `head`: one `factory()` per layer (a `LayerCaches` when the
    head has more than one)."""
    if head.spec.layers == 1:
        return factory()
    return LayerCaches([factory() for _ in range(head.spec.layers)])


class DraftHead(nn.Module):
    def __init__(self, spec: HeadSpec, model: nn.Module, vocab: mx.array):
        """Fresh weights; the layers are `spec.layers` new layers of `model`'s family."""
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        # Besides the final normed state: the last layer's own output (`Decoder.hidden`'s
        # capture index len(layers)) where the head reads h before the final norm.
        self.target_layers = (len(model.layers),) if spec.prenorm_input else ()
        self.fc = nn.Linear(2 * d, d, bias=spec.fc_bias)
        if spec.input_norms:
            self.enorm = nn.RMSNorm(d, eps=spec.norm_eps)
            self.hnorm = nn.RMSNorm(d, eps=spec.norm_eps)
        # The first layer keeps the name `block`: heads saved with one layer load as ever.
        self.block = family_block(model, spec.block_layer)
        self.more_blocks = [family_block(model, spec.block_layer) for _ in range(spec.layers - 1)]
        if not spec.block_input_norm:
            self.block.input_layernorm = nn.Identity()
        if spec.final_norm:
            self.norm = nn.RMSNorm(d, eps=spec.norm_eps)
        if spec.own_lm_head:
            self.lm_head = nn.Linear(d, int(vocab.size), bias=False)
        self._vocab = vocab  # draft-vocabulary ids in the target's vocabulary (not trained)

    @property
    def vocab(self) -> mx.array:
        return self._vocab

    @property
    def blocks(self) -> list[nn.Module]:
        """The head's layers, in the order x runs through them."""
        return [self.block, *self.more_blocks]

    def from_target(self, rows: mx.array) -> mx.array:
        """What the first draft step reads from the target's rows (`Decoder.hidden`): the
        final normed state, their last d columns, or (`prenorm_input`) the captured
        state before the final norm, their first d."""
        d = self.spec.hidden_size
        return rows[..., :d] if self.spec.prenorm_input else rows[..., -d:]

    def __call__(self, hidden: mx.array, embeds: mx.array, mask: Any = None, cache=None):
        """g (B, L, d) from hidden states h (B, L, d) and next-token embeddings (B, L, d)."""
        if self.spec.zero_first_embedding and _first_position(cache) == 0:
            embeds = mx.concatenate([mx.zeros_like(embeds[:, :1]), embeds[:, 1:]], axis=1)
        if self.spec.input_norms:
            embeds, hidden = self.enorm(embeds), self.hnorm(hidden)
        parts = [embeds, hidden] if self.spec.embedding_first else [hidden, embeds]
        x = self.fc(mx.concatenate(parts, axis=-1))
        caches = cache.parts if isinstance(cache, LayerCaches) else [cache] * len(self.blocks)
        for block, layer_cache in zip(self.blocks, caches):
            x = block(x, mask, layer_cache)
        return x

    def features(self, g: mx.array) -> mx.array:
        """What the LM head reads: g, through the final norm where the head has one."""
        return self.norm(g) if self.spec.final_norm else g

    def feedback(self, g: mx.array) -> mx.array:
        """What the next draft step reads in place of the target's hidden state."""
        return self.features(g) if self.spec.feed_normed else g

    def logits(self, g: mx.array, rows: mx.array | None) -> mx.array:
        """Draft logits over the draft vocabulary; `rows` are the target LM head's rows."""
        g = self.features(g)
        if self.spec.own_lm_head:
            return self.lm_head(g)
        return g @ rows.T


def _first_position(cache) -> int | None:
    """The sequence position of the rows a head call takes in (its cache's offset; 0
    without a cache); None where the cache holds a position per row."""
    offset = 0 if cache is None else cache.offset
    return offset if isinstance(offset, int) else None


def save_head(head: DraftHead, directory: Path, dtype=mx.float16) -> None:
    """head.safetensors (weights in `dtype`, plus the vocabulary ids) and head.json."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(head.parameters())}
    weights["vocab"] = head.vocab.astype(mx.int32)
    tmp = directory / f".{WEIGHTS_FILE}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights)
    tmp.replace(directory / WEIGHTS_FILE)
    (directory / HEAD_FILE).write_text(json.dumps(head.spec.to_json(), indent=2) + "\n")


def build_head(spec: HeadSpec, model: nn.Module, vocab: mx.array) -> DraftHead:
    """A head for `model` with fresh weights: its layers start as copies of the target's
    last ones, in order, where the shapes allow (a far better start than random). Their
    output is on the residual stream's scale (large), so our heads have a final norm."""
    head = DraftHead(spec, model, vocab)
    if spec.final_norm:  # the target's own final norm: g starts on the target's scale
        norm = getattr(getattr(model, "model", None), "norm", None)
        if norm is not None and "weight" in norm:
            head.norm.weight = mx.array(norm.weight).astype(mx.float32)
    for block, source in zip(head.blocks, model.layers[-len(head.blocks) :]):
        _copy_layer(source, block)
    return head


def _copy_layer(source: nn.Module, block: nn.Module) -> None:
    """`source`'s weights into `block` when every one fits (float, same shape)."""
    theirs = dict(tree_flatten(source.parameters()))
    mine = dict(tree_flatten(block.parameters()))
    same = [(k, theirs[k]) for k, v in mine.items() if k in theirs and theirs[k].shape == v.shape]
    if len(same) == len(mine) and all(
        v.dtype in (mx.float32, mx.float16, mx.bfloat16) for _, v in same
    ):
        block.load_weights([(k, v.astype(mx.float32)) for k, v in same], strict=False)


def is_saved_head(directory: Path) -> bool:
    """Whether `directory` holds a head in our own format (else maybe a published one)."""
    return (directory / HEAD_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def load_saved_head(directory: Path, model: nn.Module, decoder: Decoder) -> DraftHead:
    """A head saved by `save_head` for `model` (published formats: `formats.load_head`)."""
    spec_file, weights_file = directory / HEAD_FILE, directory / WEIGHTS_FILE
    try:
        raw = json.loads(spec_file.read_text())
        if raw.pop("format", None) != FORMAT:
            raise HeadError(f"{spec_file} is not an mlxspec head ({FORMAT})")
        spec = HeadSpec(**raw)
        weights = mx.load(str(weights_file))
    except (OSError, ValueError, TypeError) as err:
        raise HeadError(f"cannot read the head in {directory}: {err}") from None
    check_fits(spec, decoder, directory)
    vocab = weights.pop("vocab").astype(mx.int32)
    head = DraftHead(spec, model, vocab)
    try:
        head.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    except ValueError as err:
        raise HeadError(
            f"the head in {directory} does not match this target's layers: {err}"
        ) from None
    return head


def check_fits(spec: HeadSpec, decoder: Decoder, where: Path) -> None:
    d = decoder.width
    vocab = decoder.embed.weight.shape[0]
    if spec.hidden_size != d or spec.vocab_size != vocab:
        raise HeadError(
            f"the head in {where} was made for a model of width {spec.hidden_size} and "
            f"vocabulary {spec.vocab_size}; this target has {d} and {vocab}"
            + (f" (it was trained for '{spec.target}')" if spec.target else "")
        )
