"""train-drafter's block kind: a DFlash-layout drafter trained on a tiny target's own
answers learns, saves as a z-lab DFlash checkpoint (the final norm folded into fc),
loads through the published-layout loader, drafts the same blocks it trained to, and
drafts losslessly with drafts accepted."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_lossless, plain_greedy
from test_drafter import tiny_teacher
from test_drafter_kinds import fit
from tiny_models import VOCAB, byte_tokenizer

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.block import load_block_drafter
from mlxspec.drafter.block_train import BlockStudent, anchored_hidden, build_block, save_block
from mlxspec.drafter.train import Batch, sparse_kl
from mlxspec.proposers.block import BlockProposer

EOS = VOCAB - 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model, decoder, store, vocab = tiny_teacher(tmp_path_factory.mktemp("data"))
    student = BlockStudent(build_block(decoder), decoder, vocab)
    before, after, progress = fit(student, store, tmp_path_factory.mktemp("block"), 120)
    return model, decoder, store, student, before, after, progress


def test_a_block_drafter_learns_the_targets_blocks(trained):
    *_, before, after, progress = trained
    start, end = progress.curve[0], progress.curve[-1]
    print(f"loss {before:.3f} -> {after:.3f}; {start} -> {end}")
    assert after < 0.7 * before
    assert end["accepted_per_block"] > start["accepted_per_block"] + 0.2
    assert end["by_slot"] == sorted(end["by_slot"], reverse=True)  # a prefix measure


def test_the_saved_checkpoint_is_a_dflash_one_that_drafts_what_was_trained(trained, tmp_path):
    model, decoder, store, student, *_ = trained
    # A final norm that is not all ones, so that folding it into fc matters.
    decoder.norm.weight = 0.5 + mx.random.uniform(shape=decoder.norm.weight.shape)
    save_block(student.module, decoder, tmp_path, {"steps": 120})
    engine = Engine(model, byte_tokenizer(), "tiny")
    proposer = BlockProposer(load_block_drafter(tmp_path, decoder), engine.target, "block")
    tokens = [int(t) for t in next(store.shards("held-out")[0].sequences())[0]]
    anchor = len(tokens) // 2
    hidden = decoder.hidden(mx.array([tokens]), [None] * len(decoder.layers))[0]
    # The student reads the final-normed state; the checkpoint the raw last-layer output.
    batch = Batch(
        mx.array([tokens]),
        hidden[None],
        mx.ones((1, len(tokens))),
        mx.zeros((1, len(tokens), 1), mx.int32),
        mx.zeros((1, len(tokens), 1)),
    )
    trained_h = anchored_hidden(student.module, decoder, batch, mx.array([[anchor]]))
    engine.target.reset()
    _, features = engine.target.prepare(tokens[: anchor + 1], capture=proposer.target_layers)
    caches = proposer.drafter.make_cache()
    proposer.drafter.add_context(features[None, :, : proposer.width], 0, caches)
    block = mx.array([[tokens[anchor]] + [proposer.drafter.spec.mask_token_id] * 7])
    loaded_h = proposer.drafter.block_hidden(block, anchor, caches, decoder)
    assert np.allclose(np.asarray(loaded_h), np.asarray(trained_h), atol=0.05, rtol=0.05)

    engine.add_proposer(proposer)
    accepted = 0
    for prompt in (tokens[:8], [5, 6, 7, 8, 5, 6, 7, 8]):
        done = list(engine.stream(prompt, GenerationSettings(max_tokens=30, k=4), "block"))[-1]
        reference = plain_greedy(model, prompt, 30, {EOS})
        assert_lossless(model, prompt, reference, list(done.token_ids), "trained", done.record)
        accepted += done.record.accepted
    assert accepted > 0


def test_train_drafter_block_kind_registers_a_dflash_checkpoint(tmp_path, monkeypatch):
    import json

    from test_drafter_kinds import tiny_entry, train_and_compare

    tiny_entry(tmp_path, monkeypatch)
    train_and_compare("block", tmp_path / "block", "block")
    config = json.loads((tmp_path / "block" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1]  # the 2-layer target's last
    record = config["mlxspec_training"]
    assert record["kind"] == "block" and record["layers"] == 1 and record["steps"] > 0
    assert len(record["curve"][-1]["by_slot"]) == 7
    assert 'kind = "block"' in (tmp_path / "models.toml").read_text()


def held_out_batch(store, decoder) -> tuple[list[int], Batch]:
    """A held-out sequence as a one-row batch (teacher tops of 1 token, unused)."""
    tokens, hidden, _ = next(store.shards("held-out")[0].sequences())
    n = len(tokens)
    batch = Batch(
        mx.array([[int(t) for t in tokens]]),
        mx.array(hidden[None]).astype(mx.float32),
        mx.ones((1, n)),
        mx.zeros((1, n, 1), mx.int32),
        mx.zeros((1, n, 1)),
    )
    return [int(t) for t in tokens], batch


def test_training_blocks_see_what_drafting_blocks_see(trained):
    """All anchors in one pass (a mask per anchor, RoPE offsets per row) equal one block
    drafted at a time over a context cache of the positions before its anchor."""
    _, decoder, store, student, *_ = trained
    tokens, batch = held_out_batch(store, decoder)
    drafter, anchors = student.module, [3, 9, len(tokens) // 2]
    together = anchored_hidden(drafter, decoder, batch, mx.array([anchors]))
    for row, anchor in enumerate(anchors):
        caches = drafter.make_cache()
        drafter.add_context(batch.hidden[:, :anchor], 0, caches)
        block = mx.array([[tokens[anchor]] + [drafter.spec.mask_token_id] * 7])
        alone = drafter.block_hidden(block, anchor, caches, decoder)
        assert mx.allclose(together[row], alone[0], atol=1e-4).item(), anchor


def test_draft_j_learns_the_teachers_distribution_of_the_token_j_plus_one_ahead(trained):
    """The loss at anchor a: draft j (from 0) against the teacher at position a + j,
    whose distribution is that of the token a + j + 1 (Batch's convention)."""
    _, decoder, store, student, *_ = trained
    tokens, batch = held_out_batch(store, decoder)
    rng = np.random.default_rng(5)
    top_ids = mx.array(rng.integers(0, student.rows.shape[0], (1, len(tokens), 4)), mx.int32)
    top_logp = mx.log(mx.softmax(mx.array(rng.normal(size=(1, len(tokens), 4))), axis=-1))
    batch = Batch(batch.tokens, batch.hidden, batch.mask, top_ids, top_logp)
    student.rng = np.random.default_rng(0)
    anchors = student.rng.integers(1, len(tokens) - 7, size=(1, 8))
    student.rng = np.random.default_rng(0)
    got = student.loss(student.module, batch).item()
    h = anchored_hidden(student.module, decoder, batch, mx.array(anchors))
    logits = h @ student.rows.T
    expected = [
        sparse_kl(logits[i, j], top_ids[0, a + j], top_logp[0, a + j]).item()
        for i, a in enumerate(anchors[0].tolist())
        for j in range(7)
    ]
    assert got == pytest.approx(np.mean(expected), rel=1e-4)


def test_held_out_agreement_credits_a_drafter_that_drafts_the_targets_tokens(trained, monkeypatch):
    """A stand-in drafter whose draft j at anchor a is the target's own choice after
    position a + j (one-hot over the draft vocabulary) agrees wherever that choice is
    in the vocabulary: the measure is aligned with drafting."""
    import mlxspec.drafter.block_train as block_train

    _, decoder, store, student, *_ = trained
    shards = store.shards("held-out")
    index = {int(t): i for i, t in enumerate(np.asarray(student.vocab))}
    size = len(index)

    def perfect(drafter, decoder, batch, anchors):
        chosen = np.asarray(mx.argmax(decoder.head(batch.hidden[0]), axis=-1))
        out = np.zeros((anchors.shape[1], 7, size), np.float32)
        for row, a in enumerate(np.asarray(anchors[0])):
            for j in range(7):
                if a + j < len(chosen) and int(chosen[a + j]) in index:
                    out[row, j, index[int(chosen[a + j])]] = 1.0
        return mx.array(out)

    monkeypatch.setattr(block_train, "anchored_hidden", perfect)
    monkeypatch.setattr(student, "rows", mx.eye(size))
    in_vocab = np.mean([int(c) in index for c in np.concatenate(student.choices(shards))])
    measured = student.agreement(shards)
    assert measured["first_token_acceptance"] >= in_vocab - 0.05 > 0.5, (measured, in_vocab)
