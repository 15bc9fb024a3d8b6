"""Drafter heads: training on a tiny random target, lossless drafting, saving, loading
published layouts, and registering the result."""

from __future__ import annotations

import json
import random
import re

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_lossless, plain_greedy
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.data import DataStore, Shard, teacher_hidden
from mlxspec.drafter.formats import convert_published, load_head
from mlxspec.drafter.head import (
    HeadError,
    HeadSpec,
    build_head,
    head_cache,
    lm_rows,
    save_head,
)
from mlxspec.drafter.train import (
    Batches,
    HeadStudent,
    HeldOutChoices,
    TrainSettings,
    acceptance_by_position,
    agreement,
    choose_vocab,
    draft_steps,
    make_loss,
    sparse_kl,
    target_choices,
    teacher_top,
    train,
)
from mlxspec.models.anatomy import split_decoder
from mlxspec.proposers import Chain, PromptLookup
from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.head import HeadProposer
from mlxspec.sampling import SamplingSettings, TokenScorer

EOS = VOCAB - 1


def target_sequences(model, n: int, seed: int, length: int = 48) -> list[list[int]]:
    """Random prompts continued by the target's own greedy choices (self-distillation)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(4, 12))]
        out.append(prompt + plain_greedy(model, prompt, length, {EOS}))
    return out


def tiny_teacher(folder, family: str = "llama"):
    """A tiny 3-layer target, teacher data from its own greedy answers (32 training,
    6 held-out sequences) and a 200-token draft vocabulary: (model, decoder, store, vocab)."""
    model = tiny_model(family, seed=3)
    decoder = split_decoder(model)
    store = DataStore(folder, "tiny", 64)
    train_seqs, held_seqs = target_sequences(model, 32, seed=0), target_sequences(model, 6, seed=1)
    store.add("self-distill", train_seqs, teacher_hidden(decoder, train_seqs), [8] * 32, 32)
    store.add("held-out", held_seqs, teacher_hidden(decoder, held_seqs), [8] * 6, 6)
    vocab = choose_vocab(store.shards("self-distill"), 200, VOCAB, {EOS})
    return model, decoder, store, vocab


def test_sparse_teacher_keeps_the_top_tokens_and_its_kl_is_the_full_one_when_k_is_all():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(300, 16)).astype(np.float16)
    rows = mx.array(rng.normal(size=(50, 16)).astype(np.float32))
    teacher = mx.array(hidden).astype(mx.float32) @ rows.T
    ids, logp = teacher_top(hidden, rows, k=5, chunk=64)  # several chunks
    assert ids.shape == logp.shape == (300, 5)
    best = np.sort(np.argsort(-np.asarray(teacher), axis=-1)[:, :5], axis=-1)
    assert (np.sort(ids, axis=-1) == best).all()
    assert np.allclose(np.exp(logp.astype(np.float32)).sum(-1), 1, atol=3e-3)  # renormalised
    # With every token kept, the sparse KL is the ordinary one.
    ids, logp = teacher_top(hidden, rows, k=64)
    assert ids.shape == (300, 50)
    student = mx.array(rng.normal(size=(300, 50)).astype(np.float32))
    p = mx.softmax(teacher, axis=-1)
    full = (p * (mx.log(p) - mx.log(mx.softmax(student, axis=-1)))).sum(-1)
    got = sparse_kl(student, mx.array(ids.astype(np.int32)), mx.array(logp).astype(mx.float32))
    assert np.allclose(np.asarray(got), np.asarray(full), atol=2e-2)  # fp16 log-probs


# The teacher of each family, made once for this module: its data (38 greedy answers) took
# more time than a 10-step training run, and three heads of one family learn from it.
# Training heads reads the store and the target, never writes them.
teachers: dict[str, tuple] = {}


def train_tiny_head(tmp_path_factory, layers: int, steps: int, family: str = "llama"):
    """A tiny target and a head of `layers` layers trained on it for `steps` steps:
    (model, head, progress, (loss before, loss after) on held-out data, folder)."""
    if family not in teachers:
        teachers[family] = tiny_teacher(tmp_path_factory.mktemp("data"), family)
    model, decoder, store, vocab = teachers[family]
    spec = HeadSpec(
        hidden_size=64, vocab_size=VOCAB, final_norm=True, feed_normed=True, layers=layers
    )
    head = build_head(spec, model, vocab)  # as `mlxspec train-drafter` makes them
    settings = TrainSettings(
        budget_minutes=5, max_steps=steps, batch=8, window=48, learning_rate=3e-3, warmup_steps=10
    )
    loss = make_loss(decoder, lm_rows(decoder, vocab), settings.feature_weight)
    batch = Batches(store.shards("held-out"), lm_rows(decoder, vocab), 48, 6, seed=0).next()
    before = loss(head, batch).item()
    out = tmp_path_factory.mktemp("head")
    student = HeadStudent(head, decoder, settings.feature_weight)
    progress = train(student, store.shards("self-distill"), store.shards("held-out"), out, settings)
    after = loss(head, batch).item()
    return model, head, progress, (before, after), out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny llama target and a one-layer head trained on it for a few seconds."""
    return train_tiny_head(tmp_path_factory, layers=1, steps=300)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """The same with a two-layer head (one KV cache per layer), trained less."""
    return train_tiny_head(tmp_path_factory, layers=2, steps=120)


