"""`--weights auto` on a backend that keeps weights quantized: both forms measured once
per model and device, the faster kept, the decision cached and shown.

The "GPU" is this CPU with `device.prefers_dequantized_weights` forced off (what Metal
and CUDA answer); the verify curves are injected, as a wide-pass timing here says nothing
about an H100 or a Mac.
"""

from __future__ import annotations

import json

import mlx.nn as nn
import pytest
from click.testing import CliRunner
from test_weight_form import (
    H100_DEQUANTIZED,
    H100_QUANTIZED,
    METAL_DEQUANTIZED,
    METAL_QUANTIZED,
)
from tiny_gguf import write_tiny_gguf

from mlxspec import device
from mlxspec.cli import main
from mlxspec.decoding import weight_form
from mlxspec.decoding.weights_choice import resolve_weights
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import open_runtime


@pytest.fixture
def tiny_entry(tmp_path, monkeypatch):
    """A models.toml entry 'tiny' of a Q4_1 GGUF target, `weights` left to auto, and a
    private cache (where the decision is kept)."""
    target = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    (tmp_path / "models.toml").write_text(f'[models.tiny]\ntarget = "{target}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models.toml"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    return load_registry().get("tiny")


def on_a_gpu_measuring(monkeypatch, quantized_curve, dequantized_curve) -> list[str]:
    """Force the quantized-keeping path; each measurement returns the curve of the form the
    model holds and is counted (the list of forms measured, in order)."""
    monkeypatch.setattr(device, "prefers_dequantized_weights", lambda: False)
    measured = []

    def fake_measure(model, vocab_size):
        held = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
        measured.append("quantized" if held else "dequantized")
        return quantized_curve if held else dequantized_curve

    monkeypatch.setattr(weight_form, "measure_verify_cost", fake_measure)
    return measured


def is_quantized(runtime) -> bool:
    layer = runtime.loaded.model.model.layers[0].mlp.up_proj
    return isinstance(layer, nn.QuantizedLinear)


def test_slow_wide_quantized_passes_make_auto_dequantize_once_and_remember(tiny_entry, monkeypatch):
    measured = on_a_gpu_measuring(monkeypatch, H100_QUANTIZED, H100_DEQUANTIZED)
    first = open_runtime(tiny_entry)
    assert measured == ["quantized", "dequantized"]
    assert first.weights.form == "dequantized" and not is_quantized(first)
    assert "dequantized speculates faster" in first.weights.reason
    second = open_runtime(tiny_entry)
    assert measured == ["quantized", "dequantized"], "the cached decision was measured again"
    assert second.weights.form == "dequantized" and not is_quantized(second)
    assert "measured before" in second.weights.reason
    assert second.loaded.weights_dtype == "float32"


def test_fast_quantized_kernels_keep_the_weights_quantized(tiny_entry, monkeypatch):
    measured = on_a_gpu_measuring(monkeypatch, METAL_QUANTIZED, METAL_DEQUANTIZED)
    runtime = open_runtime(tiny_entry)
    assert measured == ["quantized", "dequantized"]
    assert runtime.weights.form == "quantized" and "quantized kept" in runtime.weights.reason
    assert is_quantized(runtime), "kept quantized, but the model runs dequantized"
    assert resolve_weights("auto", tiny_entry.target).form == "quantized"
    assert measured == ["quantized", "dequantized"]


def test_explicit_weights_and_the_cpu_never_measure(tiny_entry, monkeypatch):
    measured = on_a_gpu_measuring(monkeypatch, H100_QUANTIZED, H100_DEQUANTIZED)
    for requested in ("quantized", "dequantized"):
        choice = resolve_weights(requested, tiny_entry.target)
        assert (choice.form, choice.measure_at_load) == (requested, False)
    monkeypatch.setattr(device, "prefers_dequantized_weights", lambda: True)  # the CPU
    runtime = open_runtime(tiny_entry)
    assert measured == []
    assert runtime.weights.form == "dequantized"
    assert "quantized matmul is slow" in runtime.weights.reason


def test_the_decision_shows_in_the_record_and_in_models_json(tiny_entry, monkeypatch):
    measured = on_a_gpu_measuring(monkeypatch, H100_QUANTIZED, H100_DEQUANTIZED)
    runner = CliRunner()

    def listed() -> dict:
        result = runner.invoke(main, ["models", "--json"])
        assert result.exit_code == 0, result.output
        return {row["name"]: row for row in json.loads(result.stdout)["models"]}["tiny"]

    before = listed()["weights_form"]
    assert before["form"] == "quantized" and "not measured yet" in before["reason"]
    assert measured == [], "models --json loaded and measured the model"

    def generated(*proposer: str) -> dict:
        args = ["generate", "hi", "-m", "tiny", *proposer, "-n", "3", "--raw", "--json"]
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[-1])["record"]["weights"]

    # Plain decoding never pays for measuring both forms: quantized, as stored.
    weights = generated("-p", "none")
    assert measured == [] and weights["form"] == "quantized"
    assert "plain decoding" in weights["reason"]
    weights = generated()  # the default proposer speculates: measured, then kept
    assert (weights["form"], weights["held"]) == ("dequantized", "float32")
    assert "dequantized speculates faster" in weights["reason"]
    after = listed()["weights_form"]
    assert after["form"] == "dequantized" and "dequantized speculates faster" in after["reason"]
    assert measured == ["quantized", "dequantized"]


def test_a_decision_on_a_partial_curve_is_made_again_by_the_next_runs(tiny_entry, monkeypatch):
    """A first run on a fresh GPU machine measures cold passes (each width compiles its
    kernels), its curves cut short by the budget: the next runs decide again on warm
    curves, and the last decision is kept."""
    from dataclasses import replace

    from mlxspec.decoding.verify_cost import PARTIAL_REMEASURES

    cold = replace(H100_DEQUANTIZED, points={1: 1.0, 2: 1.02}, partial=True)
    measured = on_a_gpu_measuring(monkeypatch, METAL_QUANTIZED, cold)
    first = open_runtime(tiny_entry)
    assert first.weights.form == "quantized" and measured == ["quantized", "dequantized"]
    measured = on_a_gpu_measuring(monkeypatch, H100_QUANTIZED, H100_DEQUANTIZED)  # warm now
    for _ in range(PARTIAL_REMEASURES + 1):
        runtime = open_runtime(tiny_entry)
    assert measured == ["quantized", "dequantized"], "decided again once, then kept"
    assert runtime.weights.form == "dequantized" and not is_quantized(runtime)
    assert "measured before" in runtime.weights.reason
