"""Medusa heads: training lowers the loss, drafting (line and tree) stays lossless, and
published checkpoints map into the same module."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from mlx.utils import tree_flatten
from test_drafter import EOS, tiny_teacher
from tiny_models import VOCAB, byte_tokenizer

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.head import HeadError, lm_rows
from mlxspec.drafter.medusa import (
    PUBLISHED,
    MedusaHeads,
    MedusaStudent,
    load_medusa,
    save_medusa,
)
from mlxspec.drafter.train import Batches, TrainSettings, train
from mlxspec.models.anatomy import split_decoder
from mlxspec.proposers.medusa import MedusaProposer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny llama target and three Medusa heads trained on it for a few seconds."""
    model, decoder, store, _ = tiny_teacher(tmp_path_factory.mktemp("data"))
    heads = MedusaHeads(64, 3, mx.arange(VOCAB))
    student = MedusaStudent(heads, decoder)
    # Fitting is what a unit test can show: 32 random-model sequences are too few for the
    # heads to generalise (held-out agreement is the training run's own curve).
    batch = Batches(store.shards("self-distill"), student.rows, 48, 6, seed=0).next()
    before = student.loss(heads, batch).item()
    agreement_before = student.agreement(store.shards("self-distill"))
    settings = TrainSettings(
        budget_minutes=5, max_steps=200, batch=8, window=48, learning_rate=3e-3, warmup_steps=10
    )
    out = tmp_path_factory.mktemp("medusa")
    progress = train(student, store.shards("self-distill"), store.shards("held-out"), out, settings)
    after = student.loss(heads, batch).item()
    agreement_after = student.agreement(store.shards("self-distill"))
    return model, heads, progress, (before, after), (agreement_before, agreement_after), out


def test_training_lowers_the_loss_and_raises_every_heads_agreement(trained):
    model, heads, progress, (before, after), (agreed_before, agreed_after), _ = trained
    assert after < 0.8 * before, (before, after)
    print("medusa agreement before", agreed_before, "after", agreed_after)
    for k in range(3):
        assert agreed_after["by_head"][k] > agreed_before["by_head"][k] + 0.05
    assert len(progress.curve[-1]["by_head"]) == 3  # the held-out curve is recorded per head


def lossless_run(model, proposer, **settings) -> tuple[int, int]:
    engine = Engine(model, byte_tokenizer(), "tiny")
    engine.add_proposer(proposer)
    drafted = accepted = 0
    rng = random.Random(5)
    for prompt in [[rng.randrange(256) for _ in range(n)] for n in (1, 6, 15)]:
        done = list(engine.stream(prompt, GenerationSettings(max_tokens=40, **settings), "medusa"))[
            -1
        ]
        reference = plain_greedy(model, prompt, 40, {EOS})
        assert_lossless(
            model, prompt, reference, list(done.token_ids), f"medusa {settings}", done.record
        )
        drafted += done.record.drafted
        accepted += done.record.accepted
    return drafted, accepted


@pytest.mark.parametrize("tree", [False, True])
def test_trained_medusa_drafts_losslessly_as_a_line_and_as_a_tree(trained, tree):
    model, heads, *_ = trained
    proposer = MedusaProposer(heads, Engine(model, byte_tokenizer()).target)
    drafted, accepted = lossless_run(model, proposer, k=3, tree=tree)
    print(f"medusa tree={tree}: accepted {accepted}/{drafted}")
    assert 0 < accepted < drafted


def test_saved_heads_load_back_and_published_checkpoints_map_in(trained, tmp_path):
    model, heads, *_ = trained
    decoder = split_decoder(model)
    save_medusa(heads, tmp_path / "ours")
    again = load_medusa(tmp_path / "ours", decoder)
    rows = lm_rows(decoder, heads.vocab)
    h = mx.random.normal((1, 4, 64))
    for a, b in zip(heads.logits(h, rows), again.logits(h, rows)):
        assert mx.abs(a - b).max().item() < 0.05  # fp16 storage

    # FasterDecoding/Medusa layout: {k}.{j}.linear.*, {k}.{layers}.weight (own LM heads).
    published = tmp_path / "published"
    published.mkdir()
    mx.random.seed(0)
    raw = {}
    for k in range(2):
        raw[f"{k}.0.linear.weight"] = 0.01 * mx.random.normal((64, 64))
        raw[f"{k}.0.linear.bias"] = mx.zeros((64,))
        raw[f"{k}.1.weight"] = mx.random.normal((VOCAB, 64))
    mx.save_safetensors(str(published / PUBLISHED), raw)
    (published / "config.json").write_text(
        json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1})
    )
    loaded = load_medusa(published, decoder)
    assert loaded.count == 2 and dict(tree_flatten(loaded.parameters()))
    block = raw["1.0.linear.weight"]
    want = (h + (h @ block.T) * mx.sigmoid(h @ block.T)) @ raw["1.1.weight"].T
    assert mx.abs(loaded.logits(h, None)[1] - want).max().item() < 1e-3
    proposer = MedusaProposer(loaded, Engine(model, byte_tokenizer()).target)
    lossless_run(model, proposer, k=2, tree=True)

    (published / PUBLISHED).unlink()
    with pytest.raises(HeadError, match="holds no Medusa heads"):
        load_medusa(published, decoder)
