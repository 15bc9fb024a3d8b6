"""GGUF rope scaling: each tiny source model with an HF-style `rope_scaling` (Llama 3's
factors, linear, YaRN, Phi-3's LongRoPE), written as llama.cpp's converter writes it
(tests/tiny_gguf.write_arch_gguf), loads back to the source's logits past its original
context, where the scaling changes them; on the quantized path, through the engine with prompt
lookup, and in a batch with a row's own offsets too. A kind that mlx-lm cannot match is one
line naming it."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from lossless import assert_lossless, plain_greedy
from mlx_lm.models.cache import BatchKVCache
from test_gguf_archs import CPU_LIKE_COST, TOLERANCE, logits, rounded_source
from tiny_gguf import tiny_source, write_arch_gguf

from mlxspec.cli import main
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter import distill
from mlxspec.events import Done
from mlxspec.models.anatomy import split_decoder
from mlxspec.models.gguf import GGUFError, check_gguf, load_gguf, model_config
from mlxspec.models.gguf_reader import read_gguf_metadata
from mlxspec.proposers import PromptLookup

ORIGINAL = 16  # the tiny sources' original context: the prompts run well past it
LLAMA3 = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # with head_dim 16 and base 10,000: one pair kept, one smoothed, six scaled by 8
        "original_max_position_embeddings": 2 * ORIGINAL,
    },
    "original_max_position_embeddings": 2 * ORIGINAL,  # where the converter reads it
}
RNG = np.random.default_rng(7)
SCALINGS = {
    "llama-llama3": ("llama", LLAMA3),
    "mistral3-llama3": ("mistral3", LLAMA3),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    # betas that move the ramp (0..5 rather than the defaults' 0..4 at this original context)
    "qwen3-yarn-betas": (
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 4.0,
                "beta_slow": 0.25,
            }
        },
    ),
    "qwen3-linear": ("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Gemma 3 4B+: factor 8 on the global layer only (the tiny one has 5 local, 1 global)
    "gemma3-linear": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "phi3-longrope": (
        "phi3",
        {
            "rope_scaling": {
                "type": "longrope",
                "long_factor": RNG.uniform(1.0, 30.0, 8).round(4).tolist(),
                "short_factor": RNG.uniform(1.0, 2.0, 8).round(4).tolist(),
            },
            "original_max_position_embeddings": ORIGINAL,
            "max_position_embeddings": 4096,
        },
    ),
}
# Past the original context (16): ~40 tokens each.
PROMPTS = [
    list(range(60, 100)),
    [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 32] * 3 + [33, 10, 5, 17],
]


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("case", sorted(SCALINGS))
def test_a_rope_scaled_file_loads_to_its_source_logits(tmp_path, case):
    arch, extra = SCALINGS[case]
    path = write_arch_gguf(tmp_path / f"tiny-{case}.gguf", arch, extra=extra)
    source, unscaled = tiny_source(arch, extra=extra), tiny_source(arch)
    model, _, _ = load_gguf(path, dequantize=True)
    for prompt in PROMPTS:
        expected = logits(source, prompt)
        error = relative_error(logits(model, prompt), expected)
        assert error < TOLERANCE, (case, prompt, error)
        # ... where the scaling matters: the same weights without it answer otherwise.
        assert relative_error(logits(unscaled, prompt), expected) > 100 * TOLERANCE
    assert check_gguf(path).startswith(f"{arch}, ")


def is_yarn(extra: dict) -> bool:
    return extra["rope_scaling"].get("rope_type") == "yarn"


NORM_ROPE = {"llama"}  # llama.cpp's LLAMA_ROPE_TYPE_NORM; qwen2 and qwen3 are NEOX


def llama_cpp_yarn(x: np.ndarray, metadata: dict, arch: str) -> np.ndarray:
    """x (positions, head_dim) rotated as llama.cpp rotates it for a YaRN file, written here
    from its C, not from mlx-lm: `ggml_rope_yarn_corr_dims` (start floor(corr_dim(beta_fast)),
    end ceil(corr_dim(beta_slow)), beta_fast 32 and beta_slow 1 where the file names none),
    `rope_yarn_ramp`, `rope_yarn` (theta_interp = theta / factor, mixed with theta by the ramp
    at ext_factor 1, cos and sin times 1 + 0.1 ln(factor)), on the pairs of the architecture's
    rope type (`llama_model_rope_type`): llama's NORM pairs (2i, 2i + 1), over the q and k
    rows the converter permuted for it, else NEOX's (i, i + d/2)."""
    get = lambda key, default=None: metadata.get(f"{arch}.{key}", default)  # noqa: E731
    dims, base = x.shape[1], get("rope.freq_base")
    factor, original = get("rope.scaling.factor"), get("rope.scaling.original_context_length")
    beta_fast, beta_slow = (
        get("rope.scaling.yarn_beta_fast", 32.0),
        get("rope.scaling.yarn_beta_slow", 1.0),
    )

    def corr_dim(rotations: float) -> float:
        return dims * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(0.0, np.floor(corr_dim(beta_fast)))
    high = min(dims - 1.0, np.ceil(corr_dim(beta_slow)))
    pair = np.arange(dims // 2)
    ramp = 1 - np.clip((pair - low) / max(0.001, high - low), 0, 1)
    theta_extrap = base ** (-2.0 * pair / dims)
    theta = (theta_extrap / factor) * (1 - ramp) + theta_extrap * ramp
    angle = np.arange(len(x))[:, None] * theta[None, :]
    scale = 1 + 0.1 * np.log(factor)
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    if arch in NORM_ROPE:
        first, second = x[:, 0::2], x[:, 1::2]
        turned = np.empty_like(x)
        turned[:, 0::2], turned[:, 1::2] = first * cos - second * sin, first * sin + second * cos
        return turned
    first, second = x[:, : dims // 2], x[:, dims // 2 :]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=1)


@pytest.mark.parametrize(
    "case", [case for case, (_, extra) in sorted(SCALINGS.items()) if is_yarn(extra)]
)
def test_a_yarn_file_rotates_as_llama_cpp_rotates_it(tmp_path, case):
    """The rope a YaRN file loads with turns each position as llama.cpp's own kernel would,
    well past the original context: the check above compares with mlx-lm's reading of the
    source's HF config, this one with llama.cpp's reading of the file."""
    arch, extra = SCALINGS[case]
    path = write_arch_gguf(tmp_path / f"tiny-{case}.gguf", arch, extra=extra)
    model, _, _ = load_gguf(path, dequantize=True)
    rope = model.layers[0].self_attn.rope
    metadata = read_gguf_metadata(path)
    x = np.random.default_rng(3).standard_normal((1024, rope.dims))
    got = np.array(rope(mx.array(x, dtype=mx.float32)[None, None])[0, 0])
    expected = llama_cpp_yarn(x, metadata, arch)
    assert relative_error(got, expected) < 1e-4, case


def test_a_llama3_q8_0_file_kept_quantized_keeps_its_factors(tmp_path):
    path = write_arch_gguf(tmp_path / "tiny-llama3.Q8_0.gguf", "llama", "Q8_0", extra=LLAMA3)
    floats, _, _ = load_gguf(path, dequantize=True)
    kept, _, config = load_gguf(path, dequantize=False)
    assert config["quantization"]["bits"] == 8
    source = rounded_source("llama", "Q8_0", extra=LLAMA3)
    for prompt in PROMPTS:
        np.testing.assert_allclose(logits(kept, prompt), logits(floats, prompt), atol=1e-3)
        assert relative_error(logits(floats, prompt), logits(source, prompt)) < TOLERANCE


def test_prompt_lookup_on_a_llama3_file_is_plain_greedy(tmp_path):
    path = write_arch_gguf(tmp_path / "tiny-llama3.gguf", "llama", extra=LLAMA3)
    model, tokenizer, config = load_gguf(path, dequantize=True)
    engine = Engine(
        model, tokenizer, config["model_type"], [PromptLookup()], verify_cost=CPU_LIKE_COST
    )
    prompt = [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12]
    settings = GenerationSettings(max_tokens=40, k=None)  # to position 53, past 32
    done = list(engine.stream(prompt, settings, "prompt-lookup"))[-1]
    assert isinstance(done, Done)
    reference = plain_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    assert_lossless(model, prompt, reference, list(done.token_ids), "llama3", done.record)
    source = tiny_source("llama", extra=LLAMA3)
    assert list(reference) == list(plain_greedy(source, prompt, 40, set()))[: len(reference)]


def test_batched_rows_of_a_llama3_file_answer_as_each_alone(tmp_path):
    """BatchKVCache (left padding) hands the rope one offset a row, an mx.array."""
    path = write_arch_gguf(tmp_path / "tiny-llama3.gguf", "llama", extra=LLAMA3)
    model, _, _ = load_gguf(path, dequantize=True)
    rows, padding = [list(range(60, 100)), list(range(120, 150))], [0, 10]
    cache = [BatchKVCache(padding) for _ in model.layers]
    batch = mx.array([[0] * pad + row for pad, row in zip(padding, rows)])
    prefill = np.array(model(batch, cache=cache))
    assert isinstance(cache[0].offset, mx.array)
    step = np.array(model(mx.array([[5], [7]]), cache=cache))
    for index, (pad, row) in enumerate(zip(padding, rows)):
        alone = logits(model, row + [[5], [7]][index])[0]
        assert relative_error(prefill[index, pad:], alone[:-1]) < TOLERANCE
        assert relative_error(step[index, -1], alone[-1]) < TOLERANCE


def test_a_llama3_file_is_no_distilled_draft_model_it_could_not_save(tmp_path):
    """Saved as mlx-lm's config.json, its rope factors would be lost on loading back."""
    path = write_arch_gguf(tmp_path / "tiny-llama3.gguf", "llama", extra=LLAMA3)
    model, _, _ = load_gguf(path, dequantize=True)
    with pytest.raises(ValueError, match="rope_freqs cannot be saved in mlx-lm's format"):
        distill.ModelStudent(model, split_decoder(model), 1, mx.arange(8))


def _llama_metadata(tmp_path, **keys) -> dict:
    path = write_arch_gguf(tmp_path / "tiny-llama.gguf", "llama")
    return {**read_gguf_metadata(path), **{f"llama.{key}": value for key, value in keys.items()}}


def test_a_factor_without_a_type_is_linear_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's loader: type "linear" when unnamed; the factor under its old key too."""
    for key in ("rope.scaling.factor", "rope.scale_linear"):
        config = model_config(_llama_metadata(tmp_path, **{key: 4.0}), tensor_names={})
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    config = model_config(_llama_metadata(tmp_path, **{"rope.scaling.type": "none"}), {})
    assert "rope_scaling" not in config


@pytest.mark.parametrize(
    "arch, keys, tensors, refusal",
    [
        ("llama", {"rope.scaling.type": "dynamic"}, (), "GGUF llama with dynamic rope scaling"),
        ("qwen2", {"rope.scaling.type": "longrope"}, (), "GGUF qwen2 with longrope rope"),
        ("gemma3", {"rope.scaling.type": "yarn"}, (), "GGUF gemma3 with yarn rope scaling"),
        ("phi3", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, (), "phi3 with lin"),
        ("llama", {}, ("rope_factors_long.weight",), "GGUF llama with longrope rope scaling"),
        ("phi3", {}, ("rope_factors_long.weight",), "GGUF phi3 LongRoPE lacks its long or sh"),
        ("qwen3", {}, ("rope_freqs.weight",), "GGUF qwen3 with llama3 rope scaling"),
        ("llama", {"rope.scaling.type": "yarn"}, ("rope_freqs.weight",), "with rope_freqs and"),
        (
            "qwen2",
            {"rope.scaling.type": "yarn", "rope.scaling.yarn_ext_factor": 0.5},
            (),
            "GGUF qwen2 yarn rope scaling with rope.scaling.yarn_ext_factor 0.5",
        ),
        (
            "llama",
            {"rope.scaling.type": "yarn", "rope.scaling.yarn_log_multiplier": 0.1},
            (),
            "yarn_log_multiplier",
        ),
        (
            "llama",
            {
                "rope.scaling.type": "linear",
                "rope.scaling.factor": 2.0,
                "rope.scaling.attn_factor": 1.5,
            },
            (),
            "linear rope scaling with rope.scaling.a",
        ),
        (
            "phi3",
            {
                "context_length": 4096,
                "rope.scaling.original_context_length": 16,
                "rope.scaling.attn_factor": 1.19,  # Phi-3's YaRN form, not LongRoPE's sqrt(3)
            },
            ("rope_factors_long.weight", "rope_factors_short.weight"),
            "GGUF phi3 LongRoPE attention factor 1.19 is not mlx-lm's 1.732051",
        ),
    ],
)
def test_rope_scaling_mlx_lm_cannot_match_is_refused_in_one_line(arch, keys, tensors, refusal):
    metadata = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}
    with pytest.raises(GGUFError) as error:
        model_config(metadata, tensor_names=set(tensors))
    assert refusal in str(error.value)
    assert "\n" not in str(error.value)


def test_a_file_shaped_like_llama_3_1_answers_through_the_cli(tmp_path):
    """Llama 3.1/3.2/3.3's files: `rope_freqs`, the `llama-bpe` pre-tokenizer and a begin
    token added by default (llama-vocab.cpp). Both were refused before; now the file is
    listed as runnable, starts each prompt with its begin token, and prompt lookup through
    `generate` gives plain decoding's tokens."""
    path = write_arch_gguf(tmp_path / "llama-3.1-tiny.gguf", "llama", extra=LLAMA3, pre="llama-bpe")
    assert check_gguf(path).startswith("llama, ")
    _, tokenizer, _ = load_gguf(path, dequantize=True)
    assert tokenizer.encode("one two")[0] == 0  # the begin token, not written as add_bos
    args = ["generate", "one two three one two three one two", "-n", "24", "--raw", "--json"]
    answers = {}
    for proposer in ("prompt-lookup", "none"):
        run = CliRunner().invoke(main, [*args, "-m", str(path), "-p", proposer])
        assert run.exit_code == 0, run.output
        answers[proposer] = json.loads(run.stdout.splitlines()[-1])
    assert answers["prompt-lookup"]["token_ids"] == answers["none"]["token_ids"]
    assert answers["none"]["record"]["prompt_tokens"] == len(tokenizer.encode(args[1]))
