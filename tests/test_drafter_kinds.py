"""train-drafter's other kinds: a distilled draft model and an exit head for
self-speculation, trained on a tiny random target; the exit head drafts losslessly."""

from __future__ import annotations

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_drafter import target_sequences
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.anatomy import split_decoder
from mlxspec.drafter.data import DataStore, teacher_hidden
from mlxspec.drafter.distill import ModelStudent
from mlxspec.drafter.exit import ExitError, ExitStudent, build_exit, load_exit, save_exit
from mlxspec.drafter.train import Batches, TrainSettings, choose_vocab, train
from mlxspec.engine import Engine, GenerationSettings
from mlxspec.proposers import SelfSpeculation

EOS = VOCAB - 1
SETTINGS = dict(budget_minutes=5, batch=8, window=48, learning_rate=3e-3, warmup_steps=10)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny 3-layer llama target and teacher data made from its own greedy answers."""
    model = tiny_model("llama", seed=3)
    decoder = split_decoder(model)
    store = DataStore(tmp_path_factory.mktemp("data"), "tiny", 64)
    train_seqs, held_seqs = target_sequences(model, 32, seed=0), target_sequences(model, 6, seed=1)
    store.add("self-distill", train_seqs, teacher_hidden(decoder, train_seqs), [8] * 32, 32)
    store.add("held-out", held_seqs, teacher_hidden(decoder, held_seqs), [8] * 6, 6)
    vocab = choose_vocab(store.shards("self-distill"), 200, VOCAB, {EOS})
    return model, decoder, store, vocab


def fit(student, store, out, steps: int):
    """Held-out loss before and after `steps` of training, and the progress record."""
    batch = Batches(store.shards("held-out"), 48, 6, seed=0).next()
    before = student.loss(student.module, *batch).item()
    settings = TrainSettings(max_steps=steps, **SETTINGS)
    progress = train(student, store.shards("self-distill"), store.shards("held-out"), out, settings)
    return before, student.loss(student.module, *batch).item(), progress


@pytest.fixture(scope="module")
def exit_head(teacher, tmp_path_factory):
    model, decoder, store, vocab = teacher
    student = ExitStudent(build_exit(decoder, 1, vocab, "tiny"), decoder)
    before, after, progress = fit(student, store, tmp_path_factory.mktemp("exit"), 150)
    return student, before, after, progress


def test_exit_head_starts_as_layer_skip_and_learns(exit_head):
    student, before, after, progress = exit_head
    start, end = progress.curve[0], progress.curve[-1]
    print(f"loss {before:.3f} -> {after:.3f}; acceptance {start} -> {end}")
    assert start["first_token_acceptance"] == pytest.approx(student.layer_skip_acceptance, abs=0.02)
    assert after < 0.7 * before
    assert end["first_token_acceptance"] > start["first_token_acceptance"] + 0.05


def test_self_spec_with_an_exit_head_is_lossless_and_reloads(teacher, exit_head, tmp_path):
    model, decoder, *_ = teacher
    save_exit(exit_head[0].module, tmp_path)
    loaded = load_exit(tmp_path, decoder)
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(SelfSpeculation(engine.target, 1, "exit", k_max=4, exit_head=loaded))
    drafted = accepted = 0
    for prompt in [s[:10] for s in target_sequences(model, 4, seed=9, length=0)]:
        done = list(engine.stream(prompt, GenerationSettings(max_tokens=30, k=3), "exit"))[-1]
        reference = plain_greedy(model, prompt, 30, {EOS})
        assert_lossless(model, prompt, reference, list(done.token_ids), "self-spec exit")
        drafted, accepted = drafted + done.record.drafted, accepted + done.record.accepted
    print(f"acceptance {accepted}/{drafted}")
    assert drafted > 0 and accepted > 0
    with pytest.raises(ValueError, match="set layers = 1"):
        SelfSpeculation(engine.target, 2, exit_head=loaded)
    with pytest.raises(ExitError, match="no exit head"):
        load_exit(tmp_path / "missing", decoder)


def test_distilled_student_learns_with_frozen_embedding(teacher, tmp_path):
    model, decoder, store, vocab = teacher
    student = ModelStudent(model, decoder, 1, vocab)
    embedding = mx.array(student.module.model.embed_tokens.weight)
    before, after, progress = fit(student, store, tmp_path, 100)
    start, end = progress.curve[0], progress.curve[-1]
    print(f"loss {before:.3f} -> {after:.3f}; acceptance {start} -> {end}")
    assert after < 0.7 * before
    assert end["first_token_acceptance"] > start["first_token_acceptance"]
    assert mx.array_equal(student.module.model.embed_tokens.weight, embedding)
    assert not mx.array_equal(student.module.model.norm.weight, model.model.norm.weight)
