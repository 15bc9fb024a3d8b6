"""The memory budget: weights, drafters, KV of the context and the prompt cache added up
against the device; a configuration that cannot fit refused in one line with its
numbers, a request that cannot fit refused before any prefill, the prompt cache giving
way first."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from test_lossless import CPU_LIKE_COST
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

import mlxspec.batch.memory as memory
from mlxspec.batch.memory import GB, Holdings, check_request, fit
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.models.kv_form import FLOAT, kv_form, kv_token_bytes
from mlxspec.server.errors import refused
from mlxspec.settings import DoesNotFit

HOLDS = Holdings(
    weights=4 * GB, drafters=GB // 2, kv_token=100_000, kv_form="kv float", prompt_cache=3 * GB
)


def test_the_prompt_cache_gives_way_first():
    device = 6 * GB
    bound = fit(HOLDS, context=8192, device=device)
    assert bound == device - HOLDS.weights - HOLDS.drafters - HOLDS.kv_token * 8192
    assert 0 < bound < HOLDS.prompt_cache
    assert fit(HOLDS, context=8192, device=64 * GB) == HOLDS.prompt_cache  # room: all of it


def test_a_configuration_that_cannot_fit_is_refused_with_its_numbers():
    with pytest.raises(DoesNotFit) as refusal:
        fit(HOLDS, context=32768, rows=2, device=8 * GB)
    line = str(refusal.value)
    assert "\n" not in line
    for said in ("weights 4.00 GB", "drafters 0.50 GB", "32768 tokens x 2 rows", "8.00 GB"):
        assert said in line


def test_a_request_that_cannot_fit_is_refused_before_any_prefill():
    model, tokenizer = tiny_model(), byte_tokenizer()
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST)
    kv_token = kv_token_bytes(model)
    weights = 10_000_000
    engine.holdings = Holdings(weights, 0, kv_token, "kv float", prompt_cache=GB)
    device = weights + kv_token * 100  # room for 100 tokens of KV; the prompt cache gives way
    original = memory.device_memory
    memory.device_memory = lambda: device
    try:
        engine.check_request([1] * 50, GenerationSettings(max_tokens=50), None)  # fits
        with pytest.raises(DoesNotFit, match="60 prompt tokens \\+ 50 max_tokens"):
            engine.check_request([1] * 60, GenerationSettings(max_tokens=50), None)
    finally:
        memory.device_memory = original
    assert engine.target.cached_tokens == []  # nothing was prefilled
    error = refused(DoesNotFit("x"))
    assert error.status_code == 400 and error.code == "insufficient_memory"


def test_check_request_counts_prompt_and_max_tokens():
    with pytest.raises(DoesNotFit):
        check_request(HOLDS, 10_000, 10_000, device=HOLDS.fixed() + HOLDS.kv_token * 19_999)
    check_request(HOLDS, 10_000, 10_000, device=HOLDS.fixed() + HOLDS.kv_token * 20_000)


def test_eight_bit_kv_holds_about_half_of_float16s():
    config = dict(FAMILIES["llama"], num_attention_heads=1, num_key_value_heads=1)
    model = tiny_model("llama", config=config)  # heads of 64 values
    model.set_dtype(mx.float16)
    float_bytes = kv_token_bytes(model, FLOAT)
    assert float_bytes == 3 * 2 * 64 * 2  # layers x (keys, values) x head x bytes
    assert kv_token_bytes(model, kv_form(8)) <= 0.55 * float_bytes
    assert kv_token_bytes(model, kv_form(4)) <= 0.3 * float_bytes


def test_generate_refuses_a_configuration_this_device_cannot_hold(monkeypatch):
    from mlxspec.cli import main

    monkeypatch.setattr(memory, "device_memory", lambda: 64 << 20)  # 64 MB
    result = CliRunner().invoke(main, ["generate", "hi", "-m", "smollm2-135m", "-n", "2"])
    assert result.exit_code == 1
    line = [text for text in result.output.splitlines() if "does not fit" in text]
    assert len(line) == 1 and "weights 0." in line[0] and "KV" in line[0]


def test_the_files_say_what_smollm2_holds_before_it_loads():
    from mlxspec.models.footprint import footprint
    from mlxspec.models.loading import weights_location

    where, present = weights_location("smollm2-135m")
    if not present:
        pytest.skip("SmolLM2 is not pulled here")
    found = footprint(where)
    # layers x (K, V) x KV heads x head_dim, float32 as every GGUF's activations are
    assert found.kv_token(FLOAT) == 30 * 2 * 3 * 64 * 4
    assert 0 < found.weights < 300 << 20


def test_serve_refuses_before_loading_what_cannot_fit(monkeypatch):
    from mlxspec.cli import main

    monkeypatch.setattr(memory, "device_memory", lambda: 64 << 20)  # 64 MB
    loaded = []
    import mlxspec.registry.runtime as runtime

    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: loaded.append(a))
    result = CliRunner().invoke(main, ["serve", "-m", "smollm2-135m", "--port", "65001"])
    assert result.exit_code == 1 and not loaded
    assert "does not fit" in result.output and "8192 tokens x 1 row" in result.output


def test_models_shows_what_smollm2_holds_at_its_context_float_and_quantized():
    from mlxspec.cli import main

    listing = json.loads(CliRunner().invoke(main, ["models", "--json"]).output)
    row = next(row for row in listing["models"] if row["name"] == "smollm2-135m")
    if not row["present"]:
        pytest.skip("SmolLM2 is not pulled here")
    memory_row = row["memory"]
    assert memory_row["context"] == 8192
    kv = memory_row["kv_gb"]
    assert kv["float"] == round(8192 * 46080 / GB, 2)  # a GGUF's KV is float32
    assert kv["4-bit"] < kv["8-bit"] <= 0.55 * kv["float"]


def test_chat_refuses_before_its_screen_opens_what_cannot_fit(monkeypatch):
    from mlxspec.cli import main

    monkeypatch.setattr(memory, "device_memory", lambda: 64 << 20)  # 64 MB
    result = CliRunner().invoke(main, ["chat", "-m", "smollm2-135m", "--plain"], input="hi\n")
    assert result.exit_code == 1 and "does not fit" in result.output


@pytest.mark.parametrize("dequantize", [True, False])
def test_the_files_estimate_is_what_the_loaded_model_holds_in_its_form(tmp_path, dequantize):
    """Read before loading, in the form `--weights` loads it in: a Q8_0 GGUF dequantized
    holds float32 weights (4 bytes a weight, not its file's bytes), kept quantized MLX's
    affine blocks with float32 scales (more than the file's), and a GGUF's KV is
    float32 on both paths (counting the file's bytes and float16 KV let a context 2x too
    long load, then be refused)."""
    from tiny_gguf import write_tiny_gguf

    from mlxspec.models.footprint import footprint
    from mlxspec.models.loading import load_model
    from mlxspec.registry.runtime import weight_bytes

    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    found = footprint(path, dequantize)
    loaded = load_model(str(path), dequantize=dequantize)
    held = weight_bytes(loaded.model)
    assert found.weights == held
    assert found.kv_token(FLOAT) == kv_token_bytes(loaded.model)
