"""A model's own greedy answers to the built-in drafter prompts, kept as token ids.

Answers cost the most to make (batched generation: ~40 min for a few hundred on a
2-core CPU) and the least to keep (prompt and answer ids, a few MB compressed), so they
are made once and committed; everything derived from them is recomputed: a drafter's
teacher states by one prefill (`data.self_distill`), the suffix seed history
(`mlxspec/suffix/seed.py`) by indexing them.

An answer set is two files beside each other (shipped in the wheel under
`mlxspec/drafter/answers/` for the packaged models):
- `<model>.<split>.npz`: `tokens` (uint16 when the vocabulary fits, else uint32; each
  prompt then its answer, back to back), `prompt_lengths`, `answer_lengths` and
  `ended` (the answer stopped at an end-of-sequence token, which is not stored);
- `<model>.<split>.json`: the manifest (model, vocabulary size and tokenizer hash,
  settings, count) and the prompt texts, in order.
Both are replaced whole (write to a temporary file, then rename), the arrays first, so
a kill between the two leaves more arrays than prompts, and only the prompts the
manifest names are read. Adding answers skips the prompts already answered: a
generation run can stop at any batch and a later one extends it.

Read them with `read_answers(model)`; `python -m mlxspec.drafter.answers` adds more.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from mlxspec.drafter.prompts import chat_prompts
from mlxspec.markup.chat_template import encode_chat

SHIPPED = Path(__file__).parent / "answers"
SPLITS = ("train", "held-out")
FORMAT = 1
MAX_TOKENS = 256


class AnswerSetError(ValueError):
    """An answer set made with another tokenizer or settings: one line for the user."""


def tokenizer_hash(tokenizer) -> str:
    """A short hash of the vocabulary's size and every 64th token's string: answers are
    only valid for the tokenizer that made them, and two tokenizers that agree on those
    are the same in practice (hashing the whole vocabulary took ~0.5 s, paid at the
    first suffix round of every process)."""
    size = len(tokenizer.get_vocab())
    sample = tokenizer.convert_ids_to_tokens(list(range(0, size, 64)))
    return hashlib.sha256(json.dumps([size, sample]).encode()).hexdigest()[:16]


@dataclass
class AnswerSet:
    """Prompts and the model's greedy answers, in the order they were answered."""

    manifest: dict
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    answer_ids: list[list[int]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def sequences(self, eos: int) -> Iterator[tuple[list[int], int]]:
        """(prompt + answer [+ eos], prompt length) per answer, in order."""
        for prompt, answer, ended in zip(self.prompt_ids, self.answer_ids, self.ended):
            yield prompt + answer + ([eos] if ended else []), len(prompt)

    def answered(self) -> dict[str, int]:
        return {prompt: i for i, prompt in enumerate(self.prompts)}

    def sequence(self, prompt: str, eos: int, max_answer: int) -> list[int] | None:
        """prompt + answer [+ eos] for `prompt`, as a generation of at most `max_answer`
        tokens would have made it; None when not answered, or answered shorter than
        that without ending (the set was made with a smaller max_tokens)."""
        i = self.answered().get(prompt)
        if i is None or (not self.ended[i] and len(self.answer_ids[i]) < max_answer):
            return None
        answer = self.answer_ids[i]
        tail = [eos] if self.ended[i] and len(answer) <= max_answer else []
        return self.prompt_ids[i] + answer[:max_answer] + tail


def paths(model: str, split: str = "train", folder: Path = SHIPPED) -> tuple[Path, Path]:
    """(arrays, manifest) of an answer set."""
    if split not in SPLITS:
        raise AnswerSetError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    return folder / f"{model}.{split}.npz", folder / f"{model}.{split}.json"


def read_answers(model: str, split: str = "train", folder: Path = SHIPPED) -> AnswerSet | None:
    """The answer set of `model` (None when there is none). This is the function a
    drafter's training (or anything else) reads the committed data with."""
    arrays_path, manifest_path = paths(model, split, folder)
    if not manifest_path.is_file() or not arrays_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    prompts = manifest.pop("prompts")
    with np.load(arrays_path) as arrays:
        tokens = arrays["tokens"].astype(np.int64)
        prompt_lengths = arrays["prompt_lengths"].tolist()
        answer_lengths = arrays["answer_lengths"].tolist()
        ended = arrays["ended"].tolist()
    answers = AnswerSet(manifest, list(prompts))
    offset = 0
    for prompt_length, answer_length, stop in zip(
        prompt_lengths[: len(prompts)], answer_lengths, ended
    ):
        middle = offset + prompt_length
        answers.prompt_ids.append(tokens[offset:middle].tolist())
        answers.answer_ids.append(tokens[middle : middle + answer_length].tolist())
        answers.ended.append(bool(stop))
        offset = middle + answer_length
    if len(answers.answer_ids) < len(prompts):
        raise AnswerSetError(f"{arrays_path} holds fewer answers than {manifest_path} names")
    return answers


def shipped_answers(target: str, tokenizer, split: str = "train") -> AnswerSet | None:
    """The committed answer set of a packaged target, when one ships and was made with
    this tokenizer (else None: a hub id or a path has none)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", target):
        return None
    answers = read_answers(target, split)
    if answers is None:
        return None
    try:
        check_matches(answers, tokenizer)
    except AnswerSetError:
        return None
    return answers


def write_answers(answers: AnswerSet, model: str, split: str, folder: Path) -> None:
    """Replace both files whole, the arrays first (see the module's docstring)."""
    arrays_path, manifest_path = paths(model, split, folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = answers.manifest["vocab_size"]
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    flat = [t for p, a in zip(answers.prompt_ids, answers.answer_ids) for t in (*p, *a)]
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        tokens=np.asarray(flat, dtype),
        prompt_lengths=np.asarray([len(p) for p in answers.prompt_ids], np.int32),
        answer_lengths=np.asarray([len(a) for a in answers.answer_ids], np.int32),
        ended=np.asarray(answers.ended, bool),
    )
    answers.manifest.update(
        count=len(answers),
        answer_tokens=sum(len(a) for a in answers.answer_ids),
        prompt_tokens=sum(len(p) for p in answers.prompt_ids),
    )
    _replace(arrays_path, buffer.getvalue())
    manifest = {**answers.manifest, "prompts": answers.prompts}
    _replace(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def new_manifest(model: str, tokenizer, max_tokens: int) -> dict:
    return {
        "format": FORMAT,
        "model": model,
        "vocab_size": len(tokenizer.get_vocab()),
        "tokenizer_sha256": tokenizer_hash(tokenizer),
        "max_tokens": max_tokens,
        "decoding": "greedy, mlx-lm batch_generate",
        "prompt": "one user turn through the model's chat template, generation prompt on",
        "mlx_lm": metadata.version("mlx-lm"),
    }


def check_matches(answers: AnswerSet, tokenizer, max_tokens: int | None = None) -> None:
    """Refuse an answer set made for another tokenizer (or, when extending it, with a
    different answer length: the set would mix two settings)."""
    if answers.manifest.get("tokenizer_sha256") != tokenizer_hash(tokenizer):
        raise AnswerSetError(
            f"the answer set of '{answers.manifest.get('model')}' was made with another "
            "tokenizer; its token ids mean nothing to this one"
        )
    if max_tokens is not None and answers.manifest.get("max_tokens") != max_tokens:
        raise AnswerSetError(
            f"the answer set was made with max_tokens={answers.manifest.get('max_tokens')}; "
            f"extend it with the same (not {max_tokens})"
        )


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A user turn, ready for the answer."""
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)


def add_answers(
    model,
    tokenizer,
    name: str,
    prompts: list[str],
    split: str = "train",
    folder: Path = SHIPPED,
    max_tokens: int = MAX_TOKENS,
    batch: int = 16,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> AnswerSet:
    """Answer the `prompts` not answered yet (greedy), saving after every batch, so a
    run stopped at any point keeps what it finished and a later run goes on."""
    from mlx_lm.generate import batch_generate

    answers = read_answers(name, split, folder) or AnswerSet(
        new_manifest(name, tokenizer, max_tokens)
    )
    check_matches(answers, tokenizer, max_tokens)
    done = answers.answered()
    missing = [p for p in dict.fromkeys(prompts) if p not in done]
    progress(len(prompts) - len(missing), len(prompts))
    for start in range(0, len(missing), batch):
        group = missing[start : start + batch]
        encoded = [encode_prompt(tokenizer, p) for p in group]
        generated = batch_generate(
            model, tokenizer, encoded, max_tokens=max_tokens, return_token_ids=True
        ).token_ids
        for prompt, ids, answer in zip(group, encoded, generated):
            answers.prompts.append(prompt)
            answers.prompt_ids.append(list(ids))
            answers.answer_ids.append(list(answer))  # mlx-lm leaves the stop token out
            answers.ended.append(len(answer) < max_tokens)
        write_answers(answers, name, split, folder)
        progress(len(prompts) - len(missing) + start + len(group), len(prompts))
    return answers


def split_prompts(split: str) -> list[str]:
    return chat_prompts(held_out=split == "held-out")


def main(argv: list[str] | None = None) -> None:
    """Make or extend a model's answer set (a maintainer's tool; it writes beside the
    package, so the answers can be committed)."""
    import argparse

    from mlxspec.drafter.progress import progress_bar
    from mlxspec.models.loading import load_model
    from mlxspec.registry.models_toml import load_registry

    parser = argparse.ArgumentParser(prog="python -m mlxspec.drafter.answers")
    parser.add_argument("--model", default="smollm2-135m", help="a models.toml entry")
    parser.add_argument("--count", type=int, default=400, help="answers wanted in all")
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--folder", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    entry = load_registry().get(args.model)
    loaded = load_model(entry.target)
    prompts = split_prompts(args.split)[: args.count]
    add_answers(
        loaded.model,
        loaded.tokenizer,
        entry.name,
        prompts,
        args.split,
        args.folder,
        args.max_tokens,
        args.batch,
        progress_bar(f"{entry.name} {args.split}"),
    )


if __name__ == "__main__":
    main()
