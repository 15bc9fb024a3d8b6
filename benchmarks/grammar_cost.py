"""What a grammar costs per request and per token: llguidance's tokenizer table, compiling
a tool schema, and one token mask along a tool call, on SmolLM2's 49k vocabulary and on a
150k one (SmolLM2's, grown with 100k made-up word pieces: a mask walks the vocabulary's
trie, so its size is what a Qwen- or Llama-sized vocabulary changes).

    python benchmarks/grammar_cost.py

Recorded results: docs/design/grammar.md.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import llguidance.hf
from llguidance import LLMatcher
from transformers import PreTrainedTokenizerFast

from mlxspec.models.loading import load_model
from mlxspec.structured.grammar import Grammar

WEATHER = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def grown(hf: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """`hf` with made-up word pieces added until it has `size` tokens."""
    data = json.loads(hf.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < size:
        piece = "Ġ" * rng.randrange(2) + "".join(rng.choices(letters, k=rng.randrange(2, 11)))
        vocab.setdefault(piece, len(vocab))
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token=hf.eos_token
    )


def measure(hf: PreTrainedTokenizerFast, label: str) -> None:
    start = time.perf_counter()
    table = llguidance.hf.from_tokenizer(hf)
    table_s = time.perf_counter() - start
    grammar = Grammar.json_schema(WEATHER).llguidance()
    start = time.perf_counter()
    matcher = LLMatcher(table, grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    masks = []
    for token in hf.encode(CALL, add_special_tokens=False):
        start = time.perf_counter()
        matcher.compute_bitmask()
        masks.append((time.perf_counter() - start) * 1e6)
        assert matcher.consume_token(token), "the call does not fit the schema"
    print(
        f"{label}: {len(hf)} tokens; table {table_s:.2f} s; compile {compile_ms:.1f} ms; "
        f"mask {statistics.mean(masks):.0f} us mean, {max(masks):.0f} us max "
        f"over {len(masks)} tokens"
    )


def main() -> None:
    hf = load_model("smollm2-135m", progress=False).tokenizer._tokenizer
    measure(hf, "SmolLM2")
    measure(grown(hf, 150_000), "SmolLM2 grown")


if __name__ == "__main__":
    main()
