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
    HEADS,
    KV_HEADS,
    LAYERS,
    D,
    captured_states,
    draft_logits,
    eagle3_checkpoint,
    midlayer,
)
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.anatomy import split_decoder
from mlxspec.drafter.formats import convert_published
from mlxspec.drafter.head import HeadError
from mlxspec.engine import Engine, GenerationSettings
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
    tokens = [random.Random(4).randrange(256) for _ in range(10)]
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
