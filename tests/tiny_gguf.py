"""Tiny random llama GGUF files, written with the `gguf` package (llama.cpp's own writer),
quantized as llama.cpp does (Q4_0, Q4_1, Q8_0), with the byte tokenizer in the metadata; and
tiny models of the other architectures, rope scaling included, as llama.cpp's converter
writes them."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from mlx.utils import tree_flatten, tree_map_with_path
from tiny_models import EOS, FAMILIES, byte_tokenizer, tiny_model

from mlxspec.models.gguf import BLOCK_TENSORS, TOKEN_TYPE_CONTROL, TOP_TENSORS

GGUF_TYPES = {"Q4_0", "Q4_1", "Q8_0"}


def _gguf_names() -> dict[str, str]:
    """mlx-lm parameter name -> GGUF tensor name (the inverse of mlxspec.models.gguf's map)."""
    names = {f"{mlx}.weight": f"{gguf}.weight" for gguf, mlx in TOP_TENSORS.items()}
    for layer in range(3):
        for gguf, mlx in BLOCK_TENSORS.items():
            names[f"model.layers.{layer}.{mlx}.weight"] = f"blk.{layer}.{gguf}.weight"
    return names


def gguf_tokens() -> list[str]:
    """llama.cpp requires BPE merges, and each must make a token of the vocabulary: the
    byte tokenizer's 256 bytes get one merge ("ĠĠ", two spaces), then the end token."""
    vocab = dict(byte_tokenizer().get_vocab())
    del vocab[EOS]
    return [*sorted(vocab, key=vocab.get), "ĠĠ", EOS]


def tiny_llama_writer(path: Path, model, tokens: list[str]) -> GGUFWriter:
    """A GGUF writer with `model`'s hyper-parameters and the byte tokenizer's metadata; the
    tensors are the caller's to add."""
    args = model.args
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_TYPE_CONTROL if t == EOS else 1 for t in tokens])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(len(tokens) - 1)
    return writer


