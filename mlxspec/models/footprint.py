"""What a model will hold, read from its files before it is loaded: the weights' bytes as
stored and a token's float KV bytes (from config.json or the GGUF header).

An estimate made in well under a second, so that a configuration the device cannot
hold is refused before the weights are read. It never overstates: weights are counted
as stored (a quantized file dequantized at load holds more) and every layer as full
attention; the loaded model is measured again (`kv_form.kv_token_bytes`).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxspec.models.gguf_header import BadGGUFHeader, read_header
from mlxspec.models.kv_form import KVForm

FLOAT_BYTES = 2  # float16 / bfloat16, what checkpoints and their KV hold


def footprint(path: str | Path) -> tuple[int, int] | None:
    """(weights' bytes as stored, float KV bytes per token) of a model folder or GGUF
    file; None where its files do not say (absent, another layout)."""
    path = Path(path)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return path.stat().st_size, _gguf_kv_token(path)
        if (path / "config.json").is_file():
            weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            return weights, _config_kv_token(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, BadGGUFHeader):
        return None
    return None


def _config_kv_token(config: dict) -> int:
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * FLOAT_BYTES


def _gguf_kv_token(path: Path) -> int:
    meta = read_header(path).metadata
    arch = str(meta["general.architecture"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads)
    )
    return int(meta[f"{arch}.block_count"]) * 2 * kv_heads * head_dim * FLOAT_BYTES


def in_form(float_bytes: int, kv: KVForm) -> int:
    """A token's KV bytes in `kv`'s form, from its float size: packed values plus a float
    scale and bias per group (mlx's affine quantization)."""
    if not kv.quantized:
        return float_bytes
    values = float_bytes // FLOAT_BYTES
    return values * kv.bits // 8 + (values // kv.group_size) * 2 * FLOAT_BYTES
