"""A GGUF file's rope scaling as mlx-lm's rope for it: Llama 3's frequency factors, YaRN,
linear, and Phi-3's LongRoPE. Any other kind, or one whose parameters mlx-lm cannot match, is
refused in one line.

Followed from llama.cpp: `conversion/base.py` (`TextModel.set_gguf_parameters`: linear and
YaRN as `rope.scaling.*` keys), `conversion/llama.py` (`LlamaModel.generate_extra_tensors`:
Llama 3's per-frequency factors as the `rope_freqs` tensor, nothing else of HF's llama3
config), `conversion/phi.py` (`Phi3MiniModel`: LongRoPE's `rope_factors_long`/`_short`
tensors and `rope.scaling.attn_factor`, no scaling type), `conversion/gemma.py` (Gemma 3's
linear factor, "only applied for global layers"), `src/llama-model.cpp` (`load_hparams`: the
type is "linear" when unnamed, the factor also under the old `rope.scale_linear`; Gemma 3's
sliding layers at scale 1; `get_rope_factors`: the long factors once the context exceeds the
original, as it does at llama.cpp's default, the trained context), `src/llama-context.cpp`
(YaRN: ext_factor 1, magnitude 0.1 ln(factor) + 1, times `rope.scaling.attn_factor`) and
`ggml/src/ggml-cpu/ops.cpp` (`ggml_rope_cache_init`: each angle divided by its factor;
`rope_yarn`, `ggml_rope_yarn_corr_dims`: beta_fast 32, beta_slow 1 by default).
"""

from __future__ import annotations

import math
from collections.abc import Container

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.models.gguf_metadata import GGUFError, Metadata

ROPE_FREQS = "rope_freqs.weight"
LONG_FACTORS = "rope_factors_long.weight"
SHORT_FACTORS = "rope_factors_short.weight"
# Not weights of any mlx-lm module: read into the rope instead.
ROPE_TENSORS = frozenset({ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS})


def rope_scaling(get: Metadata, tensor_names: Container[str], supported: Container[str]) -> dict:
    """The mlx-lm config keys of the file's rope scaling ({} for none); `supported`: the kinds
    ("llama3", "linear", "yarn", "longrope") this architecture's mlx-lm model can take."""
    kind = _scaling_kind(get, tensor_names)
    if kind is None:
        return {}
    if kind not in supported:
        raise _error(f"GGUF {get.architecture} with {kind} rope scaling is not supported")
    # Set by the file but not by what mlx-lm's rope of that kind takes.
    if kind != "longrope":
        _refuse_unless(get, kind, "rope.scaling.attn_factor", 1.0)
    if kind == "yarn":
        # mlx-lm's YarnRoPE always mixes fully (ext_factor 1) and takes no attention factor.
        _refuse_unless(get, kind, "rope.scaling.yarn_ext_factor", 1.0)
        _refuse_unless(get, kind, "rope.scaling.yarn_attn_factor", 1.0)
        _refuse_unless(get, kind, "rope.scaling.yarn_log_multiplier", 0.0)
        scaling = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            # llama.cpp's n_ctx_orig_yarn: the trained context where the key is missing
            "original_max_position_embeddings": get(
                "rope.scaling.original_context_length", get("context_length")
            ),
        }
        for beta in ("beta_fast", "beta_slow"):  # mlx-lm's defaults are llama.cpp's: 32, 1
            if get.has(f"rope.scaling.yarn_{beta}"):
                scaling[beta] = get(f"rope.scaling.yarn_{beta}")
        return {"rope_scaling": scaling}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": _linear_factor(get)}}
    if kind == "longrope":
        return {"rope_scaling": _longrope(get, tensor_names)}
    return {}  # llama3: the factors go onto the built model (use_rope_freqs)