def test_training_lowers_the_loss_and_raises_held_out_acceptance(trained):
    _, _, progress, (before, after), _ = trained
    start, end = progress.curve[0], progress.curve[-1]
    print(f"held-out loss {before:.3f} -> {after:.3f}; acceptance {start} -> {end}")
    assert after < 0.5 * before
    assert end["first_token_acceptance"] > start["first_token_acceptance"] + 0.1
    assert progress.step == 300 and progress.positions > 1000


def shard_of(decoder, seqs: list[list[int]], prompt_length: int) -> Shard:
    """Teacher data of `seqs` as one shard, without a store."""
    return Shard(
        np.concatenate([np.array(s, np.int32) for s in seqs]),
        np.concatenate(teacher_hidden(decoder, seqs)),
        np.concatenate([[0], np.cumsum([len(s) for s in seqs])]),
        np.array([prompt_length] * len(seqs)),
    )


@pytest.mark.parametrize("fixture", ["trained", "deep"])
def test_acceptance_by_position_drafts_as_the_proposer_does(fixture, request):
    """The all-positions measure of draft steps 1..3 equals the head drafting step by
    step from its own KV cache(s) (as HeadProposer does), fed the true tokens."""
    model, head, *_ = request.getfixturevalue(fixture)
    decoder = split_decoder(model)
    rows = lm_rows(decoder, head.vocab)
    seq = target_sequences(model, 1, seed=11)[0]
    hidden = teacher_hidden(decoder, [seq])[0]
    logits = draft_steps(head, decoder, rows, np.array(seq), hidden, 3)
    for i in (0, 5, len(seq) - 6):
        cache = head_cache(head)
        h = mx.array(hidden[None, : i + 1]).astype(mx.float32)
        g = head(
            h, decoder.embed(mx.array([seq[1 : i + 2]])), create_attention_mask(h, cache), cache
        )
        g = g[:, -1:]
        for step in range(3):
            assert mx.allclose(head.logits(g, rows)[0, 0], logits[step, i], atol=1e-4), (i, step)
            g = head(head.feedback(g), decoder.embed(mx.array([[seq[i + 2 + step]]])), None, cache)

    shard = shard_of(decoder, target_sequences(model, 4, seed=12), 8)
    by_position = acceptance_by_position(head, decoder, rows, [shard])
    first = agreement(head, decoder, rows, [shard])["first_token_acceptance"]
    print(f"acceptance by position {by_position}")
    assert by_position[0] == first and first > 0
    assert by_position[0] >= by_position[1] >= by_position[2]


