"""Block drafters (z-lab DFlash, DeepSeek DSpark) in their published layouts: tiny
checkpoints written here with the exact tensor names and config fields of the reference
code (see docs/design/drafters.md), loaded through the real loader, checked against the
published forward pass written out by hand, then drafting in the engine: greedy output
equal to plain greedy (lines and trees), sampled output distributed as the target's
(chi-square), drafts accepted where the drafter is made to agree with the target, and
one clear line for checkpoints that do not fit."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_lossless, plain_greedy
from test_sampling import significant
from test_sampling_settings import (
    MAX_TOKENS,
    PROMPT,
    RANK_BINS,
    RUNS,
    K,
    Runs,
    bin_probabilities,
    departures_from_the_target,
    rank_bin,
    with_eos,
)
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.drafter.block import BlockDrafterError, load_block_drafter
from mlxspec.events import Bonus, Rejected, TokenEvent
from mlxspec.models.anatomy import split_decoder
from mlxspec.proposers.base import ProposalContext, Situation
from mlxspec.proposers.block import BlockProposer
from mlxspec.sampling import SamplingSettings, TokenScorer

D, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
EOS = VOCAB - 1
MASK = 0  # a byte the prompts below never use
# Which target layers feed each drafter: DFlash reads the last layer's own output
# (index N-1), DSpark the embedding output (-1): both ends of the capture path.
DFLASH_IDS, DSPARK_IDS = [0, 2], [-1, 1]
DFLASH_BLOCK, DSPARK_BLOCK, MARKOV_RANK = 5, 4, 64
DFLASH_CONFIG = {"mask_token_id": MASK, "target_layer_ids": DFLASH_IDS}


def _normal(*shape, scale=0.2):
    return mx.random.normal(shape) * scale


def backbone(ids: list[int], layers: int = LAYERS, scale: float = 0.2) -> dict[str, mx.array]:
    """The tensors DFlash and DSpark share: fc over the target layers, its norm, Qwen3-style
    layers with q/k norms, a final norm (names of z-lab's dflash/model.py and DeepSpec's
    deepspec/modeling/dspark/qwen3/modeling.py)."""
    weights = {"fc.weight": _normal(D, len(ids) * D, scale=0.1), "norm.weight": 1 + _normal(D)}
    weights["hidden_norm.weight"] = 1 + _normal(D)
    for i in range(layers):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + _normal(D),
            p + "post_attention_layernorm.weight": 1 + _normal(D),
            p + "self_attn.q_proj.weight": _normal(HEADS * HEAD_DIM, D, scale=scale),
            p + "self_attn.k_proj.weight": _normal(KV_HEADS * HEAD_DIM, D, scale=scale),
            p + "self_attn.v_proj.weight": _normal(KV_HEADS * HEAD_DIM, D, scale=scale),
            p + "self_attn.o_proj.weight": _normal(D, HEADS * HEAD_DIM, scale=scale),
            p + "self_attn.q_norm.weight": 1 + _normal(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + _normal(HEAD_DIM),
            p + "mlp.gate_proj.weight": _normal(FFN, D, scale=scale),
            p + "mlp.up_proj.weight": _normal(FFN, D, scale=scale),
            p + "mlp.down_proj.weight": _normal(D, FFN, scale=scale),
        }
    return weights


def qwen3_fields(layers: int = LAYERS) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
        "attention_bias": False,
    }


def save(folder, weights: dict[str, mx.array], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))


def dflash_checkpoint(folder, seed: int = 3, drop: str = "", **changes) -> dict[str, mx.array]:
    """A random DFlash drafter as z-lab publishes one (z-lab/Qwen3-8B-DFlash-b16's
    config layout: architectures, top-level block_size, dflash_config's mask token and
    target layers); no embedding or LM head: it borrows the target's."""
    mx.random.seed(seed)
    weights = backbone(DFLASH_IDS)
    config = {
        "architectures": ["DFlashDraftModel"],
        **qwen3_fields(),
        "block_size": DFLASH_BLOCK,
        "num_target_layers": 3,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": DFLASH_IDS},
        "dtype": "float32",
        **changes,
    }
    save(folder, {k: v for k, v in weights.items() if k != drop}, config)
    return weights


