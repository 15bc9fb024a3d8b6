"""Published drafter checkpoints mapped into `DraftHead`.

Layouts (weight names as the projects publish them; safetensors files, or PyTorch .bin
files where a folder has none: read without torch, see `torch_bin.py`):
- EAGLE-1 (SafeAILab): `fc.{weight,bias}` over [embedding, hidden] and one decoder
  layer `layers.0.*` without input norm; the target's LM head reads its output.
- DeepSeek-V3 style MTP (also GLM-4.5): the layer after the last one in the target's own
  checkpoint, `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.*}` plus a decoder block,
  built as layer N (vLLM's deepseek_mtp.py / glm4_moe_mtp.py: dense or MoE by that index);
  without `shared_head.head` (GLM-4.6) the target's LM head reads it.
- MiMo MTP: `model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,
  final_layernorm}` plus a decoder block; [hidden, embedding] order; it reads the target's
  last layer output before the final norm (vLLM's mimo.py `MiMoModel.forward` returns
  `hidden_states + residual`, and `hidden_layernorm` was trained on that; mimo_mtp.py);
  its output is final-normed and fed back normed.
- Qwen3-Next / Qwen3.5 / Qwen3.6 MTP: `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,
  norm}` plus `mtp.layers.0.*` (a full-attention layer); zero-centred norms (the stored
  weight is w - 1); output normed and fed back normed; the target's LM head.
The MTP layer is the target family's own (dense or MoE): its weights pass through the
target's mlx-lm `sanitize` under a layer name of the target (which stacks MoE experts,
splits MLA's kv_b_proj, dequantizes FP8), then load strictly; quantized by `pull --mtp`,
they stay quantized where the target does (`stored_quantized.py`).
- EAGLE-3 (SafeAILab; `fc`, `midlayer.*`, `d2t`; or vLLM speculators' `layers.0.*` with
  `hidden_norm`): three target layers and a wider attention, a module of its own
  (`eagle3.py`).
Every tensor of the folder is read, or known harmless and named in a warning, or the
load fails naming it (`strict.py`); so are the fields of the folder's config.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxspec.device import prefers_dequantized_weights
from mlxspec.drafter.eagle3 import load_eagle3
from mlxspec.drafter.head import (
    DraftHead,
    Head,
    HeadError,
    HeadSpec,
    is_saved_head,
    load_saved_head,
)
from mlxspec.drafter.mtp_pull import KEPT_CONFIG
from mlxspec.drafter.stored_quantized import (
    as_loaded,
    dequantized,
    fit_quantized,
    quantized_bases,
    settings,
    stacked_experts,
)
from mlxspec.drafter.strict import unknown_fields, unread_tensors
from mlxspec.drafter.torch_bin import TorchCheckpointError, read_torch_bin
from mlxspec.models.anatomy import Decoder, last_attention_layer

BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
# Copies of the target's embedding that the layouts ship (EAGLE-1's; DeepSeek-V3's MTP
# layer's): the target's own is used, as vLLM does.
EMBEDDING_COPY = re.compile(r"^(model\.layers\.\d+\.)?embed_tokens\.weight$")
HARMLESS = ("*rotary_emb.inv_freq",)  # RoPE tables: a warning names them
# config.json fields: `pull --mtp` writes the target's (`mtp_pull.KEPT_CONFIG`), EAGLE-1
# ships its layer's llama config (the layer is built as the target's own, so those
# fields only have to agree with the weights' shapes, which load strictly).
MTP_FIELDS = (*KEPT_CONFIG, "quantization", "mtp_source")  # model_type: metadata (strict.py)
EAGLE1_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
)


def load_head(directory: Path, model: nn.Module, decoder: Decoder) -> Head:
    """Any head folder for `model`: ours (`save_head`) or a published checkpoint."""
    if is_saved_head(directory):
        return load_saved_head(directory, model, decoder)
    return convert_published(directory, model, decoder)


def read_weights(directory: Path, dequantize: bool = True) -> dict[str, mx.array]:
    """The folder's tensors (safetensors, else PyTorch .bin); those `pull --mtp` stored
    quantized made float unless `dequantize` is false."""
    weights: dict[str, mx.array] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    if not weights:  # the weights, not e.g. a training_args.bin beside them
        files = sorted(directory.glob("pytorch_model*.bin")) or sorted(directory.glob("*.bin"))
        for file in files:
            weights.update(_torch_bin(file))
    if dequantize and quantized_bases(weights):
        return dequantized(weights, *settings(directory))
    return weights


def _torch_bin(file: Path) -> dict[str, mx.array]:
    try:
        return {k: mx.array(v) for k, v in read_torch_bin(file).items()}
    except TorchCheckpointError as err:
        raise HeadError(str(err)) from None


def _split(weights: dict[str, mx.array], prefix: str, block: str, renames: dict[str, str]):
    """(our name, array, its checkpoint name) triples: the block's layer parts under
    `block`, and the `renames` parts under `prefix`; anything else is not taken."""
    triples = []
    for key, value in weights.items():
        if key.startswith(block) and key[len(block) :].startswith(BLOCK_PARTS):
            triples.append((f"block.{key[len(block) :]}", value, key))
        elif key.startswith(prefix):
            rest = key[len(prefix) :]
            name = next(
                (o + rest[len(t) :] for t, o in renames.items() if rest.startswith(t)), None
            )
            if name is not None:
                triples.append((name, value, key))
    return triples


def _check_folder(directory: Path, layout: str, names, used, harmless=()) -> None:
    """Every tensor and config field of a published head folder accounted for."""
    what = f"the {layout} head in {directory}"
    used = [*used, *(n for n in names if EMBEDDING_COPY.match(n))]
    problem = unread_tensors(names, used, HARMLESS + tuple(harmless), what)
    config_file = directory / "config.json"
    if problem is None and config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as err:
            raise HeadError(f"{config_file} is not JSON: {err}") from None
        fields = EAGLE1_FIELDS if layout == "eagle-1" else MTP_FIELDS
        problem = unknown_fields(config, fields, f"{what}: its config.json")
        if problem is None and config.get("mtp_use_dedicated_embeddings"):
            problem = f"{what}: mtp_use_dedicated_embeddings is not supported"
        if problem is None and config.get("hidden_act", "silu") != "silu":
            problem = f"{what}: hidden_act {config['hidden_act']!r} is not supported"
    if problem is not None:
        raise HeadError(problem)


@dataclass(frozen=True)
class Layout:
    """A published head layout: present when `prefix` + its first renamed part +
    "weight" is a key."""

    name: str
    prefix: str  # where the fusion parts (renamed by `renames`) live
    block: str  # where the decoder layer's parts live
    renames: dict[str, str]
    switches: dict = field(default_factory=dict)  # HeadSpec switches
    zero_centred: bool = False  # norms stored as w - 1 (Qwen3-Next's RMSNorm is 1 + w)


NORM_SUFFIX = "norm.weight"


def _layouts(model: nn.Module) -> list[Layout]:
    n = len(model.layers)
    mtp = {"input_norms": True, "final_norm": True, "fc_bias": False}
    deepseek = {
        "eh_proj.": "fc.",
        "enorm.": "enorm.",
        "hnorm.": "hnorm.",
        "shared_head.norm.": "norm.",
        "shared_head.head.": "lm_head.",
    }
    mimo = {
        "input_proj.": "fc.",
        "token_layernorm.": "enorm.",
        "hidden_layernorm.": "hnorm.",
        "final_layernorm.": "norm.",
    }
    qwen3_next = {
        "fc.": "fc.",
        "pre_fc_norm_embedding.": "enorm.",
        "pre_fc_norm_hidden.": "hnorm.",
        "norm.": "norm.",
    }
    return [
        Layout("eagle-1", "", "layers.0.", {"fc.": "fc."}, {"block_input_norm": False}),
        # DeepSeek-V3 and GLM-4.5: the layer after the target's last one, built as that
        # layer (vLLM's deepseek_mtp / glm4_moe_mtp give its decoder layer index N).
        Layout(
            "deepseek-mtp",
            f"model.layers.{n}.",
            f"model.layers.{n}.",
            deepseek,
            {**mtp, "block_layer": n, "zero_first_embedding": True},
        ),
        Layout(
            "mimo-mtp",
            "model.mtp_layers.0.",
            "model.mtp_layers.0.",
            mimo,
            {
                **mtp,
                "embedding_first": False,
                "feed_normed": True,
                "prenorm_input": True,
                "zero_first_embedding": True,
            },
        ),
        Layout(
            "qwen3-next-mtp",
            "mtp.",
            "mtp.layers.0.",
            qwen3_next,
            {**mtp, "feed_normed": True},
            zero_centred=True,
        ),
    ]


def _sanitize_marker(model: nn.Module) -> str:
    """The layer name the block's weights go through the target's `sanitize` under."""
    return f"model.layers.{last_attention_layer(model.layers)}."


def _misfit(err: Exception, model: nn.Module, layout: Layout) -> str:
    """What does not fit, on one line; a tensor `sanitize` asked for (an expert, say) in
    the checkpoint's own name rather than the layer name it was passed under."""
    if isinstance(err, KeyError):
        return "missing " + str(err.args[0]).replace(_sanitize_marker(model), layout.block)
    return " ".join(str(err).split())


