"""What a model will hold, read from its files before it is loaded: the weights' bytes in
the form it will be loaded in, and a token's KV.

An estimate made in well under a second, so that a configuration the device cannot hold is
refused before the weights are read. It follows the load: a GGUF's activations, and so its
KV, are float32 on every path (`models/gguf.py`), and a model dequantized at load
(`--weights`) holds float32 weights, its element count times 4, not its file's bytes
(counting the file's let SmolLM2 at a 1M-token context load, then be refused: 0.09 GB of
Q4_1 on disk, 0.50 GB held). Every layer is counted as full attention; the loaded model is
measured again (`kv_form.kv_token_bytes`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from mlxspec.models.gguf_header import BadGGUFHeader, TensorInfo, read_header
from mlxspec.models.gguf_reader import EIGHT_BIT, GROUP_SIZE
from mlxspec.models.kv_form import KVForm

FLOAT_BYTES = 2  # float16 / bfloat16, what checkpoints hold
FLOAT32_BYTES = 4  # what a dequantized model, and any GGUF's activations, hold


@dataclass(frozen=True)
class Footprint:
    weights: int  # bytes, in the form the model will be loaded in
    kv_values: int  # a token's KV values, every layer's keys and values
    kv_element: int  # bytes a float KV value takes as loaded (2, or 4 for float32)

    def kv_token(self, kv: KVForm) -> int:
        """A token's KV bytes in `kv`'s form: float values, or packed values plus a scale
        and a bias per group in the KV's own dtype (mlx's affine quantization)."""
        if not kv.quantized:
            return self.kv_values * self.kv_element
        groups = self.kv_values // kv.group_size
        return self.kv_values * kv.bits // 8 + groups * 2 * self.kv_element


def footprint(path: str | Path, dequantize: bool = False) -> Footprint | None:
    """What a model folder or GGUF file will hold, loaded dequantized or as stored; None
    where its files do not say (absent, another layout)."""
    path = Path(path)
    try:
        if path.is_file() and path.suffix == ".gguf":
            header = read_header(path)
            weights = sum(_gguf_held(t, dequantize) for t in header.tensors)
            return Footprint(weights, _gguf_kv_values(header.metadata), FLOAT32_BYTES)
        if (path / "config.json").is_file():
            files = sorted(path.glob("*.safetensors"))
            weights = sum(f.stat().st_size for f in files)
            config = json.loads((path / "config.json").read_text())
            if dequantize:
                bits = (config.get("quantization") or {}).get("bits", 32)
                weights = FLOAT32_BYTES * sum(_safetensors_elements(f, bits) for f in files)
            element = FLOAT32_BYTES if dequantize else FLOAT_BYTES
            return Footprint(weights, _config_kv_values(config), element)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, BadGGUFHeader):
        return None
    return None


def _gguf_held(tensor: TensorInfo, dequantize: bool) -> int:
    """A GGUF tensor's bytes as loaded (`models/gguf_reader.py`): float32, or a quantized
    matrix kept as MLX affine blocks of 32 (8 bits where the file held more than 4, else
    4) with a float32 scale and bias each."""
    count = math.prod(tensor.dims)
    name = GGMLQuantizationType(tensor.type_id).name
    if dequantize or name in ("F32", "F16", "BF16"):
        return FLOAT32_BYTES * count
    bits = 8 if name in EIGHT_BIT else 4
    return count * bits // 8 + count // GROUP_SIZE * 2 * FLOAT32_BYTES


def _safetensors_elements(path: Path, bits: int) -> int:
    """Weights a safetensors file holds once unpacked, from its header's shapes: a
    quantized layer's packed uint32 words hold 32 / `bits` weights each (mlx-lm's
    layout); its scales and biases go away."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or name.endswith((".scales", ".biases")):
            continue
        count = math.prod(info["shape"])
        total += count * (32 // bits if info["dtype"] == "U32" else 1)
    return total


def _config_kv_values(config: dict) -> int:
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim


def _gguf_kv_values(meta: dict) -> int:
    arch = str(meta["general.architecture"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads)
    )
    return int(meta[f"{arch}.block_count"]) * 2 * kv_heads * head_dim
