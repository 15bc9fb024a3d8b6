"""A drafter for a model found on the disk: another found model of the same vocabulary (its
token list, whatever format holds it), at most a quarter of its size, nearest a tenth first;
`mlxspec models` names it and `--proposer draft-model` runs it, losslessly."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from test_loading import save_tiny_llama
from test_on_disk import ollama_store
from tiny_gguf import gguf_tokens, write_tiny_gguf

from mlxspec.cli import main
from mlxspec.models.gguf import read_gguf_metadata
from mlxspec.models.gguf_tokenizer import tokenizer_from_metadata
from mlxspec.registry.found_drafters import folder_key, tokens_key
from mlxspec.registry.models_toml import load_registry

BIG = "lmstudio:publisher/Big-GGUF"


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A float32 target in LM Studio's folder; the same tiny llama in Q4_0 and Q4_1 beside it
    (0.15x and 0.17x its bytes), in Q8_0 in Ollama's store (0.28x: too big to pay), and an
    MLX folder whose byte vocabulary lacks the GGUF's one merge (another vocabulary)."""
    lmstudio = tmp_path / "lmstudio"
    for name, qtype, seed in [("Big-GGUF", "F32", 0), ("Small-GGUF", "Q4_0", 1)]:
        (lmstudio / "publisher" / name).mkdir(parents=True)
        write_tiny_gguf(lmstudio / "publisher" / name / f"tiny.{qtype}.gguf", qtype, seed=seed)
    (lmstudio / "other" / "Small-Q4_1").mkdir(parents=True)
    write_tiny_gguf(lmstudio / "other" / "Small-Q4_1" / "tiny.Q4_1.gguf", "Q4_1", seed=2)
    ollama = tmp_path / "ollama"
    ollama_store(ollama, "tiny", "q8", write_tiny_gguf(tmp_path / "q8.gguf", "Q8_0", seed=3))
    hub = tmp_path / "hub"
    snapshot = hub / "models--someone--tiny-llama" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    save_tiny_llama(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MLXSPEC_LMSTUDIO_MODELS", str(lmstudio))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    return lmstudio


def test_models_names_the_smaller_model_of_the_same_vocabulary(disk):
    listed = CliRunner().invoke(main, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)["found"]}
    big = rows[BIG]
    assert big["proposers"] == ["prompt-lookup", "suffix", "draft-model"]
    # nearest a tenth first; Ollama's Q8_0 is over a quarter of the size, the MLX folder
    # another vocabulary
    assert [d["name"] for d in big["drafters"]] == [
        "lmstudio:publisher/Small-GGUF",
        "lmstudio:other/Small-Q4_1",
    ]
    assert 0.14 < big["drafters"][0]["size_ratio"] < 0.16
    assert rows["ollama:tiny:q8"]["drafters"] == []  # Q4_0 is half its size: no gain
    assert rows["hf:someone/tiny-llama"]["drafters"] == []
    text = CliRunner().invoke(main, ["models"]).output
    assert "(draft-model: lmstudio:publisher/Small-GGUF, 0.15x its size)" in text


def test_a_found_target_drafts_with_it_and_answers_as_plain_decoding(disk):
    entry = load_registry().including(BIG).get(BIG)
    small = disk / "publisher" / "Small-GGUF" / "tiny.Q4_0.gguf"
    assert entry.proposers["draft-model"].options["draft"] == str(small)
    assert entry.default_proposer == "prompt-lookup"  # measured-safe default, as before
    args = ["generate", "one two three one two three", "-n", "12", "--raw", "--json", "-m", BIG]
    drafted = CliRunner().invoke(main, [*args, "-p", "draft-model", "--k", "3"])
    plain = CliRunner().invoke(main, [*args, "-p", "none"])
    assert drafted.exit_code == 0 and plain.exit_code == 0, drafted.output + plain.output
    drafted, plain = (json.loads(r.stdout.splitlines()[-1]) for r in (drafted, plain))
    record = drafted["record"]
    assert record["proposer"] == "draft-model" and record["drafted"] > 0, record
    assert drafted["token_ids"] == plain["token_ids"]


def test_no_drafter_where_none_is_on_the_disk(disk):
    for folder in (disk / "publisher" / "Small-GGUF", disk / "other" / "Small-Q4_1"):
        for file in folder.iterdir():
            file.unlink()
    entry = load_registry().including(BIG).get(BIG)
    assert list(entry.proposers) == ["prompt-lookup", "suffix"]


def test_the_vocabulary_is_the_token_list_whatever_holds_it(tmp_path):
    tokens = gguf_tokens()
    assert tokens_key(tokens) == tokens_key([*tokens, "[PAD259]", "[PAD260]"])  # llama.cpp's pad
    assert tokens_key(["▁▁", "x"]) == tokens_key(["  ", "x"])  # Gemma's spaces in a GGUF
    assert tokens_key(tokens) != tokens_key(tokens[::-1])
    assert tokens_key(tokens) != tokens_key(tokens[:-1])
    # An MLX folder holding the GGUF's own vocabulary as tokenizer.json has the same key.
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    folder = tmp_path / "mlx"
    folder.mkdir()
    tokenizer_from_metadata(read_gguf_metadata(gguf))._tokenizer.save_pretrained(folder)
    assert folder_key(folder) == tokens_key(tokens)


def test_a_changed_tokenizer_json_is_read_again(tmp_path):
    folder = tmp_path / "mlx"
    save_tiny_llama(folder)
    before = folder_key(folder)
    assert before is not None and folder_key(folder) == before  # the second from the cache
    document = json.loads((folder / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(document))
    stat = (folder / "tokenizer.json").stat()
    os.utime(folder / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert folder_key(folder) not in (None, before)


def test_a_registry_entry_naming_the_same_weights_is_pointed_to(disk, tmp_path, monkeypatch):
    models = tmp_path / "models.toml"
    models.write_text(
        '[models.tiny-hub]\ntarget = "someone/tiny-llama"\ndescription = "from the hub"\n'
    )
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    listed = CliRunner().invoke(main, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)["found"]}
    assert rows["hf:someone/tiny-llama"]["registry_entries"] == ["tiny-hub"]
    assert rows[BIG]["registry_entries"] == []
    text = CliRunner().invoke(main, ["models"]).output
    assert "registry entry tiny-hub: -m tiny-hub for its proposers, same weights" in text


def test_a_draft_models_first_cost_is_what_its_step_reads_not_its_parameter_count():
    """Before a draft is timed its cost is guessed from the models: the bytes a step reads
    (what bounds it), not a count of parameters that reads a 4-bit model's packed words as
    one for eight weights. A bfloat16 draft for the same model in 4 bits (bfloat16 scales,
    groups of 64) reads 2 / (0.5 + 4/64) = 3.6x its bytes; the count said 6.4x."""
    import mlx.core as mx
    import mlx.nn as nn
    from tiny_models import tiny_model

    from mlxspec.registry.runtime import draft_cost_hint

    def in_bfloat16():
        model = tiny_model("llama")
        model.set_dtype(mx.bfloat16)
        return model

    target = in_bfloat16()
    nn.quantize(target, group_size=64, bits=4)
    assert draft_cost_hint(in_bfloat16(), target) == pytest.approx(2 / (0.5 + 4 / 64), rel=0.05)
