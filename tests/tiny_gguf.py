"""Tiny random llama GGUF files, written with the `gguf` package (llama.cpp's own writer),
quantized as llama.cpp does (Q4_0, Q4_1, Q8_0), with the byte tokenizer in the metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from mlx.utils import tree_flatten
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
