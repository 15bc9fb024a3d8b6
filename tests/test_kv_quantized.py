"""KV cache quantization (`--kv-bits`): speculative greedy equals plain greedy with the
same quantized KV, token for token; a float and a quantized cache never stand in for
each other (prompt cache, calibration); the record names the form."""

from __future__ import annotations

import random

import pytest
from test_lossless import CPU_LIKE_COST, Oracle
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.verify_cost import calibration_key
from mlxspec.events import Done
from mlxspec.models.kv_form import FLOAT, KVForm, kv_form
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.proposers import DraftModel, PromptLookup, SelfSpeculation, truncated_model

ANSWER = 24
# Heads of 32 values: a group of 32 quantizes them (the suite's usual 16 cannot be).
WIDE_HEADS = {"llama": dict(FAMILIES["llama"], num_attention_heads=2, num_key_value_heads=2)}


def wide_model(seed: int = 0):
    return tiny_model("llama", seed=seed, config=WIDE_HEADS["llama"])


def answer(engine: Engine, prompt: list[int], proposer: str, k: int | None = None) -> Done:
    settings = GenerationSettings(max_tokens=ANSWER, k=k)
    done = list(engine.stream(prompt, settings, proposer))[-1]
    assert isinstance(done, Done)
    return done


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    phrase = [rng.randrange(256) for _ in range(6)]
    return [
        [rng.randrange(256) for _ in range(25)],
        phrase * 5 + [rng.randrange(256) for _ in range(3)] + phrase[:3],  # lookup matches
    ]


@pytest.mark.parametrize(
    "kv",
    [KVForm(8, 32, 0), KVForm(4, 32, 0), KVForm(4, 32, 30)],
    ids=["q8-from-0", "q4-from-0", "q4-from-30"],
)
def test_speculative_greedy_equals_plain_greedy_with_the_same_quantized_kv(kv):
    model, tokenizer = wide_model(), byte_tokenizer()
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, kv=kv)
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    engine.add_proposer(DraftModel(truncated_model(model, 2), "draft-truncated", 5, kv=kv))
    engine.add_proposer(DraftModel(wide_model(seed=99), "draft-other", 4, kv=kv))
    engine.add_proposer(SelfSpeculation(engine.target, layers=1, name="self-spec", k_max=4))
    for prompt in prompts():
        engine.reset()
        plain = answer(engine, prompt, "none")
        assert plain.record.kv == kv.key
        # The oracle drafts plain's answer with one position wrong a round: every
        # rejection position, so every trim of the quantized cache, is exercised; a
        # start of 30 puts verifies across it (the float layers come back below it).
        engine.add_proposer(Oracle(len(prompt), list(plain.token_ids)))
        for name in ["lookup", "draft-truncated", "draft-other", "self-spec", "oracle"]:
            for k in (3, None):
                done = answer(engine, prompt, name, k)
                assert list(done.token_ids) == list(plain.token_ids), f"{kv.key} {name} k={k}"
                assert done.record.kv == kv.key
        oracle = answer(engine, prompt, "oracle", 3)
        assert 0 < oracle.record.accepted < oracle.record.drafted  # rejections did happen


def test_quantized_kv_changes_what_the_model_reads():
    """(Else the lossless test above would prove nothing about quantized caches.)"""
    model, tokenizer = wide_model(), byte_tokenizer()
    prompt = prompts()[0]
    logits = {}
    for kv in (FLOAT, KVForm(4, 32, 0)):
        engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, kv=kv)
        engine.target.fill(prompt[:-1])
        logits[kv.key], _ = engine.target.verify(prompt[-1:])
    assert abs(logits[FLOAT.key] - logits[KVForm(4, 32, 0).key]).max().item() > 1e-3


def test_a_float_entry_never_serves_a_quantized_target_nor_the_other_way():
    model, tokenizer = wide_model(), byte_tokenizer()
    pool = PromptCache()
    quantized = KVForm(8, 32, 0)
    engines = {
        kv.key: Engine(
            model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, prompt_cache=pool, kv=kv
        )
        for kv in (FLOAT, quantized)
    }
    prompt = prompts()[0]
    fresh = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, kv=quantized)
    expected = answer(fresh, prompt, "none").token_ids
    answer(engines[FLOAT.key], prompt, "none")
    engines[FLOAT.key].target.put_away()  # the float cache now waits in the shared pool
    done = answer(engines[quantized.key], prompt, "none")
    assert done.record.reused_prompt_tokens == 0
    assert done.token_ids == expected
    engines[quantized.key].target.put_away()
    again = answer(engines[FLOAT.key], prompt, "none")
    assert again.record.reused_prompt_tokens == len(prompt) - 1  # its own entry, not the other