def dspark_checkpoint(folder, seed: int = 4, drop: str = "", **changes) -> dict[str, mx.array]:
    """A random DSpark drafter as DeepSeek publishes one (deepseek-ai/dspark_qwen3_*_block7:
    its own embedding and LM head, a vanilla Markov head, a confidence head reading the
    hidden state and the Markov features; fields at the top level)."""
    mx.random.seed(seed)
    weights = backbone(DSPARK_IDS) | {
        "embed_tokens.weight": _normal(VOCAB, D, scale=1.0),
        "lm_head.weight": _normal(VOCAB, D, scale=0.5),
        "markov_head.markov_w1.weight": _normal(VOCAB, MARKOV_RANK, scale=0.5),
        "markov_head.markov_w2.weight": _normal(VOCAB, MARKOV_RANK, scale=0.5),
        "confidence_head.proj.weight": _normal(1, D + MARKOV_RANK),
        "confidence_head.proj.bias": _normal(1),
    }
    config = {
        "architectures": ["Qwen3DSparkModel"],
        **qwen3_fields(),
        "block_size": DSPARK_BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": DSPARK_IDS,
        "num_target_layers": 3,
        "num_anchors": 512,
        "markov_rank": MARKOV_RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        **changes,
    }
    save(folder, {k: v for k, v in weights.items() if k != drop}, config)
    return weights


WRITERS = {"dflash": dflash_checkpoint, "dspark": dspark_checkpoint}


@pytest.fixture(scope="module")
def target():
    model = tiny_model("qwen3", seed=2)
    return model, split_decoder(model)


def block_proposer(engine: Engine, folder, name: str = "block", k_max=None) -> BlockProposer:
    drafter = load_block_drafter(folder, engine.target.decoder)
    return BlockProposer(drafter, engine.target, name, k_max)


# --- The published forward passes, by hand -------------------------------------------------


