"""Each GGUF architecture mlxspec runs, as an mlx-lm model: its config from the `<arch>.*`
metadata, llama.cpp's tensor names as mlx-lm's parameter names, and the conventions llama.cpp's
converter applied to the weights.

Followed from llama.cpp: `conversion/llama.py` (`LlamaModel.permute`: Q and K rows of llama and
Mistral interleaved for its rope), `conversion/gemma.py` (`Gemma3Model`: every `*norm.weight`
stored with Gemma's +1 added, out-of-vocabulary embedding rows dropped), `conversion/phi.py`
(`Phi3MiniModel`: fused `attn_qkv` and gate-up `ffn_up`), `conversion/qwen.py`,
`gguf-py/gguf/constants.py` and `tensor_mapping.py` (the names), and `src/llama-model.cpp`
(Gemma 3's fixed sliding pattern of 6, local rope base 10,000 and query scale). Rope scaling:
gguf_rope.py.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from mlxspec.models.gguf_metadata import GGUFError, Metadata
from mlxspec.models.gguf_rope import rope_scaling

# llama.cpp's per-block tensor names -> mlx-lm's module paths, as llama, Qwen and Mistral have them.
LLAMA_BLOCK = {
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
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3's four norms a block: llama.cpp names the one before the MLP `ffn_norm` (FFN_PRE_NORM).
GEMMA3_BLOCK = {
    **LLAMA_BLOCK,
    **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps HF's fused projections: `qkv_proj` as `attn_qkv`, `gate_up_proj` as `ffn_up`.
PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class Architecture:
    """How one `general.architecture` becomes an mlx-lm model."""

    model_type: str  # the mlx_lm.models module
    block_tensors: dict[str, str]
    config: Callable[[Metadata, Container[str]], dict]
    # Added to every norm weight on loading: llama.cpp stored Gemma's (1 + w) where mlx-lm's
    # Gemma RMSNorm adds the 1 itself.
    norm_offset: float = 0.0


def _common(get: Metadata, tensor_names: Container[str], rope: Container[str]) -> dict:
    """What every supported architecture writes alike (TextModel.set_gguf_parameters); `rope`:
    the rope scaling kinds its mlx-lm model takes (gguf_rope.rope_scaling)."""
    scaling = rope_scaling(get, tensor_names, rope)
    if get.has("attention.temperature_scale"):
        raise GGUFError(f"GGUF {get.architecture} attention temperature scaling is not supported")
    hidden_size = get("embedding_length")
    n_heads = get("attention.head_count")
    head_dim = get("attention.key_length", hidden_size // n_heads)
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "vocab_size": get("vocab_size", len(get.metadata.get("tokenizer.ggml.tokens", ()))),
        "max_position_embeddings": get("context_length"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **scaling,
    }


def _full_rotary(get: Metadata, config: dict) -> dict:
    if get("rope.dimension_count", config["head_dim"]) != config["head_dim"]:
        raise GGUFError(f"GGUF {get.architecture} with partial rotary embeddings is not supported")
    return config


def _llama_config(get: Metadata, tensor_names: Container[str]) -> dict:
    # Llama 3's `rope_freqs` factors are set on the built model (gguf_rope.use_rope_freqs).
    config = _full_rotary(get, _common(get, tensor_names, ("llama3", "linear", "yarn")))
    # llama.cpp's converter permutes the rows of Q and K so that each rotated pair is adjacent
    # (the original Meta layout), which is what MLX's "traditional" RoPE rotates. Using the flag
    # instead of un-permuting keeps the file's (possibly quantized) tensors untouched; the two
    # give the same logits.
    return {**config, "model_type": "llama", "rope_traditional": True}


def _qwen_config(model_type: str):
    def config(get: Metadata, tensor_names: Container[str]) -> dict:
        # Qwen is converted without the permute (TextModel, not LlamaModel): HF's halves rope.
        config = _common(get, tensor_names, ("linear", "yarn"))
        return {**_full_rotary(get, config), "model_type": model_type}

    return config


# Gemma 3's sliding layers, as llama.cpp's llama-model.cpp fixes them (none are in the file).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # the one size whose queries are scaled by hidden/heads, not head_dim


def _gemma3_config(get: Metadata, tensor_names: Container[str]) -> dict:
    # A linear factor (Gemma 3 4B+): mlx-lm's gemma3_text, like llama.cpp, scales only the
    # global layers' rope.
    config = _full_rotary(get, _common(get, tensor_names, ("linear",)))
    if get.has("final_logit_softcapping") or get.has("attn_logit_softcapping"):
        raise GGUFError("GGUF gemma3 with logit soft-capping is not supported")
    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if not isinstance(pattern, int):
        raise GGUFError("GGUF gemma3 with a per-layer sliding window pattern is not supported")
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config.pop("tie_word_embeddings")  # mlx-lm's Gemma 3 ties when lm_head is absent (sanitize)
    return {
        **config,
        "model_type": "gemma3_text",
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
    }


def _phi3_config(get: Metadata, tensor_names: Container[str]) -> dict:
    # LongRoPE (Phi-3.5, Phi-4-mini): its factors are read in with the tensors.
    config = _common(get, tensor_names, ("longrope",))
    head_dim = config.pop("head_dim")  # mlx-lm's Phi-3 takes hidden_size // heads
    return {
        **config,
        "model_type": "phi3",
        "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
        "original_max_position_embeddings": get(
            "rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
    }


ARCHITECTURES = {
    "llama": Architecture("llama", LLAMA_BLOCK, _llama_config),
    # Ministral 3 / Mistral Small 3: a LlamaModel in llama.cpp's converter, so permuted alike.
    "mistral3": Architecture("llama", LLAMA_BLOCK, _llama_config),
    "qwen2": Architecture("qwen2", LLAMA_BLOCK, _qwen_config("qwen2")),
    "qwen3": Architecture("qwen3", {**LLAMA_BLOCK, **QK_NORMS}, _qwen_config("qwen3")),
    "gemma3": Architecture("gemma3_text", GEMMA3_BLOCK, _gemma3_config, norm_offset=-1.0),
    "phi3": Architecture("phi3", PHI3_BLOCK, _phi3_config),
}


def architecture_of(metadata: dict) -> Architecture:
    """The file's architecture, or one line naming it and the supported ones."""
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise GGUFError(f"GGUF architecture {name!r} is not supported (supported: {supported})")
    return ARCHITECTURES[name]


def model_config(metadata: dict, tensor_names: Container[str]) -> dict:
    """mlx-lm config from the `<arch>.*` metadata keys (nothing assumed about the model)."""
    name = metadata.get("general.architecture")
    architecture = architecture_of(metadata)
    return architecture.config(Metadata(metadata, name), tensor_names)


def mlx_lm_name(gguf_name: str, architecture: Architecture) -> str:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`."""
    if gguf_name in TOP_TENSORS:
        return TOP_TENSORS[gguf_name]
    block, index, tensor = (gguf_name.split(".", 2) + ["", ""])[:3]
    if block != "blk" or not index.isdigit() or tensor not in architecture.block_tensors:
        raise GGUFError(
            f"unexpected GGUF tensor {gguf_name!r} for mlx-lm's {architecture.model_type} model"
        )
    return f"model.layers.{index}.{architecture.block_tensors[tensor]}"
