"""Training data for drafter heads: token sequences and the target's hidden states.

The target is the teacher. Its final-normed hidden states are all a head needs: the
teacher's distribution at position i is its LM head applied to h_i, so storing hidden
states (fp16) instead of logits keeps the cache small. Sequences come from three
sources that need no network:
- `self-distill`: the target's own greedy answers to the built-in chat prompts
  (`prompts.py`; generated in batches by mlx-lm's `batch_generate`), the distribution a
  chat drafter faces;
- `text`: documentation that ships with Python (pydoc's topics) and installed packages'
  descriptions, teacher-forced (fast: prefill only);
- `file`: the user's own texts and chats (`--data`), teacher-forced the same way.

Data is written in shards as it is made and the manifest says what is done, so an
interrupted run picks up where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.drafter.answers import AnswerSet, encode_prompt
from mlxspec.markup.chat_template import encode_chat
from mlxspec.models.anatomy import Decoder

MANIFEST = "manifest.json"


def offline_texts() -> Iterator[str]:
    """English prose that installs with Python and its packages."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata.get("Name") or ""):
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else ""
        if body and len(body) > 500:
            yield body


def text_sequences(tokenizer, length: int, limit_tokens: int) -> list[list[int]]:
    """`offline_texts` cut into token windows of `length`, up to `limit_tokens` in all."""
    out, total = [], 0
    for text in offline_texts():
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - length // 4, length):
            out.append(ids[start : start + length])
            total += len(out[-1])
            if total >= limit_tokens:
                return out
    return out


def teacher_hidden(
    decoder: Decoder, sequences: list[list[int]], batch: int = 8
) -> list[np.ndarray]:
    """The target's final-normed hidden states of each sequence (teacher-forced)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # little padding
    found: dict[int, np.ndarray] = {}
    for start in range(0, len(order), batch):
        group = order[start : start + batch]
        width = max(len(sequences[i]) for i in group)
        padded = [sequences[i] + [0] * (width - len(sequences[i])) for i in group]  # right pad:
        hidden = decoder.hidden(mx.array(padded), [None] * len(decoder.layers))  # causal, so
        hidden = np.asarray(hidden.astype(mx.float16))  # pads never reach real positions
        for row, i in enumerate(group):
            found[i] = hidden[row, : len(sequences[i])]
    return [found[i] for i in range(len(sequences))]


@dataclass
class Shard:
    tokens: np.ndarray  # (N,) int32, sequences back to back
    hidden: np.ndarray  # (N, d) float16
    offsets: np.ndarray  # (S + 1,) where each sequence starts; the last is N
    prompt_lengths: np.ndarray  # (S,) tokens of each sequence that were prompt (not answer)

    def sequences(self) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        for s in range(len(self.offsets) - 1):
            a, b = self.offsets[s], self.offsets[s + 1]
            yield self.tokens[a:b], self.hidden[a:b], int(self.prompt_lengths[s])


class DataStore:
    """A folder of shards plus a manifest of what each source has done so far."""

    def __init__(self, directory: Path, target: str, hidden_size: int):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST
        self.manifest = json.loads(path.read_text()) if path.is_file() else {}
        if self.manifest and (
            self.manifest.get("target") != target or self.manifest.get("hidden_size") != hidden_size
        ):
            raise ValueError(
                f"{directory} holds data for '{self.manifest.get('target')}', not '{target}'; "
                "pass another --data-dir"
            )
        self.manifest.update(target=target, hidden_size=hidden_size)
        self.manifest.setdefault("shards", [])
        self.manifest.setdefault("done", {})

    def done(self, source: str) -> int:
        return self.manifest["done"].get(source, 0)

    def add(
        self,
        source: str,
        sequences: list[list[int]],
        hidden: list[np.ndarray],
        prompt_lengths: list[int],
        units: int,
    ) -> None:
        """Write one shard, then record `units` more of `source` as done (atomically)."""
        name = f"{source}-{len(self.manifest['shards']):05d}.npz"
        lengths = [len(s) for s in sequences]
        np.savez(
            self.directory / name,
            tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]),
            hidden=np.concatenate(hidden).astype(np.float16),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            prompt_lengths=np.asarray(prompt_lengths, np.int32),
        )
        self.manifest["shards"].append(
            {"file": name, "source": source, "tokens": int(sum(lengths))}
        )
        self.manifest["done"][source] = self.done(source) + units
        tmp = self.directory / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1))
        tmp.replace(self.directory / MANIFEST)

    def tokens(self, source: str | None = None) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"] if source in (None, s["source"]))

    def shards(self, source: str | None = None) -> list[Shard]:
        out = []
        for entry in self.manifest["shards"]:
            if source in (None, entry["source"]):
                with np.load(self.directory / entry["file"]) as f:
                    out.append(Shard(f["tokens"], f["hidden"], f["offsets"], f["prompt_lengths"]))
        return out


def self_distill(
    model,
    tokenizer,
    decoder: Decoder,
    store: DataStore,
    prompts: list[str],
    source: str = "self-distill",
    max_tokens: int = 192,
    batch: int = 32,
    progress: Callable[[int, int], None] = lambda done, total: None,
    answered: AnswerSet | None = None,
) -> None:
    """The target's greedy answers to `prompts`, with its hidden states, into `store`.
    Answers already in `answered` (the committed answer set, `answers.py`) are taken
    from it; only the hidden states are computed, by one prefill."""
    from mlx_lm.generate import batch_generate

    eos = next(iter(tokenizer.eos_token_ids))
    progress(store.done(source), len(prompts))
    for start in range(store.done(source), len(prompts), batch):
        group = prompts[start : start + batch]
        encoded = [encode_prompt(tokenizer, p) for p in group]
        known = [answered.sequence(p, eos, max_tokens) if answered else None for p in group]
        missing = [i for i, sequence in enumerate(known) if sequence is None]
        if missing:
            generated = batch_generate(
                model,
                tokenizer,
                [encoded[i] for i in missing],
                max_tokens=max_tokens,
                return_token_ids=True,
            ).token_ids
            for i, answer in zip(missing, generated):
                ending = [eos] if len(answer) < max_tokens else []
                known[i] = encoded[i] + list(answer) + ending
        sequences = [list(sequence) for sequence in known]
        store.add(
            source,
            sequences,
            teacher_hidden(decoder, sequences),
            [len(p) for p in encoded],
            len(group),
        )
        progress(min(start + batch, len(prompts)), len(prompts))


def add_text(
    decoder: Decoder,
    tokenizer,
    store: DataStore,
    limit_tokens: int,
    length: int = 256,
    per_shard: int = 64,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Teacher-forced windows of offline text into `store`, up to `limit_tokens`."""
    windows = text_sequences(tokenizer, length, limit_tokens)
    _add_windows(decoder, store, "text", windows, per_shard, progress)


