"""GGUF files in the quants MLX's own reader cannot parse (the K-quants most published GGUFs
use, Q5_0/Q5_1), read through llama.cpp's `gguf` package: dequantized exactly to what
llama.cpp's reference dequantization gives (float path), or kept quantized in MLX's affine
form within its rounding (the Mac's path).

A K-quant tiny llama is written block by block: the `gguf` package can dequantize K-quants
but not make them, so each matrix is random blocks (with finite scales), and the reference
weights are the package's own dequantization of those blocks."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tiny_gguf import _gguf_names, gguf_tokens, tiny_llama_writer, write_tiny_gguf
from tiny_models import FAMILIES, tiny_model

from mlxspec.models.gguf import GGUFError, load_gguf

# Where each K-quant block keeps its float16 scales (d, and dmin where it has one).
SCALE_BYTES = {"Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}
WIDE = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # K-quant rows are 256 weights a block


def random_blocks(rows: int, columns: int, kind: str, rng) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
    for at in SCALE_BYTES[kind]:
        scale = np.full(len(blocks), 0.002, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, at : at + 2 or None] = scale
    return blocks.reshape(rows, -1)


def write_kquant_gguf(path: Path, kind: str) -> dict[str, np.ndarray]:
    """A 3-layer llama of width 256 whose matrices are random `kind` blocks; returns the
    reference float weights by mlx-lm name (the blocks as llama.cpp dequantizes them)."""
    tokens = gguf_tokens()
    config = {**FAMILIES["llama"], **WIDE, "vocab_size": len(tokens)}
    model = tiny_model("llama", seed=0, config=config)
    writer = tiny_llama_writer(path, model, tokens)
    rng = np.random.default_rng(0)
    names, reference = _gguf_names(), {}
    quant = GGMLQuantizationType[kind]
    for name, value in tree_flatten(model.parameters()):
        data = np.array(value, dtype=np.float32)
        if data.ndim == 2:
            blocks = random_blocks(*data.shape, kind, rng)
            writer.add_tensor(names[name], blocks, raw_dtype=quant)
            reference[name] = dequantize(blocks, quant)
        else:
            writer.add_tensor(names[name], data)
            reference[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def logits(model: nn.Module, tokens=(5, 17, 99, 200, 3)) -> np.ndarray:
    return np.array(model(mx.array([list(tokens)])).astype(mx.float32))


@pytest.mark.parametrize("kind", sorted(SCALE_BYTES))
def test_a_kquant_gguf_loads_to_llama_cpps_own_dequantization(tmp_path, kind):
    path = tmp_path / f"tiny.{kind}.gguf"
    reference = write_kquant_gguf(path, kind)
    model, tokenizer, config = load_gguf(path, dequantize=True)
    loaded = dict(tree_flatten(model.parameters()))
    for name, weights in reference.items():
        assert np.array_equal(np.array(loaded[name]), weights), name
    expected = llama.Model(llama.ModelArgs.from_dict(config))
    expected.load_weights([(name, mx.array(w)) for name, w in reference.items()])
    assert np.array_equal(logits(model), logits(expected))
    assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"

    kept, _, kept_config = load_gguf(path, dequantize=False)
    bits = kept_config["quantization"]["bits"]
    assert bits == (8 if kind in ("Q5_K", "Q6_K") else 4)
    assert_within_affine_rounding(kept, reference, bits)


def assert_within_affine_rounding(model: nn.Module, reference: dict, bits: int) -> None:
    """Each matrix kept quantized is the reference within one step of its group of 32
    (MLX's affine rounding)."""
    checked = 0
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        weights = mx.dequantize(module.weight, module.scales, module.biases, 32, bits)
        step = np.repeat(np.abs(np.array(module.scales)), 32, axis=-1)
        gap = np.abs(np.array(weights) - reference[f"{path}.weight"])
        assert (gap <= step + 1e-6).all(), (path, float((gap / step).max()))
        checked += 1
    assert checked == len([w for w in reference.values() if w.ndim == 2])


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_q5_gguf_files_load_to_the_model_they_were_written_from(tmp_path, kind, monkeypatch):
    """Q5_0 and Q5_1, which the gguf package can write: the loaded model answers as the
    model the file was made from, within five-bit rounding."""
    import tiny_gguf

    monkeypatch.setattr(tiny_gguf, "GGUF_TYPES", {*tiny_gguf.GGUF_TYPES, kind})
    path = write_tiny_gguf(tmp_path / f"tiny.{kind}.gguf", kind)
    model, _, _ = load_gguf(path, dequantize=True)
    source = tiny_model("llama", seed=0, config={**FAMILIES["llama"], "vocab_size": 258})
    quant = GGMLQuantizationType[kind]
    loaded = dict(tree_flatten(model.parameters()))
    for name, value in tree_flatten(source.parameters()):
        data = np.array(value, dtype=np.float32)
        if data.ndim == 2:  # exactly llama.cpp's rounding of the source weights
            assert np.array_equal(np.array(loaded[name]), dequantize(quantize(data, quant), quant))
    # on this random tiny model five-bit rounding moves the logits by about a tenth
    error = np.abs(logits(model) - logits(source)).max() / np.abs(logits(source)).max()
    assert error < 0.2, error


def test_a_quant_nobody_can_read_is_one_line_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "tiny.Q4_K.gguf"
    write_kquant_gguf(path, "Q4_K")
    import gguf.quants

    def cannot(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)
    with pytest.raises(GGUFError, match=r"tensor '.*' is Q4_K, which the gguf package cannot"):
        load_gguf(path, dequantize=True)
