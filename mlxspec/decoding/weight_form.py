"""Which form of a quantized target's weights speculates faster here, by measurement.

Quantized weights save memory and bandwidth, so a one-token step is cheapest with them;
but a backend whose quantized kernels are slow for wide passes prices every draft out
(on one H100 through MLX's CUDA backend, 9 tokens over SmolLM2's Q4_1 weights took
1.5 s against 4 ms for one). `auto` therefore measures both verify-cost curves at load,
where the dequantized weights fit in memory, and keeps the form with the higher best
expected tokens per second at a typical acceptance. Quantized stays unless the
dequantized form is clearly faster (DEQUANTIZE_MARGIN): it costs 2-4x the memory.

The seam for `--weights auto` (the resolver of the weights choice): `measure_weight_forms`
at load, then `choose_weight_form`; its `reason` goes to the run record and
`mlxspec models --json`. On MLX's CPU backend the choice stays dequantized without
measuring (quantized matmul is slow there for every width).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec.decoding.policy import expected_tokens
from mlxspec.decoding.verify_cost import (
    VerifyCost,
    cached_verify_cost,
    calibration_key,
    known_calibration,
    measure_verify_cost,
)

QUANTIZED, DEQUANTIZED = "quantized", "dequantized"
REFERENCE_ACCEPTANCE = 0.7  # a typical per-token acceptance (prompt lookup on edits, heads)
DEQUANTIZE_MARGIN = 1.2  # dequantized must be this much faster to be kept
LONGEST_DRAFT = 16


@dataclass(frozen=True)
class WeightForm:
    form: str  # QUANTIZED or DEQUANTIZED: what speculation runs on
    reason: str  # one line for the run record and `models --json`
    tokens_per_second: dict[str, float]  # best expected speed per measured form
    # A curve the budget cut short (cold passes compiling kernels on a GPU backend): the
    # next runs decide again (verify_cost.measure_again), as for a partial curve.
    partial: bool = False
    measurements: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WeightForm:
        data = json.loads(text)
        return cls(
            data["form"],
            data["reason"],
            dict(data["tokens_per_second"]),
            bool(data.get("partial", False)),
            int(data.get("measurements", 1)),
        )

    def merged(self, later: WeightForm) -> WeightForm:
        """A later decision replaces this one (its curves were measured warmer)."""
        return replace(later, measurements=self.measurements + later.measurements)


def best_tokens_per_second(cost: VerifyCost, acceptance: float = REFERENCE_ACCEPTANCE) -> float:
    """max over k of E(k) / seconds of a verify of k + 1 (k = 0: plain decoding)."""
    return max(
        expected_tokens(acceptance, k) / (cost.step_seconds * (cost(k + 1) if k else 1.0))
        for k in range(LONGEST_DRAFT + 1)
    )


def choose_weight_form(curves: dict[str, VerifyCost], skipped: str = "") -> WeightForm:
    """The form to keep from the measured curves (QUANTIZED alone when the dequantized
    form was not measured, `skipped` saying why)."""
    speeds = {form: best_tokens_per_second(cost) for form, cost in curves.items()}
    partial = any(cost.partial for cost in curves.values())
    quantized = speeds[QUANTIZED]
    if DEQUANTIZED not in speeds:
        return WeightForm(QUANTIZED, f"auto: quantized kept ({skipped})", speeds, partial)
    dequantized = speeds[DEQUANTIZED]
    wide = f"9 tokens cost {curves[QUANTIZED](9):.1f} steps quantized, "
    wide += f"{curves[DEQUANTIZED](9):.1f} dequantized"
    speed = f"{dequantized:.0f} against {quantized:.0f} tok/s at {REFERENCE_ACCEPTANCE:.0%}"
    if dequantized >= DEQUANTIZE_MARGIN * quantized:
        reason = f"auto: dequantized speculates faster here ({wide}; {speed})"
        return WeightForm(DEQUANTIZED, reason, speeds, partial)
    reason = f"auto: quantized kept, as fast or faster ({wide}; {speed})"
    return WeightForm(QUANTIZED, reason, speeds, partial)


def dequantized_bytes(model: nn.Module, bytes_per_weight: int) -> int:
    """Memory the model's weights take once every quantized layer is dequantized."""
    quantized = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "bits") and "scales" in module
    }
    total = 0
    for name, value in tree_flatten(model.parameters()):
        owner, _, part = name.rpartition(".")
        module = quantized.get(owner)
        if module is None:
            total += value.nbytes
        elif part == "weight":  # packed: 32 / bits weights per uint32
            total += value.size * 32 // module.bits * bytes_per_weight
    return total


def measure_weight_forms(
    model: nn.Module,
    vocab_size: int,
    free_bytes: int | None,
    dequantize: Callable[[nn.Module], nn.Module],
    bytes_per_weight: int = 2,
    measure: Callable[[nn.Module, int], VerifyCost] = measure_verify_cost,
) -> tuple[WeightForm, nn.Module]:
    """Measure the quantized model's curve, then (if the dequantized weights fit in
    `free_bytes`; None: unknown, assumed to fit) dequantize it and measure again.
    Returns the choice and the model in the chosen form where it is at hand: the
    dequantized one, or the quantized one when dequantizing was skipped; a caller whose
    choice is QUANTIZED after both were measured reloads it as stored."""
    curves = {QUANTIZED: measure(model, vocab_size)}
    need = dequantized_bytes(model, bytes_per_weight)
    if free_bytes is not None and need > free_bytes:
        skipped = f"dequantized weights ({need / 2**30:.1f} GiB) do not fit in memory"
        return choose_weight_form(curves, skipped), model
    model = dequantize(model)
    curves[DEQUANTIZED] = measure(model, vocab_size)
    return choose_weight_form(curves), model


def weight_form_key(model_ref: str) -> str:
    """Where `auto`'s decision for a model is kept: beside its calibrations, per model
    and device (and BLAS, mlx version), so another machine measures again."""
    return calibration_key(model_ref, "auto weight form")


def cached_weight_form(model_ref: str) -> WeightForm | None:
    """The decision measured for this model on this device before, if any."""
    return known_calibration(weight_form_key(model_ref), WeightForm.from_json)


def free_memory_bytes() -> int | None:
    """Memory the device can still give a model (None: it does not say)."""
    info = mx.device_info()
    total = info.get("max_recommended_working_set_size") or info.get("memory_size")
    return int(total) - mx.get_active_memory() if total else None


def dequantize_as_loaded(model: nn.Module) -> nn.Module:
    """Dequantize a loaded model as `load_model(dequantize=True)` does (float32 scales
    first, so no weight is rounded)."""
    from mlx_lm.utils import dequantize_model

    model.set_dtype(mx.float32)
    return dequantize_model(model)


def decide_weight_form(model_ref: str, model: nn.Module, vocab_size: int) -> WeightForm:
    """`auto`'s decision for a quantized model loaded as stored: cached, or measured in
    both forms once and cached. Measuring may leave `model` dequantized (in place)."""

    def measure() -> WeightForm:
        free = free_memory_bytes()
        return measure_weight_forms(
            model, vocab_size, free, dequantize_as_loaded, 4, measure_verify_cost
        )[0]

    return cached_verify_cost(weight_form_key(model_ref), measure, WeightForm.from_json)