def test_unrolled_loss_trains_each_draft_step_on_the_token_it_drafts(trained):
    """EAGLE-3's training-time test: the loss of draft step s is the KL of the head's
    step-s draft (as `draft_steps` drafts it) to the teacher's distribution s tokens
    ahead, weighed 0.8^(s-1), over the rows whose token exists."""
    model, head, *_ = trained
    decoder = split_decoder(model)
    rows = lm_rows(decoder, head.vocab)
    seq = np.array(target_sequences(model, 1, seed=13)[0])
    shard = shard_of(decoder, [seq.tolist()], 8)
    batch = Batches([shard], rows, 64, 1, seed=0).next()  # the whole sequence, padded
    logits = draft_steps(head, decoder, rows, seq, shard.hidden, 3)
    ids, logp = teacher_top(shard.hidden, rows)
    ids, logp = mx.array(ids.astype(np.int32)), mx.array(logp).astype(mx.float32)
    n, expected = len(seq) - 2, 0.0
    for s in range(3):  # step s+1 at row i drafts the token after position i+s+1
        usable = len(seq) - 2 - s
        kl = sparse_kl(logits[s, :usable], ids[s + 1 : s + 1 + usable], logp[s + 1 :][:usable])
        expected += 0.8**s * kl.mean().item()
    got = make_loss(decoder, rows, feature_weight=0.0, steps=3)(head, batch).item()
    print(f"unrolled loss {got:.5f}, from draft_steps {expected:.5f} ({n} rows)")
    assert got == pytest.approx(expected, rel=1e-4)
    one = make_loss(decoder, rows, feature_weight=0.0, steps=1)(head, batch).item()
    assert one == pytest.approx(sparse_kl(logits[0], ids[1:-1], logp[1:-1]).mean().item(), 1e-4)
    # A student unrolls only in the last part of its budget.
    student = HeadStudent(head, decoder, 0.0, unroll=3, unroll_from=0.75)
    assert student.loss(head, batch, done=0.7).item() == pytest.approx(one, rel=1e-6)
    assert student.loss(head, batch, done=0.8).item() == pytest.approx(got, rel=1e-6)


def test_held_out_choices_are_made_once_per_set_of_shards(trained):
    """The target's choices are reused while the shards are the same ones, and made
    anew for other shards (never a stale set)."""
    model, *_ = trained
    decoder = split_decoder(model)
    first = [shard_of(decoder, target_sequences(model, 3, seed=14), 8)]
    other = [shard_of(decoder, target_sequences(model, 2, seed=15), 8)]
    choices = HeldOutChoices(decoder)
    made = choices(first)
    assert [len(c) for c in made] == [len(t) for t, _, _ in first[0].sequences()]
    assert all((a == b).all() for a, b in zip(made, target_choices(decoder, first)))
    assert choices(first) is made  # reused
    again = choices(other)
    assert len(again) == 2 and all(
        (a == b).all() for a, b in zip(again, target_choices(decoder, other))
    )
    assert choices(first) is not made  # made anew, and equal
    assert all((a == b).all() for a, b in zip(choices(first), made))


def test_draft_vocabulary_is_the_targets_most_used_tokens():
    model = tiny_model("llama", seed=3)
    decoder = split_decoder(model)
    seqs = target_sequences(model, 8, seed=2)
    shard = shard_of(decoder, seqs, 4)
    vocab = choose_vocab([shard], 10, VOCAB, {EOS})
    answers = [t for s in seqs for t in s[4:]]
    most = {t for t, _ in __import__("collections").Counter(answers).most_common(9)}
    assert EOS in vocab.tolist() and len(vocab.tolist()) == 10
    assert most <= set(vocab.tolist())


def lossless_check(model, proposer, prompts, max_tokens=40, **settings):
    engine = Engine(model, byte_tokenizer(), "tiny", [proposer])
    drafted = accepted = 0
    for prompt in prompts:
        events = list(
            engine.stream(prompt, GenerationSettings(max_tokens=max_tokens, **settings), "head")
        )
        got = list(events[-1].token_ids)
        reference = plain_greedy(model, prompt, max_tokens, {EOS})
        assert_lossless(model, prompt, reference, got, f"head on {prompt[:4]}", events[-1].record)
        drafted += events[-1].record.drafted
        accepted += events[-1].record.accepted
    return drafted, accepted


def test_trained_head_drafts_losslessly_and_gets_accepted(trained):
    model, head, *_ = trained
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=6)
    prompts = [s[:10] for s in target_sequences(model, 6, seed=9, length=0)]
    drafted, accepted = lossless_check(model, proposer, prompts, k=3)
    print(f"acceptance {accepted}/{drafted}")
    assert 0.03 * drafted < accepted < drafted  # measured 0.05; an untrained head: ~1/257


