"""Split a model across the ranks of a group: tensor parallel (the model's own `shard()`)
or pipeline (`model.model.pipeline()`, where mlx-lm's family has one), plus a fingerprint
of the model files so that ranks with different files are caught at start."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxspec.distributed.config import PARALLEL_MODES
from mlxspec.distributed.errors import DistributedError
from mlxspec.models.anatomy import text_settings


def _args(model: nn.Module) -> dict:
    """The model's settings (a multimodal wrapper's: its text model's)."""
    args = getattr(model, "args", None)
    return {} if args is None else text_settings(args)


def tensor_widths(model: nn.Module) -> dict[str, int]:
    """The sizes a tensor-parallel split divides among the ranks."""
    args = _args(model)
    names = {
        "num_attention_heads": "query heads",
        "num_key_value_heads": "KV heads",
        "intermediate_size": "MLP width",
        "linear_num_key_heads": "linear-attention key heads",  # Qwen3.5's Gated DeltaNet
        "linear_num_value_heads": "linear-attention value heads",
    }
    widths = {label: int(args[key]) for key, label in names.items() if args.get(key)}
    # Qwen3.5 splits an untied LM head by vocabulary rows.
    if hasattr(getattr(model, "language_model", None), "sharding_group"):
        if not args.get("tie_word_embeddings") and args.get("vocab_size"):
            widths["vocabulary"] = int(args["vocab_size"])
    return widths


def working_rank_counts(widths: dict[str, int], most: int = 16) -> list[int]:
    return [n for n in range(1, most + 1) if all(w % n == 0 for w in widths.values())]


def check_shardable(model: nn.Module, parallel: str, size: int) -> None:
    """Raise one clear line when this model cannot be split `size` ways in `parallel`."""
    family = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    inner = getattr(model, "model", None)
    if not hasattr(model, "shard") and not hasattr(inner, "pipeline"):
        raise DistributedError(
            f"mlx-lm's '{family}' models have neither a tensor-parallel shard() nor a "
            "pipeline split: run them on one rank"
        )
    if parallel == "tensor":
        if not hasattr(model, "shard"):
            raise DistributedError(
                f"mlx-lm's '{family}' models have no tensor-parallel shard(); "
                "try --parallel pipeline"
            )
        widths = tensor_widths(model)
        if any(w % size for w in widths.values()):
            counts = ", ".join(map(str, working_rank_counts(widths)))
            sizes = ", ".join(f"{w} {label}" for label, w in widths.items())
            raise DistributedError(
                f"tensor parallel over {size} ranks needs a rank count dividing the model's "
                f"{sizes}; rank counts that work: {counts}"
            )
    elif parallel == "pipeline":
        if inner is None or not hasattr(inner, "pipeline"):
            raise DistributedError(
                f"mlx-lm's '{family}' models have no pipeline split (mlx-lm has one for "
                "qwen2, qwen3_moe, deepseek_v3 and a few others); use --parallel tensor"
            )
        if len(inner.layers) < size:
            raise DistributedError(
                f"pipeline over {size} ranks needs at least {size} layers; "
                f"the model has {len(inner.layers)}"
            )
    else:
        raise DistributedError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}")


def shard(model: nn.Module, group: mx.distributed.Group, parallel: str) -> None:
    """Split a model whose weights may still be lazy (unread): only the slices this rank
    keeps are read when it is evaluated."""
    check_shardable(model, parallel, group.size())
    if parallel == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)


def allreduces_per_forward(model: nn.Module, parallel: str) -> int:
    """Collectives inside one forward pass: tensor parallel sums the attention and the
    MLP output of every layer; a pipeline passes the hidden state once per stage."""
    layers = len(getattr(getattr(model, "model", model), "layers", []))
    return 2 * layers if parallel == "tensor" else 1


def fingerprint(path: Path, samples: int = 64, chunk: int = 4096) -> int:
    """A 31-bit digest of a model's files (config, weights): names, sizes and evenly spaced
    samples of their bytes. Read from disk, so a rank that loads only its shard can still
    be compared with the others; cheap, and different model files differ."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if path.is_dir() and (path / "config.json").is_file():
        files.insert(0, path / "config.json")
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size};".encode())
        with file.open("rb") as stream:
            for offset in sorted({i * max(0, size - chunk) // samples for i in range(samples + 1)}):
                stream.seek(offset)
                digest.update(stream.read(chunk))
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF
