"""EAGLE-3 heads in vLLM's `speculators` layout (RedHatAI's): the random SafeAILab head
of test_eagle3 rewritten in speculators' names and config (`layers.0.*`, `fc` with a
bias, `transformer_layer_config`, `norm_before_residual`,
`eagle_aux_hidden_state_layer_ids`, an `embed_tokens` copy), checked against the
published forward pass by hand, then drafting losslessly, line and tree."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_eagle3 import (
    CAPTURED,
    DRAFT_VOCAB,
    EOS,
    FFN,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    D,
    captured_states,
    draft_logits,
    eagle3_checkpoint,
    midlayer,
    rope,
)
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.formats import convert_published
from mlxspec.drafter.head import HeadError
from mlxspec.models.anatomy import split_decoder
from mlxspec.proposers.head import HeadProposer


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=1, layers=LAYERS)
    return model, split_decoder(model)


def speculators_checkpoint(folder, aux=None, norm_before_residual=True, **layer_changes):
    """The SafeAILab head of test_eagle3, saved as vLLM's speculators saves EAGLE-3."""
    w = eagle3_checkpoint(folder)
    w["fc.bias"] = 0.1 * mx.random.normal((D,))
    saved = {
        ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
        for k, v in w.items()
        if k != "used"
    }
    saved["embed_tokens.weight"] = mx.zeros((VOCAB, D))  # speculators ships a copy: unused
    mx.save_safetensors(str(folder / "model.safetensors"), saved)
    layer = {
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": D // HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        **layer_changes,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]},
        },
    }
    if aux is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux
    (folder / "config.json").write_text(json.dumps(config))
    return w


@pytest.mark.parametrize("aux, norm_before_residual", [(None, True), ([1, 3, 6], False)])
def test_a_speculators_head_maps_onto_the_published_forward_pass(
    target, tmp_path, aux, norm_before_residual
):
    model, decoder = target
    w = speculators_checkpoint(tmp_path, aux, norm_before_residual)
    head = convert_published(tmp_path, model, decoder)
    layers = tuple(aux) if aux else CAPTURED
    assert head.spec.source_format == "eagle-3" and head.target_layers == layers
    assert head.vocab.tolist() == w["used"].tolist()
    tokens = random.Random(4).choices(range(256), k=10)
    rows = decoder.hidden(mx.array([tokens]), [None] * LAYERS, capture=layers)
    embeds = decoder.embed(mx.array([tokens[1:]]))
    g = head(head.from_target(rows[:, :-1]), embeds, "causal")
    fused = captured_states(model, tokens[:-1], layers) @ w["fc.weight"].T + w["fc.bias"]
    expected = midlayer(w, fused, embeds, norm_before_residual)
    assert mx.allclose(g, expected, atol=1e-4)
    assert mx.allclose(head.logits(g, None), draft_logits(w, expected), atol=1e-3)


@pytest.mark.parametrize("tree", [False, True])
def test_a_speculators_head_drafts_losslessly(target, tmp_path, tree):
    model, decoder = target
    speculators_checkpoint(tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(HeadProposer(convert_published(tmp_path, model, decoder), engine.target))
    rng = random.Random(8)
    drafted = 0
    for n in (3, 8):
        prompt = [rng.randrange(256) for _ in range(n)] * 2
        done = list(engine.stream(prompt, GenerationSettings(30, k=3, tree=tree), "head"))[-1]
        reference = plain_greedy(model, prompt, 30, {EOS})
        assert_lossless(model, prompt, reference, list(done.token_ids), f"{n}", done.record)
        drafted += done.record.drafted
    assert drafted > 0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 96}, "width 96"),
        ({"aux": [1, 3, 40]}, "not 3 different layers of this 8-layer target"),
        ({"extra_layer": True}, "more than one layer"),
        ({"intermediate_size": 2 * FFN}, "does not fit"),
    ],
)
def test_speculators_heads_that_cannot_fit_get_one_line(target, tmp_path, changes, message):
    model, decoder = target
    aux = changes.pop("aux", None)
    extra = changes.pop("extra_layer", False)
    speculators_checkpoint(tmp_path, aux, **changes)
    if extra:
        weights = mx.load(str(tmp_path / "model.safetensors"))
        weights["layers.1.input_layernorm.weight"] = mx.ones((D,))
        mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(HeadError, match=message) as err:
        convert_published(tmp_path, model, decoder)
    assert "\n" not in str(err.value)


