"""Drafter heads in a batch: each row gets exactly the hidden states a request alone gets.

A head drafts from the target's hidden states of the tokens its row's cache took in
since the last round (`SingleCaches` hands them to a request alone). In the batch,
rows are left-padded, verified right-padded and trimmed to ragged lengths; a joining
request's prompt is prefilled over several rounds; one pass captures the union of the
rows' layers. Whatever the batch did, a row's states must be its own, with none of its
positions missed or handed over twice, and its output its plain greedy output.
"""

from __future__ import annotations

import random

import mlx.core as mx
from test_one_loop import repeating_prompt
from tiny_models import tiny_model

from mlxspec.batch.caches import BatchCaches
from mlxspec.target import Target


def fed_hidden(model, tokens: list[int], capture: tuple[int, ...]) -> mx.array:
    """The hidden states (len(tokens), F) one fresh single-sequence fill computes."""
    return Target(model).fill(tokens, capture=capture)[1]


def test_batch_caches_keep_each_row_the_hidden_states_of_the_tokens_it_kept():
    """Rows with different captures (and one with none), prefilled in chunks, then
    ragged verifies and keeps: after each, a row holds the states of exactly the tokens
    it kept, in its own capture's columns; a kept prefix is never reused for a row
    that captures (the pool keeps no hidden states), and still is for one that does not."""
    model = tiny_model("llama", seed=3)
    caches = BatchCaches(model, prefix_capacity=2)
    prompts = [repeating_prompt(1), repeating_prompt(2)[:19], repeating_prompt(3)[:9]]
    captures = [(), (1,), None]
    for request_id, (prompt, capture) in enumerate(zip(prompts, captures)):
        caches.start(request_id, prompt, capture)
        while not caches.advance(request_id, 8):
            pass
        caches.join(request_id)
    assert caches.hidden[2] is None
    for row in (0, 1):
        expected = fed_hidden(model, prompts[row], captures[row])
        assert mx.allclose(caches.hidden[row], expected, atol=1e-4).item(), f"row {row}"
    sequences = [list(p) for p in prompts]
    rng = random.Random(0)
    for _ in range(5):
        rows = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 4))] for _ in sequences]
        caches.verify(rows)
        n_keep = [rng.randint(1, len(row)) for row in rows]
        caches.keep(n_keep, max(map(len, rows)))
        for row, (tokens, kept) in enumerate(zip(rows, n_keep)):
            sequences[row] += tokens[:kept]
        assert caches.lengths() == [len(s) for s in sequences]
        assert caches.hidden[2] is None
        for row in (0, 1):
            expected = fed_hidden(model, sequences[row], captures[row])[-n_keep[row] :]
            assert caches.hidden[row].shape == expected.shape, f"row {row}"
            assert mx.allclose(caches.hidden[row], expected, atol=1e-4).item(), f"row {row}"
    caches.leave([1, 2], [(0, sequences[0])])
    follow_up = [*sequences[0], 7, 8]
    assert caches.start(10, follow_up, ()) == 0
    caches.advance(10, len(follow_up))
    caches.join(10)
    assert mx.allclose(caches.hidden[-1], fed_hidden(model, follow_up, ()), atol=1e-4).item()
    assert caches.start(11, follow_up, None) == len(sequences[0])  # the pool still serves
