"""EAGLE-3 checkpoints: a random one written in SafeAILab's names and config, checked
against the published forward pass written out by hand below (three captured target
layers through fc; [norm(embedding), norm(h)] attention with the raw h as residual;
pre-norm output fed back; d2t vocabulary), then drafting losslessly in the engine."""

from __future__ import annotations

import json
import random
import sys

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_lossless, plain_greedy
from test_drafter import rms
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.formats import convert_published
from mlxspec.drafter.head import HeadError, HeadSpec, build_head
from mlxspec.models.anatomy import split_decoder
from mlxspec.proposers import Chain, PromptLookup
from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.head import HeadProposer
from mlxspec.sampling import SamplingSettings, TokenScorer

D, HEADS, KV_HEADS, HEAD_DIM, FFN, DRAFT_VOCAB = 64, 4, 2, 16, 128, 100
LAYERS = 8  # captures the residual stream entering layers 2, 4 and 5
CAPTURED = (2, 4, 5)
EOS = VOCAB - 1


# SafeAILab's EAGLE-3 config for Llama-3.1-8B (SafeAILab/EAGLE @ cb7e084,
# eagle/traineagle3/config.json), its sizes shrunk by eagle3_checkpoint.
SAFEAILAB_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
}


def eagle3_checkpoint(folder, seed: int = 7, **config_changes) -> dict[str, mx.array]:
    """A random EAGLE-3 head for the tiny llama, saved as SafeAILab publishes it."""
    mx.random.seed(seed)
    used = sorted(random.Random(seed).sample(range(VOCAB), DRAFT_VOCAB - 1) + [EOS])
    p = "midlayer."

    def normal(*shape, scale=0.2):
        return mx.random.normal(shape) * scale

    weights = {
        "fc.weight": normal(D, 3 * D, scale=0.1),
        p + "hidden_norm.weight": 1 + normal(D),
        p + "input_layernorm.weight": 1 + normal(D),
        p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, 2 * D),
        p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, 2 * D),
        p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, 2 * D),
        p + "self_attn.o_proj.weight": normal(D, HEADS * HEAD_DIM),
        p + "post_attention_layernorm.weight": 1 + normal(D),
        p + "mlp.gate_proj.weight": normal(FFN, D),
        p + "mlp.up_proj.weight": normal(FFN, D),
        p + "mlp.down_proj.weight": normal(D, FFN),
        "norm.weight": 1 + normal(D),
        "lm_head.weight": normal(DRAFT_VOCAB, D, scale=1.0),
        "d2t": mx.array(used, dtype=mx.int64) - mx.arange(DRAFT_VOCAB, dtype=mx.int64),
        "t2d": mx.array([t in used for t in range(VOCAB)]),
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = SAFEAILAB_LLAMA3_8B | {
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        **config_changes,
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights["used"] = mx.array(used)
    return weights


# --- The published forward pass, by hand ------------------------------------------------


def rope(x, base=10000.0):
    """Rotate-half RoPE at positions 0..L-1; x (1, heads, L, HEAD_DIM)."""
    half = HEAD_DIM // 2
    angles = mx.arange(x.shape[2])[:, None] * base ** (-mx.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos, sin = (mx.concatenate([f(angles)] * 2, -1) for f in (mx.cos, mx.sin))
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def midlayer(w, h, e, norm_before_residual: bool = False):
    """The EAGLE-3 layer over a whole sequence (causal): h (1, L, D), e (1, L, D); the
    residual is h, or hidden_norm(h) with speculators' `norm_before_residual`."""
    p, n = "midlayer.", h.shape[1]
    x = mx.concatenate(
        [rms(e, w[p + "input_layernorm.weight"]), rms(h, w[p + "hidden_norm.weight"])], -1
    )

    def heads(name, count):
        y = x @ w[f"{p}self_attn.{name}_proj.weight"].T
        return y.reshape(1, n, count, HEAD_DIM).transpose(0, 2, 1, 3)

    q, k, v = rope(heads("q", HEADS)), rope(heads("k", KV_HEADS)), heads("v", KV_HEADS)
    k, v = (mx.repeat(t, HEADS // KV_HEADS, axis=1) for t in (k, v))
    future = mx.triu(mx.ones((n, n)), k=1) * -1e9
    scores = mx.softmax(q @ k.transpose(0, 1, 3, 2) / HEAD_DIM**0.5 + future, axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(1, n, HEADS * HEAD_DIM)
    residual = rms(h, w[p + "hidden_norm.weight"]) if norm_before_residual else h
    h = residual + attended @ w[p + "self_attn.o_proj.weight"].T
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return h + (gate * mx.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def draft_logits(w, g):
    return rms(g, w["norm.weight"]) @ w["lm_head.weight"].T


def captured_states(model, tokens, layers=CAPTURED):
    """The residual stream entering `layers`, side by side (1, L, 3D)."""
    h, taken = model.model.embed_tokens(mx.array([tokens])), []
    for index, layer in enumerate(model.model.layers):
        if index in layers:
            taken.append(h)
        h = layer(h, "causal")
    return mx.concatenate(taken, -1)


# --- Tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=1, layers=LAYERS)
    return model, split_decoder(model)


def test_an_eagle3_checkpoint_maps_onto_the_published_forward_pass(target, tmp_path):
    model, decoder = target
    w = eagle3_checkpoint(tmp_path)
    head = convert_published(tmp_path, model, decoder)
    assert head.spec.source_format == "eagle-3" and head.target_layers == CAPTURED
    assert head.vocab.tolist() == w["used"].tolist()  # draft id i -> target id i + d2t[i]

    tokens = random.Random(3).choices(range(256), k=12)
    rows = decoder.hidden(mx.array([tokens]), [None] * LAYERS, capture=head.target_layers)
    assert rows.shape == (1, 12, 4 * D)
    states = captured_states(model, tokens)
    assert mx.allclose(rows[..., : 3 * D], states, atol=1e-5)
    assert mx.allclose(decoder.logits(rows), model(mx.array([tokens])), atol=1e-4)

    embeds = decoder.embed(mx.array([tokens[1:]]))
    g = head(head.from_target(rows[:, :-1]), embeds, "causal")
    expected = midlayer(w, states[:, :-1] @ w["fc.weight"].T, embeds)
    assert mx.allclose(g, expected, atol=1e-4)
    assert mx.allclose(head.logits(g, None), draft_logits(w, expected), atol=1e-3)


def test_eagle3_drafts_feed_back_the_pre_norm_output(target, tmp_path):
    """Two draft steps from the proposer equal the published pass over the sequence
    whose last hidden input is the first step's (pre-norm) output."""
    model, decoder = target
    w = eagle3_checkpoint(tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(convert_published(tmp_path, model, decoder), engine.target)
    prompt = random.Random(5).choices(range(256), k=10)
    _, hidden = engine.target.prepare(prompt, capture=proposer.target_layers)
    ctx = ProposalContext(prompt, TokenScorer(SamplingSettings()), None, engine.target, hidden)
    assert proposer.situation(ctx) is not None
    drafted = proposer.propose(ctx, 2).tokens

    fused = captured_states(model, prompt[:-1]) @ w["fc.weight"].T
    g = midlayer(w, fused, decoder.embed(mx.array([prompt[1:]])))
    first = w["used"][mx.argmax(draft_logits(w, g)[0, -1])].item()
    fed = mx.concatenate([fused, g[:, -1:]], axis=1)
    g2 = midlayer(w, fed, decoder.embed(mx.array([prompt[1:] + [first]])))
    second = w["used"][mx.argmax(draft_logits(w, g2)[0, -1])].item()
    assert drafted == [first, second]


@pytest.mark.parametrize("tree", [False, True])
def test_an_eagle3_head_drafts_losslessly_alone_and_in_a_chain(target, tmp_path, tree):
    model, decoder = target
    eagle3_checkpoint(tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    head = HeadProposer(convert_published(tmp_path, model, decoder), engine.target, "e3")
    engine.add_proposer(head)
    engine.add_proposer(Chain([PromptLookup("lookup", 3, 1, 4), head], name="chain"))
    rng = random.Random(6)
    for name in ("e3", "chain"):
        for n in (2, 9):
            prompt = [rng.randrange(256) for _ in range(n)] * 2
            settings = GenerationSettings(max_tokens=30, k=3, tree=tree)
            done = list(engine.stream(prompt, settings, name))[-1]
            reference = plain_greedy(model, prompt, 30, {EOS})
            assert_lossless(
                model, prompt, reference, list(done.token_ids), f"{name} {n}", done.record
            )
            assert done.record.drafted > 0


def test_eagle3_checkpoints_that_cannot_fit_get_one_line_errors(target, tmp_path):
    model, decoder = target
    eagle3_checkpoint(tmp_path, hidden_size=96)
    with pytest.raises(HeadError, match="width 96"):
        convert_published(tmp_path, model, decoder)
    eagle3_checkpoint(tmp_path)
    shallow = tiny_model("llama", seed=1, layers=5)  # 2, 5 // 2 and 5 - 3 are one layer
    with pytest.raises(HeadError, match="not 3 different layers"):
        convert_published(tmp_path, shallow, split_decoder(shallow))
    (tmp_path / "config.json").unlink()
    with pytest.raises(HeadError, match="config.json"):
        convert_published(tmp_path, model, decoder)


def test_a_chain_refuses_heads_that_read_different_target_layers(target, tmp_path):
    model, decoder = target
    eagle3_checkpoint(tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    eagle3 = HeadProposer(convert_published(tmp_path, model, decoder), engine.target, "e3")
    ours = build_head(HeadSpec(hidden_size=D, vocab_size=VOCAB), model, mx.arange(VOCAB))
    with pytest.raises(ValueError, match="different target layers"):
        Chain([eagle3, HeadProposer(ours, engine.target)])


def test_a_pytorch_eagle3_checkpoint_loads_without_torch(target, tmp_path, monkeypatch):
    """SafeAILab ships pytorch_model.bin; the same weights load from it as from
    safetensors (written by test_torch_bin's stand-in for torch.save)."""
    from test_torch_bin import FakeTensor, fake_torch, torch_save

    model, decoder = target
    w = eagle3_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch = fake_torch(monkeypatch)
    kinds = {
        mx.float32: torch.FloatStorage,
        mx.int64: torch.LongStorage,
        mx.bool_: torch.BoolStorage,
    }
    state = {}
    for key, value in w.items():
        if key != "used":
            shape = tuple(value.shape)
            strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
            flat = np.asarray(value).ravel()
            state[key] = FakeTensor(kinds[value.dtype], flat, 0, shape, strides)
    torch_save(tmp_path / "pytorch_model.bin", state)
    monkeypatch.delitem(sys.modules, "torch")
    head = convert_published(tmp_path, model, decoder)
    assert head.vocab.tolist() == w["used"].tolist()
    assert mx.array_equal(head.fc.weight, w["fc.weight"])
    assert mx.array_equal(
        head.midlayer.self_attn.q_proj.weight, w["midlayer.self_attn.q_proj.weight"]
    )