def write_tiny_gguf(path: Path, qtype: str, seed: int = 0) -> Path:
    """tests' tiny llama (3 layers, width 64) as a GGUF file, its matrices in `qtype`."""
    tokens = gguf_tokens()
    model = tiny_model("llama", seed=seed, config={**FAMILIES["llama"], "vocab_size": len(tokens)})
    writer = tiny_llama_writer(path, model, tokens)
    kind = GGMLQuantizationType[qtype]
    names = _gguf_names()
    for name, value in tree_flatten(model.parameters()):
        data = np.array(value, dtype=np.float32)
        if data.ndim == 2:
            writer.add_tensor(names[name], quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(names[name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- Other architectures, written as llama.cpp's convert_hf_to_gguf.py writes them -------------

# The tiny source model of each GGUF architecture (mlx-lm family, config). Gemma 3's sliding
# pattern is llama.cpp's fixed 6 (no key in the file), so it gets 6 layers: one global.
ARCH_SOURCES = {
    "llama": ("llama", FAMILIES["llama"]),
    "mistral3": ("llama", FAMILIES["llama"]),
    "qwen2": (
        "qwen2",
        dict(
            FAMILIES["llama"],
            model_type="qwen2",
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=4096,
            tie_word_embeddings=True,  # Qwen2.5's small models: no output.weight in the file
        ),
    ),
    "qwen3": ("qwen3", FAMILIES["qwen3"]),
    "gemma3": (
        "gemma3_text",
        dict(FAMILIES["gemma3_text"], num_hidden_layers=6, sliding_window_pattern=6),
    ),
    "phi3": (
        "phi3",
        dict(
            FAMILIES["llama"],
            model_type="phi3",
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
        ),
    ),
}
PERMUTED = {"llama", "mistral3"}  # LlamaModel subclasses in llama.cpp's converter


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (conversion/llama.py), copied: each head's two halves
    interleaved, so that rope rotates adjacent pairs."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def source_config(arch: str, extra: dict | None = None) -> dict:
    """The HF-style config of tiny_source(arch), with `extra` (e.g. a `rope_scaling`)."""
    family, config = ARCH_SOURCES[arch]
    return {**config, "vocab_size": len(gguf_tokens()), **(extra or {})}


def tiny_source(arch: str, seed: int = 0, extra: dict | None = None):
    """The mlx-lm model a tiny `arch` GGUF is written from (Gemma 3 tied, as Google ships it);
    `extra`: config keys over the architecture's own (a rope scaling)."""
    family = ARCH_SOURCES[arch][0]
    model = tiny_model(family, seed=seed, config=source_config(arch, extra))
    if family == "gemma3_text":
        model.sanitize({})  # no lm_head: the embeddings are the head, as in Gemma 3's checkpoints
    # A fresh model's norms are all alike (ones, or Gemma's zeros): made different, a norm
    # loaded into another's place changes the logits.
    rng = np.random.default_rng(seed)
    model.update(
        tree_map_with_path(
            lambda path, value: (
                value + mx.array(rng.normal(0, 0.3, value.shape).astype(np.float32))
                if path.endswith("norm.weight")
                else value
            ),
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model


def _write_metadata(writer: GGUFWriter, arch: str, args) -> None:
    """The keys llama.cpp's converter writes for `arch` (TextModel.set_gguf_parameters plus
    each model class's own)."""
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(getattr(args, "max_position_embeddings", None) or 4096)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(getattr(args, "rope_theta", 10000.0))
    if arch in PERMUTED:
        writer.add_vocab_size(args.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(args.sliding_window)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(args.original_max_position_embeddings)
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(0)


def _llama3_rope_freqs(hparams: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors (conversion/llama.py), copied with numpy
    for torch: Llama 3's factor per rotated pair, from HF's `rope_scaling` (llama3). The
    converter reads the original context from the top-level hparams, default 8192 (Llama
    3.1's value, which its config keeps under rope_scaling): the tiny sources carry it at both
    places."""
    rope_params = hparams["rope_scaling"]
    base = hparams.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rope_params.get("factor", 8.0)
    low_freq_factor = rope_params.get("low_freq_factor", 1.0)
    high_freq_factor = rope_params.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def _write_rope_scaling(writer: GGUFWriter, arch: str, hparams: dict, head_dim: int) -> None:
    """The rope scaling of HF's `rope_scaling` as the converter writes it: linear and YaRN as
    keys (TextModel.set_gguf_parameters; Gemma3Model writes linear alike), Llama 3's factors
    as `rope_freqs` (LlamaModel), LongRoPE's as `rope_factors_long`/`_short` with the
    attention factor (Phi3MiniModel.generate_extra_tensors)."""
    import gguf

    scaling = hparams.get("rope_scaling")
    if not scaling:
        return
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if arch == "phi3":
        original = hparams["original_max_position_embeddings"]
        scale = hparams["max_position_embeddings"] / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
        for kind, factors in (("LONG", "long_factor"), ("SHORT", "short_factor")):
            name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[f"ROPE_FACTORS_{kind}"]]
            writer.add_tensor(f"{name}.weight", np.array(scaling[factors], dtype=np.float32))
    elif rope_type == "llama3" and arch in PERMUTED:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]
        writer.add_tensor(f"{name}.weight", _llama3_rope_freqs(hparams, head_dim))
    elif rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if (beta_fast := scaling.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := scaling.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)
    else:
        raise ValueError(f"no converter path for {arch} with {rope_type} rope scaling")


def write_arch_gguf(
    path: Path,
    arch: str,
    qtype: str = "F32",
    seed: int = 0,
    extra: dict | None = None,
    pre: str | None = None,
) -> Path:
    """tiny_source(arch, seed, extra) as llama.cpp converts it: names from gguf-py's own tensor
    map, llama's Q/K permuted, Gemma's norms stored plus one, matrices in `qtype` (F32, F16 or
    a quant), its rope scaling as the converter writes it. `pre`: the pre-tokenizer named
    (default: Qwen's for Qwen, else GPT-2's); token 0 is then the begin token, as Llama 3's
    files name one."""
    import gguf

    source = tiny_source(arch, seed, extra)
    args = source.args
    tokens = gguf_tokens()
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, args)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    _write_rope_scaling(writer, arch, source_config(arch, extra), head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or ("qwen2" if arch.startswith("qwen") else "default"))
    if pre is not None:
        writer.add_bos_token_id(0)
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_TYPE_CONTROL if t == EOS else 1 for t in tokens])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(len(tokens) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], args.num_hidden_layers)
    kind = GGMLQuantizationType[qtype]
    for name, value in tree_flatten(source.parameters()):
        module, suffix = name.rsplit(".", 1)
        data = np.array(value, dtype=np.float32)
        if arch in PERMUTED and module.endswith(("q_proj", "k_proj")):
            n_kv = args.num_attention_heads if "q_proj" in module else args.num_key_value_heads
            data = llama_cpp_permute(data, args.num_attention_heads, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # Gemma3Model.norm_shift
        gguf_name = f"{names.get_name(module)}.{suffix}"
        if data.ndim == 2 and qtype == "F16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif data.ndim == 2 and qtype != "F32":
            writer.add_tensor(gguf_name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
