"""`auto` weights from measurement: the faster form for speculation, and why."""

from __future__ import annotations

import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model
from tiny_models import tiny_model

from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.decoding.weight_form import (
    DEQUANTIZED,
    QUANTIZED,
    choose_weight_form,
    dequantized_bytes,
    measure_weight_forms,
)

# The H100 through MLX's CUDA backend, SmolLM2 Q4_1: a step 4 ms, 9 tokens 1.5 s.
H100_QUANTIZED = VerifyCost({1: 1.0, 2: 40.0, 4: 120.0, 8: 330.0, 16: 660.0}, 0.004)
H100_DEQUANTIZED = VerifyCost({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}, 0.006)
# Metal: quantized kernels fast for every width, and the step cheaper than float16's.
METAL_QUANTIZED = VerifyCost({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.8}, 0.008)
METAL_DEQUANTIZED = VerifyCost({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.2, 16: 1.6}, 0.02)


def test_slow_quantized_wide_passes_make_auto_keep_dequantized_weights():
    choice = choose_weight_form({QUANTIZED: H100_QUANTIZED, DEQUANTIZED: H100_DEQUANTIZED})
    assert choice.form == DEQUANTIZED
    assert "dequantized speculates faster" in choice.reason and "tok/s" in choice.reason


def test_fast_quantized_kernels_keep_quantized_weights():
    choice = choose_weight_form({QUANTIZED: METAL_QUANTIZED, DEQUANTIZED: METAL_DEQUANTIZED})
    assert choice.form == QUANTIZED and "quantized kept" in choice.reason


def test_a_dequantized_form_only_slightly_faster_does_not_cost_the_memory():
    slightly = VerifyCost(dict(METAL_QUANTIZED.points), METAL_QUANTIZED.step_seconds / 1.1)
    choice = choose_weight_form({QUANTIZED: METAL_QUANTIZED, DEQUANTIZED: slightly})
    assert choice.form == QUANTIZED


def quantized_tiny():
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    return model


def fake_measure(model, vocab_size):
    """The H100's curves, by what the model holds (no timing in a unit test)."""
    held = any(hasattr(m, "bits") for _, m in model.named_modules())
    return H100_QUANTIZED if held else H100_DEQUANTIZED


def test_dequantized_size_is_what_dequantizing_really_holds():
    model = quantized_tiny()
    predicted = dequantized_bytes(model, bytes_per_weight=4)  # float32 scales: float32 weights
    real = sum(v.nbytes for _, v in tree_flatten(dequantize_model(model).parameters()))
    assert predicted == real


@pytest.mark.parametrize("free_bytes", [None, 10**9])
def test_both_forms_are_measured_where_memory_allows(free_bytes):
    choice, model = measure_weight_forms(
        quantized_tiny(), 257, free_bytes, dequantize_model, measure=fake_measure
    )
    assert choice.form == DEQUANTIZED and set(choice.tokens_per_second) == {QUANTIZED, DEQUANTIZED}
    assert not any(hasattr(m, "bits") for _, m in model.named_modules())


def test_no_room_for_dequantized_weights_keeps_the_quantized_ones_unmeasured():
    choice, model = measure_weight_forms(
        quantized_tiny(), 257, 1000, dequantize_model, measure=fake_measure
    )
    assert choice.form == QUANTIZED and "do not fit in memory" in choice.reason
    assert any(hasattr(m, "bits") for _, m in model.named_modules())