def test_a_two_layer_head_trains_drafts_losslessly_and_loads_back(deep, tmp_path):
    """A deeper head: each layer starts as a copy of the target's matching last layer,
    training lowers its loss, it drafts lines and trees losslessly with a KV cache per
    layer, and it saves and loads back with both layers."""
    model, head, progress, (before, after), _ = deep
    assert head.spec.layers == 2 and len(head.more_blocks) == 1
    fresh = build_head(head.spec, model, head.vocab)
    for block, layer in zip(fresh.blocks, model.layers[-2:]):
        w = block.mlp.down_proj.weight
        assert mx.array_equal(w, layer.mlp.down_proj.weight.astype(w.dtype))
    print(f"two layers: held-out loss {before:.3f} -> {after:.3f}, {progress.curve[-1]}")
    assert after < 0.5 * before
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=6)
    prompts = [s[:10] for s in target_sequences(model, 4, seed=9, length=0)]
    drafted, accepted = lossless_check(model, proposer, prompts, k=3)
    tree_drafted, tree_accepted = lossless_check(model, proposer, prompts, k=3, tree=True)
    print(f"line {accepted}/{drafted}, tree {tree_accepted}/{tree_drafted}")
    assert 0 < accepted < drafted and 0 < tree_accepted < tree_drafted
    assert proposer.cache.offset == proposer.entries  # every layer's draft entries cut off
    assert len({c.offset for c in proposer.cache.parts}) == 1
    save_head(head, tmp_path)
    loaded = load_head(tmp_path, model, split_decoder(model))
    assert loaded.spec.layers == 2
    h, e = mx.random.normal((1, 5, 64)), mx.random.normal((1, 5, 64))
    assert mx.allclose(loaded(h, e, "causal"), head(h, e, "causal"), atol=2e-2)


def test_trained_head_drafts_trees_losslessly(trained):
    """The head grows a tree (its state re-run per branch) and the target verifies it
    in one pass; the output stays the target's and the head stays in sync."""
    model, head, *_ = trained
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=6)
    prompts = [s[:10] for s in target_sequences(model, 6, seed=9, length=0)]
    drafted, accepted = lossless_check(model, proposer, prompts, k=3, tree=True)
    print(f"tree acceptance {accepted}/{drafted} (depths)")
    assert 0.03 * drafted < accepted < drafted


def test_a_one_branch_head_tree_is_the_heads_own_line(trained, monkeypatch):
    """With one child per node and one node per level, the level-wise tree pass (tree
    mask, positions by depth) must reproduce the line the head drafts step by step."""
    import mlxspec.proposers.head as head_module

    model, head, *_ = trained
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=6)
    prompt = target_sequences(model, 1, seed=9, length=0)[0][:10]
    _, hidden = engine.target.prepare(prompt, capture=())
    ctx = ProposalContext(prompt, TokenScorer(SamplingSettings()), None, engine.target, hidden)
    assert proposer.situation(ctx) is not None
    line = proposer.propose(ctx, 5).tokens
    monkeypatch.setattr(head_module, "BRANCH", 1)
    monkeypatch.setattr(head_module, "BEAM", 1)
    tree = proposer.propose_tree(ctx, 5, 32)
    assert tree.is_chain and tree.tokens == line
    assert proposer.cache.offset == proposer.entries  # the draft entries were cut off
    monkeypatch.setattr(head_module, "BRANCH", 3)
    monkeypatch.setattr(head_module, "BEAM", 4)
    wide = proposer.propose_tree(ctx, 5, 64)
    first = max(wide.children()[0], key=lambda n: wide.scores[n - 1])
    assert wide.tokens[first - 1] == line[0] and not wide.is_chain
    best_child = max(wide.children()[first], key=lambda n: wide.scores[n - 1])
    assert wide.tokens[best_child - 1] == line[1]  # a level pass gives the line's 2nd token
    assert proposer.propose(ctx, 5).tokens == line


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_barely_trained_head_is_lossless_with_many_rejections(family, tmp_path_factory):
    """A head trained for a few steps: most drafts refused, at every position of the line,
    some kept (an untrained one keeps none, so acceptance and rollback would go untested)."""
    model, head, *_ = train_tiny_head(tmp_path_factory, layers=1, steps=10, family=family)
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=4)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17)]
    drafted, accepted = lossless_check(model, proposer, prompts, k=3)  # a fixed k: drafts
    print(f"barely trained acceptance {accepted}/{drafted}")
    assert drafted > 0 and 0 < accepted < 0.5 * drafted  # mostly refused, some kept