def rms(x, w, eps=1e-6):
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, base=10000.0):
    """Rotate-half RoPE; x (1, heads, L, HEAD_DIM) at `positions` (L,)."""
    half = HEAD_DIM // 2
    angles = positions[:, None] * base ** (-mx.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos, sin = (mx.concatenate([f(angles)] * 2, -1) for f in (mx.cos, mx.sin))
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def layer_outputs(model, tokens: list[int], ids: list[int]) -> mx.array:
    """The target's hidden_states[i + 1] (layer i's output; -1: the embedding) for i in
    `ids`, side by side, as z-lab's `extract_context_feature` takes them (1, L, len * D).
    A hybrid's GatedDeltaNet layers run without a mask (they are causal by recurrence)."""
    h = model.model.embed_tokens(mx.array([tokens]))
    states = [h]
    for layer in model.model.layers:
        h = layer(h, None if getattr(layer, "is_linear", False) else "causal")
        states.append(h)
    return mx.concatenate([states[i + 1] for i in ids], -1)


def drafter_layer(
    w, i: int, x, context, start: int, window: int | None = None, theta: float = 10000.0
):
    """Layer i over the block x (1, B, D) at positions start.., keys and values from
    [context, block] at positions 0..: every query sees everything, or with a `window`
    (a sliding layer, causal by default: SpecForge's create_dflash_sdpa_mask) the keys less than
    `window` before it and no later block slot."""
    p, b, c = f"layers.{i}.", x.shape[1], context.shape[1]
    normed = rms(x, w[p + "input_layernorm.weight"])
    both = mx.concatenate([context, normed], axis=1)

    def heads(rows, name, count):
        y = rows @ w[f"{p}self_attn.{name}_proj.weight"].T
        y = y.reshape(1, rows.shape[1], count, HEAD_DIM).transpose(0, 2, 1, 3)
        return rms(y, w[f"{p}self_attn.{name}_norm.weight"]) if name in "qk" else y

    q = rope(heads(normed, "q", HEADS), mx.arange(start, start + b), theta)
    k = rope(heads(both, "k", KV_HEADS), mx.arange(start - c, start + b), theta)
    k, v = (mx.repeat(t, HEADS // KV_HEADS, axis=1) for t in (k, heads(both, "v", KV_HEADS)))
    query, key = mx.arange(start, start + b)[:, None], mx.arange(start - c, start + b)[None]
    hidden = (query - key >= window) | (key > query) if window else mx.zeros((b, c + b), mx.bool_)
    scores = q @ k.transpose(0, 1, 3, 2) / HEAD_DIM**0.5 + mx.where(hidden, -1e9, 0.0)
    scores = mx.softmax(scores, axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(1, b, HEADS * HEAD_DIM)
    h = x + attended @ w[p + "self_attn.o_proj.weight"].T
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return h + (gate * mx.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_logits(
    fmt: str, w, model, sequence: list[int], windows=(None,) * LAYERS, theta: float = 10000.0
):
    """The block's draft logits after `sequence` (its last token pending) by the reference
    code, before any Markov bias: z-lab's dflash_generate (slots 1.. predict, target's
    embedding and LM head) or DeepSpec's (slots 0.. predict, own embedding and LM head)."""
    ids, size = (DFLASH_IDS, DFLASH_BLOCK) if fmt == "dflash" else (DSPARK_IDS, DSPARK_BLOCK)
    start = len(sequence) - 1
    context = rms(
        layer_outputs(model, sequence[:-1], ids) @ w["fc.weight"].T, w["hidden_norm.weight"]
    )
    block = mx.array([[sequence[-1]] + [MASK] * (size - 1)])
    embed = model.model.embed_tokens if fmt == "dflash" else lambda t: w["embed_tokens.weight"][t]
    h = embed(block)
    for i in range(LAYERS):
        h = drafter_layer(w, i, h, context, start, windows[i], theta)
    text_model = getattr(model, "language_model", model)  # Qwen3.5 wraps its text model
    lm_head = text_model.lm_head.weight if fmt == "dflash" else w["lm_head.weight"]
    logits = rms(h, w["norm.weight"])[0] @ lm_head.T
    return logits[1:] if fmt == "dflash" else logits


def markov(w, token: int) -> mx.array:
    return w["markov_head.markov_w1.weight"][token] @ w["markov_head.markov_w2.weight"].T


def reference_drafts(fmt: str, w, model, sequence: list[int]) -> list[int]:
    """The greedy block: DSpark's drawn left to right, each slot biased by the Markov
    head from the token before it (DeepSpec's sample_block_tokens)."""
    logits = reference_logits(fmt, w, model, sequence)
    if fmt == "dflash":
        return mx.argmax(logits, axis=-1).tolist()
    drafts, previous = [], sequence[-1]
    for row in logits:
        previous = int(mx.argmax(row + markov(w, previous)))
        drafts.append(previous)
    return drafts


# --- Tests ---------------------------------------------------------------------------------


def greedy_ctx(engine: Engine, sequence: list[int], capture) -> ProposalContext:
    """The context the engine hands a proposer after prefilling `sequence` (its last
    token pending), the target's features of the tokens before it included."""
    engine.target.reset()
    _, hidden = engine.target.prepare(sequence, capture=capture)
    scorer = TokenScorer(SamplingSettings())
    return ProposalContext(sequence, scorer, np.random.default_rng(0), engine.target, hidden)


@pytest.mark.parametrize("fmt", ["dflash", "dspark"])
def test_a_published_checkpoint_drafts_what_the_reference_forward_pass_drafts(
    fmt, target, tmp_path
):
    model, _ = target
    w = WRITERS[fmt](tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = block_proposer(engine, tmp_path)
    assert proposer.k_max == (DFLASH_BLOCK - 1 if fmt == "dflash" else DSPARK_BLOCK)
    sequence = random.Random(1).choices(range(1, 256), k=11)
    ctx = greedy_ctx(engine, sequence, proposer.target_layers)
    assert proposer.situation(ctx) is not None
    expected = reference_drafts(fmt, w, model, sequence)
    assert proposer.propose(ctx, proposer.k_max).tokens == expected
    # A later round: the pending token and one draft verified, the next draft pending.
    longer = sequence + expected[:2]
    _, hidden = engine.target.verify(longer[-3:-1], capture=proposer.target_layers)
    ctx = replace(ctx, tokens=longer, hidden=hidden)
    proposer.situation(ctx)
    assert proposer.propose(ctx, 3).tokens == reference_drafts(fmt, w, model, longer)[:3]
    # Another request sharing the first 6 tokens: the context is cut back to them.
    edited = sequence[:6] + [7, 8, 9]
    reused, hidden = engine.target.prepare(edited, capture=proposer.target_layers)
    assert reused == 6
    ctx = replace(ctx, tokens=edited, hidden=hidden)
    proposer.situation(ctx)
    assert proposer.propose(ctx, 3).tokens == reference_drafts(fmt, w, model, edited)[:3]


def test_a_dspark_tree_offers_each_node_the_top_tokens_of_its_own_markov_row(target, tmp_path):
    model, _ = target
    w = dspark_checkpoint(tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = block_proposer(engine, tmp_path)
    sequence = random.Random(2).choices(range(1, 256), k=9)
    ctx = greedy_ctx(engine, sequence, proposer.target_layers)
    proposer.situation(ctx)
    tree = proposer.propose_tree(ctx, 3, 20)
    logits, depths = reference_logits("dspark", w, model, sequence), tree.depths
    parents_seen = set()
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
        before = sequence[-1] if parent == 0 else tree.tokens[parent - 1]
        top = mx.argsort(-(logits[depths[node] - 1] + markov(w, before)))[:3].tolist()
        assert token in top, (node, token, top)
        parents_seen.add(parent)
    assert len(parents_seen) >= 3  # children of several nodes, not of one line


@pytest.mark.parametrize("fmt", ["dflash", "dspark"])
def test_sampled_drafts_come_with_the_distributions_they_were_drawn_from(fmt, target, tmp_path):
    """q of each slot is what rejection sampling divides by: the drafted tokens' ranks
    under their reported rows must follow those rows (one-sample chi-square, per slot)."""
    model, _ = target
    WRITERS[fmt](tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = block_proposer(engine, tmp_path)
    ctx = greedy_ctx(engine, prompts(3)[0], proposer.target_layers)
    ctx = replace(ctx, scorer=TokenScorer(SamplingSettings(temperature=1.0)))
    proposer.situation(ctx)
    slots = 3
    observed = np.zeros((slots, len(RANK_BINS) + 1))
    expected = np.zeros_like(observed)
    for seed in range(400):
        draft = proposer.propose(replace(ctx, rng=np.random.default_rng(seed)), slots)
        rows = np.asarray(draft.probs)
        for slot, (token, row) in enumerate(zip(draft.tokens, rows)):
            observed[slot, rank_bin(row, token)] += 1
            expected[slot] += bin_probabilities(row)
    for slot in range(slots):
        statistic = float(((observed[slot] - expected[slot]) ** 2 / expected[slot]).sum())
        assert not significant(statistic, len(RANK_BINS)), (slot, observed[slot], expected[slot])


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] * 2 for n in (2, 9)]


@pytest.mark.parametrize("fmt", ["dflash", "dspark"])
def test_block_drafts_stay_lossless_in_lines_and_trees(fmt, target, tmp_path):
    model, _ = target
    WRITERS[fmt](tmp_path)
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(block_proposer(engine, tmp_path))
    for tree in (False, True):
        drafted = tree_rounds = 0
        for k in (3, None) if not tree else (3,):  # fixed, and the adaptive policy's
            for prompt in prompts(6):
                settings = GenerationSettings(max_tokens=30, k=k, tree=tree)
                done = list(engine.stream(prompt, settings, "block"))[-1]
                reference = plain_greedy(model, prompt, 30, {EOS})
                label = f"{fmt} tree={tree} k={k} {prompt[:3]}"
                assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
                drafted += done.record.drafted
                tree_rounds += done.record.tree_rounds
        assert drafted > 0 and (tree_rounds > 0) == tree


def agreeing(fmt: str, folder, model, reference: list[int]) -> None:
    """A drafter made to agree with `reference` (prompt + plain greedy output).
    DFlash: its layers silenced, so each slot's output is the mask token's embedding,
    which the final norm's weight turns into the LM head row of the reference's most
    common token. DSpark: a quiet LM head and a Markov head holding the reference's
    bigrams (each token's most frequent successor there)."""
    weights = WRITERS[fmt](folder)
    config = json.loads((folder / "config.json").read_text())
    if fmt == "dflash":
        token = Counter(reference).most_common(1)[0][0]
        weights = {k: (v * 0 if k.startswith("layers.") else v) for k, v in weights.items()}
        mask = model.model.embed_tokens.weight[MASK]
        unit = mask * mx.rsqrt((mask * mask).mean() + 1e-6)
        lm_head = getattr(model, "language_model", model).lm_head  # Qwen3.5: its text model's
        weights["norm.weight"] = lm_head.weight[token] / unit
        assert int(mx.argmax(lm_head(lm_head.weight[token]))) == token
    else:
        pairs = Counter(zip(reference, reference[1:]))
        successor = {before: after for (before, after), _ in reversed(pairs.most_common())}
        w1, w2 = np.zeros((VOCAB, MARKOV_RANK), np.float32), np.zeros((VOCAB, MARKOV_RANK))
        for row, (before, after) in enumerate(successor.items()):
            w1[before, row], w2[after, row] = 1.0, 30.0
        weights["markov_head.markov_w1.weight"] = mx.array(w1)
        weights["markov_head.markov_w2.weight"] = mx.array(w2.astype(np.float32))
        weights["lm_head.weight"] = weights["lm_head.weight"] * 0.01
    save(folder, weights, config)


@pytest.mark.parametrize("fmt", ["dflash", "dspark"])
def test_a_drafter_made_to_agree_gets_its_drafts_accepted(fmt, target, tmp_path):
    model, _ = target
    # Plain greedy emits 100 in 38 of 40 tokens after the first; after the second, a
    # mix of bigrams (2 and 153 14 times each).
    prompt = prompts(3)[1] if fmt == "dflash" else prompts(1)[1]
    reference = plain_greedy(model, prompt, 40, {EOS})
    agreeing(fmt, tmp_path, model, prompt + list(reference))
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(block_proposer(engine, tmp_path))
    for tree in (False, True):
        settings = GenerationSettings(max_tokens=40, k=3, tree=tree)
        done = list(engine.stream(prompt, settings, "block"))[-1]
        assert_lossless(model, prompt, reference, list(done.token_ids), fmt, done.record)
        assert done.record.accepted >= 0.5 * done.record.drafted > 0, done.record


def sampled_runs(engine: Engine) -> Runs:
    """RUNS seeded runs at temperature 1 of the first MAX_TOKENS tokens, k = K."""
    runs = Runs([], [], Counter())
    for seed in range(RUNS):
        sampling = SamplingSettings(temperature=1.0, seed=seed)
        settings = GenerationSettings(max_tokens=MAX_TOKENS, k=K, sampling=sampling)
        events = list(engine.stream(PROMPT, settings, "block"))
        emitted = [(type(e), t) for e in events if isinstance(e, TokenEvent) for t in e.tokens]
        emitted = [(kind, token) for kind, token in emitted if kind is not Rejected]
        runs.bonuses += [(seed, i) for i, (kind, _) in enumerate(emitted) if kind is Bonus]
        runs.tokens.append(with_eos(events[-1].token_ids))
        runs.kept.update(dict(enumerate(events[-1].record.accepted_lengths)))
    return runs


def test_sampled_block_drafts_leave_every_token_distributed_as_the_target(tmp_path):
    """The flat target of test_sampling_settings (whose rows the check reads): a line
    with the drafter's q (rejection sampling). Trees of one-hot candidates go through
    the engine's multi-candidate rule, checked in test_sampling_settings; the q of each
    slot is checked below."""
    model = tiny_model("llama", seed=5, sharpness=5.0)
    dflash_checkpoint(tmp_path)
    flat = VerifyCost({1: 1.0, 64: 1.0}, 1.0)  # no calibration pass: k is fixed anyway
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=flat)
    engine.add_proposer(block_proposer(engine, tmp_path))
    runs = sampled_runs(engine)
    departures = departures_from_the_target(runs)
    assert not departures, departures
    assert runs.kept[0] > 0 and runs.kept[1] > 0, runs.kept  # refusals and accepts both


@pytest.mark.parametrize(
    "fmt, change, needles",
    [
        ("dflash", {"drop": "layers.1.mlp.down_proj.weight"}, ["lacks 1 tensor", "down_proj"]),
        ("dspark", {"drop": "markov_head.markov_w2.weight"}, ["lacks 1 tensor", "markov_w2"]),
        ("dflash", {"hidden_size": 96}, ["96 wide", "target is 64 wide"]),
        ("dspark", {"intermediate_size": 64}, ["mlp.gate_proj.weight is (96, 64)"]),
        ("dflash", {"dflash_config": {"mask_token_id": 0, "target_layer_ids": [0, 3]}}, ["[0, 3]"]),
        ("dflash", {"architectures": ["DFlash2DraftModel"]}, ["DFlash2"]),
        ("dspark", {"markov_head_type": "rnn"}, ["'rnn'"]),
        ("dspark", {"model_type": "gemma4_text"}, ["Gemma-style dspark"]),
        # What the loader does not read is named, never dropped (vLLM's qwen3_dflash
        # options included: sliding-window block decoding, attention sinks).
        ("dflash", {"extra": "layers.0.self_attn.sinks"}, ["does not read", "self_attn.sinks"]),
        ("dspark", {"extra": "layers.1.self_attn.sinks"}, ["does not read", "self_attn.sinks"]),
        ("dflash", {"logit_scale": 2.0}, ["logit_scale", "does not understand"]),
        ("dspark", {"logit_scale": 2.0}, ["logit_scale", "does not understand"]),
        ("dflash", {"dflash_config": DFLASH_CONFIG | {"new_flag": 1}}, ["new_flag"]),
        (
            "dflash",
            {"dflash_config": DFLASH_CONFIG | {"use_swa": True, "swa_window_size": 2048}},
            ["use_swa", "not supported"],
        ),
        (
            "dflash",
            {"dflash_config": DFLASH_CONFIG | {"attention_sink_bias": True}},
            ["attention_sink_bias", "not supported"],
        ),
    ],
)
def test_checkpoints_that_cannot_fit_get_one_line(fmt, change, needles, target, tmp_path):
    _, decoder = target
    drop, extra = change.pop("drop", ""), change.pop("extra", "")
    WRITERS[fmt](tmp_path, drop=drop, **change)
    if extra:
        weights = mx.load(str(tmp_path / "model.safetensors"))
        mx.save_safetensors(str(tmp_path / "model.safetensors"), weights | {extra: mx.zeros((4,))})
    with pytest.raises(BlockDrafterError) as error:
        load_block_drafter(tmp_path, decoder)
    message = str(error.value)
    assert "\n" not in message and all(needle in message for needle in needles), message


def test_the_cli_says_in_one_line_why_a_block_drafter_does_not_fit(tmp_path, monkeypatch):
    from test_cli import assert_one_line_error, run
    from test_loading import save_tiny_llama

    save_tiny_llama(tmp_path / "target")
    dflash_checkpoint(tmp_path / "drafter", hidden_size=96)
    models = tmp_path / "models.toml"
    models.write_text(
        '[models.tiny]\ntarget = "./target"\n\n'
        '[models.tiny.proposers.dflash]\nkind = "block"\npath = "./drafter"\n'
    )
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    result = run("generate", "hi", "-m", "tiny", "--proposer", "dflash", "-n", "4")
    assert_one_line_error(result, "proposer 'dflash'", "96 wide")


def test_the_policy_prices_a_block_drafter_per_round():
    """One pass drafts every k alike: with the same cost, a drafter priced per round gets
    a longer draft than one priced per token, and its measured cost is a round's."""

    class Source:
        name, k_max, cost_hint = "block", 15, 0.2

        def __init__(self, per_round: bool):
            self.cost_per_round = per_round

    curve = VerifyCost({1: 1.0, 4: 1.1, 8: 1.2, 16: 1.4}, 1.0)
    chosen = {}
    for per_round in (False, True):
        policy = Policy(curve)
        situation = Situation(Source(per_round), "block", prior=0.8)
        chosen[per_round] = policy.choose(situation, 15)
        policy.update(situation, drafted=8, accepted=8, draft_seconds=0.4)
        assert policy.draft_cost["block"] == pytest.approx(0.4 if per_round else 0.05)
    assert chosen[True] > chosen[False] >= 1, chosen


def test_sliding_layers_see_a_window_of_the_context_and_earlier_slots_only(target, tmp_path):
    """Newer z-lab drafters slide some layers (layer_types, sliding_window): such a layer
    is causal over the block (is_causal unset) and sees the last `window` positions."""
    model, _ = target
    kinds = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    w = dflash_checkpoint(tmp_path, **kinds)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = block_proposer(engine, tmp_path)
    sequence = random.Random(4).choices(range(1, 256), k=10)
    ctx = greedy_ctx(engine, sequence, proposer.target_layers)
    proposer.situation(ctx)
    expected = reference_logits("dflash", w, model, sequence, windows=(4, None))
    assert proposer.propose(ctx, 4).tokens == mx.argmax(expected, axis=-1).tolist()
    assert proposer.propose(ctx, 4).tokens != reference_drafts("dflash", w, model, sequence)


def test_the_policy_verifies_only_the_slots_that_pay_by_their_own_acceptance():
    """A drafter whose first slot is always kept and second never: per position the
    policy verifies one draft; one pooled rate (1/2 a token) would verify more."""

    class Source:
        name, k_max, cost_hint, cost_per_round = "block", 15, 0.05, True

        def __init__(self, by_position: bool):
            self.acceptance_by_position = by_position

    curve = VerifyCost({1: 1.0, 2: 1.02, 4: 1.04, 8: 1.08, 16: 1.16}, 1.0)
    chosen = {}
    for by_position in (False, True):
        policy = Policy(curve)
        situation = Situation(Source(by_position), "block", prior=0.5)
        for _ in range(30):
            policy.update(situation, drafted=4, accepted=1, draft_seconds=0.05)
        chosen[by_position] = policy.choose(situation, 15)
    assert chosen == {False: chosen[False], True: 1} and chosen[False] >= 2, chosen


def test_a_hybrid_target_rolls_back_by_snapshot_and_stays_lossless(tmp_path):
    """A GatedDeltaNet hybrid (test_mtp's tiny Qwen3.5: recurrent layers whose state
    cannot be trimmed): rejected block drafts are undone by the snapshot path, and a
    drafter made to agree still gets most of its drafts accepted."""
    from test_mtp import target as hybrid_target

    model = hybrid_target("qwen3_5")
    prompt = prompts(2)[1]  # an answer whose bigrams are mostly, not always, the same
    reference = plain_greedy(model, prompt, 40, {EOS})
    agreeing("dspark", tmp_path, model, prompt + list(reference))
    engine = Engine(model, byte_tokenizer(), "hybrid")
    engine.add_proposer(block_proposer(engine, tmp_path))
    assert engine.target.strategy == "snapshot"
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=40, k=3), "block"))[-1]
    assert_lossless(model, prompt, reference, list(done.token_ids), "hybrid", done.record)
    assert done.record.accepted >= 0.5 * done.record.drafted > 0, done.record
    assert done.record.accepted < done.record.drafted  # rejections were rolled back too


QWEN35_THETA = 1e7  # z-lab's Qwen3.5 drafters' rope_theta (the targets' too)


def as_qwen35_release(folder) -> None:
    """A DFlash checkpoint's config rewritten as z-lab publishes them for Qwen3.5 targets
    (z-lab/Qwen3.5-*-DFlash config.json): `block_size` inside `dflash_config`,
    `rope_parameters` in place of `rope_theta`, sliding layers (`use_sliding_window`).
    The drafter layers stay Qwen3's, with plain norms (not offsets from one as the
    target's are)."""
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["block_size"] = config.pop("block_size")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": QWEN35_THETA}
    del config["rope_theta"]
    kinds = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    config |= {"use_sliding_window": True, **kinds}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_qwen35_dflash_drafter_reads_a_hybrid_target_and_stays_lossless(tmp_path):
    """z-lab's Qwen3.5 layout on a GatedDeltaNet hybrid (test_mtp's tiny Qwen3.5, layers 0
    and 2 recurrent): the features it reads are those recurrent layers' outputs; it drafts
    what the reference forward pass drafts, and stays lossless with rejected drafts rolled
    back by snapshot, from a random drafter and from one made to agree."""
    from test_mtp import target as hybrid_target

    model = hybrid_target("qwen3_5")
    assert [layer.is_linear for layer in model.layers] == [True, False, True, False]
    w = dflash_checkpoint(tmp_path)
    as_qwen35_release(tmp_path)
    engine = Engine(model, byte_tokenizer(), "hybrid")
    assert engine.target.strategy == "snapshot"
    proposer = block_proposer(engine, tmp_path)
    assert proposer.k_max == DFLASH_BLOCK - 1
    sequence = random.Random(5).choices(range(1, 256), k=10)
    ctx = greedy_ctx(engine, sequence, proposer.target_layers)
    assert proposer.situation(ctx) is not None
    expected = reference_logits("dflash", w, model, sequence, (4, None), QWEN35_THETA)
    assert proposer.propose(ctx, 4).tokens == mx.argmax(expected, axis=-1).tolist()
    sampled = replace(ctx, scorer=TokenScorer(SamplingSettings(temperature=1.0)))
    rows = mx.array(np.asarray(proposer.propose(sampled, 4).probs))  # the law, not its argmax
    law = mx.softmax(expected, axis=-1)
    assert mx.allclose(rows, law, atol=1e-5), float((rows - law).abs().max())

    def run(folder, prompt: list[int], k: int | None):
        engine = Engine(model, byte_tokenizer(), "hybrid")
        engine.add_proposer(block_proposer(engine, folder))
        done = list(engine.stream(prompt, GenerationSettings(max_tokens=30, k=k), "block"))[-1]
        reference = plain_greedy(model, prompt, 30, {EOS})
        label = f"qwen3.5 dflash {folder.name} k={k} {prompt[:3]}"
        assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
        return done.record

    for k in (3, None):  # fixed, and the adaptive policy's
        for prompt in prompts(7):
            drafted = run(tmp_path, prompt, k).drafted
            # Adaptive: a random drafter at 0.55 of a step on a 30-token answer may not earn
            # even a probe (priced at 2 % of the rounds it waits); fixed k always drafts.
            assert drafted > 0 or k is None
    # Plain greedy settles on 127 after 18 tokens: a drafter made to draft 127 in every
    # slot gets those accepted and the earlier ones rejected (kept prefixes replayed).
    prompt = prompts(6)[1]
    reference = plain_greedy(model, prompt, 30, {EOS})
    agreeing("dflash", tmp_path / "agrees", model, prompt + list(reference))
    as_qwen35_release(tmp_path / "agrees")
    record = run(tmp_path / "agrees", prompt, 3)
    assert 0 < record.accepted < record.drafted, (record.accepted, record.drafted)
    assert min(record.accepted_by_position) > 0  # whole blocks of 3 accepted too


# SpecForge's DFlash config for Qwen3.6-27B (sgl-project/SpecForge @ a6b6b02,
# configs/qwen3.6-27b-dflash.json), quoted whole; test_a_specforge_dflash_config_... shrinks
# its sizes: two layers (a sliding one, the full last one), window 4, the tiny target's layers.
SPECFORGE_QWEN36_27B = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17408,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "max_position_embeddings": 262144,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 64,
    "pad_token_id": 248044,
    "rms_norm_eps": 1e-06,
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "transformers_version": "5.5.3",
    "use_cache": True,
    "use_sliding_window": True,
    "vocab_size": 248320,
    "rope_theta": 10000000,
    "rope_scaling": None,
}


def test_a_specforge_dflash_config_drafts_as_the_reference(target, tmp_path):
    """SpecForge's published Qwen3.6-27B drafter config, sizes shrunk, loads and drafts
    the reference forward pass's law (sliding layer masked as SpecForge trains it,
    RoPE at theta 1e7)."""
    model, _ = target
    mx.random.seed(13)
    w = backbone(DFLASH_IDS)
    config = SPECFORGE_QWEN36_27B | {
        "block_size": DFLASH_BLOCK,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": DFLASH_IDS},
        "head_dim": HEAD_DIM,
        "hidden_size": D,
        "intermediate_size": FFN,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": 3,
        "sliding_window": 4,
        "vocab_size": VOCAB,
    }
    save(tmp_path, w, config)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = block_proposer(engine, tmp_path)
    sequence = random.Random(6).choices(range(1, 256), k=10)
    ctx = greedy_ctx(engine, sequence, proposer.target_layers)
    assert proposer.situation(ctx) is not None
    expected = reference_logits("dflash", w, model, sequence, (4, None), 1e7)
    sampled = replace(ctx, scorer=TokenScorer(SamplingSettings(temperature=1.0)))
    rows = mx.array(np.asarray(proposer.propose(sampled, 4).probs))
    law = mx.softmax(expected, axis=-1)
    assert mx.allclose(rows, law, atol=1e-5), float((rows - law).abs().max())