def _not_the_heads(layout: Layout, names, model: nn.Module) -> list[str]:
    """Tensors of an MTP checkpoint folder that are not the head's but harmless: the
    target's own (a whole checkpoint rather than `pull --mtp`'s extract) and the MTP
    layers after the first, which mlxspec does not use (every draft step runs the
    first; vLLM's MiMo MTP drafts one step, its DeepSeek MTP cycles through them)."""
    stem, _, index = layout.block.rstrip(".").rpartition(".")
    later = re.compile(rf"^{re.escape(stem)}\.(\d+)\.")
    target = re.compile(r"^(model\.(layers\.(\d+)\.|embed_tokens\.|norm\.)|lm_head\.)")
    n = len(model.layers)

    def skipped(name: str) -> bool:
        if (m := later.match(name)) and int(m.group(1)) > int(index):
            return True
        m = target.match(name)
        return bool(m) and (m.group(3) is None or int(m.group(3)) < n)

    return [name for name in names if skipped(name)]


def _family_names(model: nn.Module, pairs: list, zero_centred: bool) -> list:
    """The block's weights in the names of mlx-lm's layer class: put through the target's
    own `sanitize` as if they were its last attention layer's. Zero-centred norms get
    their 1 back unless that sanitize already added it."""
    block = {k[len("block.") :]: v for k, v in pairs if k.startswith("block.")}
    rest = [(k, v) for k, v in pairs if not k.startswith("block.")]
    if zero_centred:
        rest = [(k, v + 1.0 if k.endswith(NORM_SUFFIX) else v) for k, v in rest]
    sanitize = getattr(model, "sanitize", None)
    if not block or sanitize is None:
        return rest + [(f"block.{k}", v) for k, v in block.items()]
    marker = _sanitize_marker(model)
    out = sanitize({marker + k: v for k, v in stacked_experts(block).items()})
    converted = {k.split(marker, 1)[1]: v for k, v in out.items() if marker in k}
    for key, value in converted.items():
        untouched = key in block and block[key] is value
        if zero_centred and key.endswith(NORM_SUFFIX) and value.ndim == 1 and untouched:
            converted[key] = value + 1.0
    return rest + [(f"block.{k}", v) for k, v in converted.items()]


