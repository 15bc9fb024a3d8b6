"""Drafter weights that `mlxspec pull --mtp` stored quantized like the target.

mlx's names (`X.weight` beside `X.scales` and `X.biases`), the group size and bits in the
folder's config.json. An MoE model's MTP layer is large (GLM-4.5-Air's ~2.2B parameters
are 8.8 GB in float32, ~1.2 GB at 4 bits), so where quantized matmul is fast (Metal) the
layer stays quantized: each layer that mlx can quantize becomes its quantized twin, and
only what it cannot (an MoE router's gate matrix) is made float. On the CPU backend,
where quantized matmul is slow, everything is made float, as the target is.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxspec.drafter.head import HeadError

SCALES = ".scales"


def quantized_bases(names) -> set[str]:
    """The layers (`X` of `X.scales`) stored quantized among tensor `names`."""
    return {name[: -len(SCALES)] for name in names if name.endswith(SCALES)}


def settings(directory: Path) -> tuple[int, int]:
    """(group_size, bits) from the folder's config.json."""
    try:
        stored = json.loads((directory / "config.json").read_text())["quantization"]
        return int(stored["group_size"]), int(stored["bits"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HeadError(
            f"{directory} holds quantized weights but no quantization in its config.json: {err}"
        ) from None


def dequantized(
    weights: dict[str, mx.array], group_size: int, bits: int, bases: set[str] | None = None
) -> dict[str, mx.array]:
    """`weights` with the quantized layers in `bases` (default: all) made float."""
    out = dict(weights)
    for base in quantized_bases(weights) if bases is None else bases:
        out[f"{base}.weight"] = mx.dequantize(
            out[f"{base}.weight"],
            out.pop(f"{base}{SCALES}"),
            out.pop(f"{base}.biases", None),
            group_size=group_size,
            bits=bits,
        )
    return out


def fit_quantized(
    module: nn.Module, weights: dict[str, mx.array], directory: Path, keep: bool
) -> dict[str, mx.array]:
    """`weights` (in `module`'s names) ready for `module.load_weights`: where `keep`, the
    layers stored quantized that mlx can quantize are quantized in `module` (same group
    size and bits) and their weights kept as stored; the rest are made float."""
    bases = quantized_bases(weights)
    if not bases:
        return weights
    group_size, bits = settings(directory)
    layers = dict(module.named_modules())
    kept = {b for b in bases if keep and hasattr(layers.get(b), "to_quantized")}
    if kept:
        nn.quantize(module, group_size, bits, class_predicate=lambda path, _: path in kept)
    return dequantized(weights, group_size, bits, bases - kept)


def as_loaded(value: mx.array) -> mx.array:
    """A float tensor in float32 (the drafter's dtype); packed quantized weights as they are."""
    return value if value.dtype == mx.uint32 else value.astype(mx.float32)
