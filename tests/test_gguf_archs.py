"""GGUF architectures beyond llama: each tiny random mlx-lm model, written as llama.cpp's
converter writes it (tests/tiny_gguf.write_arch_gguf: gguf-py's own tensor names, llama's Q/K
permute, Gemma's norms plus one), loads back to the same logits; greedy decoding through the
engine with prompt-lookup equals plain greedy on a loaded file; and an architecture the loader
cannot map is one line naming it and the supported ones."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from lossless import assert_lossless, plain_greedy
from mlx.utils import tree_map
from tiny_gguf import ARCH_SOURCES, tiny_source, write_arch_gguf

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Done
from mlxspec.models.gguf import GGUFError, check_gguf, load_gguf, model_config
from mlxspec.proposers import PromptLookup

# Longer than Gemma 3's tiny sliding window (12), so its window and its global layer both count.
PROMPTS = [
    [5, 17, 99, 200, 3],
    list(range(40, 60)),
    [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 32, 104, 101, 108, 108, 111, 33],
]
# Largest |loaded - source| logit over the largest |source| logit, where the source's matrices
# are rounded as the file's (float16, or llama.cpp's Q8_0 and back): only the order of float32
# arithmetic differs (llama's rope on permuted rows, Gemma's norm offset added back).
TOLERANCE = 1e-5


def logits(model, tokens) -> np.ndarray:
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def rounded_source(arch: str, qtype: str, extra: dict | None = None):
    """tiny_source(arch, extra=extra) with each matrix as the file holds it: the reference for
    its logits."""
    source = tiny_source(arch, extra=extra)
    kind = GGMLQuantizationType[qtype]

    def rounded(value):
        data = np.array(value, dtype=np.float32)
        if data.ndim != 2 or qtype == "F32":
            return value
        if qtype == "F16":
            return mx.array(data.astype(np.float16).astype(np.float32))
        return mx.array(dequantize(quantize(data, kind), kind))

    source.update(tree_map(rounded, source.parameters()))
    return source


@pytest.mark.parametrize("qtype", ["F16", "F32", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(ARCH_SOURCES))
def test_a_converted_model_loads_to_its_own_logits(tmp_path, arch, qtype):
    path = write_arch_gguf(tmp_path / f"tiny-{arch}.{qtype}.gguf", arch, qtype)
    source = rounded_source(arch, qtype)
    model, _, config = load_gguf(path, dequantize=True)
    assert config["model_type"] == ARCH_SOURCES[arch][0]
    for prompt in PROMPTS:
        expected = logits(source, prompt)
        error = np.abs(logits(model, prompt) - expected).max() / np.abs(expected).max()
        assert error < TOLERANCE, (arch, qtype, prompt, error)
    assert check_gguf(path).startswith(f"{arch}, ")


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2"])
def test_a_q8_0_file_kept_quantized_answers_as_dequantized(tmp_path, arch):
    """Q8_0 blocks kept as MLX's 8-bit affine (the Mac's path) map them exactly."""
    path = write_arch_gguf(tmp_path / f"tiny-{arch}.Q8_0.gguf", arch, "Q8_0")
    floats, _, _ = load_gguf(path, dequantize=True)
    kept, _, config = load_gguf(path, dequantize=False)
    assert config["quantization"]["bits"] == 8
    for prompt in PROMPTS:
        np.testing.assert_allclose(logits(kept, prompt), logits(floats, prompt), atol=1e-3)


CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05}, 0.05)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_prompt_lookup_on_a_loaded_file_is_plain_greedy(tmp_path, arch):
    path = write_arch_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    model, tokenizer, config = load_gguf(path, dequantize=True)
    engine = Engine(
        model, tokenizer, config["model_type"], [PromptLookup()], verify_cost=CPU_LIKE_COST
    )
    prompt = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12]
    settings = GenerationSettings(max_tokens=24, k=None)
    done = list(engine.stream(prompt, settings, "prompt-lookup"))[-1]
    assert isinstance(done, Done)
    reference = plain_greedy(model, prompt, 24, set(tokenizer.eos_token_ids))
    assert_lossless(model, prompt, reference, list(done.token_ids), arch, done.record)
    # ... and plain greedy of the loaded file is the source model's own greedy.
    assert (
        list(reference)
        == list(plain_greedy(tiny_source(arch), prompt, 24, set()))[: len(reference)]
    )


def test_an_architecture_it_cannot_map_is_one_line_naming_the_supported_ones():
    with pytest.raises(GGUFError) as error:
        model_config({"general.architecture": "falcon"}, tensor_names={})
    message = str(error.value)
    assert "\n" not in message
    assert "'falcon'" in message
    assert "gemma3, llama, mistral3, phi3, qwen2, qwen3" in message


def test_a_rope_scaling_type_it_cannot_map_is_refused_in_one_line():
    """Phi-3's LongRoPE factors, Llama 3's, YaRN and linear map (tests/test_gguf_rope.py);
    another type stays one line naming it."""
    metadata = {"general.architecture": "phi3", "phi3.rope.scaling.type": "dynamic"}
    with pytest.raises(GGUFError, match=r"^GGUF phi3 with dynamic rope scaling is not supported$"):
        model_config(metadata, tensor_names=set())
