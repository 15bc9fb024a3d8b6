"""`mlxspec pull NAME --mtp`: a model's own MTP layer(s), fetched from its original checkpoint.

MLX conversions drop the MTP tensors (mlx-lm's `sanitize` filters them out), so they are
read from the original (Hugging Face) checkpoint, without downloading all of it: its
`model.safetensors.index.json` says which shard holds each tensor, and only the shards
holding MTP tensors are fetched (one `hf_hub_download` per file; a local folder with the
same files works too). Just those tensors are kept, quantized like the target when the
target is quantized, and saved in their published names (`formats.py` reads them) with the
config fields the layer needs.

MTP tensor names by family (config field giving the count in brackets):
- Qwen3-Next / Qwen3.5 / Qwen3.6: `mtp.*` (`mtp_num_hidden_layers`)
- DeepSeek-V3 / GLM-4.5: `model.layers.{num_hidden_layers + i}.*` (`num_nextn_predict_layers`)
- MiMo: `model.mtp_layers.{i}.*` (`num_nextn_predict_layers`)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mlx.core as mx

from mlxspec.models.packaged import PullError
from mlxspec.paths import cache_dir

INDEX_FILE, SINGLE_FILE, CONFIG_FILE = (
    "model.safetensors.index.json",
    "model.safetensors",
    "config.json",
)
MTP_FILE = "mtp.safetensors"
# Config fields the MTP layer's conversion reads (the rest of a config is not needed).
KEPT_CONFIG = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
)


def mtp_folder(target: str) -> Path:
    """Where the MTP layer of `target` (a hub id or path) is kept once pulled."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", target.strip("/~."))
    return cache_dir() / "mtp" / slug


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under text_config)."""
    return config.get("text_config", config)


def mtp_keys(names: list[str], config: dict) -> list[str]:
    """The tensor names among `names` that belong to MTP layers, by the layouts above.
    DeepSeek-V3's layer 61 also holds a copy of the target's embedding (vLLM's
    deepseek_mtp loads it as the shared one; 1.8 GB there): left out, the target's is used."""
    first = text_config(config).get("num_hidden_layers")
    count = text_config(config).get("num_nextn_predict_layers") or 1
    after_last = tuple(f"model.layers.{first + i}." for i in range(count)) if first else ()
    embedding_copies = tuple(f"{prefix}embed_tokens." for prefix in after_last)
    return sorted(
        name
        for name in names
        if name.startswith(("mtp.", "model.mtp_layers."))
        or ".mtp." in name
        or (after_last and name.startswith(after_last) and not name.startswith(embedding_copies))
    )


def _fetch(source: str, filename: str, required: bool = True) -> Path | None:
    """One file of `source`: from the folder it names, else from the hub (cached)."""
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / filename
        if path.is_file():
            return path
        if required:
            raise PullError(f"{local} has no {filename}; expected an original checkpoint")
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(source, filename))
    except LocalEntryNotFoundError:  # (a subclass of EntryNotFoundError)
        raise PullError(
            f"cannot reach the Hugging Face hub to fetch {filename} of {source} (offline?); "
            "run the same command when online"
        ) from None
    except EntryNotFoundError:
        if required:
            raise PullError(f"{source} on the hub has no {filename}") from None
        return None
    except GatedRepoError:
        raise PullError(
            f"{source} is gated on the Hugging Face hub; accept its licence there and log in "
            "with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise PullError(f"no model {source} on the Hugging Face hub; check --from") from None
    except OSError:
        raise PullError(
            f"cannot reach the Hugging Face hub to fetch {filename} of {source} (offline?); "
            "run the same command when online"
        ) from None


def _from_fp8(tensors: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """FP8 matrices made bfloat16, so that they quantize like the target's (or stay
    float as a float target's do). DeepSeek-V3 ships its layers as float8_e4m3 (read as
    bytes) with one `weight_scale_inv` per block of `weight_block_size` (128 x 128, in
    its config's quantization_config): the weight is the FP8 value times that scale."""
    block_rows, block_cols = (config.get("quantization_config") or {}).get(
        "weight_block_size", (128, 128)
    )
    out = dict(tensors)
    for scale_name in [name for name in tensors if name.endswith(".weight_scale_inv")]:
        name = scale_name.removesuffix("_scale_inv")
        weight = mx.from_fp8(out[name], dtype=mx.float32)
        scales = mx.repeat(mx.repeat(out.pop(scale_name), block_rows, 0), block_cols, 1)
        out[name] = (weight * scales[: weight.shape[0], : weight.shape[1]]).astype(mx.bfloat16)
    return out


def _quantized(tensors: dict[str, mx.array], quantization: dict) -> dict[str, mx.array]:
    """Matrices quantized as the target's are (mlx's `X.weight`, `X.scales`, `X.biases`);
    norms, vectors and matrices the group size does not divide stay."""
    group_size, bits = int(quantization["group_size"]), int(quantization["bits"])
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        base = name.removesuffix(".weight")
        quantizable = (
            name.endswith(".weight")
            and value.ndim == 2
            and mx.issubdtype(value.dtype, mx.floating)
            and value.shape[-1] % group_size == 0
        )
        if quantizable:
            weight, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            out.update({name: weight, f"{base}.scales": scales, f"{base}.biases": biases})
        else:
            out[name] = value
    return out


def pull_mtp(
    source: str, destination: Path, quantization: dict | None, say=lambda _: None
) -> list[str]:
    """Fetch, extract, (quantize) and save the MTP tensors of `source` in `destination`;
    the names of the tensors kept."""
    config = json.loads(_fetch(source, CONFIG_FILE).read_text())
    index_path = _fetch(source, INDEX_FILE, required=False)
    if index_path is not None:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:  # a one-file checkpoint: that file holds everything
        weight_map = {name: SINGLE_FILE for name in mx.load(str(_fetch(source, SINGLE_FILE)))}
    keys = mtp_keys(list(weight_map), config)
    if not keys:
        n = text_config(config).get("num_hidden_layers", "N")
        raise PullError(
            f"{source} has no MTP tensors (looked for mtp.*, model.mtp_layers.* and "
            f"model.layers.{n}.*); this model ships no MTP layer"
        )
    shards = sorted({weight_map[key] for key in keys})
    say(f"{len(keys)} MTP tensors in {len(shards)} of the checkpoint's files: {', '.join(shards)}")
    tensors: dict[str, mx.array] = {}
    for shard in shards:
        loaded = mx.load(str(_fetch(source, shard)))
        tensors.update({key: loaded[key] for key in keys if key in loaded})
    missing = [key for key in keys if key not in tensors]
    if missing:
        raise PullError(f"{source}'s index lists {missing[0]} but its shard does not hold it")
    # A multimodal wrapper's prefix (model.language_model.mtp.*) goes: formats reads mtp.*
    tensors = {key[key.index("mtp.") :] if ".mtp." in key else key: v for key, v in tensors.items()}
    tensors = _from_fp8(tensors, config)
    kept = {k: text_config(config)[k] for k in KEPT_CONFIG if k in text_config(config)}
    if quantization:
        tensors = _quantized(tensors, quantization)
        kept["quantization"] = {k: quantization[k] for k in ("group_size", "bits")}
    kept["mtp_source"] = source
    destination.mkdir(parents=True, exist_ok=True)
    partial = destination / f".{MTP_FILE}.{os.getpid()}.safetensors"
    mx.save_safetensors(str(partial), tensors)
    partial.replace(destination / MTP_FILE)
    (destination / CONFIG_FILE).write_text(json.dumps(kept, indent=2) + "\n")
    return keys
