"""Published drafter checkpoints mapped into `DraftHead`.

Layouts (weight names as the projects publish them; safetensors files, or PyTorch .bin
files where a folder has none: read without torch, see `torch_bin.py`):
- EAGLE-1 (SafeAILab): `fc.{weight,bias}` over [embedding, hidden] and one decoder
  layer `layers.0.*` without input norm; the target's LM head reads its output.
- DeepSeek-V3 style MTP (also GLM-4.5): the layer after the last one in the target's own
  checkpoint, `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.*}` plus a decoder block.
- MiMo MTP: `model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,
  final_layernorm}` plus a decoder block; [hidden, embedding] order.
- EAGLE-3 (SafeAILab; `fc`, `midlayer.*`, `d2t`): three target layers and a wider
  attention, a module of its own (`eagle3.py`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxspec.anatomy import Decoder
from mlxspec.drafter.eagle3 import load_eagle3
from mlxspec.drafter.head import DraftHead, Head, HeadError, HeadSpec
from mlxspec.drafter.torch_bin import TorchCheckpointError, read_torch_bin

BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def read_weights(directory: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    if not weights:  # the weights, not e.g. a training_args.bin beside them
        files = sorted(directory.glob("pytorch_model*.bin")) or sorted(directory.glob("*.bin"))
        for file in files:
            weights.update(_torch_bin(file))
    return weights


def _torch_bin(file: Path) -> dict[str, mx.array]:
    try:
        return {k: mx.array(v) for k, v in read_torch_bin(file).items()}
    except TorchCheckpointError as err:
        raise HeadError(str(err)) from None


def _split(weights: dict[str, mx.array], prefix: str, block: str, renames: dict[str, str]):
    """(our name, array) pairs: the block's layer parts under `block`, and the `renames`
    parts under `prefix`; anything else (embedding copies, the target's layers) is left."""
    pairs = []
    for key, value in weights.items():
        if key.startswith(block) and key[len(block) :].startswith(BLOCK_PARTS):
            pairs.append((f"block.{key[len(block) :]}", value))
        elif key.startswith(prefix):
            rest = key[len(prefix) :]
            name = next(
                (o + rest[len(t) :] for t, o in renames.items() if rest.startswith(t)), None
            )
            if name is not None:
                pairs.append((name, value))
    return pairs


def _layouts(model: nn.Module) -> list[tuple[str, str, str, dict[str, str], dict]]:
    """(name, prefix, block prefix, renames, HeadSpec switches) per layout; it is present
    when its prefix + its first renamed part + "weight" is a key."""
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
    return [
        ("eagle-1", "", "layers.0.", {"fc.": "fc."}, {"block_input_norm": False}),
        ("deepseek-mtp", f"model.layers.{n}.", f"model.layers.{n}.", deepseek, mtp),
        (
            "mimo-mtp",
            "model.mtp_layers.0.",
            "model.mtp_layers.0.",
            mimo,
            {**mtp, "embedding_first": False},
        ),
    ]


def convert_published(directory: Path, model: nn.Module, decoder: Decoder) -> Head:
    """A `DraftHead` from a published checkpoint folder (see the module docstring)."""
    if not directory.is_dir():
        raise HeadError(f"no drafter head at {directory}: not a folder")
    weights = read_weights(directory)
    if any(key.startswith("midlayer.") for key in weights):
        return load_eagle3(directory, weights, model, decoder)
    for name, prefix, block, renames, switches in _layouts(model):
        if f"{prefix}{next(iter(renames))}weight" not in weights:
            continue
        pairs = _split(weights, prefix, block, renames)
        own_head = any(k.startswith("lm_head.") for k, _ in pairs)
        d, vocab_size = decoder.width, decoder.embed.weight.shape[0]
        spec = HeadSpec(
            hidden_size=d,
            vocab_size=vocab_size,
            source_format=name,
            own_lm_head=own_head,
            **switches,
        )
        head = DraftHead(spec, model, mx.arange(vocab_size, dtype=mx.int32))
        try:
            head.load_weights([(k, v.astype(mx.float32)) for k, v in pairs], strict=True)
        except ValueError as err:
            raise HeadError(
                f"{directory} looks like a {name} head but does not fit this target: {err}"
            ) from None
        return head
    raise HeadError(
        f"no drafter head in {directory}: expected an mlxspec head (head.json + head.safetensors), "
        "an EAGLE-1 or EAGLE-3 checkpoint (fc.weight with layers.0.* or midlayer.*) or MTP "
        "layers (eh_proj / mtp_layers)"
    )
