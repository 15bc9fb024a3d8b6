"""Split a loaded model across the ranks of a group: tensor parallel (the model's own
`shard()`) or pipeline (`model.model.pipeline()`, where mlx-lm's family has one), plus a
fingerprint of the weights so that ranks with different model files are caught at start."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec.distributed.config import PARALLEL_MODES
from mlxspec.distributed.errors import DistributedError


def _args(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    return vars(args) if args is not None else {}


def tensor_widths(model: nn.Module) -> dict[str, int]:
    """The sizes a tensor-parallel split divides among the ranks."""
    args = _args(model)
    names = {
        "num_attention_heads": "query heads",
        "num_key_value_heads": "KV heads",
        "intermediate_size": "MLP width",
    }
    return {label: int(args[key]) for key, label in names.items() if args.get(key)}


def working_rank_counts(widths: dict[str, int], most: int = 16) -> list[int]:
    return [n for n in range(1, most + 1) if all(w % n == 0 for w in widths.values())]


def check_shardable(model: nn.Module, parallel: str, size: int) -> None:
    """Raise one clear line when this model cannot be split `size` ways in `parallel`."""
    family = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
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
        inner = getattr(model, "model", None)
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
    check_shardable(model, parallel, group.size())
    if parallel == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())


def allreduces_per_forward(model: nn.Module, parallel: str) -> int:
    """Collectives inside one forward pass: tensor parallel sums the attention and the
    MLP output of every layer; a pipeline passes the hidden state once per stage."""
    layers = len(getattr(getattr(model, "model", model), "layers", []))
    return 2 * layers if parallel == "tensor" else 1


def fingerprint(model: nn.Module) -> int:
    """A 31-bit digest of the full (unsharded) weights: names, shapes, dtypes and a
    strided sample of every tensor's values. Cheap, and different model files differ."""
    digest = hashlib.sha256()
    sums = []
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        digest.update(f"{name}:{value.shape}:{value.dtype};".encode())
        flat = value.reshape(-1)
        sums.append(mx.sum(flat[:: max(1, flat.size // 257)].astype(mx.float32)))
    if sums:  # 5 significant digits: the same files summed on another chip still agree
        digest.update(" ".join(f"{v:.5g}" for v in mx.stack(sums).tolist()).encode())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF
