"""train-drafter's other kinds: a distilled draft model (mlx-lm format) and an exit head
for self-speculation, trained on a tiny random target; both draft losslessly."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from lossless import assert_lossless, plain_greedy
from test_cli import assert_one_line_error
from test_drafter import target_sequences, tiny_teacher
from test_loading import save_tiny_llama
from tiny_models import VOCAB, byte_tokenizer

from mlxspec.cli import main
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.distill import ModelStudent
from mlxspec.drafter.exit import ExitError, ExitStudent, build_exit, load_exit, save_exit
from mlxspec.drafter.train import Batches, TrainSettings, train
from mlxspec.proposers import SelfSpeculation

EOS = VOCAB - 1
SETTINGS = dict(budget_minutes=5, batch=8, window=48, learning_rate=3e-3, warmup_steps=10)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny 3-layer llama target and teacher data made from its own greedy answers."""
    return tiny_teacher(tmp_path_factory.mktemp("data"))


def fit(student, store, out, steps: int):
    """Held-out loss before and after `steps` of training, and the progress record."""
    batch = Batches(store.shards("held-out"), student.rows, 48, 6, seed=0).next()
    before = student.loss(student.module, batch).item()
    settings = TrainSettings(max_steps=steps, **SETTINGS)
    progress = train(student, store.shards("self-distill"), store.shards("held-out"), out, settings)
    return before, student.loss(student.module, batch).item(), progress


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
        assert_lossless(
            model, prompt, reference, list(done.token_ids), "self-spec exit", done.record
        )
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


def tiny_entry(tmp_path, monkeypatch) -> None:
    """A saved tiny 2-layer llama as models.toml entry 'tiny'."""
    save_tiny_llama(tmp_path / "tiny")
    models = tmp_path / "models.toml"
    models.write_text(f'[models.tiny]\ntarget = "{tmp_path / "tiny"}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))


def train_and_compare(kind: str, out, proposer: str) -> None:
    """`train-drafter --kind KIND` registers PROPOSER, which drafts in `generate` with
    output identical to plain decoding."""
    size = ["--heads", "2"] if kind == "medusa" else ["--layers", "1"]
    args = ["--model", "tiny", "--kind", kind, *size, "--out", str(out)]
    args += ["--budget", "0.05", "--prompts", "8", "--text-tokens", "600"]
    result = CliRunner().invoke(main, ["train-drafter", *args])
    assert result.exit_code == 0, result.output
    assert f"registered as proposer '{proposer}'" in result.output

    def generate(proposer):
        args = ["generate", "hello there", "-m", "tiny", "-p", proposer, "-n", "24", "--json"]
        result = CliRunner().invoke(main, [*args, "--k", "3"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    spec, plain = generate(proposer), generate("none")
    assert spec["record"]["proposer"] == proposer and spec["record"]["drafted"] > 0
    assert spec["token_ids"] == plain["token_ids"]


def test_train_drafter_model_kind_saves_an_mlx_lm_draft_model(tmp_path, monkeypatch):
    """From a target folder to a registered draft model that mlx-lm loads too."""
    from mlx_lm import load

    tiny_entry(tmp_path, monkeypatch)
    train_and_compare("model", tmp_path / "draft", "distilled")
    record = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert record["kind"] == "model" and record["layers"] == 1 and record["steps"] > 0
    draft, tokenizer = load(str(tmp_path / "draft"))
    assert len(draft.layers) == 1
    assert tokenizer.get_vocab() == byte_tokenizer().get_vocab()
    assert draft(mx.array([[1, 2, 3]])).shape == (1, 3, VOCAB)


def test_train_drafter_exit_kind_registers_self_spec_with_the_head(tmp_path, monkeypatch):
    tiny_entry(tmp_path, monkeypatch)
    train_and_compare("exit", tmp_path / "exit", "self-spec-exit")
    record = json.loads((tmp_path / "exit" / "exit.json").read_text())["record"]
    assert record["kind"] == "exit" and record["layers"] == 1
    assert record["layer_skip_acceptance"] == record["curve"][0]["first_token_acceptance"]
    assert 'exit = "' in (tmp_path / "models.toml").read_text()


def test_train_drafter_medusa_kind_registers_medusa_heads(tmp_path, monkeypatch):
    tiny_entry(tmp_path, monkeypatch)
    train_and_compare("medusa", tmp_path / "medusa", "medusa")
    record = json.loads((tmp_path / "medusa" / "medusa.json").read_text())
    assert record["kind"] == "medusa" and record["heads"] == 2
    assert len(record["curve"][-1]["by_head"]) == 2
    assert 'kind = "medusa"' in (tmp_path / "models.toml").read_text()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--kind", "model", "--layers", "2"], "--layers must be in 1..1 for this 2-layer"),
        (["--kind", "exit", "--layers", "5"], "--layers must be in 1..1 for this 2-layer"),
        (["--kind", "exit", "--layers", "0"], "--layers"),
        (["--kind", "head", "--layers", "2"], "a head's --layers must be in 1..1"),
        (["--kind", "medusa", "--layers", "1"], "--kind medusa has none"),
        (["--kind", "exit", "--unroll", "2"], "--unroll is for --kind head"),
        (["--unroll", "0"], "--unroll"),
    ],
)
def test_train_drafter_refuses_bad_layers_in_one_line(tmp_path, monkeypatch, extra, needle):
    tiny_entry(tmp_path, monkeypatch)
    args = ["train-drafter", "--model", "tiny", "--out", str(tmp_path / "d"), *extra]
    assert_one_line_error(CliRunner().invoke(main, args), needle)
    assert not (tmp_path / "d" / "data").exists()  # refused before making any data
