"""GGUF tokenizers beyond SmolLM2's: Qwen's byte-level BPE (`tokenizer.ggml.pre` "qwen2": one
digit at a time, llama-vocab.cpp's regex) and SentencePiece (`tokenizer.ggml.model` "llama":
Gemma without the prefix space, Phi-3/Mistral with it), each checked against transformers' own
GGUF tokenizer converter, an implementation independent of mlxspec's."""

from __future__ import annotations

import pytest
from tiny_gguf import gguf_tokens
from tokenizers.pre_tokenizers import ByteLevel
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

from mlxspec.models.gguf_tokenizer import tokenizer_from_metadata

TEXTS = [
    "hello world",
    "Numbers 12345 and 3.14!",
    "  two spaces, then\ta tab\nand a new line",
    "it's what we'd've said",
    "héllo wörld – ünïcode ✓",
]


def oracle(architecture: str, metadata: dict):
    fields = {
        "tokenizer_type": metadata["tokenizer.ggml.model"],
        "pre_tokenizer_type": metadata.get("tokenizer.ggml.pre"),
        "tokens": metadata["tokenizer.ggml.tokens"],
        "token_type": metadata["tokenizer.ggml.token_type"],
    }
    for key in ("merges", "scores"):
        if f"tokenizer.ggml.{key}" in metadata:
            fields[key] = metadata[f"tokenizer.ggml.{key}"]
    backend, _ = convert_gguf_tokenizer(architecture, fields)
    return backend


def assert_encodes_as_transformers(ours, theirs, texts: list[str]) -> None:
    """The same ids as transformers' tokenizer, and decoded back to the text."""
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text


def qwen_metadata(pre: str = "qwen2", unmerged: tuple[str, ...] = ()) -> dict:
    """Byte tokens plus merges of digits and letters: where the split regex decides.
    `unmerged`: tokens no merge makes, which only a whole-word vocabulary reaches."""
    alphabet = sorted(ByteLevel.alphabet())
    merges = ["1 2", "12 3", "l l", "ll o", "h e", "he llo", "Ġ w", "Ġw o", "' s", "Ġ Ġ"]
    merges += ["4 5", "W o"]
    made = [merge.replace(" ", "") for merge in merges]
    tokens = [*alphabet, *made, *unmerged, "<|endoftext|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def spm_metadata(prefix_space: bool) -> dict:
    """A SentencePiece vocabulary: control tokens, 256 byte tokens, pieces with their scores."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁h", "he", "ll", "llo", "▁w", "or"]
    pieces += ["▁he", "▁hello", "hello", "▁wor", "▁world", "▁t", "wo", "▁two", "s", "pa", "▁s"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [3, 3, 3, 2, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.add_space_prefix": prefix_space,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
    }


def test_qwen2_pre_tokenizer_splits_digits_one_by_one_like_transformers():
    metadata = qwen_metadata()
    ours = tokenizer_from_metadata(metadata)
    theirs = oracle("qwen2", metadata)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
    # "123" is a token, but qwen2's regex puts each digit apart, so it is never made.
    assert metadata["tokenizer.ggml.tokens"].index("123") not in ours.encode("x 12345")


def test_llama3_pre_tokenizer_keeps_digits_in_threes_like_transformers():
    metadata = qwen_metadata("llama-bpe")
    ours = tokenizer_from_metadata(metadata)
    assert_encodes_as_transformers(ours, oracle("llama", metadata), [*TEXTS, "x 12345 y 1234567"])
    tokens = metadata["tokenizer.ggml.tokens"]
    # "12345" is split "123" + "45", both tokens; qwen2's regex would give five digits.
    assert ours.encode("12345", add_special_tokens=False) == [
        tokens.index("123"),
        tokens.index("45"),
    ]


def test_tekken_pre_tokenizer_splits_words_at_capitals_like_transformers():
    metadata = qwen_metadata("tekken")
    ours = tokenizer_from_metadata(metadata)
    texts = [*TEXTS, "helloWorld HELLO wo 12345"]
    assert_encodes_as_transformers(ours, oracle("llama", metadata), texts)


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken"])
def test_llama3_and_tekken_take_a_word_that_is_a_token_whole(pre):
    """llama-vocab.cpp's ignore_merges: a piece of the split that is itself a token is that
    token, even where no merge reaches it (tokenizer.json's "ignore_merges": true)."""
    metadata = qwen_metadata(pre, unmerged=("Ġworld",))
    ours = tokenizer_from_metadata(metadata)
    world = metadata["tokenizer.ggml.tokens"].index("Ġworld")
    assert ours.encode(" world", add_special_tokens=False) == [world]
    # Qwen's vocabulary merges only: the same token list never gives it.
    assert world not in tokenizer_from_metadata(qwen_metadata("qwen2", ("Ġworld",))).encode(
        " world"
    )


def test_llama3_adds_its_begin_token_unless_the_file_says_not_to():
    metadata = {**qwen_metadata("llama-bpe"), "tokenizer.ggml.bos_token_id": 0}
    assert tokenizer_from_metadata(metadata).encode("hi")[0] == 0
    metadata["tokenizer.ggml.add_bos_token"] = False
    assert tokenizer_from_metadata(metadata).encode("hi")[0] != 0
    # Qwen's files add no begin token unless they say so (llama.cpp's BPE default).
    qwen = {**qwen_metadata(), "tokenizer.ggml.bos_token_id": 0}
    assert tokenizer_from_metadata(qwen).encode("hi")[0] != 0


@pytest.mark.parametrize(("architecture", "prefix_space"), [("gemma3", False), ("phi3", True)])
def test_sentencepiece_tokenizer_matches_transformers(architecture, prefix_space):
    metadata = spm_metadata(prefix_space)
    ours = tokenizer_from_metadata(metadata)
    theirs = oracle(architecture, metadata)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, (text, ids)
        assert ours.decode(ids) == text, text
    hello = metadata["tokenizer.ggml.tokens"].index("▁hello")
    assert hello in ours.encode(" hello" if not prefix_space else "hello")
    # unknown characters come as their UTF-8 bytes, <0xXX>
    assert ours.encode("✓", add_special_tokens=False)[-3:] == [4 + 0xE2, 4 + 0x9C, 4 + 0x93]


def test_streaming_decode_of_sentencepiece_gives_the_text():
    tokenizer = tokenizer_from_metadata(spm_metadata(prefix_space=True))
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokenizer.encode("hello two worlds ✓", add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == "hello two worlds ✓"


def test_the_tiny_byte_vocabulary_still_round_trips():
    tokens = gguf_tokens()
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(tokens),
        "tokenizer.ggml.merges": ["Ġ Ġ"],
    }
    tokenizer = tokenizer_from_metadata(metadata)
    assert tokenizer.decode(tokenizer.encode(TEXTS[2])) == TEXTS[2]
