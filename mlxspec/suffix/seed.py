"""The seed history: a model's own greedy answers to the built-in drafter prompts, as a
ready history for suffix decoding before the user has any.

A model repeats its own phrasing from one answer to the next, so its answers to a few
hundred varied questions draft part of its answer to the next one. The answers ship
with the package (`mlxspec/drafter/answers/`, committed once, shared with drafter
training); the index over them is built in memory at the first suffix round that reads
history (a fraction of a second), never written anywhere, and in particular never into
the user's own history store: that stays the user's requests only. It is read exactly
when the user's history is (not with `--no-history`, `history = false` or an API
request's `"history": false`).
"""

from __future__ import annotations

import numpy as np

from mlxspec.drafter.answers import shipped_answers
from mlxspec.suffix.index import SENTINEL, PrefixIndex

_BUILT: dict[str, PrefixIndex | None] = {}


def seed_documents(target: str, tokenizer) -> list[list[int]]:
    """Prompt (as the model saw it) + answer per shipped answer of `target`, as the
    history stores a request (end-of-sequence token left out); none for a model without
    shipped answers or whose tokenizer differs from the one that made them."""
    answers = shipped_answers(target, tokenizer)
    if answers is None:
        return []
    return [p + a for p, a in zip(answers.prompt_ids, answers.answer_ids)]


def seed_index(target: str, tokenizer) -> PrefixIndex | None:
    """The seed's prefix index (built once per process), or None where there is none."""
    if target not in _BUILT:
        documents = seed_documents(target, tokenizer)
        if documents:
            stream = [SENTINEL]
            for document in documents:
                stream += [*document, SENTINEL]
            _BUILT[target] = PrefixIndex(np.asarray(stream, np.int32))
        else:
            _BUILT[target] = None
    return _BUILT[target]