def test_head_follows_a_growing_conversation_and_a_chain(trained):
    """Second turn reuses the target's cache (only new hidden states arrive); a chain
    keeps the head fed while lookup drafts."""
    model, head, *_ = trained
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=4)
    chain = Chain([PromptLookup("lookup", 3, 1, 4), proposer], name="head")
    engine.add_proposer(chain)
    first = [5, 6, 7, 8, 9, 5, 6, 7]
    out1 = list(engine.stream(first, GenerationSettings(max_tokens=20, k=3), "head"))[-1]
    second = first + list(out1.token_ids) + [10, 11, 12]
    out2 = list(engine.stream(second, GenerationSettings(max_tokens=30, k=3), "head"))[-1]
    assert out2.record.reused_prompt_tokens > len(first)
    reference = plain_greedy(model, second, 30, {EOS})
    assert_lossless(model, second, reference, list(out2.token_ids), "second turn", out2.record)
    assert proposer.base == 0  # no gap: the head kept every hidden state


def test_sampling_with_a_head_gives_full_width_draft_probabilities(trained):
    """The head scores only its own vocabulary; the q it hands to rejection sampling must
    be a distribution over the target's full width, with no mass outside that vocabulary
    and the drafted token drawn from it."""
    model, head, *_ = trained
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = HeadProposer(head, engine.target, k_max=4)
    drafts = []
    propose = proposer.propose
    proposer.propose = lambda ctx, k: drafts.append(propose(ctx, k)) or drafts[-1]
    engine.add_proposer(proposer)
    settings = GenerationSettings(
        max_tokens=30, k=3, sampling=SamplingSettings(temperature=0.8, seed=1)
    )
    done = list(engine.stream([1, 2, 3, 4], settings, "head"))[-1]
    assert done.record.drafted > 0 and len(done.token_ids) > 0
    width = model.lm_head.weight.shape[0]
    outside = np.ones(width, bool)
    outside[np.asarray(head.vocab)] = False
    assert drafts and outside.any()  # the head's vocabulary is a strict subset
    for draft in drafts:
        probs = np.asarray(draft.probs)
        assert probs.shape == (len(draft.tokens), width)
        assert np.allclose(probs.sum(axis=-1), 1.0, atol=1e-4)
        assert probs[:, outside].max() == 0
        assert all(probs[i, t] > 0 for i, t in enumerate(draft.tokens))


def test_saved_head_loads_back_in_fp16(trained, tmp_path):
    model, head, *_ = trained
    save_head(head, tmp_path)
    assert (tmp_path / "head.safetensors").stat().st_size < 200_000
    decoder = split_decoder(model)
    loaded = load_head(tmp_path, model, decoder)
    assert loaded.vocab.tolist() == head.vocab.tolist()
    h, e = mx.random.normal((1, 5, 64)), mx.random.normal((1, 5, 64))
    assert mx.allclose(loaded(h, e, "causal"), head(h, e, "causal"), atol=2e-2)


def test_a_head_for_another_target_is_refused(trained, tmp_path):
    _, head, *_ = trained
    save_head(head, tmp_path)
    other = tiny_model("llama", seed=3)
    other_decoder = split_decoder(other)
    spec = (tmp_path / "head.json").read_text().replace('"hidden_size": 64', '"hidden_size": 96')
    (tmp_path / "head.json").write_text(spec)
    with pytest.raises(HeadError, match="width 96"):
        load_head(tmp_path, other, other_decoder)
    with pytest.raises(HeadError, match="no drafter head"):
        load_head(tmp_path / "missing", other, other_decoder)


# --- Published layouts, written as random checkpoints in their own names ---------------


def block_weights(model, prefix: str, skip_input_norm: bool = False) -> dict[str, mx.array]:
    fresh = {k: mx.random.normal(v.shape) for k, v in tree_flatten(model.layers[0].parameters())}
    if skip_input_norm:
        fresh.pop("input_layernorm.weight")
    return {prefix + k: v for k, v in fresh.items()}


def rms(x, w, eps=1e-5):
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


