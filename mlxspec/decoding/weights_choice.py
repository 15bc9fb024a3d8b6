"""The form a target's weights take in memory: kept as stored (quantized) or float32.

A choice of the user's (`--weights`, env MLXSPEC_WEIGHTS, a models.toml default), never a
silent fact of the device: Metal keeps quantized weights and MLX's CPU backend runs them
slowly, so `auto` decides per device, and CI can run the Metal path on a CPU. What was
chosen, and why, goes into the run record; what the model holds goes into the
calibration key, so a curve measured on one form never prices the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec import device
from mlxspec.decoding.verify_cost import measure_again
from mlxspec.decoding.weight_form import DEQUANTIZED, QUANTIZED, cached_weight_form

AUTO = "auto"
CHOICES = (AUTO, QUANTIZED, DEQUANTIZED)
ENV_VAR = "MLXSPEC_WEIGHTS"


@dataclass(frozen=True)
class WeightsChoice:
    requested: str  # auto, quantized or dequantized: what the user asked for
    dequantize: bool  # load as float32 (False: keep quantized layers and dtypes as stored)
    reason: str  # one line for the record: why this form
    measure_at_load: bool = False  # auto, not decided yet: a quantized model measures both

    @property
    def form(self) -> str:
        return DEQUANTIZED if self.dequantize else QUANTIZED


def resolve_weights(requested: str, model_ref: str) -> WeightsChoice:
    """The form to load `model_ref` in on this device, and why.

    The one place `auto` decides: dequantize on MLX's CPU backend; elsewhere the form
    measured faster for this model on this device (weight_form.py), or, until measured,
    quantized with `measure_at_load` (the runtime measures once and caches)."""
    if requested not in CHOICES:
        raise ValueError(f"weights must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested != AUTO:
        return WeightsChoice(requested, requested == DEQUANTIZED, f"{requested} as asked")
    name = device.device_name()
    if device.prefers_dequantized_weights():
        return WeightsChoice(AUTO, True, f"auto: quantized matmul is slow on MLX's {name} backend")
    known = cached_weight_form(model_ref)
    if known is not None:
        reason = f"{known.reason}, measured before"
        if measure_again(known):  # decided on a partial curve: loaded as stored, decided anew
            return WeightsChoice(AUTO, False, reason, measure_at_load=True)
        return WeightsChoice(AUTO, known.form == DEQUANTIZED, reason)
    reason = f"auto: {name} runs quantized kernels fast (both forms not measured yet)"
    return WeightsChoice(AUTO, False, reason, measure_at_load=True)


def for_plain_decoding(choice: WeightsChoice) -> WeightsChoice:
    """`auto` not decided yet, for a run that will not speculate (`-p none`): quantized as
    stored, without measuring both forms (seconds, and on a GPU backend each new width
    compiles its kernels): a one-token step reads the fewest bytes quantized."""
    if not choice.measure_at_load:
        return choice
    reason = "auto: quantized kept for plain decoding (both forms not measured yet)"
    return WeightsChoice(AUTO, False, reason)


def held_weights(model: nn.Module) -> str:
    """What the model's weights are in memory, e.g. 'q4+q8 (affine, group 32), float32'
    (quantized layers, then the float dtypes) or 'float32': read from its modules, so it
    cannot disagree with what a pass really runs."""
    quantized = [m for _, m in model.named_modules() if hasattr(m, "bits") and "scales" in m]
    floats = sorted(
        {
            str(value.dtype).removeprefix("mlx.core.")
            for _, value in tree_flatten(model.parameters())
            if mx.issubdtype(value.dtype, mx.floating)
        }
    )
    parts = ["+".join(floats)] if floats else []
    if quantized:
        bits = "+".join(f"q{b}" for b in sorted({m.bits for m in quantized}))
        modes = "/".join(sorted({getattr(m, "mode", "affine") for m in quantized}))
        groups = "/".join(str(g) for g in sorted({m.group_size for m in quantized}))
        parts.insert(0, f"{bits} ({modes}, group {groups})")
    return ", ".join(parts) or "unknown"


def weights_record(model: nn.Module, choice: WeightsChoice | None) -> dict[str, str]:
    """The run record's `weights`: the form chosen, why, and what the model holds."""
    if choice is None:
        return {
            "form": "as given",
            "reason": "the model was handed in loaded",
            "held": held_weights(model),
        }
    return {"form": choice.form, "reason": choice.reason, "held": held_weights(model)}
