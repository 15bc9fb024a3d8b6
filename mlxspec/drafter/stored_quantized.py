"""Drafter weights that `mlxspec pull --mtp` stored quantized like the target.

mlx's names (`X.weight` beside `X.scales` and `X.biases`), the group size and bits in the
folder's config.json. An MoE model's MTP layer is large (GLM-4.5-Air's ~2.2B parameters
are 8.8 GB in float32, ~1.2 GB at 4 bits), so where quantized matmul is fast (Metal) the
layer stays quantized: each layer that mlx can quantize becomes its quantized twin (one
the pull had to leave float, as it could not name it the mlx way, is quantized as it
loads), and only what mlx cannot quantize (DeepSeek's MoE router gate) is made float.
On the CPU backend, where quantized matmul is slow, everything is made float, as the
target is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxspec.drafter.head import HeadError

SCALES = ".scales"
EXPERT = re.compile(r"^(.*\.)?experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")


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


def stacked_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts stored one by one and quantized (`mlp.experts.{e}.{proj}.*`), stacked the
    way mlx-lm's SwitchGLU holds them (`mlp.switch_mlp.{proj}.*`). Every MoE family's
    sanitize stacks `.weight`; not all stack `.scales` and `.biases` (Qwen3-Next's
    does not), so quantized experts are stacked before it runs."""
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for name in weights:
        match = EXPERT.match(name)
        if match is None:
            continue
        prefix, expert, projection, part = match.groups()
        if f"{prefix or ''}experts.{expert}.{projection}{SCALES}" in weights:
            groups.setdefault((prefix or "", projection, part), {})[int(expert)] = name
    out = dict(weights)
    for (prefix, projection, part), names in groups.items():
        parts = [out.pop(names[expert]) for expert in sorted(names)]
        out[f"{prefix}switch_mlp.{projection}.{part}"] = mx.stack(parts)
    return out


def target_settings(directory: Path) -> tuple[int, int] | None:
    """(group_size, bits) where `pull --mtp` recorded the target's quantization; None for
    a float target (or a folder it did not write)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return settings(directory) if isinstance(config, dict) and "quantization" in config else None


def fit_quantized(
    module: nn.Module, weights: dict[str, mx.array], directory: Path, keep: bool
) -> dict[str, mx.array]:
    """`weights` (in `module`'s names) ready for `module.load_weights`. Where `keep` and
    the target is quantized, every layer of `module` that mlx can quantize is quantized
    with the target's group size and bits: stored quantized, its weights are kept as
    they are; stored float (Qwen3.5 MoE's fused experts, which only the target's
    sanitize splits into mlx's layers), they are quantized now. The rest is made float."""
    bases = quantized_bases(weights)
    target = target_settings(directory)
    if target is None:
        return dequantized(weights, *settings(directory)) if bases else weights
    group_size, bits = target
    if not keep:
        return dequantized(weights, group_size, bits, bases)
    layers = dict(module.named_modules())

    def quantizable(base: str) -> bool:
        return hasattr(layers.get(base), "to_quantized")

    kept = {base for base in bases if quantizable(base)}
    out = dequantized(weights, group_size, bits, bases - kept)
    late = {
        name.removesuffix(".weight")
        for name, value in out.items()
        if name.endswith(".weight")
        and value.ndim >= 2
        and value.shape[-1] % group_size == 0
        and mx.issubdtype(value.dtype, mx.floating)
        and quantizable(name.removesuffix(".weight"))
    }
    for base in late:
        weight, scales, biases = mx.quantize(out[f"{base}.weight"], group_size, bits)
        out.update({f"{base}.weight": weight, f"{base}.scales": scales, f"{base}.biases": biases})
    if kept | late:
        nn.quantize(module, group_size, bits, class_predicate=lambda path, _: path in kept | late)
    return out


def as_loaded(value: mx.array) -> mx.array:
    """A float tensor in float32 (the drafter's dtype); packed quantized weights as they are."""
    return value if value.dtype == mx.uint32 else value.astype(mx.float32)