LAYOUTS = {
    "eagle-1": lambda m: {
        "fc.weight": mx.random.normal((64, 128)),
        "fc.bias": mx.random.normal((64,)),
        "embed_tokens.weight": mx.zeros((VOCAB, 64)),  # EAGLE ships a copy: ignored
        **block_weights(m, "layers.0.", skip_input_norm=True),
    },
    "deepseek-mtp": lambda m: {
        "model.layers.3.eh_proj.weight": mx.random.normal((64, 128)),
        "model.layers.3.enorm.weight": mx.random.normal((64,)),
        "model.layers.3.hnorm.weight": mx.random.normal((64,)),
        "model.layers.3.shared_head.norm.weight": mx.random.normal((64,)),
        "model.layers.3.shared_head.head.weight": mx.random.normal((VOCAB, 64)),
        "model.layers.0.mlp.up_proj.weight": mx.zeros((128, 64)),  # the target's own: ignored
        **block_weights(m, "model.layers.3."),
    },
    "mimo-mtp": lambda m: {
        "model.mtp_layers.0.input_proj.weight": mx.random.normal((64, 128)),
        "model.mtp_layers.0.token_layernorm.weight": mx.random.normal((64,)),
        "model.mtp_layers.0.hidden_layernorm.weight": mx.random.normal((64,)),
        "model.mtp_layers.0.final_layernorm.weight": mx.random.normal((64,)),
        **block_weights(m, "model.mtp_layers.0."),
    },
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layouts_map_into_the_head(layout, tmp_path):
    model = tiny_model("llama", seed=1)
    decoder = split_decoder(model)
    mx.random.seed(7)
    weights = LAYOUTS[layout](model)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    head = convert_published(tmp_path, model, decoder)
    assert head.spec.source_format == layout

    # Every block weight landed where it belongs.
    mine = dict(tree_flatten(head.block.parameters()))
    theirs = {k.split(".", 3 if layout != "eagle-1" else 2)[-1]: v for k, v in weights.items()}
    for key, value in mine.items():
        assert mx.array_equal(value, theirs[key]), key
    if layout == "eagle-1":
        assert "input_layernorm" not in mine and "input_layernorm.weight" not in mine

    # The fusion in front of the block, written out by hand from the raw weights; vLLM's
    # MTP layers read zeros for the embedding at position 0.
    h, given = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    e = given
    if layout != "eagle-1":
        e = mx.concatenate([mx.zeros((1, 1, 64)), e[:, 1:]], axis=1)
    if layout == "eagle-1":
        fused = mx.concatenate([e, h], -1) @ weights["fc.weight"].T + weights["fc.bias"]
    else:
        p = "model.layers.3." if layout == "deepseek-mtp" else "model.mtp_layers.0."
        names = (
            ("enorm", "hnorm", "eh_proj")
            if layout == "deepseek-mtp"
            else ("token_layernorm", "hidden_layernorm", "input_proj")
        )
        e_n, h_n = (
            rms(e, weights[f"{p}{names[0]}.weight"]),
            rms(h, weights[f"{p}{names[1]}.weight"]),
        )
        parts = [e_n, h_n] if layout == "deepseek-mtp" else [h_n, e_n]
        fused = mx.concatenate(parts, -1) @ weights[f"{p}{names[2]}.weight"].T
    expected = head.block(fused, "causal")
    assert mx.allclose(head(h, given, "causal"), expected, atol=1e-4)

    # Draft logits: MTP normalises and may use its own LM head; EAGLE-1 the target's.
    g = head(h, given, "causal")
    rows = lm_rows(decoder, head.vocab)
    if layout == "deepseek-mtp":
        ref = (
            rms(g, weights["model.layers.3.shared_head.norm.weight"])
            @ weights["model.layers.3.shared_head.head.weight"].T
        )
    elif layout == "mimo-mtp":
        ref = rms(g, weights["model.mtp_layers.0.final_layernorm.weight"]) @ rows.T
    else:
        ref = g @ rows.T
    assert mx.allclose(head.logits(g, rows), ref, atol=1e-3)


VICUNA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 32000,
}
BLOCK_PREFIX = {
    "eagle-1": "layers.0.",
    "deepseek-mtp": "model.layers.3.",
    "mimo-mtp": "model.mtp_layers.0.",
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("extra", ["tensor", "flag"])
def test_a_published_tensor_or_flag_mlxspec_does_not_read_is_named(layout, extra, tmp_path):
    """One extra tensor (a norm the layout does not have) or one config field mlxspec does
    not act on is refused in one line naming it, where the loader used to drop both."""
    model = tiny_model("llama", seed=1)
    mx.random.seed(7)
    weights = LAYOUTS[layout](model)
    # EAGLE-1: SafeAILab's Vicuna-7B config (SafeAILab/EAGLE @ cb7e084,
    # eagle/train/vicuna_7B_config.json), sizes shrunk; MTP: what `pull --mtp` keeps.
    config = (
        VICUNA_7B | {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
        if layout == "eagle-1"
        else {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3}
    ) | {"vocab_size": VOCAB}
    if extra == "tensor":
        weights[BLOCK_PREFIX[layout] + "extra_norm.weight"] = mx.ones((64,))
    else:
        config["attention_sink_bias"] = True
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    named = "extra_norm.weight" if extra == "tensor" else "attention_sink_bias"
    with pytest.raises(HeadError, match=named) as err:
        convert_published(tmp_path, model, split_decoder(model))
    assert "\n" not in str(err.value)


def test_a_whole_checkpoints_own_tensors_are_named_in_one_warning(tmp_path, caplog):
    """A folder holding the target's own layers beside the MTP layer (a whole checkpoint,
    not `pull --mtp`'s extract): they are not the head's, and a one-line warning says so."""
    model = tiny_model("llama", seed=1)
    mx.random.seed(7)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), LAYOUTS["deepseek-mtp"](model))
    with caplog.at_level("WARNING", logger="mlxspec.drafter"):
        convert_published(tmp_path, model, split_decoder(model))
    [line] = [r.getMessage() for r in caplog.records]
    assert "not used (harmless): model.layers.0.mlp.up_proj.weight" in line and "\n" not in line