def convert_published(
    directory: Path, model: nn.Module, decoder: Decoder, dequantize: bool | None = None
) -> Head:
    """A `DraftHead` from a published checkpoint folder (see the module docstring).
    Layers `pull --mtp` stored quantized stay quantized unless `dequantize` (default: where
    quantized matmul is slow, as for the target; see `stored_quantized.py`)."""
    if not directory.is_dir():
        raise HeadError(f"no drafter head at {directory}: not a folder")
    keep = not (prefers_dequantized_weights() if dequantize is None else dequantize)
    weights = read_weights(directory, dequantize=not keep)
    eagle3 = "layers.0.hidden_norm.weight" in weights  # vLLM speculators' names
    if eagle3 or any(key.startswith("midlayer.") for key in weights):
        return load_eagle3(directory, read_weights(directory), model, decoder)
    for layout in _layouts(model):
        if f"{layout.prefix}{next(iter(layout.renames))}weight" not in weights:
            continue
        triples = _split(weights, layout.prefix, layout.block, layout.renames)
        skipped = [] if layout.name == "eagle-1" else _not_the_heads(layout, weights, model)
        _check_folder(directory, layout.name, weights, [t[2] for t in triples], skipped)
        pairs = [(name, value) for name, value, _ in triples]
        own_head = any(k.startswith("lm_head.") for k, _ in pairs)
        d, vocab_size = decoder.width, decoder.embed.weight.shape[0]
        spec = HeadSpec(
            hidden_size=d,
            vocab_size=vocab_size,
            source_format=layout.name,
            own_lm_head=own_head,
            **layout.switches,
        )
        head = DraftHead(spec, model, mx.arange(vocab_size, dtype=mx.int32))
        try:
            named = dict(_family_names(model, pairs, layout.zero_centred))
            named = fit_quantized(head, named, directory, keep)
            head.load_weights([(k, as_loaded(v)) for k, v in named.items()], strict=True)
        except HeadError:
            raise
        except (ValueError, KeyError) as err:
            raise HeadError(
                f"{directory} looks like a {layout.name} head but does not fit this target "
                f"({type(model.layers[-1]).__name__} layers): {_misfit(err, model, layout)}"
            ) from None
        return head
    raise HeadError(
        f"no drafter head in {directory}: expected an mlxspec head (head.json + head.safetensors), "
        "an EAGLE-1 or EAGLE-3 checkpoint (fc.weight with layers.0.* or midlayer.*) or MTP "
        f"layers (model.layers.{len(model.layers)}.eh_proj, model.mtp_layers.0.*, mtp.fc)"
    )
