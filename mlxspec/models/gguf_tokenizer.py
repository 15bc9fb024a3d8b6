"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, rebuilt with HF
`tokenizers`, since a GGUF carries no tokenizer.json.

Two kinds, as llama.cpp's llama-vocab.cpp has them: byte-level BPE (`gpt2`: SmolLM2, Llama 3,
Qwen), its text split first by the regex `tokenizer.ggml.pre` names; and SentencePiece (`llama`:
Gemma, Phi-3, Mistral 7B), whose merges llama.cpp makes from the token scores (the best-scoring
adjacent pair first), with bytes of unknown characters as `<0xXX>` tokens.
"""

from __future__ import annotations

import numpy as np
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

from mlxspec.models.gguf_metadata import GGUFError, python_number

# How llama.cpp splits text before BPE, by `tokenizer.ggml.pre` (see its llama-vocab.cpp).
# "smollm" (like starcoder) puts every digit on its own, then applies GPT-2's regex: exactly
# SmolLM2's own tokenizer.json, `Sequence[Digits(individual_digits), ByteLevel(use_regex)]`.
DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "codeshell"}
GPT2_PRE_TOKENIZERS = {"default", "gpt2"}
# LLAMA_VOCAB_PRE_TYPE_QWEN2's regex (Qwen 2/2.5/3 and their distills): one digit at a time.
QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_LLAMA3's (Llama 3.x, Falcon 3, LFM2...): digits in runs of up to three.
LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_TEKKEN's (Mistral Nemo, Mistral Small 3), as its tokenizer.json has it:
# letters split at a capital, one digit at a time.
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRE_TOKENIZERS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"}
LLAMA3_PRE_TOKENIZERS |= {"midm-2.0", "lfm2"}
SPLIT_PRE_TOKENIZERS = {
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(LLAMA3_PRE_TOKENIZERS, LLAMA3_SPLIT),
}
# llama-vocab.cpp sets `ignore_merges` (a word that is a token is taken whole, before any merge:
# tokenizer.json's "ignore_merges": true) and `add_bos` for these.
WHOLE_WORD_PRE_TOKENIZERS = LLAMA3_PRE_TOKENIZERS | {"tekken"}

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPM_SPACE = "\u2581"


def tokenizer_from_metadata(metadata: dict) -> TokenizerWrapper:
    """mlx-lm's tokenizer wrapper for the file's vocabulary, special tokens and template."""
    check_tokenizer(metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = np.array(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))).tolist()
    if metadata["tokenizer.ggml.model"] == "gpt2":
        backend = _byte_level_bpe(metadata, tokens)
        detokenizer, trim = BPEStreamingDetokenizer, None
    else:
        prefix_space = bool(python_number(metadata.get("tokenizer.ggml.add_space_prefix", True)))
        tokens = [_spm_spelling(token) for token in tokens]
        backend = _sentencepiece_bpe(metadata, tokens, types, prefix_space)
        detokenizer, trim = SPMStreamingDetokenizer, prefix_space
    _add_special_tokens(backend, tokens, types)

    def special(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[python_number(token_id)]

    bos_token = special("bos_token_id")
    bos_by_default = metadata.get("tokenizer.ggml.pre") in WHOLE_WORD_PRE_TOKENIZERS
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", bos_by_default)
    if bos_token is not None and python_number(add_bos):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A $B",
            special_tokens=[(bos_token, python_number(metadata["tokenizer.ggml.bos_token_id"]))],
        )
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        # Decoding must give back the exact text, as mlx-lm's streaming detokenizer does.
        clean_up_tokenization_spaces=False,
    )
    # The FIM tokens the file names, for markup/fim.py (which else finds them by their text).
    hf_tokenizer.gguf_fim_token_ids = {
        key: python_number(metadata[f"tokenizer.ggml.{key}_token_id"])
        for key in ("fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
        if f"tokenizer.ggml.{key}_token_id" in metadata
    }
    # Chat models end a turn with an end-of-turn token the metadata may name apart from EOS.
    end_of_turn = metadata.get("tokenizer.ggml.eot_token_id")
    extra_eos = [] if end_of_turn is None else [python_number(end_of_turn)]
    if trim is None:
        return TokenizerWrapper(hf_tokenizer, detokenizer, eos_token_ids=extra_eos)
    return TokenizerWrapper(
        hf_tokenizer, lambda tok: detokenizer(tok, trim_space=trim), eos_token_ids=extra_eos
    )


def check_tokenizer(metadata: dict) -> None:
    """GGUFError, one line, where the file's tokenizer is not one this module rebuilds."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(
            f"GGUF tokenizer {kind!r} is not supported (supported: byte-level BPE 'gpt2', "
            "SentencePiece 'llama')"
        )
    if kind == "gpt2":
        _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))


def _byte_level_bpe(metadata: dict, tokens: list[str]) -> Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    pre_type = metadata.get("tokenizer.ggml.pre", "default")
    backend = Tokenizer(
        models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre_type in WHOLE_WORD_PRE_TOKENIZERS,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(pre_type)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in DIGIT_SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_type in GPT2_PRE_TOKENIZERS:
        return byte_level
    if pre_type in SPLIT_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_PRE_TOKENIZERS[pre_type]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFError(f"GGUF pre-tokenizer {pre_type!r} is not supported yet")


def _spm_spelling(token: str) -> str:
    """Gemma's files keep tokens of only spaces with real spaces; the text they match is spelt
    with SentencePiece's '▁' (as transformers' GGUF reader notes too)."""
    return SPM_SPACE * len(token) if token and not token.strip(" ") else token


def _sentencepiece_bpe(
    metadata: dict, tokens: list[str], types: list[int], prefix_space: bool
) -> Tokenizer:
    """llama.cpp's llm_tokenizer_spm as BPE: each merge ranked by its result's score."""
    scores = np.array(metadata.get("tokenizer.ggml.scores", np.zeros(len(tokens)))).tolist()
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = []
    for token_id, token in enumerate(tokens):
        if types[token_id] != 1:  # only normal tokens are reached by merging
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[token_id], token_id, vocab[left], (left, right)))
    merges.sort()
    unknown = [token for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_UNKNOWN]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[merge for *_, merge in merges],
            unk_token=unknown[0] if unknown else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    spaces = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), spaces]) if prefix_space else spaces
    )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, token_type in zip(tokens, types)
            if token_type == TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(tokens, types)
            if token_type == TOKEN_TYPE_USER_DEFINED
        ]
    )
