"""Tiny random-weight models from mlx-lm's own classes, with a real byte-level tokenizer.

Random models are the fast way to test the engine's logic on every cache kind:
plain KV (llama, qwen3), rotating sliding windows (gemma3_text), and recurrent
state (lfm2's conv layers). The LM head is scaled up so the models are confident:
near-tied top-2 logits, where batched and one-token arithmetic may legitimately
round differently, become rare and the lossless tests keep their teeth.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)

EOS = "<|end|>"


def byte_tokenizer(pieces: Sequence[str] = ()) -> TokenizerWrapper:
    """256 byte tokens + an end-of-text token: every string encodes, every id decodes.
    `pieces`: more tokens after those, each several characters long, that no merge makes:
    encoding never gives them, decoding writes them (for a model rigged to, scripted.py)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    for piece in pieces:
        vocab[byte_level(piece)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)


def byte_level(text: str) -> str:
    """`text` as the byte-level vocabulary spells it (a character per byte)."""
    byte_chars = bytes_to_unicode()
    return "".join(byte_chars[b] for b in text.encode())


VOCAB = 257

# Every family: 3 layers of width 64, 4 heads, the byte tokenizer's vocabulary.
SIZE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB)

# Qwen3.5's text model, dense or MoE: Gated DeltaNet layers and full attention.
QWEN3_5 = dict(
    SIZE,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    tie_word_embeddings=False,
    rope_parameters={"type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
)

FAMILIES = {
    "llama": dict(
        SIZE,
        model_type="llama",
        intermediate_size=128,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        SIZE,
        model_type="qwen3",
        intermediate_size=128,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        SIZE,
        model_type="gemma3_text",
        intermediate_size=128,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=12,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    ),
    # Mamba layers beside attention, that ignore a padded row's length: no batch holds it.
    "jamba": dict(
        SIZE,
        model_type="jamba",
        intermediate_size=128,
        num_key_value_heads=2,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=100,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
        num_experts=1,
        num_experts_per_tok=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
    ),
    "lfm2": dict(
        SIZE,
        model_type="lfm2",
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        full_attn_idxs=[1],
    ),
    # Qwen3.5: Gated DeltaNet layers (recurrent state, `ArraysCache`) with full attention
    # every `full_attention_interval`-th layer: here 0 and 2 recurrent, 1 attention. A flat
    # config is the text model's (`ModelArgs.from_dict` wraps it as `text_config`).
    "qwen3_5": dict(QWEN3_5, model_type="qwen3_5", intermediate_size=128),
    # Qwen3.5 MoE (35B-A3B's text model): the same layers, with 4 routed experts (2 per
    # token) and a gated shared one in place of each MLP.
    "qwen3_5_moe": dict(
        QWEN3_5,
        model_type="qwen3_5_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    # gpt-oss: sliding-window layers (a window shorter than the prompts) beside full ones,
    # attention sinks (random here: a fresh model's are zeros), 4 experts, 2 per token.
    "gpt_oss": dict(
        SIZE,
        model_type="gpt_oss",
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=10000,
    ),
    # Gemma 4 (E2B/E4B's text model): sliding and full layers (the full ones with their own
    # head width), per-layer input embeddings, the last layer reusing layer 1's KV (it has
    # no cache of its own), a logit soft-cap.
    "gemma4_text": dict(
        SIZE,
        model_type="gemma4_text",
        num_hidden_layers=4,
        intermediate_size=128,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=12,
        sliding_window_pattern=2,
        num_kv_shared_layers=1,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # tied, the scaled embeddings make it echo its input
    ),
}


def tiny_model(
    family: str = "llama",
    seed: int = 0,
    sharpness: float = 8.0,
    layers: int | None = None,
    config: dict | None = None,
):
    """A random model of `family`; `sharpness` scales the output logits. `config`: the
    family's own, changed (e.g. head counts that 3 ranks divide)."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    config = dict(config or FAMILIES[family])
    if layers is not None:
        config["num_hidden_layers"] = layers
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))

    def sharpen(path, value):
        if path.endswith("self_attn.sinks"):  # gpt-oss: zeros until trained
            return mx.random.normal(value.shape)
        if path.endswith("lm_head.weight") or (
            path.endswith("embed_tokens.weight") and not hasattr(model, "lm_head")
        ):
            return value * sharpness
        return value

    model.update(tree_map_with_path(sharpen, model.parameters()))
    mx.eval(model.parameters())
    return model
