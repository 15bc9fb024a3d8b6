"""The packaged Gemma 3 270M (the base model in Q4_K_M, from PyPI in four wheels): a GGUF
nobody here made, of the K-quant most published files use and an architecture beyond
llama (sliding-window layers, Gemma's norms), answers as the model does, and prompt
lookup gives plain decoding's tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_lossless import CPU_LIKE_COST

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.models.gguf_reader import tensor_types
from mlxspec.models.loading import load_model
from mlxspec.models.packaged import ensure_packaged_model
from mlxspec.proposers.lookup import PromptLookup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", progress=False, dequantize=True)


def test_the_file_is_a_k_quant_of_gemma3():
    kinds = set(tensor_types(ensure_packaged_model("gemma3-270m", progress=False)).values())
    assert "Q4_K" in kinds, kinds


def test_the_packaged_gemma_knows_what_comes_next(gemma):
    """What a 270M base model knows (measured: ' the', ' a', ' Paris' after the first
    prompt; ' four' after the second), each read from the file as written."""
    for prompt, word, among in (
        ("The capital of France is", "Paris", 3),
        ("One, two, three,", "four", 1),
    ):
        tokens = gemma.tokenizer.encode(prompt)
        logits = gemma.model(mx.array([tokens]))[0, -1]
        likeliest = [
            gemma.tokenizer.decode([t]).strip() for t in mx.argsort(-logits)[:among].tolist()
        ]
        assert word in likeliest, (prompt, likeliest)


def test_prompt_lookup_on_gemma_is_plain_greedy(gemma):
    model, tokenizer = gemma.model, gemma.tokenizer
    engine = Engine(model, tokenizer, "gemma3-270m", [PromptLookup()], verify_cost=CPU_LIKE_COST)
    text = "Repeat the list exactly: apple, banana, cherry, date, elderberry, fig, grape.\n"
    prompt = tokenizer.encode(text + text[:30])
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=40), "prompt-lookup"))[-1]
    reference = plain_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    assert_lossless(model, prompt, reference, list(done.token_ids), "gemma", done.record)
    assert done.record.accepted > 0  # the drafts were the model's own tokens