def _scaling_kind(get: Metadata, tensor_names: Container[str]) -> str | None:
    """What llama.cpp's loader makes of the file: its factor tensors, else the named type
    ("linear" where only a factor is written), None where nothing scales."""
    named = get("rope.scaling.type", "")
    if get.has("rope.scaling.alpha"):
        return "alpha"  # HunYuan's NTK-alpha: no mlx-lm rope of these architectures
    if LONG_FACTORS in tensor_names or SHORT_FACTORS in tensor_names:
        if named not in ("", "longrope") or _linear_factor(get) != 1.0:
            raise _error(f"GGUF {get.architecture} with LongRoPE factors and {named} scaling")
        return "longrope"
    if ROPE_FREQS in tensor_names:
        if named not in ("", "none") or _linear_factor(get) != 1.0:
            raise _error(f"GGUF {get.architecture} with rope_freqs and {named} rope scaling")
        return "llama3"
    if named == "none" or (named in ("", "linear") and _linear_factor(get) == 1.0):
        return None  # "none" forces scale 1 in llama.cpp; a factor of 1 (or 0) is no scaling
    return named or "linear"


def _error(message: str) -> GGUFError:
    return GGUFError(message)


def _linear_factor(get: Metadata) -> float:
    """`rope.scaling.factor`, or the old `rope.scale_linear`; 0 (unset) means 1."""
    factor = get("rope.scaling.factor", get("rope.scale_linear", 0.0))
    return float(factor) or 1.0


def _refuse_unless(get: Metadata, kind: str, key: str, default: float) -> None:
    if get.has(key) and get(key) != default:
        raise _error(
            f"GGUF {get.architecture} {kind} rope scaling with {key} {get(key)} is not supported"
        )


def _longrope(get: Metadata, tensor_names: Container[str]) -> dict:
    """Phi-3's LongRoPE as mlx-lm's phi3 takes it; the factor lists are read in with the
    tensors (with_rope_factors). mlx-lm's SuScaledRoPE always rotates by the long factors and
    scales by sqrt(1 + ln(s) / ln(original)), s = context / original: the file's
    `attn_factor` must be that (the converter's own formula), else it is refused."""
    if LONG_FACTORS not in tensor_names or SHORT_FACTORS not in tensor_names:
        raise _error(f"GGUF {get.architecture} LongRoPE lacks its long or short factors")
    original = get("rope.scaling.original_context_length")
    scale = get("context_length") / original
    expected = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn_factor = get("rope.scaling.attn_factor", 1.0)
    if not math.isclose(attn_factor, expected, rel_tol=1e-6):
        raise _error(
            f"GGUF {get.architecture} LongRoPE attention factor {attn_factor} is not "
            f"mlx-lm's {expected:.6f}"
        )
    return {"type": "longrope", "long_factor": None, "short_factor": None}


def with_rope_factors(config: dict, tensors: dict) -> dict:
    """`config` with LongRoPE's long and short factors read from the file, as lists."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("type") != "longrope":
        return config
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    pairs = int(head_dim * config.get("partial_rotary_factor", 1.0)) // 2
    factors = {}
    for key, name in (("long_factor", LONG_FACTORS), ("short_factor", SHORT_FACTORS)):
        values = np.array(tensors[name].astype(mx.float32))
        if values.shape != (pairs,):
            raise _error(f"GGUF {name} has shape {values.shape}, not ({pairs},)")
        factors[key] = values.tolist()
    return {**config, "rope_scaling": {**scaling, **factors}}


class FrequencyFactorRoPE(nn.Module):
    """mlx-lm's Llama3RoPE with the file's factors in place of the ones it computes from
    HF's config (the GGUF keeps only the factors): the same `mx.fast.rope` call, whose angle
    is position / freqs, i.e. llama.cpp's theta / factor. An array offset (BatchKVCache's,
    one a row) goes through as mlx-lm's own ropes pass it."""

    def __init__(self, dims: int, traditional: bool, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors
        mx.eval(self._freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


def use_rope_freqs(model: nn.Module, config: dict, tensors: dict) -> None:
    """Llama 3's `rope_freqs` factors (where the file has them) on every layer's rope."""
    if ROPE_FREQS not in tensors:
        return
    dims = config["head_dim"]
    factors = tensors[ROPE_FREQS].astype(mx.float32)
    if factors.shape != (dims // 2,):
        raise _error(f"GGUF {ROPE_FREQS} has shape {factors.shape}, not ({dims // 2},)")
    for layer in model.layers:
        layer.self_attn.rope = FrequencyFactorRoPE(
            dims, config["rope_traditional"], config["rope_theta"], factors
        )
