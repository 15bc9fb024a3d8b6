"""Batched verify: several sequences share one target pass and keep their own lengths.

Every row's greedy output must equal its solo plain greedy output whatever shares the
batch, whenever it joined or others left, and however its drafts were cut.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from tiny_models import tiny_model

from mlxspec.batch import target as batch_target
from mlxspec.batch.target import BatchTarget, Prefill

BATCHED = ["llama", "qwen3"]


def greedy_rounds(target: BatchTarget, rows: dict, rng: random.Random, rounds: int) -> None:
    """Rounds of ragged, often corrupted drafts of each row's known continuation."""
    for _ in range(rounds):
        verified = []
        for row in rows.values():
            k = rng.randrange(0, 6)
            done = len(row["tokens"]) - len(row["prompt"])
            draft = list(row["reference"][done : done + k]) + [0] * k
            draft = draft[:k]
            if k and rng.random() < 0.7:
                draft[rng.randrange(k)] ^= 1
            verified.append([row["tokens"][-1], *draft])
        choices = mx.argmax(target.verify(verified), axis=-1).tolist()
        kept = []
        for row, line, choice in zip(rows.values(), verified, choices):
            n = 0
            while n < len(line) - 1 and line[n + 1] == choice[n]:
                n += 1
            row["tokens"].extend([*line[1 : n + 1], choice[n]])
            kept.append(n + 1)
        target.keep(kept, max(map(len, verified)))
        assert target.lengths() == [len(r["tokens"]) - 1 for r in rows.values()]


def new_row(model, prompt: list[int], reference: list[int]) -> tuple[Prefill, dict]:
    prefill = Prefill(model, prompt[:-1])
    while not prefill.done:
        prefill.advance(chunk=4)  # several chunks even for short prompts
    return prefill, {"prompt": prompt, "reference": reference, "tokens": list(prompt)}


@pytest.mark.parametrize("family", BATCHED)
def test_ragged_rows_join_and_leave_match_solo_greedy(family, monkeypatch):
    monkeypatch.setattr(batch_target, "COMPACT_AT", 3)  # compaction runs too
    model = tiny_model(family, seed=1)
    rng = random.Random(family)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 1, 9)]
    references = [plain_greedy(model, p, 60, set()) for p in prompts]
    target, rows = BatchTarget(model), {}
    for i in range(3):
        prefill, rows[i] = new_row(model, prompts[i], references[i])
        target.join(prefill)
    greedy_rounds(target, rows, rng, 6)
    target.leave([0, 2])  # row 1 leaves mid-way
    left = rows.pop(1)
    prefill, rows[3] = new_row(model, prompts[3], references[3])
    target.join(prefill)  # a late joiner
    greedy_rounds(target, rows, rng, 12)
    for i, row in [*rows.items(), (1, left)]:
        got = row["tokens"][len(row["prompt"]) :]
        n = min(len(got), 60)
        assert n >= 6
        assert_lossless(model, row["prompt"], references[i][:n], got[:n], f"{family} row {i}")


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_families_that_cannot_batch_are_refused_in_one_line(family):
    with pytest.raises(ValueError, match="batching needs plain KV caches") as err:
        BatchTarget(tiny_model(family))
    assert "\n" not in str(err.value)
