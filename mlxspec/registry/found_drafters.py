"""Which drafter a model found on the disk can have: another found model with the same
vocabulary, much smaller. A draft model's tokens must mean the target's (the engine checks
again when it loads one), so the match is the token list itself, in id order, whatever
format holds it: an MLX folder's tokenizer.json or a GGUF's `tokenizer.ggml.tokens`.

llama.cpp's converter pads a GGUF's token list to the embedding's rows with `[PADn]` tokens
(Qwen 2.5: 151,665 tokens padded to 151,936) and spells SentencePiece tokens of spaces alone
with real spaces (Gemma); both are undone before comparing, so a GGUF target can take an MLX
drafter and the other way round.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

from mlxspec.paths import cache_dir, file_lock

# A drafter must cost little beside the target: at most a quarter of its bytes, and the one
# nearest a tenth is taken first (the ratio at which published draft pairs sit: Qwen3 0.6B
# for 8B, Llama 3.2 1B for 8B).
DRAFT_AT_MOST = 0.25
DRAFT_AIM = 0.1
PAD_TOKEN = re.compile(r"\[PAD\d+\]")
SPM_SPACE = "\u2581"
KEYS_FILE = "found-vocabularies.json"  # tokenizer.json's key by its path, size and mtime


def tokens_key(tokens: list[str]) -> str:
    """The vocabulary's fingerprint: its tokens in id order, padding cut, spaces as '▁'."""
    end = len(tokens)
    while end and PAD_TOKEN.fullmatch(tokens[end - 1]):
        end -= 1
    spelt = [SPM_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens[:end]]
    return hashlib.sha256(json.dumps(spelt).encode()).hexdigest()[:16]


def folder_key(folder: Path) -> str | None:
    """tokens_key of an MLX folder's tokenizer.json (None: it has none that reads), kept in
    the cache dir by the file's size and time, since a big one takes a while to parse."""
    path = folder / "tokenizer.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    stamp = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    keys_file = cache_dir() / KEYS_FILE
    keys = _read_keys(keys_file)
    if stamp in keys:
        return keys[stamp]
    key = _tokenizer_json_key(path)
    if key is not None:
        try:
            with file_lock(keys_file.with_suffix(".lock")):
                keys = {s: k for s, k in _read_keys(keys_file).items() if _still_there(s)}
                keys[stamp] = key
                keys_file.write_text(json.dumps(keys))
        except OSError:
            pass  # a read-only cache dir: the key is found again next time
    return key


def drafters_for(target, found: Iterable) -> list:
    """The runnable found models that can draft for `target` (a FoundModel): the same
    vocabulary, at most a quarter of its size, the one nearest a tenth of it first."""
    if not target.runnable or target.vocabulary is None or not target.size_bytes:
        return []
    matches = [
        model
        for model in found
        if model.runnable
        and model.path != target.path
        and model.vocabulary == target.vocabulary
        and 0 < model.size_bytes <= DRAFT_AT_MOST * target.size_bytes
    ]
    aim = math.log(DRAFT_AIM)
    return sorted(matches, key=lambda m: abs(math.log(m.size_bytes / target.size_bytes) - aim))


def _tokenizer_json_key(path: Path) -> str | None:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        vocab = document["model"]["vocab"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None
    by_id: dict[int, str] = {}
    if isinstance(vocab, dict):  # BPE, WordPiece: token -> id
        by_id.update((token_id, token) for token, token_id in vocab.items())
    else:  # Unigram: [piece, score] in id order
        by_id.update((token_id, piece[0]) for token_id, piece in enumerate(vocab))
    for added in document.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
    if not by_id:
        return None
    return tokens_key([by_id.get(i, f"[PAD{i}]") for i in range(max(by_id) + 1)])


def _read_keys(path: Path) -> dict[str, str]:
    try:
        keys = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return keys if isinstance(keys, dict) else {}


def _still_there(stamp: str) -> bool:
    return Path(stamp.rsplit(":", 2)[0]).exists()
