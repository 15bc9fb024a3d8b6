"""The committed answer set (drafter data): round trip, resume, and training reads it."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.drafter.answers import (
    AnswerSetError,
    add_answers,
    check_matches,
    paths,
    read_answers,
    shipped_answers,
)
from mlxspec.drafter.data import DataStore, self_distill
from mlxspec.models.anatomy import split_decoder

PROMPTS = ["Explain tides.", "Why is soil brown?", "List three birds.", "Say hi.", "Count."]


@pytest.fixture
def generated(monkeypatch) -> list[list[int]]:
    """Every prompt batch_generate is asked to answer (spied, still run for real)."""
    asked: list[list[int]] = []
    module = importlib.import_module("mlx_lm.generate")  # `mlx_lm.generate` is a function
    real = module.batch_generate

    def spy(model, tokenizer, prompts, **kwargs):
        asked.extend(prompts)
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(module, "batch_generate", spy)
    return asked


def test_answers_round_trip_and_a_later_run_only_adds_what_is_missing(tmp_path, generated):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    first = add_answers(model, tokenizer, "tiny", PROMPTS[:3], folder=tmp_path, max_tokens=6)
    assert len(generated) == 3
    read = read_answers("tiny", folder=tmp_path)
    assert read.prompts == PROMPTS[:3] and read.answer_ids == first.answer_ids
    assert read.prompt_ids == first.prompt_ids and read.manifest["count"] == 3
    with np.load(paths("tiny", folder=tmp_path)[0]) as arrays:
        assert arrays["tokens"].dtype == np.uint16  # 257 ids fit: half the bytes of int32
    more = add_answers(model, tokenizer, "tiny", PROMPTS, folder=tmp_path, max_tokens=6, batch=1)
    assert len(generated) == 5  # only the two new prompts were answered
    assert more.prompts == PROMPTS and more.answer_ids[:3] == first.answer_ids
    with pytest.raises(AnswerSetError, match="max_tokens=6"):
        add_answers(model, tokenizer, "tiny", PROMPTS, folder=tmp_path, max_tokens=9)


def test_a_kill_between_the_two_writes_reads_only_what_the_manifest_names(tmp_path):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    add_answers(model, tokenizer, "tiny", PROMPTS[:2], folder=tmp_path, max_tokens=4)
    arrays, manifest = paths("tiny", folder=tmp_path)
    old_manifest = manifest.read_bytes()
    add_answers(model, tokenizer, "tiny", PROMPTS[:4], folder=tmp_path, max_tokens=4)
    manifest.write_bytes(old_manifest)  # the arrays were replaced, the manifest was not yet
    read = read_answers("tiny", folder=tmp_path)
    assert read.prompts == PROMPTS[:2] and len(read.answer_ids) == 2


def test_an_answer_set_of_another_tokenizer_is_refused(tmp_path):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    made = add_answers(model, tokenizer, "tiny", PROMPTS[:1], folder=tmp_path, max_tokens=4)
    other = byte_tokenizer()
    other._tokenizer.add_tokens(["<extra>"])
    with pytest.raises(AnswerSetError, match="another tokenizer"):
        check_matches(made, other)
    assert shipped_answers("/abs/path", tokenizer) is None  # only packaged names ship any


def test_training_prefills_committed_answers_instead_of_generating(tmp_path, generated):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    committed = add_answers(model, tokenizer, "tiny", PROMPTS[:3], folder=tmp_path, max_tokens=6)
    generated.clear()
    decoder = split_decoder(model)
    store = DataStore(tmp_path / "data", "tiny", decoder.width)
    self_distill(model, tokenizer, decoder, store, PROMPTS[:4], max_tokens=6, answered=committed)
    assert len(generated) == 1  # the one prompt the committed set lacks
    (shard,) = store.shards("self-distill")
    eos = next(iter(tokenizer.eos_token_ids))
    first = committed.prompt_ids[0] + committed.answer_ids[0]
    first += [eos] if committed.ended[0] else []
    assert shard.tokens[: len(first)].tolist() == first
    assert shard.hidden.shape == (len(shard.tokens), decoder.width)  # prefilled states


def test_the_shipped_answer_set_holds_out_the_bench_chat_suite():
    from mlxspec.bench.suites import load_suite

    manifest = json.loads(paths("smollm2-135m")[1].read_text())
    assert manifest["count"] == len(manifest["prompts"]) >= 100
    assert manifest["vocab_size"] == 49152 and manifest["tokenizer_sha256"]
    bench = {p.text for p in load_suite("all")} | {p.text for p in load_suite("agent")}
    assert not bench & set(manifest["prompts"])