def test_unknown_checkpoints_get_a_clear_refusal(tmp_path):
    model = tiny_model("llama", seed=1)
    decoder = split_decoder(model)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"something.else": mx.zeros((2,))})
    with pytest.raises(HeadError, match="no drafter head"):
        convert_published(tmp_path, model, decoder)


def test_train_drafter_command_trains_registers_and_generates(tmp_path, monkeypatch):
    """One command from nothing to a registered head that `generate` drafts with."""
    from click.testing import CliRunner
    from test_loading import save_tiny_llama

    from mlxspec.cli import main

    save_tiny_llama(tmp_path / "tiny")
    models = tmp_path / "models.toml"
    models.write_text(f'[models.tiny]\ntarget = "{tmp_path / "tiny"}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    out = tmp_path / "head"
    args = ["--model", "tiny", "--out", str(out), "--budget", "0.05", "--prompts", "8"]
    mine = tmp_path / "mine.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    mine.write_text(
        '{"text": "my own notes about tiny models"}\n{"text": "and more"}\n'
        + json.dumps({"messages": chat})
        + "\n"
    )
    args += ["--text-tokens", "600", "--data", str(mine)]
    result = CliRunner().invoke(main, ["train-drafter", *args])
    assert result.exit_code == 0, result.output
    assert "registered as proposer 'head'" in result.output
    record = json.loads((out / "head.json").read_text())["record"]
    assert record["data"]["self_distill_tokens"] > 0 and record["data"]["text_tokens"] >= 600
    # The byte-level tiny tokenizer has no chat template: a chat's contents go on lines.
    texts = ["my own notes about tiny models", "and more", "hi\nhello"]
    assert record["data"]["file_tokens"] == sum(map(len, texts))
    assert record["steps"] > 0 and len(record["curve"]) >= 2
    by_position = record["acceptance_by_position"]
    assert len(by_position) == 3 and by_position[0] == record["curve"][-1]["first_token_acceptance"]
    assert "draft tokens 1, 2, 3:" in result.output

    def generate(proposer):
        args = ["generate", "hello there", "-m", "tiny", "-p", proposer, "-n", "24", "--json"]
        result = CliRunner().invoke(main, [*args, "--k", "3"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    spec, plain = generate("head"), generate("none")
    assert spec["record"]["proposer"] == "head" and spec["record"]["drafted"] > 0
    assert spec["token_ids"] == plain["token_ids"]


def test_train_drafter_refuses_bad_input_in_one_line(tmp_path):
    from click.testing import CliRunner

    from mlxspec.cli import main

    args = ["train-drafter", "--out", str(tmp_path / "h"), "--no-self-distill"]
    result = CliRunner().invoke(main, [*args, "--text-tokens", "0"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.count("Error:") == 1 and "no training data" in result.output


class TemplateTokenizer:
    """Characters as ids, and a chat template that wants the user to speak first."""

    chat_template = "<role>content"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        if messages[0]["role"] != "user":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def test_data_file_texts_and_chats_go_through_the_chat_template(tmp_path):
    from mlxspec.drafter.data import encode_items, read_data_file

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "x": 1}]
    mine = tmp_path / "mine.jsonl"
    lines = [{"text": "notes"}, {"text": "a"}, {"messages": chat}, {"text": ""}]
    mine.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n")
    with mine.open("a") as f:
        f.write("\n".join(json.dumps(line) for line in lines[2:]) + "\n")
    items = read_data_file(mine)
    spoken = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert [item for _, item in items] == ["notes", "a", spoken]  # other keys are dropped
    assert [where for where, _ in items] == [f"{mine} line {n}" for n in (1, 2, 4)]
    # "a" is one token: nothing to learn from, dropped.
    ids = encode_items(TemplateTokenizer(), items, mine)
    assert ids == [[ord(c) for c in "notes"], [ord(c) for c in "<user>hi<assistant>yo"]]

    plain = tmp_path / "notes.txt"
    plain.write_text('{"text": "a text file is one text, JSON or not"}')
    assert read_data_file(plain) == [(str(plain), plain.read_text())]


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        (b"\x87\x00 binary", ".txt", "is not UTF-8 text (byte 0)"),
        (b"  \n", ".txt", "holds no text to train on"),
        (b'{"text": ""}\n\n', ".jsonl", "holds no text to train on"),
        (b'{"text": "ok"}\nnot json\n', ".jsonl", "line 2: not JSON"),
        (b'{"text": "ok"}\n{"prompt": "x"}\n', ".jsonl", 'line 2: expected {"text"'),
        (b'{"messages": [{"role": "user"}]}\n', ".jsonl", 'line 1: expected {"text"'),
        (b'{"messages": []}\n', ".jsonl", 'line 1: expected {"text"'),
        (b'["text"]\n', ".jsonl", 'line 1: expected {"text"'),
    ],
)
def test_a_bad_data_file_is_named_with_its_line(tmp_path, content, suffix, message):
    from mlxspec.drafter.data import DataFileError, read_data_file

    path = tmp_path / f"mine{suffix}"
    path.write_bytes(content)
    with pytest.raises(DataFileError, match="^" + re.escape(f"{path}")) as caught:
        read_data_file(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_chat_the_template_refuses_is_named_with_its_line(tmp_path):
    from mlxspec.drafter.data import DataFileError, encode_items, read_data_file

    mine = tmp_path / "mine.jsonl"
    bot_first = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    mine.write_text('{"text": "fine"}\n' + json.dumps({"messages": bot_first}) + "\n")
    with pytest.raises(DataFileError, match=f"{re.escape(str(mine))} line 2: the chat template"):
        encode_items(TemplateTokenizer(), read_data_file(mine), mine)


def test_a_bad_data_file_fails_before_the_model_loads(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import mlxspec.models.loading
    from mlxspec.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the data file was checked")

    monkeypatch.setattr(mlxspec.models.loading, "load_model", never)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    args = ["train-drafter", "--out", str(tmp_path / "h"), "--data", str(mine)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.count("Error:") == 1 and f"{mine} line 2: expected" in result.output


def test_built_in_prompts_hold_out_whole_topics_and_span_every_style():
    from mlxspec.drafter.prompts import TEMPLATES, TOPICS, TRAINING_PROMPTS, chat_prompts

    training, held = chat_prompts(), chat_prompts(held_out=True)
    assert len(training) + len(held) == len(TOPICS) * len(TEMPLATES)
    assert len(training) == TRAINING_PROMPTS == 5760  # as docs/drafters.md says
    held_topics = {t for i, t in enumerate(TOPICS) if i % 8 == 7}  # every 8th, by design
    assert not any(t in p for p in training for t in held_topics if " " in t)
    first = training[:200]  # a small run still sees many styles
    styles = {tm for tm in TEMPLATES if any(p.startswith(tm.split("{t}")[0]) for p in first)}
    assert len(styles) > 0.8 * len(TEMPLATES)
    assert chat_prompts() == training  # a fixed order: data making resumes by count