class DataFileError(ValueError):
    """A --data file that cannot be trained on; the message names the file and the line."""


def read_data_file(path: Path) -> list[tuple[str, str | list[dict]]]:
    """The user's own data, checked before anything loads: (where, a text or a chat) per
    item. A .jsonl file holds one item a line, {"text": "..."} or {"messages": [{"role":
    ..., "content": ...}, ...]} (an OpenAI-format chat, put through the chat template);
    any other file is one text."""
    try:
        raw = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFileError(f"{path} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise DataFileError(f"cannot read {path}: {err.strerror}") from None
    items: list[tuple[str, str | list[dict]]] = []
    if path.suffix != ".jsonl":
        items = [(str(path), raw)] if raw.strip() else []
    else:
        for n, line in enumerate(raw.splitlines(), 1):
            where = f"{path} line {n}"
            item = _item(line, where)
            if item:
                items.append((where, item))
    if not items:
        raise DataFileError(f"{path} holds no text to train on")
    return items


def _item(line: str, where: str) -> str | list[dict]:
    """One JSONL line's text or chat ("" for a blank line)."""
    if not line.strip():
        return ""
    try:
        item = json.loads(line)
    except ValueError as err:
        raise DataFileError(f"{where}: not JSON ({err})") from None
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return item["text"]
    messages = item.get("messages") if isinstance(item, dict) else None
    if isinstance(messages, list) and messages and all(_is_message(m) for m in messages):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise DataFileError(
        f'{where}: expected {{"text": "..."}} or '
        '{"messages": [{"role": "user", "content": "..."}, ...]}'
    )


def _is_message(message) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def encode_items(
    tokenizer, items: list[tuple[str, str | list[dict]]], path: Path
) -> list[list[int]]:
    """Token ids of each text or chat of `path` that has something to learn from (2+ tokens)."""
    out = []
    for where, item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item)
        else:
            try:
                ids = encode_chat(tokenizer, item, generation_prompt=False)
            except Exception as err:  # the template's own checks (e.g. roles must alternate)
                raise DataFileError(f"{where}: the chat template refused it ({err})") from None
        if len(ids) > 1:
            out.append(ids)
    if not out:
        raise DataFileError(f"{path} holds no text to train on")
    return out


def add_file(
    decoder: Decoder,
    tokenizer,
    store: DataStore,
    path: Path,
    length: int = 256,
    per_shard: int = 64,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """The user's own texts and chats (`read_data_file`), teacher-forced in windows of
    `length` tokens: what the target would say at each position is the lesson, whoever
    wrote the text."""
    windows = [
        ids[start : start + length]
        for ids in encode_items(tokenizer, read_data_file(path), path)
        for start in range(0, max(len(ids) - 2, 1), length)
    ]
    _add_windows(decoder, store, "file", windows, per_shard, progress)


def _add_windows(
    decoder: Decoder,
    store: DataStore,
    source: str,
    windows: list[list[int]],
    per_shard: int,
    progress: Callable[[int, int], None],
) -> None:
    """Teacher states of text windows (no prompt part), a shard at a time, resumable."""
    progress(store.done(source), len(windows))
    for start in range(store.done(source), len(windows), per_shard):
        group = windows[start : start + per_shard]
        store.add(source, group, teacher_hidden(decoder, group), [0] * len(group), len(group))
        progress(min(start + per_shard, len(windows)), len(windows))