# --- Newer configs, against the reference forward pass -------------------------------------

# vLLM speculators' EAGLE-3 config for a Qwen3-8B verifier, as the library writes it
# (vllm-project/speculators @ c05b95b: Eagle3SpeculatorConfig's fields in
# src/speculators/models/eagle3/config.py; under transformers 5 scripts/train.py puts the
# verifier's `rope_parameters` in transformer_layer_config, with no `rope_theta`), sizes
# shrunk. `norm_before_residual` is left out: vLLM's speculators config adapter
# (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3) defaults it to true.
QWEN3_8B_LAYER = {
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"],
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 1,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SPECULATORS_EAGLE3 = {
    "architectures": ["Eagle3Speculator"],
    "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
    "draft_vocab_size": 32000,
    "dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [2, 18, 33],
    "embed_requires_grad": False,
    "fc_norm": False,
    "norm_before_fc": False,
    "norm_output": False,
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "accept_tolerance": 0.0,
                "proposal_type": "greedy",
                "speculative_tokens": 3,
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"},
    },
    "speculators_model_type": "eagle3",
    "speculators_version": "0.4.0",
    "target_hidden_size": None,
    "transformer_layer_config": QWEN3_8B_LAYER,
    "transformers_version": "5.5.3",
}
SHRUNK_LAYER = {
    "head_dim": HEAD_DIM,
    "hidden_size": D,
    "intermediate_size": FFN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
}
THETA = 1e6


def published(folder, layer_changes=(), weights_changes=(), **outer) -> dict[str, mx.array]:
    """A random head in speculators' names under SPECULATORS_EAGLE3 (shrunk), with
    `outer` fields changed (None: removed); the weights by their speculators names."""
    w = eagle3_checkpoint(folder)
    w.pop("used")
    saved = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in w.items()}
    saved["embed_tokens.weight"] = mx.zeros((VOCAB, D))  # speculators ships a copy
    for name in ("q_proj", "k_proj"):  # soft attention: every RoPE frequency shows
        saved[f"layers.0.self_attn.{name}.weight"] *= 0.5
    saved |= dict(weights_changes)
    mx.save_safetensors(str(folder / "model.safetensors"), saved)
    layer = QWEN3_8B_LAYER | SHRUNK_LAYER | dict(layer_changes)
    layer = {k: v for k, v in layer.items() if v is not None or k == "sliding_window"}
    config = SPECULATORS_EAGLE3 | {
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": list(CAPTURED),
        "transformer_layer_config": layer,
    }
    for key, value in outer.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(config))
    return saved


