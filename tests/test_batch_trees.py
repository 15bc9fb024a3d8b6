"""Draft trees in a batch: rows' trees of different shapes, and lines, share one pass.

Each row's tree gets its own mask and its own RoPE positions (`BatchTarget.verify_tree`);
each row then keeps its accepted path (`keep_tree`). A row's node must see exactly the
logits of its path fed alone, and its cache after the keep must be the cache of its
kept tokens fed alone; every request's greedy output stays its solo plain greedy output.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_batch import collect, fed_alone, greedy_rounds, joined, sample_prompts
from test_batch_hidden import fed_hidden
from test_lossless import CPU_LIKE_COST, MAX_TOKENS
from test_one_loop import repeating_prompt
from test_trees import SHAPE, TreeOracle
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.rows import cut_tree, first_guess
from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.events import Done
from mlxspec.models.tree import DraftTree, chain
from mlxspec.proposers import Lookahead, PromptLookup

# A second shape: three children of the root, the middle one with two of its own.
FAN = DraftTree([20, 21, 22, 23, 24], [0, 0, 0, 2, 2])


def node_logits_alone(model, tokens: list[int], tree: DraftTree) -> list[mx.array]:
    """The logits after each node's path (root first), from the row's tokens fed alone."""
    return [
        model(mx.array([tokens + tree.path_tokens(node)]))[0, -1] for node in range(len(tree) + 1)
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_rows_nodes_see_their_own_path_and_keep_it_in_the_cache(family):
    """Rows of different lengths (left padding), shuffled by earlier ragged rounds,
    verify two tree shapes and a line in one pass; then each keeps a different path,
    a side branch included, and holds what its kept tokens fed alone leave."""
    model = tiny_model(family, seed=5)
    rng = random.Random(family)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (11, 3, 7)]
    target, rows = joined(model, prompts)
    greedy_rounds(target, rows, rng, 6)  # ragged keeps: left padding, shuffled tails
    trees = [SHAPE, chain([30, 31]), FAN]
    verified = [[row["tokens"][-1], *tree.tokens] for row, tree in zip(rows.values(), trees)]
    logits, _ = target.verify_tree(verified, trees)
    for i, (row, tree) in enumerate(zip(rows.values(), trees)):
        for node, alone in enumerate(node_logits_alone(model, row["tokens"], tree)):
            got = logits[i, node]
            assert mx.abs(got - alone).max().item() < 1e-4, f"row {i} node {node}"
    paths = [[1, 4], [], [2, 5]]  # SHAPE: root -> 1 -> 4; the line refused; FAN: a side branch
    target.keep_tree([[0, *path] for path in paths], max(map(len, verified)))
    for row, tree, path in zip(rows.values(), trees, paths):
        row["tokens"].extend(tree.tokens[node - 1] for node in path)
        row["tokens"].append(0)  # a stand-in next pending token: the cache holds the rest
    assert target.lengths() == [len(r["tokens"]) - 1 for r in rows.values()]
    for i, row in rows.items():
        solo = fed_alone(model, row["tokens"][:-1])
        for layer in target.attention:
            handed = target.extract(i)[layer]
            n = solo[layer].offset
            for name in ("keys", "values"):
                got, alone = getattr(handed, name), getattr(solo[layer], name)[..., :n, :]
                assert mx.allclose(got, alone, atol=1e-4), f"row {i} layer {layer} {name}"


def test_capturing_rows_keep_the_hidden_states_of_their_kept_path():
    """Rows whose proposer reads hidden states (a head's, one layer's, none) verify trees:
    after the keep, a capturing row holds the states of its root and its kept path's
    nodes, side branch included, in its own capture's columns."""
    model = tiny_model("llama", seed=3)
    caches = BatchCaches(model, prefix_capacity=0)
    prompts = [repeating_prompt(1)[:13], repeating_prompt(2)[:6], repeating_prompt(3)[:9]]
    captures = [(), (1,), None]
    for request_id, (prompt, capture) in enumerate(zip(prompts, captures)):
        caches.start(request_id, prompt[:-1], capture)
        while not caches.advance([request_id], 4):
            pass
        caches.join([request_id])
    trees, paths = [SHAPE, FAN, chain([5, 6])], [[2, 5], [3], [1]]
    rows = [[prompt[-1], *tree.tokens] for prompt, tree in zip(prompts, trees)]
    caches.verify_tree(rows, trees)
    caches.keep_tree(paths, max(map(len, rows)))
    assert caches.hidden[2] is None
    for row in (0, 1):
        kept = [prompts[row][-1], *(trees[row].tokens[node - 1] for node in paths[row])]
        tokens = [*prompts[row], *kept[1:]]
        expected = fed_hidden(model, tokens, captures[row])[-len(kept) :]
        assert caches.hidden[row].shape == expected.shape, f"row {row}"
        assert mx.allclose(caches.hidden[row], expected, atol=1e-4).item(), f"row {row}"