def test_a_quantized_cache_is_not_cut_below_its_start():
    """A quantized entry cut to a prefix shorter than the start would hold quantized KV
    where a fresh prefill holds float: it is refilled instead, and the answer is a fresh
    engine's."""
    model, tokenizer = wide_model(), byte_tokenizer()
    kv = KVForm(4, 32, 20)
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, kv=kv)
    first = prompts()[0]
    answer(engine, first, "none")  # its cache now holds 25 + 23 tokens, quantized past 20
    second = first[:12] + [7, 8, 9, 10, 11, 12]
    done = answer(engine, second, "none")
    fresh = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, kv=kv)
    assert done.token_ids == answer(fresh, second, "none").token_ids
    assert done.record.reused_prompt_tokens == 0


def test_the_calibration_key_names_the_kv_form():
    keys = {calibration_key("m", "float16", kv=kv) for kv in (FLOAT, kv_form(8), kv_form(4))}
    assert len(keys) == 3
    assert calibration_key("m", "float16") == calibration_key("m", "float16", kv=FLOAT)


def test_the_engine_calibrates_under_its_kv_form(monkeypatch):
    import mlxspec.decoding.engine as engine_module

    seen = []
    monkeypatch.setattr(
        engine_module, "cached_verify_cost", lambda key, measure: seen.append(key) or CPU_LIKE_COST
    )
    for kv in (FLOAT, kv_form(8, 32)):
        assert Engine(wide_model(), byte_tokenizer(), "llama", kv=kv).verify_cost is CPU_LIKE_COST
    assert len(set(seen)) == 2 and kv_form(8, 32).key in seen[1]


@pytest.mark.parametrize(
    "bits, group, error",
    [(3, None, "--kv-bits must be 4 or 8"), (8, 48, "--kv-group-size must be 32, 64 or 128")],
)
def test_a_bad_kv_form_is_one_line_naming_the_option(bits, group, error):
    with pytest.raises(ValueError, match=error):
        kv_form(bits, group)


@pytest.mark.parametrize("start, held, kept", [(0, 10, 2), (30, 27, 2), (30, 27, 4)])
def test_a_kept_verify_leaves_the_cache_a_fresh_prefill_would(start, held, kept):
    """After a verify of 4 tokens from `held`, keeping `kept` of them: the cache reads as
    a fresh prefill of those tokens (a start of 30 and 27 + 2 kept: the verify crossed the
    start and the float layers came back)."""
    import mlx.core as mx

    from mlxspec.models.target import Target

    model, kv = wide_model(), KVForm(4, 32, start)
    sequence = prompts()[1] + prompts()[0]
    target = Target(model, None, kv)
    target.fill(sequence[:held])
    verified = sequence[held : held + 4]
    target.verify(verified)
    target.keep(verified, kept)
    fresh = Target(model, None, kv)
    fresh.fill(sequence[: held + kept])
    assert target.cached_tokens == fresh.cached_tokens
    assert [type(c) for c in target.cache] == [type(c) for c in fresh.cache]
    after, _ = target.verify(sequence[held + kept : held + kept + 3])
    expected, _ = fresh.verify(sequence[held + kept : held + kept + 3])
    assert mx.allclose(after, expected, atol=1e-4).item()


def test_a_quantized_entry_outlives_the_process_for_its_own_form_only(tmp_path):
    from mlxspec.models.prompt_disk import DiskCache

    model, tokenizer = wide_model(), byte_tokenizer()
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(300)]  # the disk keeps long prompts only
    quantized = KVForm(8, 32, 100)

    def engine(kv: KVForm) -> Engine:
        pool = PromptCache(disk=DiskCache(tmp_path, "llama", 1 << 30))
        return Engine(
            model, tokenizer, "llama", verify_cost=CPU_LIKE_COST, prompt_cache=pool, kv=kv
        )

    first = engine(quantized)
    expected = answer(first, prompt, "none").token_ids
    first.save_prompts()
    restarted = answer(engine(quantized), prompt, "none")
    assert restarted.record.reused_prompt_tokens == len(prompt) - 1
    assert restarted.token_ids == expected
    assert answer(engine(FLOAT), prompt, "none").record.reused_prompt_tokens == 0


def test_a_kv_bits_the_cache_cannot_hold_is_one_line():
    from click.testing import CliRunner

    from mlxspec.cli import main

    result = CliRunner().invoke(main, ["generate", "hi", "--kv-bits", "3"])
    assert result.exit_code == 2 and "'3' is not one of '4', '8'" in result.output


def test_models_toml_names_the_kv_form_and_the_command_line_overrides_it(tmp_path):
    from mlxspec.registry.models_toml import load_registry
    from mlxspec.registry.runtime import entry_kv

    toml = tmp_path / "models.toml"
    toml.write_text(
        '[models.foo]\ntarget = "owner/foo"\n[models.foo.defaults]\n'
        "kv_bits = 8\nkv_group_size = 32\nquantized_kv_start = 100\n"
    )
    registry = load_registry(toml)
    assert entry_kv(registry.get("foo")) == KVForm(8, 32, 100)
    overridden = registry.with_defaults(kv_bits=4, quantized_kv_start=0).get("foo")
    assert entry_kv(overridden) == KVForm(4, 32, 0)