def rms_eps(x, w, eps=1e-6):
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_step(w, features, embeds, config, layer=None):
    """vLLM's EAGLE-3 drafter over a sequence (causal, positions 0..L-1), written out
    from llama_eagle3.py's combine_hidden_states (input_norm, fc_norm, fc) and its first
    decoder layer (input_layernorm(e) beside hidden_norm(h); the residual is h, or
    hidden_norm(h) with norm_before_residual), speculators' qwen3 first layer where the
    layer is qwen3 (q_norm/k_norm per head, before RoPE), RoPE at the config's theta.
    Returns (draft logits, what the next step is fed: the pre-norm output, or with
    norm_output the normed one)."""
    layer = layer or config["transformer_layer_config"]
    theta = layer.get("rope_theta") or layer["rope_parameters"]["rope_theta"]
    x = features
    if config.get("norm_before_fc"):
        x = rms_eps(x, w["input_norm.weight"])
    if config.get("fc_norm"):
        chunks = mx.split(x, 3, axis=-1)
        x = mx.concatenate([rms_eps(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1)
    h = x @ w["fc.weight"].T
    p, n = "layers.0.", h.shape[1]
    normed = rms_eps(h, w[p + "hidden_norm.weight"])
    both = mx.concatenate([rms_eps(embeds, w[p + "input_layernorm.weight"]), normed], -1)

    def heads(name, count):
        y = both @ w[f"{p}self_attn.{name}_proj.weight"].T
        y = y.reshape(1, n, count, HEAD_DIM).transpose(0, 2, 1, 3)
        if layer["model_type"] == "qwen3" and name in "qk":
            y = rms_eps(y, w[f"{p}self_attn.{name}_norm.weight"])
        return y

    q, k = rope(heads("q", HEADS), theta), rope(heads("k", KV_HEADS), theta)
    k, v = (mx.repeat(t, HEADS // KV_HEADS, axis=1) for t in (k, heads("v", KV_HEADS)))
    future = mx.triu(mx.ones((n, n)), k=1) * -1e9
    scores = mx.softmax(q @ k.transpose(0, 1, 3, 2) / HEAD_DIM**0.5 + future, axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(1, n, HEADS * HEAD_DIM)
    residual = normed if config.get("norm_before_residual", True) else h
    g = residual + attended @ w[p + "self_attn.o_proj.weight"].T
    m = rms_eps(g, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    g = g + (gate * mx.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = rms_eps(g, w["norm.weight"])
    return out @ w["lm_head.weight"].T, out if config.get("norm_output") else g


def qk_norms():
    return {
        f"layers.0.self_attn.{x}_norm.weight": 1 + 0.3 * mx.random.normal((HEAD_DIM,)) for x in "qk"
    }


VARIANTS = {
    # transformers 5's rope_parameters, no rope_theta; norm_before_residual left out
    "rope_parameters": ({}, {}, {"norm_before_residual": None}),
    # a Qwen3 verifier's draft layer as speculators writes it: q_norm/k_norm
    "qwen3_layer": ({"model_type": "qwen3"}, "qk", {}),
    # gpt-oss style (Eagle 3.1): one norm over the captured layers before fc, normed output fed back
    "norm_before_fc": (
        {"rope_parameters": None, "rope_theta": 10000.0},
        "input_norm",
        {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    ),
    # one norm per captured layer
    "fc_norm": ({}, "fc_norm", {"fc_norm": True, "norm_before_residual": False}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_newer_speculators_configs_draft_as_vllm_does(target, tmp_path, variant):
    """Each newer speculators config loads and its first draft step (logits and what
    it feeds back) equals the reference forward pass written out by hand."""
    model, decoder = target
    layer_changes, extra, outer = VARIANTS[variant]
    mx.random.seed(21)
    weights = {
        "": {},
        "qk": qk_norms(),
        "input_norm": {"input_norm.weight": 1 + 0.3 * mx.random.normal((3 * D,))},
        "fc_norm": {f"fc_norm.{i}.weight": 1 + 0.3 * mx.random.normal((D,)) for i in range(3)},
    }[extra or ""]
    w = published(tmp_path, layer_changes, weights, **outer)
    config = json.loads((tmp_path / "config.json").read_text())
    head = convert_published(tmp_path, model, decoder)

    tokens = random.Random(22).choices(range(256), k=24)
    rows = decoder.hidden(mx.array([tokens[:-1]]), [None] * LAYERS, capture=head.target_layers)
    embeds = decoder.embed(mx.array([tokens[1:]]))
    expected, fed = reference_step(w, captured_states(model, tokens[:-1]), embeds, config)
    g = head(head.from_target(rows), embeds, "causal")
    logits = head.logits(g, None)
    assert mx.allclose(logits, expected, atol=1e-3, rtol=1e-3), float(
        (logits - expected).abs().max()
    )
    assert mx.allclose(head.feedback(g), fed, atol=1e-4)


# SpecForge's EAGLE-3 config for Qwen3-235B-A22B (sgl-project/SpecForge @ a6b6b02,
# configs/qwen3-235B-A22B-eagle3.json), sizes shrunk; its layer ids are layer OUTPUTS
# (SpecForge's resolve_eagle_capture_layers defaults to [1, N//2 - 1, N - 4]).
SPECFORGE_QWEN3_235B = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 46, 90], "use_aux_hidden_state": True},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "draft_vocab_size": 32000,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 24576,
    "max_position_embeddings": 40960,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 1,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "vocab_size": 151936,
}
OUTPUTS = [0, 3, 5]  # layer outputs: the residual stream entering 1, 4 and 6


def specforge(folder) -> dict[str, mx.array]:
    """A random head in SafeAILab's names under SpecForge's config (shrunk)."""
    w = eagle3_checkpoint(folder)
    w.pop("used")
    for name in ("q_proj", "k_proj"):
        w[f"midlayer.self_attn.{name}.weight"] *= 0.5
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    config = SPECFORGE_QWEN3_235B | SHRUNK_LAYER | {"draft_vocab_size": DRAFT_VOCAB}
    config["eagle_config"] = {**config["eagle_config"], "eagle_aux_hidden_state_layer_ids": OUTPUTS}
    (folder / "config.json").write_text(json.dumps(config))
    return {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in w.items()}


def test_a_specforge_head_reads_the_layer_outputs_its_config_names(target, tmp_path):
    model, decoder = target
    w = specforge(tmp_path)
    head = convert_published(tmp_path, model, decoder)
    assert head.target_layers == tuple(i + 1 for i in OUTPUTS)
    config = json.loads((tmp_path / "config.json").read_text())
    tokens = random.Random(23).choices(range(256), k=20)
    rows = decoder.hidden(mx.array([tokens[:-1]]), [None] * LAYERS, capture=head.target_layers)
    embeds = decoder.embed(mx.array([tokens[1:]]))
    features = captured_states(model, tokens[:-1], head.target_layers)
    flat = config | {"norm_before_residual": False}  # SafeAILab's residual: the raw h
    expected, fed = reference_step(w, features, embeds, flat, layer=config)
    g = head(head.from_target(rows), embeds, "causal")
    assert mx.allclose(head.logits(g, None), expected, atol=1e-3, rtol=1e-3)
    assert mx.allclose(head.feedback(g), fed, atol=1e-4)


LAYOUT_WRITERS = {
    "safeailab": lambda folder: eagle3_checkpoint(folder),
    "speculators": lambda folder: published(folder),
    "specforge": specforge,
}


@pytest.mark.parametrize("layout", LAYOUT_WRITERS)
@pytest.mark.parametrize("extra", ["tensor", "flag", "layer_flag"])
def test_an_eagle3_tensor_or_flag_mlxspec_does_not_read_is_named(target, tmp_path, layout, extra):
    """One extra tensor (an attention sink), or one config field mlxspec does not act on
    (vLLM's logit_scale), is refused in one line that names it."""
    model, decoder = target
    LAYOUT_WRITERS[layout](tmp_path)
    named = {"tensor": "self_attn.sinks", "flag": "logit_scale", "layer_flag": "logit_scale"}[extra]
    if extra == "tensor":
        weights = mx.load(str(tmp_path / "model.safetensors"))
        prefix = "layers.0." if layout == "speculators" else "midlayer."
        weights[prefix + "self_attn.sinks"] = mx.zeros((HEADS,))
        mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        inner = config.get("transformer_layer_config", config)
        (inner if extra == "layer_flag" else config)["logit_scale"] = 2.0
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match=named) as err:
        convert_published(tmp_path, model, decoder)
    assert "\n" not in str(err.value)


def test_eagle3_options_mlxspec_does_not_run_are_refused_in_one_line(target, tmp_path):
    model, decoder = target
    for layer_changes, named in [
        ({"layer_types": ["sliding_attention"], "use_sliding_window": True}, "sliding"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"model_type": "gemma3_text"}, "gemma3_text"),
    ]:
        published(tmp_path, layer_changes)
        with pytest.raises(HeadError, match=named) as err:
            convert_published(tmp_path, model, decoder)
        assert "\n" not in str(err.value)