def tree_scheduler(family: str, seed: int) -> Scheduler:
    engine = Engine(
        tiny_model(family, seed=seed), byte_tokenizer(), family, verify_cost=CPU_LIKE_COST
    )
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    engine.add_proposer(Lookahead("lookahead"))
    scheduler = Scheduler(engine, max_batch=8)
    scheduler.prefill_chunk = 4
    return scheduler


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_requests_share_the_batch_and_equal_their_solo_greedy_output(family):
    """Tree requests (a branching oracle at a fixed depth, lookup asked for trees,
    lookahead, which always branches) beside a line and a plain request, staggered:
    each output is its solo plain greedy output, and the tree rows verified trees in
    rounds they shared."""
    scheduler = tree_scheduler(family, seed=3)
    model, eos = scheduler.engine.target.model, {VOCAB - 1}
    prompts = sample_prompts(4)
    references = [plain_greedy(model, p, MAX_TOKENS, eos) for p in prompts]
    tree = GenerationSettings(max_tokens=MAX_TOKENS, k=3, tree=True)
    requests = [
        (prompts[0], tree, TreeOracle(len(prompts[0]), references[0])),
        (prompts[1], GenerationSettings(max_tokens=MAX_TOKENS, tree=True), "lookup"),
        (prompts[2], GenerationSettings(max_tokens=MAX_TOKENS), None),
        (prompts[3], tree, TreeOracle(len(prompts[3]), references[3])),
        (prompts[4], GenerationSettings(max_tokens=MAX_TOKENS, k=2), "lookahead"),
    ]
    first = [scheduler.submit(*request) for request in requests[:3]]
    events = collect(scheduler, late=requests[3:])
    assert sorted(events) == [*first, 3, 4]
    records = {}
    for i, got in events.items():
        done = got[-1]
        assert isinstance(done, Done)
        assert_lossless(model, prompts[i], references[i], list(done.token_ids), f"{family} {i}")
        records[i] = done.record
    for i in (0, 3, 4):  # branching sources: trees verified beside other rows
        assert records[i].tree_rounds > 0, f"request {i} verified no tree"
        assert any(records[i].batch_sizes[2:]), f"request {i} never shared a round"
    assert 0 < records[0].accepted < records[0].drafted  # branches refused: rollback ran
    assert records[1].tree and not records[2].tree


def test_a_tree_is_cut_to_the_round_width_by_its_likeliest_nodes():
    scored = DraftTree([1, 2, 3, 4], [0, 0, 1, 2], [0.9, 0.2, 0.8, 0.1])
    assert cut_tree(scored, 2) == DraftTree([1, 3], [0, 1], [0.9, 0.8])
    assert cut_tree(DraftTree([1, 2, 3], [0, 0, 1]), 2) == DraftTree([1, 2], [0, 0])
    assert cut_tree(chain([5, 6, 7]), 1) == chain([5])


def test_a_row_cut_to_a_plain_round_learns_from_its_trees_likeliest_first_token():
    """While the width is 0 a row's first draft token is checked against the target's
    own; a tree's nodes of one depth come in no order of likelihood (a head's top
    choices from `argpartition`), so its first token is its likeliest child of the root."""
    unsorted = DraftTree([7, 8, 9, 5], [0, 0, 2, 0], [0.2, 0.7, 0.6, 0.1])
    assert first_guess(unsorted) == 8
    assert first_guess(DraftTree([7, 8, 9], [0, 1, 0])) == 7  # no scores: the first child
    assert first_guess(chain([4, 5])) == 4


def test_a_batch_of_a_model_that_cannot_verify_trees_refuses_them_in_one_line():
    scheduler = tree_scheduler("lfm2", seed=1)
    with pytest.raises(GenerationError, match="KV cache") as err:
        scheduler.submit([1, 2, 3], GenerationSettings(tree=True), "lookup")
    assert "\n" not in str(err.value) and not scheduler.busy
    # A line from the same source batches as before.
    line = scheduler.submit([1, 2, 3], GenerationSettings(max_tokens=4), "lookup")
    assert isinstance(collect(scheduler)[line][-1], Done)
