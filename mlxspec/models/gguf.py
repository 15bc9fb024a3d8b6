"""Read a llama-architecture GGUF file into mlx-lm's llama model and a matching tokenizer.

`mx.load` already parses GGUF: it returns the tensors (Q4_0/Q4_1/Q8_0 blocks come back as
MLX affine `weight`/`scales`/`biases` triplets, group size 32) and the metadata; the
K-quants and the other llama.cpp quants come through gguf_reader.py in the same shape. This module
maps llama.cpp's tensor names and `llama.*` hyper-parameters onto mlx-lm's llama `Model`, and
rebuilds the tokenizer from the `tokenizer.*` metadata, since a GGUF carries no tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from mlxspec.models.gguf_reader import (
    UnreadableGGUF,
    read_gguf,
    read_gguf_metadata,
    tensor_types,
)

# llama.cpp quantizes in blocks of 32 weights; mx.load keeps that as the affine group size.
GGUF_GROUP_SIZE = 32

# llama.cpp's per-block tensor names -> mlx-lm's llama module paths.
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# How llama.cpp splits text before BPE, by `tokenizer.ggml.pre` (see its llama-vocab.cpp).
# "smollm" (like starcoder) puts every digit on its own, then applies GPT-2's regex: exactly
# SmolLM2's own tokenizer.json, `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`.
DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "codeshell"}
GPT2_PRE_TOKENIZERS = {"default", "gpt2"}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class GGUFError(ValueError):
    """A GGUF file this loader cannot map faithfully; the message is one line."""


def load_gguf(path: Path, *, dequantize: bool) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """mlx-lm llama model, tokenizer and the mlx-lm config built from a GGUF file.

    dequantize=True gives float32 weights (MLX's CPU backend runs quantized matmul slowly);
    False keeps llama.cpp's Q4_1/Q4_0/Q8_0 blocks as MLX affine quantization, which maps them
    exactly (value = scale * q + bias per group of 32). The weights are left lazy (read and
    dequantized on first use, see loading.materialise), so that a rank of a sharded target
    can split the model first and dequantize only its own slices.
    """
    try:
        tensors, metadata = read_gguf(path, keep_quantized=not dequantize)
    except UnreadableGGUF as err:
        raise GGUFError(str(err)) from None
    config = model_config(metadata, tensor_names=tensors)
    weights, bits_by_module = _mlx_lm_weights(tensors, dequantize=dequantize)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if bits_by_module:
        config["quantization"] = _quantization_config(bits_by_module)
        nn.quantize(
            model,
            group_size=GGUF_GROUP_SIZE,
            class_predicate=lambda module_path, _: (
                {"group_size": GGUF_GROUP_SIZE, "bits": bits_by_module[module_path]}
                if module_path in bits_by_module
                else False
            ),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise GGUFError(f"{path}: tensors do not fit mlx-lm's llama model: {error}") from None
    model.eval()
    return model, _tokenizer_from_metadata(metadata), config


def is_gguf(path: Path) -> bool:
    """A GGUF file, by its magic bytes: Ollama keeps them as blobs without the suffix."""
    if not path.is_file():
        return False
    with open(path, "rb") as file:
        return file.read(4) == b"GGUF"


def check_gguf(path: Path) -> str:
    """What a GGUF file holds ("llama, Q4_K/Q6_K/F32"), read from its header alone;
    GGUFError where this loader cannot run it (its architecture, its tokenizer)."""
    metadata = read_gguf_metadata(path)
    kinds = tensor_types(path)
    model_config(metadata, tensor_names=kinds)
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    return f"{metadata['general.architecture']}, {'/'.join(sorted(set(kinds.values())))}"


def read_gguf_tokenizer(path: Path) -> TokenizerWrapper:
    """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    return _tokenizer_from_metadata(read_gguf_metadata(path))


def model_config(metadata: dict, tensor_names) -> dict:
    """mlx-lm llama config from the `llama.*` metadata keys (nothing assumed about the model)."""
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise GGUFError(f"GGUF architecture {architecture!r} is not supported (only 'llama')")
    if "rope_freqs.weight" in tensor_names or f"{architecture}.rope.scaling.type" in metadata:
        raise GGUFError("GGUF files with rope scaling (e.g. Llama 3.1) are not supported yet")

    def number(key: str, default=None):
        value = metadata.get(f"{architecture}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {architecture}.{key}")
        return _python_number(value)

    hidden_size = number("embedding_length")
    n_heads = number("attention.head_count")
    head_dim = number("attention.key_length", hidden_size // n_heads)
    if number("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError("GGUF models with partial rotary embeddings are not supported")
    vocab_size = number("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    return {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": number("block_count"),
        "intermediate_size": number("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": number("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        "vocab_size": vocab_size,
        "max_position_embeddings": number("context_length"),
        "rope_theta": number("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes the rows of Q and K so that each rotated pair is
        # adjacent (the original Meta layout), which is what MLX's "traditional" RoPE rotates.
        # Using the flag instead of un-permuting keeps the file's (possibly quantized) tensors
        # untouched; the two give the same logits.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def _python_number(value):
    if isinstance(value, mx.array):
        value = np.array(value).item()
        if isinstance(value, float):
            # float32 metadata: keep the short decimal it was written as (1e-05, not 9.99e-06).
            return float(str(np.float32(value)))
    return value


def _mlx_lm_name(gguf_name: str) -> str:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`."""
    if gguf_name in TOP_TENSORS:
        return TOP_TENSORS[gguf_name]
    block, index, tensor = (gguf_name.split(".", 2) + ["", ""])[:3]
    if block != "blk" or not index.isdigit() or tensor not in BLOCK_TENSORS:
        raise GGUFError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")
    return f"model.layers.{index}.{BLOCK_TENSORS[tensor]}"


def _mlx_lm_weights(tensors: dict, *, dequantize: bool) -> tuple[dict, dict]:
    """(mlx-lm parameter name -> array, module path -> bits for modules left quantized).

    Everything that is not a packed quantized block becomes float32, so activations run in
    float32 on both paths. SmolLM2's residual stream reaches ~25,000: within a factor of 3 of
    float16's limit, and float16 activations changed its greedy answers. The fp16 scales and
    biases convert to float32 exactly, so the quantized path stays bit-exact to llama.cpp's
    blocks; they cost 17 MB more than fp16 ones for a 135M model.
    """
    weights = {}
    bits_by_module = {}
    for name, tensor in tensors.items():
        gguf_module, _, part = name.rpartition(".")
        if part != "weight":
            continue  # scales/biases are read with their weight below
        module = _mlx_lm_name(gguf_module)
        if f"{gguf_module}.scales" not in tensors:
            weights[f"{module}.weight"] = tensor.astype(mx.float32)
            continue
        scales = tensors[f"{gguf_module}.scales"].astype(mx.float32)
        biases = tensors[f"{gguf_module}.biases"].astype(mx.float32)
        bits = tensor.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
        if dequantize:
            weights[f"{module}.weight"] = _dequantize(tensor, scales, biases, bits)
        else:
            weights.update(
                {f"{module}.weight": tensor, f"{module}.scales": scales, f"{module}.biases": biases}
            )
            bits_by_module[module] = bits
    return weights, bits_by_module


def _dequantize(packed: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """Float32 weights from MLX affine blocks; exact with float32 scales.

    For 4 and 8 bits (all that mx.load makes of GGUF) this unpacks with plain array ops:
    7x faster than `mx.dequantize` on MLX's CPU backend (0.3 s against 2.3 s for SmolLM2).
    """
    if bits not in (4, 8):
        return mx.dequantize(packed, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
    rows = packed.shape[0]
    codes = packed.view(mx.uint8)
    if bits == 4:  # two codes a byte, the low nibble first
        codes = mx.stack([codes & 0xF, codes >> 4], axis=-1)
    groups = codes.reshape(rows, -1, GGUF_GROUP_SIZE).astype(mx.float32)
    return (groups * scales[..., None] + biases[..., None]).reshape(rows, -1)


def _quantization_config(bits_by_module: dict) -> dict:
    """mlx-lm's `quantization` config: the common bits, with per-module overrides."""
    common_bits = max(set(bits_by_module.values()), key=list(bits_by_module.values()).count)
    config = {"group_size": GGUF_GROUP_SIZE, "bits": common_bits, "mode": "affine"}
    for module, bits in bits_by_module.items():
        if bits != common_bits:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return config


def _tokenizer_from_metadata(metadata: dict) -> TokenizerWrapper:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = np.array(metadata["tokenizer.ggml.token_type"]).tolist()
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]

    backend = Tokenizer(
        models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, token_type in zip(tokens, token_types)
            if token_type == TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == TOKEN_TYPE_USER_DEFINED
        ]
    )

    def special(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[_python_number(token_id)]

    bos_token = special("bos_token_id")
    if bos_token is not None and _python_number(
        metadata.get("tokenizer.ggml.add_bos_token", False)
    ):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A $B",
            special_tokens=[(bos_token, _python_number(metadata["tokenizer.ggml.bos_token_id"]))],
        )

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        # Decoding must give back the exact text, as mlx-lm's streaming detokenizer does.
        clean_up_tokenization_spaces=False,
    )
    # Chat models end a turn with an end-of-turn token the metadata may name apart from EOS.
    end_of_turn = metadata.get("tokenizer.ggml.eot_token_id")
    extra_eos = [] if end_of_turn is None else [_python_number(end_of_turn)]
    return TokenizerWrapper(hf_tokenizer, BPEStreamingDetokenizer, eos_token_ids=extra_eos)


def _pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in DIGIT_SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_type in GPT2_PRE_TOKENIZERS:
        return byte_level
    raise GGUFError(f"GGUF pre-tokenizer {pre_type!r} is not supported yet")
